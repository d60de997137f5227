"""``kiln-flows train`` end to end: request file → admission → training → adapter, receipt, exit codes."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from flows.cli import main
from kiln_core.canonical import sha256_prefixed
from kiln_core.kiln_prompts import kiln_prompts_sha256
from kiln_core.synthetic import synthesize_corpus

CONFIG = {"training_mode": "off_policy", "objective": "reverse_kl", "loss": "teacher_top_k", "top_k": 16, "lora_rank": 4,
          "lora_alpha": 8.0, "seed": 3, "learning_rate": 0.02, "checkpoint_interval": 2, "epochs": 2}


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matrices: one thread is faster and steadier than two on a shared runner.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
            "post_eval": None, "unknown_field": "ignored like Kiln"}
    path = directory / name
    path.write_text(json.dumps(body))
    return str(path)


def train(capsys, *argv):
    code = main(["train", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, (json.loads(out[-1]) if out else None)


def test_train_end_to_end_json(tiny_student, corpus_dir, tmp_path, capsys):
    request = write_request(corpus_dir)
    code, result = train(capsys, "--request", request, "--adapter", "cli-demo", "--student", str(tiny_student),
                         "--out", str(tmp_path), "--json")
    assert code == 0, result
    run_dir = tmp_path / "runs" / "cli-demo"
    assert result == {"status": "success", "adapter": str(run_dir / "adapter"), "receipt": str(run_dir / "train_receipt.json"),
                      "latest_checkpoint": "cli-demo-checkpoint-step-00000006.kiln-checkpoint", "final_loss": result["final_loss"]}
    assert isinstance(result["final_loss"], float)
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    receipt = json.loads((run_dir / "train_receipt.json").read_text())
    corpus_bytes = (corpus_dir / "corpus.jsonl").read_bytes()
    assert receipt["training_data"] == {"source": "jsonl_off_policy_opd_teacher", "path": "corpus.jsonl",
                                        "sha256": sha256_prefixed(corpus_bytes)}
    assert receipt["opd"]["teacher_identity"]["served_model_id"] == "synthetic-teacher"
    assert receipt["opd"]["teacher_identity_revision"].startswith("sha256:")
    assert receipt["opd"]["top_k"] == 16 and receipt["config"]["output_name"] == "cli-demo"
    assert (tmp_path / "corpora").is_dir()  # the admitted corpus was materialized under the root
    manifest = json.loads((run_dir / "cli-demo-checkpoint-step-00000002.kiln-checkpoint" / "checkpoint_manifest.json").read_text())
    # Kiln's prompt-list digest (checked against an independent encoding in test_kiln_checkpoint.py)
    assert manifest["data"]["content_sha256"] == kiln_prompts_sha256(corpus_bytes)
    # the adapter is immutable: training the same name again is refused
    code, again = train(capsys, "--request", request, "--adapter", "cli-demo", "--student", str(tiny_student), "--out", str(tmp_path), "--json")
    assert code == 2 and again["code"] == "adapter_exists"


def test_sigterm_cancels_then_cli_resume_matches_an_uninterrupted_run(tiny_student, corpus_dir, tmp_path, capsys, monkeypatch):
    import kiln_core.training.trainer as trainer

    request = write_request(corpus_dir)
    args = ["--request", request, "--student", str(tiny_student), "--out", str(tmp_path), "--json"]
    assert train(capsys, *args, "--adapter", "reference")[0] == 0

    original = trainer.train_opd

    def terminated_after_step_3(**kwargs):
        def progress(step, total, loss):
            kwargs["on_progress"](step, total, loss)
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # what `kill <pid>` does to a CLI run
        return original(**{**kwargs, "on_progress": progress})

    monkeypatch.setattr(trainer, "train_opd", terminated_after_step_3)
    code, cancelled = train(capsys, *args, "--adapter", "resumable")
    assert code == 3 and cancelled["status"] == "cancelled"
    assert cancelled["latest_checkpoint"] == "resumable-checkpoint-step-00000003.kiln-checkpoint"
    receipt = json.loads((tmp_path / "runs" / "resumable" / "train_receipt.json").read_text())
    assert (receipt["status"], receipt["failure_reason"]) == ("failed", "cancelled")
    monkeypatch.setattr(trainer, "train_opd", original)

    code, resumed = train(capsys, *args, "--adapter", "resumable", "--resume-checkpoint", cancelled["latest_checkpoint"])
    assert code == 0 and resumed["status"] == "success"
    adapter = lambda name: (tmp_path / "runs" / name / "adapter" / "adapter_model.safetensors").read_bytes()  # noqa: E731
    assert adapter("resumable") == adapter("reference")


def test_rejections_exit_2_with_a_code(tiny_student, corpus_dir, tmp_path, capsys):
    student = str(tiny_student)
    base = ["--student", student, "--out", str(tmp_path), "--json", "--adapter", "rejected"]
    cases = [
        (write_request(corpus_dir, "on-policy.json", training_mode="on_policy"), "invalid_config", "training_mode"),
        (write_request(corpus_dir, "low-k.json", top_k=8), "invalid_config", "OPD top_k 8 is not executable"),
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
    code, result = train(capsys, "--request", request, *base[:-2], "--adapter", "../escape")
    assert code == 2 and result["code"] == "invalid_adapter_name"
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
