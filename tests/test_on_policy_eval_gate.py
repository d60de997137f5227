"""The held-out watch and the quality gate on on-policy runs: the same evaluation and promotion as off-policy.

What a user depends on: ``kiln-flows train --request ON_POLICY.json --eval-corpus HELDOUT.jsonl`` records
the held-out curve (a baseline, then every ``--eval-every`` steps and after the last) in the receipt and
the checkpoints, and an interrupted watched run resumes its curve to the same adapter bytes; a spec with ``prompts`` and ``quality_gate`` promotes a passing adapter and holds a
failing one back (renamed ``.failed``, the reason in its receipt); ``stop_on_divergence`` stops an
on-policy run at a step boundary with a checkpoint; and a held-out corpus sharing a prompt with the
training prompts is refused (``eval_train_overlap``, exit 2) naming the held-out line and the prompt
file's line, before any model loads.

The held-out corpus is scored by the registered tiny teacher (the run's teacher), so the held-out
rules accept it; its prompts are not the training prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from test_evaluation import examples, write_jsonl
from test_on_policy_cli import ALIAS, CONFIG, PROMPTS, root, train, write_request  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

HELD_OUT = [("What is the capital of France?", "Paris."), ("Name a colour.", "Blue."), ("Count to three.", "1 2 3")]
OVERLAPPING = [("Name a colour.", "Blue."), ("What is two plus two?", "Four.")]  # the second is PROMPTS[0]


def scored(root: Path, tiny_student, directory: Path, name: str, pairs) -> Path:
    """``pairs`` scored by the registered teacher ``ALIAS``, as ``kiln-flows score --teacher ALIAS`` does."""
    from kiln_core.scoring import score_examples

    source = write_jsonl(directory / f"{name}-examples.jsonl", examples(pairs))
    out = directory / f"{name}.jsonl"
    score_examples(str(source), teacher_alias=ALIAS, registry_root=str(root), student_dir=str(tiny_student), top_k=16,
                   out_uri=str(out), device="cpu")
    return out


@pytest.fixture(scope="module")
def held_out(root, tiny_student, tmp_path_factory) -> Path:
    return scored(root, tiny_student, tmp_path_factory.mktemp("on-policy-heldout"), "heldout", HELD_OUT)


@pytest.fixture(scope="module")
def overlapping(root, tiny_student, tmp_path_factory) -> Path:
    return scored(root, tiny_student, tmp_path_factory.mktemp("on-policy-overlap"), "overlap", OVERLAPPING)


def prompt_file(directory: Path) -> Path:
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def spec(root: Path, tiny_student, prompts: Path, adapter: str, **blocks):
    from kiln_core.contracts.pipeline import parse_spec

    return parse_spec({"teacher": {"kind": "local_registry", "alias": ALIAS}, "prompts": str(prompts),
                       "student": str(tiny_student), "storage_root": str(root), "adapter": adapter,
                       "config": {**CONFIG, "training_mode": "on_policy"}, **blocks})


def no_model_loads(monkeypatch):
    """Fail the test if training starts or any model (student or teacher) loads."""
    import transformers

    import kiln_core.on_policy.teacher as teacher_module
    import kiln_core.training.on_policy_trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for input that must be refused")

    monkeypatch.setattr(trainer, "train_on_policy", refuse)
    monkeypatch.setattr(teacher_module.LiveLocalTeacher, "load", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)  # every model loader


def test_train_eval_corpus_records_the_held_out_curve(tiny_student, root, held_out, tmp_path, capsys):
    request = write_request(tmp_path)
    code, result = train(capsys, "--request", request, "--adapter", "onpol-watched", "--student", str(tiny_student),
                         "--out", str(root), "--eval-corpus", str(held_out), "--eval-every", "2", "--json")
    assert code == 0 and result["status"] == "success", result
    receipt = json.loads((Path(result["run"]) / "train_receipt.json").read_text())
    assert receipt["opd"]["training_mode"] == "on_policy"
    curve = receipt["eval_curve"]
    steps = result["steps"]
    # a baseline before the first step, one every 2 steps, one after the last
    assert [point["step"] for point in curve["points"]] == sorted({0, *range(2, steps + 1, 2), steps})
    assert all(point["reverse_kl"] is not None and point["tokens"] > 0 for point in curve["points"])
    assert curve["held_out"]["corpus"] == str(held_out) and curve["watch"]["every_steps"] == 2
    # each checkpoint carries the curve up to its step, so a resumed run continues it
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(resolve(result["run"]), "onpol-watched-checkpoint-step-00000002.kiln-checkpoint")
    assert [point.step for point in checkpoint.extension.eval_curve.points] == [0, 2]


def test_an_interrupted_watched_run_resumes_its_curve_and_trains_the_same_bytes(tiny_student, tiny_teacher, root,
                                                                                 held_out, tmp_path, capsys):
    """SIGTERM after step 2, then the printed resume command: the curve continues from the checkpoint's,
    and the adapter is the uninterrupted watched run's (watching never changes what training computes)."""
    import kiln_core.training.on_policy_trainer as trainer
    from kill_support import sigterm_after_step
    from test_on_policy_cli import adapter_bytes

    request = write_request(tmp_path)
    watch = ["--eval-corpus", str(held_out), "--eval-every", "2"]
    args = ["--request", request, "--adapter", "onpol-watch-resume", "--student", str(tiny_student), "--json", *watch]
    code, reference = train(capsys, *args, "--out", str(root))
    assert code == 0, reference
    other = tmp_path / "other-root"
    assert main(["teachers", "register", ALIAS, str(tiny_teacher), "--out", str(other), "--device", "cpu"]) == 0
    capsys.readouterr()
    with sigterm_after_step(trainer, "train_on_policy", 2, hook="on_step_committed"):
        code, cancelled = train(capsys, *args, "--out", str(other))
    assert code == 3 and cancelled["latest_checkpoint"].endswith("step-00000002.kiln-checkpoint")
    code, refused = train(capsys, *args, "--out", str(other))
    assert code == 2 and f"--eval-corpus {held_out} --eval-every 2" in refused["message"]  # the exact resume command
    code, resumed = train(capsys, *args, "--out", str(other), "--resume-checkpoint", cancelled["latest_checkpoint"])
    assert code == 0, resumed
    assert adapter_bytes(resumed) == adapter_bytes(reference)
    curves = [json.loads((Path(r["run"]) / "train_receipt.json").read_text())["eval_curve"] for r in (reference, resumed)]
    assert [p["step"] for p in curves[1]["points"]] == [p["step"] for p in curves[0]["points"]]
    assert [p["reverse_kl"] for p in curves[1]["points"]] == pytest.approx([p["reverse_kl"] for p in curves[0]["points"]])


def test_stop_on_divergence_stops_an_on_policy_run_with_a_checkpoint(tiny_student, root, held_out, tmp_path):
    """A learning rate of 1.0 never improves the held-out KL: with patience 1 the watch stops after step 1."""
    from kiln_core.engine import run_pipeline

    watch = {"corpus": str(held_out), "every_steps": 1, "patience": 1, "flat_window": None, "stop_on_divergence": True}
    result = run_pipeline(spec(root, tiny_student, prompt_file(tmp_path), "onpol-stop", eval=watch,
                               config={**CONFIG, "training_mode": "on_policy", "learning_rate": 1.0}))
    assert (result.status, result.failure_reason) == ("failed", "training_error"), result
    assert result.steps < result.total_steps and result.latest is None
    assert result.latest_checkpoint == f"onpol-stop-checkpoint-step-{result.steps:08d}.kiln-checkpoint"
    receipt = json.loads(Path(result.receipt).read_text())
    assert receipt["stop_reason"] in ("stalled", "diverged") and receipt["status"] == "failed"
    assert receipt["eval_curve"]["alarms"][-1]["step"] == result.steps


def test_quality_gate_promotes_a_passing_on_policy_adapter(tiny_student, root, held_out, tmp_path):
    from kiln_core.engine import run_pipeline

    result = run_pipeline(spec(root, tiny_student, prompt_file(tmp_path), "onpol-quality-pass",
                               quality_gate={"corpus": str(held_out), "max_reverse_kl": 1e6}))
    quality = result.gate["quality_gate"]
    assert result.gate["outcome"] == "promoted" and result.latest is not None
    assert json.loads(Path(result.latest).read_text())["adapter"] == result.adapter
    assert quality["failures"] == [] and quality["distilled"]["tokens"] == quality["base"]["tokens"] > 0
    assert quality["base"]["reverse_kl"] != quality["distilled"]["reverse_kl"]  # the trained adapter was evaluated
    receipt = json.loads(Path(result.receipt).read_text())
    assert receipt["gate_outcome"] == "promoted" and receipt["opd"]["training_mode"] == "on_policy"


def test_quality_gate_holds_a_failing_on_policy_adapter_back(tiny_student, root, held_out, tmp_path):
    from kiln_core.engine import run_pipeline

    result = run_pipeline(spec(root, tiny_student, prompt_file(tmp_path), "onpol-quality-fail",
                               quality_gate={"corpus": str(held_out), "max_reverse_kl": 0.0}))
    assert result.gate["outcome"] == "demoted" and result.held_back and result.latest is None
    assert result.run.endswith("/onpol-quality-fail.failed")
    assert not (root / "runs" / "onpol-quality-fail" / "latest.json").exists()
    receipt = json.loads(Path(result.receipt).read_text())
    assert receipt["gate_outcome"] == "demoted" and receipt["quality_gate"]["failures"][0].startswith("reverse_kl ")
    assert "NOT promoted" in receipt["quality_gate"]["verdict"]


def test_a_held_out_corpus_sharing_a_training_prompt_is_refused_before_any_model_loads(
        tiny_student, root, overlapping, tmp_path, capsys, monkeypatch):
    from kiln_core.engine import run_pipeline
    from kiln_core.evaluation import EvalInputError

    no_model_loads(monkeypatch)
    request = write_request(tmp_path)
    code, result = train(capsys, "--request", request, "--adapter", "onpol-leak", "--student", str(tiny_student),
                         "--out", str(root), "--eval-corpus", str(overlapping), "--eval-every", "2", "--json")
    assert (code, result["status"], result["code"]) == (2, "rejected", "eval_train_overlap"), result
    # line 3 of the held-out corpus (line 1 is the manifest) is prompt 0, line 1 of the request's prompt file
    assert result["line"] == 3 and result["file"] == str(overlapping)
    assert "training prompt 0 (line 1 of the prompt file" in result["message"]
    assert not (root / "runs" / "onpol-leak").exists()

    prompts = tmp_path / "spaced.jsonl"  # a prompt file with a blank line: the message names the physical line
    prompts.write_text("\n" + "".join(json.dumps(p) + "\n" for p in PROMPTS))
    for blocks in ({"quality_gate": {"corpus": str(overlapping), "max_reverse_kl": 1e6}},
                   {"eval": {"corpus": str(overlapping), "every_steps": 2}}):
        with pytest.raises(EvalInputError) as refused:
            run_pipeline(spec(root, tiny_student, prompts, "onpol-leak", **blocks))
        assert (refused.value.code, refused.value.line, refused.value.file) == ("eval_train_overlap", 3, str(overlapping))
        assert f"training prompt 0 (line 2 of the prompt file {prompts})" in refused.value.message
    assert not (root / "runs" / "onpol-leak").exists()
