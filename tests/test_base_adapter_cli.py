"""``kiln-flows train`` with ``config.base_adapter``: off-policy first, then a warm start from that adapter.

What a user depends on: a request naming an adapter a first run published trains from it, off-policy
and on-policy (the recipe: teacher answers first, then the student's own rollouts); the receipt records
the base adapter's name and digest; a base adapter re-published under the same name is a different
run; a warm-started run interrupted and resumed — ``resume: latest`` as every pipeline retry does, or
``--resume-checkpoint`` — ends with the same adapter bytes as an uninterrupted one; and a missing or
mismatching base adapter is refused (exit 2, stable code) before any corpus work or model load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from kill_support import sigterm_after_step
from kiln_core.synthetic import synthesize_corpus
from on_policy_support import chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

ALIAS = "tiny-teacher"
OFF_POLICY = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
              "learning_rate": 0.02, "checkpoint_interval": 2, "epochs": 2}
ON_POLICY = {"samples_per_prompt": 2, "max_tokens": 4, "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 5,
             "learning_rate": 2e-2, "checkpoint_interval": 2, "epochs": 1}
PROMPTS = [chat("What is two plus two?"), chat("Translate to French: good morning")]


@pytest.fixture(scope="module")
def root(tiny_student, tiny_teacher, tmp_path_factory) -> Path:
    """A storage root with the tiny teacher registered, a scored corpus beside it, and a published
    off-policy adapter ``base`` (the first half of the recipe)."""
    directory = tmp_path_factory.mktemp("warm-root")
    assert main(["teachers", "register", ALIAS, str(tiny_teacher), "--out", str(directory), "--device", "cpu",
                 "--json"]) == 0
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=3, top_k=16, seed=0)
    manifest = (directory / "corpus.jsonl").read_text().splitlines()[0]
    (directory / "teacher-manifest.jsonl").write_text(manifest + "\n")
    code = main(["train", "--request", off_policy_request(directory, "base.json"), "--adapter", "base",
                 "--student", str(tiny_student), "--out", str(directory), "--json"])
    assert code == 0
    return directory


def off_policy_request(directory: Path, name: str, **overrides) -> str:
    path = directory / name
    path.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl",
                                "config": {**OFF_POLICY, **overrides}}))
    return str(path)


def on_policy_request(directory: Path, name: str, **overrides) -> str:
    path = directory / name
    path.write_text(json.dumps({"teacher": ALIAS, "prompts": PROMPTS, "config": {**ON_POLICY, **overrides}}))
    return str(path)


def train(capsys, *argv):
    code = main(["train", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, (json.loads(out[-1]) if out else None)


def latest(root: Path, adapter: str) -> dict:
    return json.loads((root / "runs" / adapter / "latest.json").read_text())


def weights(result: dict) -> bytes:
    return (Path(result["adapter"]) / "adapter_model.safetensors").read_bytes()


def test_an_off_policy_run_warm_starts_from_a_published_adapter(tiny_student, root, capsys):
    base = latest(root, "base")
    args = ["--student", str(tiny_student), "--out", str(root), "--json"]
    code, cold = train(capsys, "--request", off_policy_request(root, "cold.json"), "--adapter", "offpol-cold", *args)
    assert code == 0
    code, warm = train(capsys, "--request", off_policy_request(root, "warm.json", base_adapter="base"),
                       "--adapter", "offpol-warm", *args)
    assert code == 0 and warm["status"] == "success", warm
    receipt = json.loads(Path(warm["receipt"]).read_text())
    assert receipt["config"]["base_adapter"] == "base"  # the name as requested
    assert receipt["adapters"]["base"] == {"path": base["adapter"], "adapter_model_sha256": base["adapter_model_sha256"],
                                           "adapter_model_bytes": len(weights({"adapter": base["adapter"]}))}
    manifest = json.loads(next(Path(warm["run"]).glob("*.kiln-checkpoint/checkpoint_manifest.json")).read_text())
    assert manifest["effective_config"]["base_adapter"] == "base"
    # the first step's loss is the base adapter's, not a fresh LoRA's (which is the base model's)
    assert warm["loss_history"][0] != cold["loss_history"][0]
    assert weights(warm) != weights(cold)
    cold_receipt = json.loads(Path(cold["receipt"]).read_text())
    assert cold_receipt["adapters"]["base"] == {"path": None, "adapter_model_sha256": None, "adapter_model_bytes": None}


def test_an_on_policy_run_warm_starts_from_the_off_policy_adapter(tiny_student, root, capsys):
    base = latest(root, "base")
    code, warm = train(capsys, "--request", on_policy_request(root, "onpol-warm.json", base_adapter="base"),
                       "--adapter", "onpol-warm", "--student", str(tiny_student), "--out", str(root), "--json")
    assert code == 0 and warm["status"] == "success", warm
    receipt = json.loads(Path(warm["receipt"]).read_text())
    assert receipt["opd"]["training_mode"] == "on_policy" and receipt["config"]["base_adapter"] == "base"
    assert receipt["adapters"]["base"]["adapter_model_sha256"] == base["adapter_model_sha256"]
    assert receipt["adapters"]["base"]["path"] == base["adapter"]


def test_a_republished_base_adapter_is_a_different_run(tiny_student, root, tmp_path, capsys):
    """The run key holds the base adapter's digest: same request, same name, new bytes → a new run."""
    import shutil

    other = tmp_path / "root"
    shutil.copytree(root / "runs" / "base", other / "runs" / "base")
    shutil.copy(root / "corpus.jsonl", other / "corpus.jsonl")
    shutil.copy(root / "teacher-manifest.jsonl", other / "teacher-manifest.jsonl")
    args = ["--student", str(tiny_student), "--out", str(other), "--json", "--adapter", "rekeyed"]
    request = off_policy_request(other, "warm.json", base_adapter="base", epochs=1)
    code, first = train(capsys, "--request", request, *args)
    assert code == 0
    code, again = train(capsys, "--request", request, *args)
    assert code == 0 and again["reused"] is True and again["run"] == first["run"]  # same base: same run
    # re-publish `base` with other weights (another seed), then the same request again
    code, _ = train(capsys, "--request", off_policy_request(other, "base2.json", seed=99), "--adapter", "base",
                    "--student", str(tiny_student), "--out", str(other), "--json")
    assert code == 0 and latest(other, "base")["adapter_model_sha256"] != latest(root, "base")["adapter_model_sha256"]
    code, rekeyed = train(capsys, "--request", request, *args)
    assert code == 0 and rekeyed["reused"] is False and rekeyed["run"] != first["run"]
    receipt = json.loads(Path(rekeyed["receipt"]).read_text())
    assert receipt["adapters"]["base"]["adapter_model_sha256"] == latest(other, "base")["adapter_model_sha256"]


def test_an_interrupted_warm_start_resumes_to_the_same_adapter(tiny_student, root, capsys):
    """SIGTERM at step 3, then a pipeline-style retry (``resume: latest``): the checkpoint's LoRA is
    restored and the base adapter is not applied again, so the bytes match an uninterrupted run."""
    import kiln_core.training.trainer as trainer
    from kiln_core.engine import run_pipeline, spec_from_request

    request = off_policy_request(root, "resume.json", base_adapter="base")
    code, reference = train(capsys, "--request", request, "--adapter", "warm-reference", "--student",
                            str(tiny_student), "--out", str(root), "--json")
    assert code == 0

    with sigterm_after_step(trainer, "train_opd", 3, hook="on_progress"):
        code, cancelled = train(capsys, "--request", request, "--adapter", "warm-resumed", "--student",
                                str(tiny_student), "--out", str(root), "--json")
    assert code == 3 and cancelled["status"] == "cancelled"

    run = spec_from_request(request, adapter="warm-resumed", student_dir=str(tiny_student), out_root=str(root))
    resumed = run_pipeline(run.spec, run.stages(handle_signals=False), resume="latest")
    assert resumed.status == "success" and resumed.run == cancelled["run"]
    receipt = json.loads(Path(resumed.receipt).read_text())
    assert receipt["data"]["resumed_from_checkpoint"] == "warm-resumed-checkpoint-step-00000003.kiln-checkpoint"
    assert receipt["adapters"]["base"]["adapter_model_sha256"] == latest(root, "base")["adapter_model_sha256"]
    assert weights({"adapter": resumed.adapter}) == weights(reference)


def test_an_interrupted_on_policy_warm_start_resumes_with_the_checkpoint_flag(tiny_student, root, capsys):
    import kiln_core.training.on_policy_trainer as trainer

    request = on_policy_request(root, "onpol-resume.json", base_adapter="base")
    args = ["--request", request, "--student", str(tiny_student), "--out", str(root), "--json"]
    code, reference = train(capsys, *args, "--adapter", "onpol-warm-reference")
    assert code == 0
    with sigterm_after_step(trainer, "train_on_policy", 2, hook="on_step_committed"):
        code, cancelled = train(capsys, *args, "--adapter", "onpol-warm-resumed")
    assert code == 3 and cancelled["status"] == "cancelled"
    code, resumed = train(capsys, *args, "--adapter", "onpol-warm-resumed", "--resume-checkpoint",
                          cancelled["latest_checkpoint"])
    assert code == 0 and resumed["status"] == "success" and resumed["run"] == cancelled["run"]
    assert weights(resumed) == weights(reference)


def test_bad_base_adapters_are_refused_before_any_work(tiny_student, root, tmp_path, capsys, monkeypatch):
    import kiln_core.training.trainer as trainer
    from kiln_core.engine import stages

    def no_work(*args, **kwargs):
        raise AssertionError("a refused request reached admission or training")

    monkeypatch.setattr(stages, "admit", no_work)
    monkeypatch.setattr(trainer, "train_opd", no_work)
    args = ["--student", str(tiny_student), "--out", str(root), "--json", "--adapter", "refused"]
    base_dir = latest(root, "base")["adapter"]
    cases = [
        ({"base_adapter": "never-published"}, "base_adapter_missing", "config.base_adapter",
         str(root / "runs" / "never-published" / "latest.json")),
        ({"base_adapter": str(tmp_path / "no-such-adapter")}, "base_adapter_missing", "config.base_adapter",
         str(tmp_path / "no-such-adapter")),
        ({"base_adapter": "base", "lora_rank": 8, "lora_alpha": 16.0}, "base_adapter_mismatch", "config.lora_rank",
         "rank mismatch"),
        ({"base_adapter": "base", "lora_alpha": 4.0}, "base_adapter_mismatch", "config.lora_alpha", "lora_alpha"),
        ({"base_adapter": base_dir, "lora_alpha": 6.0}, "base_adapter_mismatch", "config.lora_alpha", "lora_alpha"),
        ({"base_adapter": "base", "resume_checkpoint": "refused-checkpoint-step-00000002.kiln-checkpoint"},
         "invalid_config", "config.base_adapter", "cannot be combined with resume_checkpoint"),
    ]
    for index, (overrides, code_name, field, fragment) in enumerate(cases):
        code, result = train(capsys, "--request", off_policy_request(root, f"bad-{index}.json", **overrides), *args)
        assert code == 2 and result["status"] == "rejected", (overrides, result)
        assert (result["code"], result["field"]) == (code_name, field) and fragment in result["message"], result
    # on-policy requests take the same path
    code, result = train(capsys, "--request", on_policy_request(root, "bad-onpol.json", base_adapter="nope"), *args)
    assert code == 2 and result["code"] == "base_adapter_missing"
    assert not (root / "runs" / "refused").exists()  # nothing was written for a refused run




def test_a_distributed_job_carries_the_resolved_base_adapter(tiny_student, root):
    """``--nproc N``: every torchrun rank gets the base adapter the launching process resolved and pinned."""
    from kiln_core.engine.pipeline import prepare
    from kiln_core.engine.request import spec_from_request
    from kiln_core.engine.training import distributed_job

    run = spec_from_request(off_policy_request(root, "nproc.json", base_adapter="base"), adapter="warm-ddp",
                            student_dir=str(tiny_student), out_root=str(root), nproc=2)
    ready = prepare(run.spec, resume=run.resume, device="cpu")
    job = distributed_job(ready.plan.model_copy(update={"resume": None}), ready.corpus, ready.manifest,
                          ready.student_dir)
    assert job.plan.base_adapter.uri == latest(root, "base")["adapter"]
    assert job.plan.base_adapter.adapter_model_sha256 == latest(root, "base")["adapter_model_sha256"]


def test_an_adapter_can_warm_start_from_its_own_published_self(tiny_student, root, capsys):
    """Kiln allows ``base_adapter`` = the output name (it continues that adapter); so does kiln-flows: the
    name's published adapter is the base, the new run is another run of the name and becomes latest."""
    args = ["--student", str(tiny_student), "--out", str(root), "--json", "--adapter", "continued"]
    code, first = train(capsys, "--request", off_policy_request(root, "first.json", epochs=1), *args)
    assert code == 0
    published = latest(root, "continued")
    code, second = train(capsys, "--request", off_policy_request(root, "again.json", epochs=1,
                                                                 base_adapter="continued"), *args)
    assert code == 0 and second["status"] == "success" and second["run"] != first["run"]
    receipt = json.loads(Path(second["receipt"]).read_text())
    assert receipt["adapters"]["base"]["path"] == published["adapter"] == first["adapter"]
    assert latest(root, "continued")["adapter"] == second["adapter"]
