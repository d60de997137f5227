"""The publish guard: a diverged run is never published; a normal one is untouched.

What a user depends on: a request with an absurd learning rate (``1e10``) fails with
``training_diverged`` (exit 3) instead of becoming ``latest.json``, its checkpoints are kept and its
receipt carries the evidence; ``config.publish_guard: false`` publishes such a run and the receipt says
the guard was off; each rule decides as a naive re-computation of it does; the run's effective
optimizer, learning rate, top-K and seed are printed when training starts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln_core.training.publish_guard import (
    LOSS_GROWTH_LIMIT,
    LOSS_MIN_RISE,
    LOSS_WINDOW_FRACTION,
    WEIGHT_GROWTH_LIMIT,
    check_loss,
    check_weight_bound,
    check_weights_finite,
    fresh_lora_bound,
    guard_verdict,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

REPO = Path(__file__).resolve().parent.parent
CONFIG = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
          "checkpoint_interval": 2, "epochs": 1}


# ---------------------------------------------------------------------------------------------
# The rules, against naive re-computations


def lora(seed: int = 0, *, in_features: int = 64, rank: int = 4, b_scale: float = 0.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(in_features)
    return {
        "layers.0.q_proj.lora_A.weight": (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound,
        "layers.0.q_proj.lora_B.weight": torch.randn(in_features, rank, generator=generator) * b_scale,
        "layers.0.down_proj.lora_A.weight": (torch.rand(rank, 2 * in_features, generator=generator) * 2 - 1) * bound,
        "layers.0.down_proj.lora_B.weight": torch.randn(in_features, rank, generator=generator) * b_scale,
    }


def naive_max_abs(tensors) -> float:
    return max(abs(v) for t in tensors.values() for v in t.flatten().tolist() if math.isfinite(v))


def test_non_finite_weight_rule_counts_every_nan_and_infinity():
    tensors = lora(1, b_scale=0.01)
    assert check_weights_finite(tensors).passed
    tensors["layers.0.q_proj.lora_B.weight"][3, 1] = float("nan")
    tensors["layers.0.down_proj.lora_A.weight"][0, 5] = float("inf")
    tensors["layers.0.down_proj.lora_A.weight"][2, 7] = float("-inf")
    naive = sum(1 for t in tensors.values() for v in t.flatten().tolist() if not math.isfinite(v))
    check = check_weights_finite(tensors)
    assert not check.passed and check.measured["non_finite_values"] == naive == 3
    assert check.measured["first_tensor"] == "layers.0.down_proj.lora_A.weight"  # sorted name order


def test_fresh_lora_bound_is_the_init_bound_of_the_narrowest_lora_a(tiny_student):
    from kiln_core.training.student import load_student

    student = load_student(str(tiny_student), rank=4, alpha=8.0, seed=5, device="cpu", precision="fp32")
    tensors = student.adapter_tensors()
    in_features = [t.shape[1] for name, t in tensors.items() if ".lora_A." in name]
    bound = fresh_lora_bound(tensors)
    assert bound == pytest.approx(1 / math.sqrt(min(in_features)))
    # the seeded init lies inside the bound and comes close to it (PEFT's Kaiming-uniform draw)
    assert 0.9 * bound < naive_max_abs(tensors) <= bound
    assert all(float(t.abs().max()) == 0.0 for name, t in tensors.items() if ".lora_B." in name)


def test_weight_bound_rule_compares_the_largest_weight_with_the_start():
    tensors = lora(2, b_scale=0.05)
    reference = 1 / math.sqrt(64)
    check = check_weight_bound(tensors, reference)
    assert check.passed and check.measured["max_abs_weight"] == pytest.approx(naive_max_abs(tensors))
    assert check.measured["ratio"] == pytest.approx(naive_max_abs(tensors) / reference)
    assert check.threshold == {"max_ratio": WEIGHT_GROWTH_LIMIT, "max_abs_weight": WEIGHT_GROWTH_LIMIT * reference}
    # exactly at the bound passes, just above it trips
    tensors["layers.0.q_proj.lora_B.weight"][0, 0] = WEIGHT_GROWTH_LIMIT * reference
    assert check_weight_bound(tensors, reference).passed
    tensors["layers.0.q_proj.lora_B.weight"][0, 0] = WEIGHT_GROWTH_LIMIT * reference * 1.001
    tripped = check_weight_bound(tensors, reference)
    assert not tripped.passed and tripped.measured["ratio"] == pytest.approx(WEIGHT_GROWTH_LIMIT * 1.001)


def test_a_warm_start_raises_the_reference_to_its_own_largest_weight():
    tensors = lora(3, b_scale=100.0)  # B far above 1000x a fresh init's bound: fine for a run that started there
    base = {name: t.clone() for name, t in tensors.items()}
    assert guard_verdict(tensors, [1.0])["verdict"] == "tripped"
    verdict = guard_verdict(tensors, [1.0], base_adapter_tensors=base)
    assert verdict["verdict"] == "passed"
    bound = next(check for check in verdict["checks"] if check["rule"] == "weight_bound")
    assert bound["measured"]["start_max_abs_weight"] == pytest.approx(naive_max_abs(base))


def naive_loss_verdict(losses: list[float]) -> bool:
    """True when the run passes: the rule as its docstring states it, computed by hand."""
    if any(not math.isfinite(x) for x in losses):
        return False
    if not losses:
        return True
    w = max(1, round(LOSS_WINDOW_FRACTION * len(losses)))
    first, last = sum(losses[:w]) / w, sum(losses[len(losses) - w:]) / w
    return not (last > LOSS_GROWTH_LIMIT * first and last - first >= LOSS_MIN_RISE)


@pytest.mark.parametrize("losses, passes", [
    ([3.0, 2.5, 2.0, 1.8, 1.7, 1.6, 1.5, 1.5, 1.4, 1.4], True),        # learning
    ([0.5, 0.6, 0.55, 0.7, 0.65, 0.6], True),                         # noisy, flat
    ([0.01, 0.02, 0.05, 0.2], True),                                  # 20x, but 0.19 nats: not diverged
    ([1.0] * 18 + [40.0, 60.0], False),                               # the last tenth far above the first
    ([0.5, 0.4, 0.45, 9.0], False),                                   # one step, 18x and 8.5 nats
    ([2.0, 1.5, float("nan"), 1.0], False),                           # non-finite anywhere
    ([2.0, float("inf")], False),
    ([], True),
])
def test_loss_rule_matches_a_naive_check(losses, passes):
    check = check_loss(losses)
    assert check.passed is passes is naive_loss_verdict(losses)
    if losses and all(math.isfinite(x) for x in losses):
        w = check.measured["window"]
        assert check.measured["first_window_mean"] == pytest.approx(sum(losses[:w]) / w)
        assert check.measured["last_window_mean"] == pytest.approx(sum(losses[-w:]) / w)


def test_the_errors_page_lists_the_run_failure_codes():
    from kiln_core.errors import RUN_FAILURE_CODES

    page = (REPO / "docs" / "errors.md").read_text(encoding="utf-8")
    section = page[page.index("## Rejection codes"):]
    assert all(f"`{code}`" in section for code in RUN_FAILURE_CODES)


def test_verdict_names_every_failed_rule_and_is_strict_json():
    tensors = lora(4)
    tensors["layers.0.q_proj.lora_B.weight"][0, 0] = float("nan")
    tensors["layers.0.q_proj.lora_B.weight"][0, 1] = 1e12
    verdict = guard_verdict(tensors, [1.0, float("nan")])
    assert verdict["verdict"] == "tripped"
    assert verdict["rules"] == ["non_finite_weight", "weight_bound", "loss_diverged"]
    json.dumps(verdict, allow_nan=False)  # the receipt is strict JSON


# ---------------------------------------------------------------------------------------------
# Through the CLI and the engine


@pytest.fixture(scope="module")
def corpus_dir(tiny_student, tmp_path_factory):
    from kiln_core.synthetic import synthesize_corpus

    directory = tmp_path_factory.mktemp("guard-corpus")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=6, top_k=16, seed=0)
    manifest = (directory / "corpus.jsonl").read_text().splitlines()[0]
    (directory / "teacher-manifest.jsonl").write_text(manifest + "\n")
    return directory


def write_request(directory: Path, name: str, **config) -> str:
    body = {"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl", "config": {**CONFIG, **config}}
    (directory / name).write_text(json.dumps(body))
    return str(directory / name)


def kiln_flows(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_diverged_request_fails_with_training_diverged_and_publishes_nothing(tiny_student, corpus_dir, tmp_path):
    request = write_request(corpus_dir, "diverged.json", learning_rate=1e10)
    done = kiln_flows("train", "--request", request, "--adapter", "diverged", "--student", str(tiny_student),
                      "--out", str(tmp_path), cwd=corpus_dir)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    # the effective settings when training starts
    assert "training diverged: optimizer muon, learning rate 1e+10, top-K 16, seed 3, publish guard on" in lines
    error = [line for line in lines if line.startswith("failed")]
    assert error and error[0].startswith("failed (training_diverged): the publish guard refused"), lines
    assert "weight_bound" in error[0]
    adapter_root = tmp_path / "runs" / "diverged"
    assert not (adapter_root / "latest.json").exists()
    (run_dir,) = [p for p in adapter_root.iterdir() if p.is_dir()]
    assert not (run_dir / "adapter").exists()
    checkpoints = sorted(p.name for p in run_dir.glob("*.kiln-checkpoint"))
    assert checkpoints == [f"diverged-checkpoint-step-{step:08d}.kiln-checkpoint" for step in (2, 4)]
    receipt = json.loads((run_dir / "train_receipt.json").read_text())
    # Kiln's closed failure_reason enum has no value for it: training_error, and our block says which
    assert receipt["status"] == "failed" and receipt["failure_reason"] == "training_error"
    assert receipt["failure_message"].startswith("the publish guard refused")
    assert receipt["adapters"]["output"]["adapter_model_sha256"] is None
    guard = receipt["publish_guard"]
    assert guard["enabled"] is True and guard["verdict"] == "tripped" and guard["code"] == "training_diverged"
    assert guard["rules"] == ["weight_bound"]
    bound = next(check for check in guard["checks"] if check["rule"] == "weight_bound")
    assert bound["passed"] is False
    assert bound["measured"]["max_abs_weight"] > bound["threshold"]["max_abs_weight"] == WEIGHT_GROWTH_LIMIT * \
        bound["measured"]["start_max_abs_weight"]
    # the evidence is the weights' own: the newest checkpoint already holds weights far beyond the bound
    from safetensors.torch import load_file

    newest = load_file(str(run_dir / checkpoints[-1] / "adapter.safetensors"))
    assert naive_max_abs(newest) > bound["threshold"]["max_abs_weight"]


def test_the_guard_turned_off_publishes_and_the_receipt_says_so(tiny_student, corpus_dir, tmp_path, capsys):
    from flows.cli import main

    request = write_request(corpus_dir, "unguarded.json", learning_rate=1e10, publish_guard=False)
    code = main(["train", "--request", request, "--adapter", "unguarded", "--student", str(tiny_student),
                 "--out", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0 and summary["status"] == "success", summary
    assert "publish guard off" in captured.err
    latest = json.loads((tmp_path / "runs" / "unguarded" / "latest.json").read_text())
    assert latest["receipt"] == summary["receipt"]
    receipt = json.loads(Path(summary["receipt"]).read_text())
    assert receipt["status"] == "success"
    assert receipt["publish_guard"] == {"enabled": False, "verdict": "off", "rules": [], "checks": []}
    assert receipt["config"]["publish_guard"] is False


def test_a_normal_run_passes_the_guard_and_publishes(tiny_student, corpus_dir, tmp_path, capsys):
    from flows.cli import main

    request = write_request(corpus_dir, "normal.json", learning_rate=2e-2)
    code = main(["train", "--request", request, "--adapter", "normal", "--student", str(tiny_student),
                 "--out", str(tmp_path), "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["latest"], summary
    guard = json.loads(Path(summary["receipt"]).read_text())["publish_guard"]
    assert guard["enabled"] is True and guard["verdict"] == "passed" and guard["rules"] == []
    bound = next(check for check in guard["checks"] if check["rule"] == "weight_bound")
    assert bound["measured"]["ratio"] < WEIGHT_GROWTH_LIMIT / 10  # far inside, not just under


def test_a_spec_turns_the_guard_off_and_it_leaves_the_run_key_alone(tiny_student, corpus_dir, tmp_path):
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine import run_pipeline
    from kiln_core.engine.pipeline import LocalStages

    def spec(guard: bool):
        return parse_spec({"teacher": {"kind": "manifest_file", "path": str(corpus_dir / "teacher-manifest.jsonl")},
                           "corpus": str(corpus_dir / "corpus.jsonl"), "student": str(tiny_student),
                           "storage_root": str(tmp_path), "adapter": "spec-run",
                           "config": {**CONFIG, "learning_rate": 1e10, "publish_guard": guard}})

    refused = run_pipeline(spec(True), LocalStages(handle_signals=False))
    assert refused.status == "failed" and refused.failure_reason == "training_diverged" and refused.latest is None
    # the same run with the guard off is the same run directory: it resumes from the kept checkpoint
    published = run_pipeline(spec(False), LocalStages(handle_signals=False))
    assert published.status == "success" and published.run == refused.run and published.latest
    receipt = json.loads(Path(published.receipt).read_text())
    assert receipt["publish_guard"]["verdict"] == "off"
    assert receipt["data"]["resumed_from_checkpoint"] == "spec-run-checkpoint-step-00000004.kiln-checkpoint"


def test_on_policy_training_goes_through_the_guard(tiny_student, tiny_teacher, tmp_path):
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherSource
    from kiln_core.training.on_policy_trainer import train_on_policy
    from plan_support import train_plan
    from on_policy_support import chat, request

    identity = local_teacher_identity(str(tiny_teacher), max_top_k=32, device_kind="cpu")
    teacher = TeacherSource.loaded(LiveLocalTeacher.load(str(tiny_teacher), identity=identity, top_k=16,
                                                         teacher_id="tiny-teacher", device="cpu"), "tiny-teacher")
    req = request([chat("What is two plus two?"), chat("Translate to French: good morning")], teacher="tiny-teacher",
                  samples_per_prompt=2, max_tokens=4, top_k=16, lora_rank=4, lora_alpha=8.0, seed=5,
                  learning_rate=1e10, checkpoint_interval=2)
    plan = train_plan(req.config, str(tmp_path), "onpol", prompts=req.prompts, teacher=teacher)
    result = train_on_policy(plan, req.prompts, student_dir=str(tiny_student), teacher=teacher)
    assert result.status == "failed" and result.failure_reason == "training_diverged" and result.adapter is None
    assert not (tmp_path / "adapter").exists() and result.latest_checkpoint is not None
    receipt = json.loads((tmp_path / "train_receipt.json").read_text())
    assert receipt["failure_reason"] == "training_error" and receipt["publish_guard"]["verdict"] == "tripped"


def test_the_flow_logs_the_settings_and_fails_with_training_diverged(tiny_student, corpus_dir, tmp_path, prefect_harness):
    """The flow run ends Failed with one line naming the code, told once at ERROR (what the UI's "Error and
    above" shows), no traceback and no "unexpected exception"; its artifacts name the same code as the log."""
    import logging

    from prefect.artifacts import Artifact

    from flows.opd_distill import opd_distill
    from flows.run_log import quiet_run_logs
    from kiln_core.contracts.pipeline import parse_spec

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    spec = parse_spec({"teacher": {"kind": "manifest_file", "path": str(corpus_dir / "teacher-manifest.jsonl")},
                       "corpus": str(corpus_dir / "corpus.jsonl"), "student": str(tiny_student),
                       "storage_root": str(tmp_path), "adapter": "flow-run",
                       "config": {**CONFIG, "learning_rate": 1e10, "optimizer": {"kind": "adam_w"}}})
    quiet_run_logs()  # installed by the flow itself; here too so that the handler below sees filtered records
    log = Collect()
    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.engine")]
    for logger in loggers:  # the flow run's loggers (the UI's log)
        logger.addHandler(log)
    try:
        state = opd_distill(spec, return_state=True)
    finally:
        for logger in loggers:
            logger.removeHandler(log)
    assert state.is_failed() and state.message.startswith("failed (training_diverged): the publish guard refused"), \
        state.message
    assert not (tmp_path / "runs" / "flow-run" / "latest.json").exists()
    messages = [record.getMessage() for record in log.records]
    assert "train: optimizer adam_w, learning rate 1e+10, top-K 16, seed 3, publish guard on" in messages
    telling = [record for record in log.records if "training_diverged" in record.getMessage()]
    assert [(record.levelname, record.getMessage()[:60]) for record in telling] == [
        ("ERROR", "Finished in state Failed('failed (training_diverged): the pu")], messages
    assert not [record for record in log.records if record.exc_info or "unexpected exception" in record.getMessage()]
    # the receipt table says what the log says (Kiln's closed enum in the file says training_error)
    receipt = Artifact.get("receipt-flow-run")
    assert "failed (training_diverged; Kiln's failure_reason training_error)" in str(receipt.data), receipt.data
    failed = Artifact.get("failed-flow-run")  # the rejection's shape: heading, code, rule; and what was kept
    assert failed.type == "markdown" and failed.data.startswith("### Failed: nothing was published\n\n"
                                                                 "**training_diverged**\n\nthe publish guard"), failed.data
    assert "Receipt: `" in failed.data and "train_receipt.json" in failed.data
