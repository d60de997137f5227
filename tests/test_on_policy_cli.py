"""``kiln-flows train`` with a Kiln on-policy request: prompts in, the same engine path, the same outputs.

What a user depends on: a request with ``prompts`` and a registered local teacher trains through
``run_pipeline`` into ``<root>/runs/<adapter>/<run key>/`` with ``latest.json`` beside it; the receipt
says ``training_mode: "on_policy"`` and the effective samples per prompt; the progress line shows
rollouts/s and teacher tokens; an interrupted run resumes to the same adapter bytes; and every bad input
of the issue is refused with a stable code (exit 2) before any model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from kill_support import sigterm_after_step
from kiln_core.contracts.opd_prompt import OpdPrompt, prompts_content_sha256
from on_policy_support import chat

ALIAS = "tiny-teacher"
PROMPTS = [chat("What is two plus two?"),
           {**chat("List files under src/."), "teacher_extra_messages": [{"role": "user", "content": "JSON only."}]},
           chat("Translate to French: good morning")]
CONFIG = {"samples_per_prompt": 2, "max_tokens": 4, "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 5,
          "learning_rate": 2e-2, "checkpoint_interval": 2, "epochs": 1}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


@pytest.fixture(scope="module")
def root(tiny_teacher, tmp_path_factory) -> Path:
    """A storage root whose local registry holds the tiny teacher under ``ALIAS``."""
    directory = tmp_path_factory.mktemp("on-policy-root")
    assert main(["teachers", "register", ALIAS, str(tiny_teacher), "--out", str(directory), "--device", "cpu",
                 "--json"]) == 0
    return directory


def write_request(directory: Path, name: str = "request.json", *, prompts=PROMPTS, teacher: str = ALIAS,
                  **overrides) -> str:
    body = {"teacher": teacher, "prompts": prompts, "config": {**CONFIG, **overrides}}
    path = directory / name
    path.write_text(json.dumps(body))
    return str(path)


def train(capsys, *argv):
    code = main(["train", *argv])
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    return code, (json.loads(out[-1]) if out else None)


def adapter_bytes(result: dict) -> bytes:
    return (Path(result["adapter"]) / "adapter_model.safetensors").read_bytes()


def test_an_on_policy_request_trains_through_the_engine(tiny_student, root, tmp_path, capsys):
    request = write_request(tmp_path)
    args = ["--request", request, "--adapter", "onpol-cli", "--student", str(tiny_student), "--out", str(root)]
    code, result = train(capsys, *args, "--json")
    assert code == 0, result
    run_dir = Path(result["run"])
    assert run_dir.parent == root / "runs" / "onpol-cli" and len(run_dir.name) == 16  # the shared run-directory rule
    assert result["status"] == "success" and result["reused"] is False
    latest = json.loads((root / "runs" / "onpol-cli" / "latest.json").read_text())
    assert latest["adapter"] == result["adapter"] == str(run_dir / "adapter")
    receipt = json.loads((run_dir / "train_receipt.json").read_text())
    prompts = [OpdPrompt.model_validate(p) for p in PROMPTS]
    assert receipt["opd"]["training_mode"] == "on_policy" and receipt["config"]["training_mode"] == "on_policy"
    assert receipt["opd"]["samples_per_prompt"] == 2 and receipt["config"]["samples_per_prompt"] == 2
    assert receipt["training_data"]["sha256"] == "sha256:" + prompts_content_sha256(prompts)
    assert result["dataset_sha256"] == receipt["training_data"]["sha256"]
    assert result["total_steps"] == 6 and 1 <= result["steps"] <= 6  # candidates: 3 prompts × 2 samples
    assert any((run_dir / "rollouts").rglob("*.parquet"))  # every rollout stored for audit and retries
    # the same request again is the same run, finished: nothing is trained or rewritten
    before = (run_dir / "train_receipt.json").read_bytes()
    code, again = train(capsys, *args, "--json")
    assert code == 0 and again["reused"] is True and again["run"] == result["run"]
    assert (run_dir / "train_receipt.json").read_bytes() == before


def test_progress_line_shows_rollouts_per_second_and_teacher_tokens(tiny_student, root, tmp_path, capsys):
    request = write_request(tmp_path, max_tokens=3)
    assert main(["train", "--request", request, "--adapter", "onpol-bar", "--student", str(tiny_student),
                 "--out", str(root)]) == 0
    err = capsys.readouterr().err
    assert "candidate" in err and "rollouts_per_s=" in err and "teacher_tokens=" in err


def test_auto_scaled_samples_per_prompt_is_what_the_receipt_records(tiny_student, root, tmp_path, capsys):
    """Kiln's default samples_per_prompt (4) auto-scales to 64 below 50 prompts; the receipt says 64."""
    config = {key: value for key, value in CONFIG.items() if key != "samples_per_prompt"}
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"teacher": ALIAS, "prompts": [chat("Hi")], "config": {**config, "max_tokens": 1,
                                                                                       "checkpoint_interval": 1000}}))
    code, result = train(capsys, "--request", str(path), "--adapter", "onpol-auto", "--student", str(tiny_student),
                         "--out", str(root), "--json")
    assert code == 0, result
    receipt = json.loads((Path(result["run"]) / "train_receipt.json").read_text())
    assert receipt["opd"]["samples_per_prompt"] == 64 and result["total_steps"] == 64


def test_sigterm_then_resume_matches_an_uninterrupted_run(tiny_student, tiny_teacher, root, tmp_path, capsys):
    import kiln_core.training.on_policy_trainer as trainer

    request = write_request(tmp_path)
    args = ["--request", request, "--student", str(tiny_student), "--json", "--adapter", "onpol-resume"]
    code, reference = train(capsys, *args, "--out", str(root))
    assert code == 0

    other = tmp_path / "other-root"
    assert main(["teachers", "register", ALIAS, str(tiny_teacher), "--out", str(other), "--device", "cpu"]) == 0
    capsys.readouterr()
    with sigterm_after_step(trainer, "train_on_policy", 2, hook="on_step_committed"):
        code, cancelled = train(capsys, *args, "--out", str(other))
    assert code == 3 and cancelled["status"] == "cancelled"
    assert cancelled["latest_checkpoint"] == "onpol-resume-checkpoint-step-00000002.kiln-checkpoint"

    code, refused = train(capsys, *args, "--out", str(other))  # the shared resume rule: refused, exact command
    assert code == 2 and refused["code"] == "resume_required"
    assert f"--resume-checkpoint {cancelled['latest_checkpoint']}" in refused["message"]
    code, resumed = train(capsys, *args, "--out", str(other), "--resume-checkpoint", cancelled["latest_checkpoint"])
    assert code == 0 and resumed["status"] == "success"
    assert Path(resumed["run"]).name == Path(reference["run"]).name  # same inputs, same run key
    assert adapter_bytes(resumed) == adapter_bytes(reference)


def test_bad_on_policy_input_is_refused_before_any_model_loads(tiny_student, tiny_teacher, root, tmp_path, capsys,
                                                               monkeypatch, models_dir):
    import kiln_core.on_policy.teacher as teacher_module
    import kiln_core.training.on_policy_trainer as trainer
    from kiln_core.tiny_models import build_tiny_model

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for a request that must be refused")

    other_vocab = build_tiny_model(models_dir / "teacher-other-vocab", seed=4, vocab_size=512, tokenizer_vocab_size=480)
    assert main(["teachers", "register", "other-vocab", str(other_vocab), "--out", str(root), "--device", "cpu"]) == 0
    (tmp_path / "teacher-manifest.jsonl").write_text("{}\n")  # a manifest file: a remote teacher
    capsys.readouterr()
    monkeypatch.setattr(trainer, "train_on_policy", no_model)
    monkeypatch.setattr(teacher_module.LiveLocalTeacher, "load", no_model)

    both = tmp_path / "both.json"
    both.write_text(json.dumps({"teacher": ALIAS, "prompts": PROMPTS, "dataset_path": "corpus.jsonl", "config": CONFIG}))
    cases = [
        (str(both), "source_not_exactly_one"),
        (write_request(tmp_path, "neither.json", prompts=[]), "source_not_exactly_one"),
        (write_request(tmp_path, "no-messages.json", prompts=[{"messages": []}]), "prompt_no_messages"),
        (write_request(tmp_path, "too-long.json", max_tokens=4096), "training_will_not_fit"),
        (write_request(tmp_path, "vocab.json", teacher="other-vocab"), "teacher_vocab_mismatch"),
        # off_policy on inline prompts: Kiln wants an assistant action in each; kiln-flows then refuses the mode
        (write_request(tmp_path, "off-empty.json", training_mode="off_policy"), "prompt_no_action"),
        (write_request(tmp_path, "off.json", training_mode="off_policy", prompts=[
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]), "unsupported"),
        (write_request(tmp_path, "unknown.json", teacher="nobody"), "teacher_not_registered"),
        (write_request(tmp_path, "remote.json", teacher="teacher-manifest.jsonl"), "remote_teacher_on_policy"),
    ]
    corpus = tmp_path / "on-policy-corpus.json"
    corpus.write_text(json.dumps({"teacher": ALIAS, "dataset_path": "corpus.jsonl", "config": {"training_mode": "on_policy"}}))
    cases.append((str(corpus), "invalid_config"))  # on_policy with a teacher-scored JSONL corpus
    for request, expected in cases:
        code, result = train(capsys, "--request", request, "--adapter", "onpol-bad", "--student", str(tiny_student),
                             "--out", str(root), "--json")
        assert (code, result["status"], result["code"]) == (2, "rejected", expected), (request, result)
    code, result = train(capsys, "--request", write_request(tmp_path), "--adapter", "onpol-bad", "--student",
                         str(tiny_student), "--out", str(root), "--json", "--nproc", "2")
    assert (code, result["code"]) == (2, "unsupported")  # one candidate per step, in one process, as Kiln
    assert not (root / "runs" / "onpol-bad").exists()  # nothing trained or published for any rejection


def test_a_spec_with_a_remote_teacher_is_refused_at_the_prompt_stage(tiny_student, tiny_teacher, tmp_path):
    """A pipeline spec whose teacher is only a pinned manifest cannot score rollouts: Kiln's code, no model loaded."""
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine import run_pipeline
    from kiln_core.errors import Rejection
    from kiln_core.identity.local_teacher import local_teacher_identity

    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32)) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    spec = parse_spec({"teacher": {"kind": "manifest_file", "path": str(manifest)}, "prompts": str(prompts),
                       "student": str(tiny_student), "storage_root": str(tmp_path / "root"), "adapter": "remote",
                       "config": {**CONFIG, "training_mode": "on_policy"}})
    with pytest.raises(Rejection) as caught:
        run_pipeline(spec)
    assert caught.value.code == "remote_teacher_on_policy" and caught.value.field == "teacher"
    assert not (tmp_path / "root" / "runs").exists()


def _register_suite(root: Path, name: str, prompts: list[str], targets: list[str]) -> None:
    from kiln_core.post_eval import SuiteRegistry

    doc = {"name": name, "default_scorer": {"kind": "exact_match", "strip_whitespace": False},
           "generation": {"max_tokens": 2},
           "examples": [{"id": f"q{i}", "messages": [{"role": "user", "content": p}], "target": t}
                        for i, (p, t) in enumerate(zip(prompts, targets))]}
    path = root / f"{name}.json"
    path.write_text(json.dumps(doc))
    SuiteRegistry.for_storage_root(str(root)).register(str(path))


def test_post_eval_gates_an_on_policy_run_as_it_gates_an_off_policy_one(tiny_student, root, tmp_path, capsys):
    """Kiln's post_eval on an on-policy request: a losing adapter is held back (exit 4), renamed
    `.failed` with the evidence in its receipt, and latest.json is not written."""
    questions = [f"Name the colour number {i}." for i in range(24)]
    _register_suite(root, "on-policy-unreachable", questions, ["no model answers this"] * len(questions))
    request = write_request(tmp_path)
    body = json.loads(Path(request).read_text())
    Path(request).write_text(json.dumps({**body, "post_eval": {"suite": "on-policy-unreachable", "min_accuracy": 0.5}}))
    code, result = train(capsys, "--request", request, "--adapter", "onpol-gated", "--student", str(tiny_student),
                         "--out", str(root), "--json")
    assert code == 4, result
    assert result["status"] == "success" and result["latest"] is None and result["gate"]["outcome"] == "demoted"
    failed = root / "runs" / "onpol-gated" / "onpol-gated.failed"
    receipt = json.loads((failed / "train_receipt.json").read_text())
    assert receipt["opd"]["training_mode"] == "on_policy" and receipt["gate_outcome"] == "demoted"
    assert receipt["post_eval"]["post_eval_gate_evidence"][0]["candidate_accuracy"] == 0.0
    assert not (root / "runs" / "onpol-gated" / "latest.json").exists()


def test_a_held_out_suite_sharing_a_training_turn_is_refused_before_training(tiny_student, root, tmp_path, capsys):
    """Kiln's overlap rule (exact prompt and target) applied to the prompts' earlier assistant turns."""
    _register_suite(root, "on-policy-leaky", ["What is two plus two?"], ["4"])
    multi_turn = {"messages": [{"role": "user", "content": "What is two plus two?"},
                               {"role": "assistant", "content": "4"},
                               {"role": "user", "content": "And three plus three?"}]}
    request = write_request(tmp_path, prompts=[*PROMPTS, multi_turn])
    body = json.loads(Path(request).read_text())
    Path(request).write_text(json.dumps({**body, "post_eval": {"suite": "on-policy-leaky", "min_accuracy": 0.5}}))
    code, result = train(capsys, "--request", request, "--adapter", "onpol-leaky", "--student", str(tiny_student),
                         "--out", str(root), "--json")
    assert code == 2 and result["code"] == "post_eval_overlap", result
    assert not (root / "runs" / "onpol-leaky").exists()
