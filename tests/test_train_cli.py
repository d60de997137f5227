"""``kiln-flows train`` end to end: request file → admission → training → adapter, receipt, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from kill_support import sigterm_after_step
from kiln_core.canonical import sha256_prefixed
from kiln_core.kiln_prompts import kiln_prompts_sha256
from kiln_core.synthetic import synthesize_corpus

CONFIG = {"training_mode": "off_policy", "objective": "reverse_kl", "loss": "teacher_top_k", "top_k": 16, "lora_rank": 4,
          "lora_alpha": 8.0, "seed": 3, "learning_rate": 0.02, "checkpoint_interval": 2, "epochs": 2}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


@pytest.fixture(scope="module")
def corpus_dir(tiny_student, tmp_path_factory):
    """A scored corpus for the tiny student, its manifest file, and request-file writer."""
    directory = tmp_path_factory.mktemp("cli-corpus")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=4, top_k=16, seed=0)
    manifest = (directory / "corpus.jsonl").read_text().splitlines()[0]
    (directory / "teacher-manifest.jsonl").write_text(manifest + "\n")
    return directory


def write_request(directory, name="request.json", **config_overrides) -> str:
    body = {"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl", "config": {**CONFIG, **config_overrides},
            "post_eval": None}
    path = directory / name
    path.write_text(json.dumps(body))
    return str(path)


def train(capsys, *argv):
    code = main(["train", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, (json.loads(out[-1]) if out else None)


def run_dir_of(result: dict) -> Path:
    return Path(result["run"])


def test_train_end_to_end_json(tiny_student, corpus_dir, tmp_path, capsys):
    request = write_request(corpus_dir)
    code, result = train(capsys, "--request", request, "--adapter", "cli-demo", "--student", str(tiny_student),
                         "--out", str(tmp_path), "--json")
    assert code == 0, result
    # one run-directory rule with the pipeline: <root>/runs/<adapter>/<run key>/, and latest.json beside
    run_dir = run_dir_of(result)
    assert run_dir.parent == tmp_path / "runs" / "cli-demo" and len(run_dir.name) == 16
    assert result["status"] == "success" and result["reused"] is False
    assert result["adapter"] == str(run_dir / "adapter") and result["receipt"] == str(run_dir / "train_receipt.json")
    assert result["latest_checkpoint"] == "cli-demo-checkpoint-step-00000006.kiln-checkpoint"
    assert isinstance(result["final_loss"], float) and result["final_loss"] == result["loss_history"][-1]
    latest = json.loads((tmp_path / "runs" / "cli-demo" / "latest.json").read_text())
    assert result["latest"] == str(tmp_path / "runs" / "cli-demo" / "latest.json")
    assert latest["receipt"] == result["receipt"] and latest["adapter"] == result["adapter"]
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    receipt = json.loads((run_dir / "train_receipt.json").read_text())
    corpus_bytes = (corpus_dir / "corpus.jsonl").read_bytes()
    assert receipt["training_data"]["sha256"] == sha256_prefixed(corpus_bytes)
    assert receipt["training_data"]["path"] == str(corpus_dir / "corpus.jsonl")
    assert receipt["opd"]["teacher_identity"]["served_model_id"] == "synthetic-teacher"
    assert receipt["opd"]["teacher_identity_revision"].startswith("sha256:")
    assert receipt["opd"]["top_k"] == 16 and receipt["config"]["output_name"] == "cli-demo"
    assert (tmp_path / "corpora").is_dir()  # the admitted corpus was materialized under the root
    manifest = json.loads((run_dir / "cli-demo-checkpoint-step-00000002.kiln-checkpoint" / "checkpoint_manifest.json").read_text())
    # Kiln's prompt-list digest (checked against an independent encoding in test_kiln_checkpoint.py)
    assert manifest["data"]["content_sha256"] == kiln_prompts_sha256(corpus_bytes)
    # the same request again is the same run: it is finished, nothing is trained or rewritten
    before = (run_dir / "train_receipt.json").read_bytes()
    code, again = train(capsys, "--request", request, "--adapter", "cli-demo", "--student", str(tiny_student), "--out", str(tmp_path), "--json")
    assert code == 0 and again["reused"] is True and again["receipt"] == result["receipt"]
    assert (run_dir / "train_receipt.json").read_bytes() == before


def test_sigterm_cancels_then_cli_resume_matches_an_uninterrupted_run(tiny_student, corpus_dir, tmp_path, capsys):
    import kiln_core.training.trainer as trainer

    request = write_request(corpus_dir)
    args = ["--request", request, "--student", str(tiny_student), "--json"]
    code, reference = train(capsys, *args, "--out", str(tmp_path / "reference"), "--adapter", "resumable")
    assert code == 0

    root = str(tmp_path / "interrupted")
    with sigterm_after_step(trainer, "train_opd", 3, hook="on_progress"):
        code, cancelled = train(capsys, *args, "--out", root, "--adapter", "resumable")
    assert code == 3 and cancelled["status"] == "cancelled"
    assert cancelled["latest_checkpoint"] == "resumable-checkpoint-step-00000003.kiln-checkpoint"
    receipt = json.loads((run_dir_of(cancelled) / "train_receipt.json").read_text())
    assert (receipt["status"], receipt["failure_reason"]) == ("failed", "cancelled")

    # without --resume-checkpoint the run is refused, naming the newest checkpoint and the exact command
    code, refused = train(capsys, *args, "--out", root, "--adapter", "resumable")
    assert code == 2 and refused["code"] == "resume_required"
    assert cancelled["latest_checkpoint"] in refused["message"]
    assert f"--resume-checkpoint {cancelled['latest_checkpoint']}" in refused["message"]
    assert f"kiln-flows train --request {request} --adapter resumable" in refused["message"]

    code, resumed = train(capsys, *args, "--out", root, "--adapter", "resumable", "--resume-checkpoint",
                          cancelled["latest_checkpoint"])
    assert code == 0 and resumed["status"] == "success"
    assert run_dir_of(resumed).name == run_dir_of(reference).name  # the same inputs: the same run key
    adapter = lambda result: (Path(result["adapter"]) / "adapter_model.safetensors").read_bytes()  # noqa: E731
    assert adapter(resumed) == adapter(reference)


def test_a_second_ctrl_c_stops_at_once_and_the_receipt_says_cancelled(tiny_student, corpus_dir, tmp_path, capsys,
                                                                         monkeypatch):
    """Two Ctrl-Cs right after step 3 (a user who does not wait for the step boundary): the run stops
    inside that step's callback, without the next step or a checkpoint, and its receipt says ``cancelled``
    like a single Ctrl-C's, not ``training_error``; exit 3."""
    import os
    import signal

    import kiln_core.training.trainer as trainer

    original = trainer.train_opd

    def ctrl_c_twice_after_step_3(*args, **kwargs):
        report = kwargs["on_progress"]

        def progress(step, total, loss):
            if report is not None:
                report(step, total, loss)
            if step == 3:
                os.kill(os.getpid(), signal.SIGINT)  # the first asks for a stop at the next boundary
                os.kill(os.getpid(), signal.SIGINT)  # the second stops now, here

        return original(*args, **{**kwargs, "on_progress": progress})

    monkeypatch.setattr(trainer, "train_opd", ctrl_c_twice_after_step_3)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    root = tmp_path / "out"
    code, _ = train(capsys, "--request", write_request(corpus_dir), "--adapter", "impatient", "--student",
                    str(tiny_student), "--out", str(root), "--json")
    assert code == 3
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # restored
    [run_dir] = [path for path in (root / "runs" / "impatient").iterdir() if path.is_dir()]
    receipt = json.loads((run_dir / "train_receipt.json").read_text())
    assert (receipt["status"], receipt["failure_reason"]) == ("failed", "cancelled"), receipt["failure_message"]
    assert "second Ctrl-C" in receipt["failure_message"]
    assert not (run_dir / "adapter").exists()
    checkpoints = sorted(path.name for path in run_dir.glob("*.kiln-checkpoint"))
    assert checkpoints == ["impatient-checkpoint-step-00000002.kiln-checkpoint"]  # none published on the way out


def test_rejections_exit_2_with_a_code(tiny_student, corpus_dir, tmp_path, capsys):
    student = str(tiny_student)
    base = ["--student", student, "--out", str(tmp_path), "--json", "--adapter", "rejected"]
    cases = [
        (write_request(corpus_dir, "on-policy.json", training_mode="on_policy"), "invalid_config", "training_mode"),
        (write_request(corpus_dir, "low-k.json", top_k=8), "top_k_unsupported", "OPD top_k 8 is not executable"),
        (write_request(corpus_dir, "scale.json", lora_alpha=64.0), "unsafe_lora_scale", "unsafe LoRA scaling"),
    ]
    for request, code_name, fragment in cases:
        code, result = train(capsys, "--request", request, *base)
        assert code == 2 and result["status"] == "rejected" and result["code"] == code_name and fragment in result["message"]

    bad_teacher = corpus_dir / "bad-teacher.json"
    bad_teacher.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "nobody", "config": CONFIG}))
    code, result = train(capsys, "--request", str(bad_teacher), *base)
    assert code == 2 and result["code"] == "teacher_not_registered"

    broken = corpus_dir / "broken.jsonl"
    broken.write_text((corpus_dir / "corpus.jsonl").read_text() + "{not json\n")
    broken_request = corpus_dir / "broken-request.json"
    broken_request.write_text(json.dumps({"dataset_path": "broken.jsonl", "teacher": "teacher-manifest.jsonl", "config": CONFIG}))
    code, result = train(capsys, "--request", str(broken_request), *base)
    assert code == 2 and result["code"] == "invalid_json" and result["line"] == 6

    request = write_request(corpus_dir)
    for name in ["../x/rejected-checkpoint-step-00000002.kiln-checkpoint", "other-checkpoint-step-00000002.kiln-checkpoint"]:
        code, result = train(capsys, "--request", request, *base, "--resume-checkpoint", name)
        assert code == 2 and result["code"] == "invalid_checkpoint_name"
    for adapter in ("../escape", "demo\n", "x" * 129, "a..b"):
        code, result = train(capsys, "--request", request, *base[:-2], "--adapter", adapter)
        assert code == 2 and result["code"] == "invalid_adapter_name", adapter
    code, result = train(capsys, "--request", str(corpus_dir / "missing.json"), *base)
    assert code == 2 and result["code"] == "invalid_request"
    assert not (tmp_path / "runs").exists()  # nothing was trained or written for any rejection


def test_resume_mismatch_is_a_rejection(tiny_student, corpus_dir, tmp_path, capsys):
    request = write_request(corpus_dir, "short.json", epochs=1)
    args = ["--student", str(tiny_student), "--out", str(tmp_path), "--json", "--adapter", "mismatch"]
    assert train(capsys, "--request", request, *args)[0] == 0
    changed = write_request(corpus_dir, "changed.json", epochs=1, learning_rate=0.01)
    code, result = train(capsys, "--request", changed, *args, "--resume-checkpoint", "mismatch-checkpoint-step-00000002.kiln-checkpoint")
    assert code == 2 and result["code"] == "resume_effective_config"


def test_a_corpus_scored_from_the_teacher_dir_names_the_differing_field_against_its_alias(
        tiny_student, tiny_teacher, tmp_path, capsys):
    """Scored with ``--teacher DIR`` (served_model_id = the directory's name), trained against the same
    teacher registered under an alias: the rejection names the field, both values, and the fix."""
    import random

    from kiln_core.synthetic import synthetic_example

    rng = random.Random(2)
    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps(synthetic_example(rng, words=5, index=i)) + "\n" for i in range(3)))
    root = tmp_path / "root"
    assert main(["score", str(examples), "--teacher", str(tiny_teacher), "--student", str(tiny_student), "--top-k", "16",
                 "--out", str(tmp_path / "corpus.jsonl"), "--device", "cpu", "--quiet", "--json"]) == 0
    assert main(["teachers", "register", "tiny-alias", str(tiny_teacher), "--out", str(root), "--device", "cpu"]) == 0
    capsys.readouterr()
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "tiny-alias", "config": CONFIG}))
    code, result = train(capsys, "--request", str(request), "--adapter", "aliased", "--student", str(tiny_student),
                         "--out", str(root), "--json")
    assert code == 2 and result["code"] == "identity_mismatch", result
    assert f"served_model_id: corpus {tiny_teacher.name!r}, registered 'tiny-alias'" in result["message"]
    assert "--teacher tiny-alias" in result["message"]  # how to fix it: score with the alias
