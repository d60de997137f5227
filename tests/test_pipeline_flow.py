"""The ``opd_distill`` pipeline flow end to end, against a real (test-harness) Prefect server.

Everything is tiny: a 4-example top-16 corpus scored "by" the tiny local teacher (its identity line is
the corpus manifest), 2 epochs = 8 optimizer steps, a checkpoint every 2 steps, AdamW with a fixed
seed. One uninterrupted run (the module-scoped ``reference``) is the yardstick the retry and crash
runs must match byte for byte: the run key does not include the storage root, so the same spec under
another root trains the same steps from the same seed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.integration

ADAPTER = "Tiny_Demo.v1"  # '_' and '.' must be slugified in artifact keys
EXAMPLES = 4
EPOCHS = 2
STEPS = EXAMPLES * EPOCHS  # one candidate per step (off-policy, samples_per_prompt default → 1)
INTERVAL = 2
SEED = 7
# The CLI installed beside the interpreter running these tests: this checkout's code, in any venv.
KILN_FLOWS = str(Path(sys.executable).with_name("kiln-flows"))


# ---------------------------------------------------------------------------------------------
# Helpers


def spec_dict(world, root: Path, *, adapter: str = ADAPTER, seed: int | None = SEED, corpus: str | None = None,
              examples: str | None = None, **options) -> dict:
    spec = {
        "teacher": {"kind": "local_dir", "path": world.teacher},
        "student": world.student,
        "storage_root": str(root),
        "adapter": adapter,
        "config": {
            "training_mode": "off_policy",
            "top_k": 16,
            "epochs": EPOCHS,
            "checkpoint_interval": INTERVAL,
            "learning_rate": 0.01,
            "lora_rank": 4,
            "lora_alpha": 8,
            "optimizer": {"kind": "adam_w"},
            "seed": seed,
        },
        "options": {"progress_every_seconds": 0.2, "cancel_poll_seconds": 5.0, **options},
    }
    if examples is not None:
        spec["examples"] = examples
    else:
        spec["corpus"] = corpus or world.corpus
    return spec


def run_pipeline(spec: dict):
    """Run the flow in this process; return (state, summary)."""
    from flows.opd_distill import opd_distill
    from flows.spec import parse_spec

    state = opd_distill(parse_spec(spec), return_state=True)
    assert state.is_completed(), f"{state.type}: {state.message}"
    return state, state.result()


def adapter_bytes(summary: dict) -> bytes:
    return (Path(summary["adapter"]) / "adapter_model.safetensors").read_bytes()


def read_receipt(summary: dict) -> dict:
    return json.loads(Path(summary["receipt"]).read_text())


def stage_of(task_run) -> str:
    return task_run.name.split("-", 1)[0]


def task_runs(flow_run_id, stages: tuple[str, ...], timeout: float = 90.0) -> dict:
    """The flow run's task runs by stage (name prefix), once every stage listed has a final state.

    Task runs reach the server through events, so they may show up a little after the flow returns.
    """
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        by_stage: dict = {}
        for run in runs:
            by_stage.setdefault(stage_of(run), []).append(run)
        ready = all(
            stage in by_stage and all(r.state is not None and r.state.is_final() for r in by_stage[stage])
            for stage in stages
        )
        if ready or time.monotonic() > deadline:
            missing = [s for s in stages if s not in by_stage]
            assert ready, f"task runs not recorded in time (missing {missing}; have {sorted(by_stage)})"
            return {stage: runs_[0] for stage, runs_ in by_stage.items() if len(runs_) == 1} | {
                stage: runs_ for stage, runs_ in by_stage.items() if len(runs_) > 1
            }
        time.sleep(0.5)


def run_dir_of(summary: dict) -> Path:
    return Path(summary["run"])


def listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


# ---------------------------------------------------------------------------------------------
# Module fixtures: the corpus is built once, the reference run trained once


@pytest.fixture(scope="module")
def world(tiny_student, tiny_teacher, tmp_path_factory):
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.synthetic import synthesize_corpus

    base = tmp_path_factory.mktemp("pipeline")
    line = build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32))
    corpus = synthesize_corpus(tiny_student, base / "corpus.jsonl", n_examples=EXAMPLES, top_k=16, manifest_line=line)
    return SimpleNamespace(base=base, student=str(tiny_student), teacher=str(tiny_teacher), corpus=str(corpus),
                           manifest_line=line)


@pytest.fixture(scope="module")
def reference(world, prefect_harness):
    """One uninterrupted run with an explicit seed (root ``ref``)."""
    root = world.base / "ref"
    spec = spec_dict(world, root)
    state, summary = run_pipeline(spec)
    return SimpleNamespace(root=root, spec=spec, state=state, summary=summary)


# ---------------------------------------------------------------------------------------------
# 1. end to end


def test_pipeline_end_to_end(world, reference, tiny_student):
    import torch
    from peft import PeftModel
    from prefect.artifacts import Artifact
    from transformers import AutoModelForCausalLM

    from tasks.artifacts import artifact_key

    summary = reference.summary
    assert summary["status"] == "success"
    receipt = read_receipt(summary)
    assert receipt["status"] == "success"
    assert receipt["data"]["total_steps"] == STEPS and receipt["data"]["examples_trained"] == STEPS
    assert len(summary["loss_history"]) == STEPS == len(receipt["loss_history"])
    assert summary["loss_history"] == receipt["loss_history"]
    assert summary["final_loss"] == summary["loss_history"][-1]
    assert receipt["hyperparameters"]["seed"] == SEED
    assert receipt["data"]["resumed_from_checkpoint"] is None

    # the run directory is <root>/runs/<adapter>/<run key>/ and holds the checkpoints at 2, 4, 6
    run = run_dir_of(summary)
    assert run.parent == reference.root / "runs" / ADAPTER
    checkpoints = [n for n in listing(run) if n.endswith(".kiln-checkpoint")]
    assert checkpoints == [f"{ADAPTER}-checkpoint-step-{s:08d}.kiln-checkpoint" for s in (2, 4, 6)]
    assert [Path(uri).name for uri in summary["checkpoints"]] == checkpoints

    # latest.json points at this receipt and adapter
    latest = json.loads((reference.root / "runs" / ADAPTER / "latest.json").read_text())
    assert Path(summary["latest"]) == reference.root / "runs" / ADAPTER / "latest.json"
    assert latest["receipt"] == summary["receipt"]
    assert latest["adapter"] == summary["adapter"]
    assert latest["receipt_sha256"] == "sha256:" + hashlib.sha256(Path(summary["receipt"]).read_bytes()).hexdigest()
    assert latest["adapter_model_sha256"] == receipt["adapters"]["output"]["adapter_model_sha256"]
    assert latest["dataset_sha256"] == summary["dataset_sha256"]

    # the adapter loads with peft onto the tiny student and changes its outputs
    base = AutoModelForCausalLM.from_pretrained(str(tiny_student))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        before = base(ids).logits.clone()
    model = PeftModel.from_pretrained(base, summary["adapter"])
    with torch.no_grad():
        after = model(ids).logits
    assert after.shape == before.shape
    assert not torch.equal(before, after), "a trained LoRA adapter should change the student's logits"

    # artifacts, with keys slugified from the adapter name
    keys = {
        "table": artifact_key("receipt", ADAPTER),
        "markdown": artifact_key("outputs", ADAPTER),
        "progress": artifact_key("train-progress", ADAPTER),
    }
    assert keys == {"table": "receipt-tiny-demo-v1", "markdown": "outputs-tiny-demo-v1",
                    "progress": "train-progress-tiny-demo-v1"}
    for kind, key in keys.items():
        artifact = Artifact.get(key)
        assert artifact is not None, f"no {kind} artifact {key}"
        assert artifact.type == kind
    table = Artifact.get(keys["table"]).data
    rows = json.loads(table) if isinstance(table, str) else table
    fields = {row["field"]: row["value"] for row in rows}
    assert fields["status"] == "success" and fields["steps"] == f"{STEPS} of {STEPS}"
    assert summary["adapter"] in Artifact.get(keys["markdown"]).data
    assert float(Artifact.get(keys["progress"]).data) == pytest.approx(100.0)


# ---------------------------------------------------------------------------------------------
# 2. an unchanged corpus is admitted once


def test_the_admit_cache_outlives_a_change_of_prefect_home(reference, tmp_path):
    # Prefect's own result storage moves with PREFECT_HOME; the admit task's cache records and their results
    # live under the storage root, so a new home still finds them (it used to refuse the result as
    # "outside of the base path").
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    assert listing(reference.root / "prefect" / "results")  # the reference run's admit result is there
    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: tmp_path / "another-prefect-home" / "storage"}):
        state, summary = run_pipeline(reference.spec)
    runs = task_runs(state.state_details.flow_run_id, ("admit", "train"))
    assert runs["admit"].state.name == "Cached", runs["admit"].state
    assert summary["status"] == "success" and summary["adapter"] == reference.summary["adapter"]


def test_unchanged_corpus_is_never_admitted_twice(world, reference, monkeypatch):
    import kiln_core.admission
    import kiln_core.admission.admit as admit_module
    import kiln_core.admission.records as records_module

    def refuse(*args, **kwargs):
        raise AssertionError("parse_corpus was called for a corpus that was already admitted")

    monkeypatch.setattr(admit_module, "parse_corpus", refuse)
    monkeypatch.setattr(records_module, "parse_corpus", refuse)
    corpora = reference.root / "corpora"
    materialized = listing(corpora)
    assert len(materialized) == 1

    calls = []
    real_admit = kiln_core.admission.admit_corpus

    def spy(*args, **kwargs):
        result = real_admit(*args, **kwargs)
        calls.append(result)
        return result

    monkeypatch.setattr(kiln_core.admission, "admit_corpus", spy)

    # same spec again: admission comes from the cache (its materialization verified); the materialize stage
    # is the byte check itself, so it always runs
    state, summary = run_pipeline(reference.spec)
    runs = task_runs(state.state_details.flow_run_id, ("admit", "materialize", "train", "publish"))
    assert runs["admit"].state.name == "Cached", runs["admit"].state
    assert runs["materialize"].state.name == "Completed", runs["materialize"].state
    assert calls == []
    assert summary["adapter"] == reference.summary["adapter"]
    assert summary["receipt"] == reference.summary["receipt"]

    # refresh: admission runs again, but binds to the same content-addressed materialization
    refreshed = copy.deepcopy(reference.spec)
    refreshed["options"]["refresh"] = True
    state, summary = run_pipeline(refreshed)
    runs = task_runs(state.state_details.flow_run_id, ("admit", "materialize", "train", "publish"))
    assert runs["admit"].state.name != "Cached"
    assert runs["admit"].state.is_completed()
    assert len(calls) == 1
    assert calls[0].reused is True
    assert Path(calls[0].materialized) == corpora / materialized[0]
    assert listing(corpora) == materialized
    assert summary["dataset_sha256"] == reference.summary["dataset_sha256"]


# ---------------------------------------------------------------------------------------------
# 2b. a cache is a hint: a cached result whose artifact is gone or changed is computed again


def admit_runs(flow_run_id) -> list:
    """The flow run's admit task runs, in the order they ran (two when a cached result was stale)."""
    runs = task_runs(flow_run_id, ("admit", "materialize", "train"))["admit"]
    return sorted(runs, key=lambda run: run.start_time or run.expected_start_time) if isinstance(runs, list) else [runs]


def test_a_deleted_or_damaged_materialization_is_admitted_again_not_reused_from_the_cache(world, prefect_harness,
                                                                                          tmp_path):
    root = tmp_path / "root"
    spec = spec_dict(world, root, adapter="hint")
    _, first = run_pipeline(spec)
    (materialization,) = [path for path in (root / "corpora").iterdir()]
    assert (root / "prefect" / "cache-keys").is_dir()  # the admit record lives beside what it describes

    # deleted (and the runs with it, so training needs the corpus): the cached ref names nothing
    shutil.rmtree(materialization)
    shutil.rmtree(root / "runs")
    state, again = run_pipeline(spec)
    assert [run.state.name for run in admit_runs(state.state_details.flow_run_id)] == ["Cached", "Completed"]
    assert again["status"] == "success" and adapter_bytes(again) == adapter_bytes(first)
    assert (materialization / "admission.json").is_file()

    # damaged: one byte of a table; set aside, admitted again, trained on the intact tables
    targets = materialization / "targets.parquet"
    targets.write_bytes(targets.read_bytes()[:-1] + b"\0")
    shutil.rmtree(root / "runs")
    state, repaired = run_pipeline(spec)
    assert [run.state.name for run in admit_runs(state.state_details.flow_run_id)] == ["Cached", "Completed"]
    assert repaired["status"] == "success" and adapter_bytes(repaired) == adapter_bytes(first)
    assert [path.name for path in (root / "corpora").iterdir() if ".damaged-" in path.name]

    # intact: reused from the cache, once
    state, _ = run_pipeline(spec)
    assert [run.state.name for run in admit_runs(state.state_details.flow_run_id)] == ["Cached"]


def test_a_deleted_or_changed_scored_corpus_is_scored_again_not_reused_from_the_cache(world, prefect_harness, tmp_path):
    import random

    from kiln_core.synthetic import synthetic_example

    rng = random.Random(5)
    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps(synthetic_example(rng, words=6, index=i)) + "\n" for i in range(EXAMPLES)))
    root = tmp_path / "root"
    spec = spec_dict(world, root, adapter="scored-hint", examples=str(examples))
    spec["config"]["epochs"] = 1
    _, first = run_pipeline(spec)
    (scored,) = list((root / "scored").glob("*.jsonl"))
    original = scored.read_bytes()

    def score_states(flow_run_id) -> list[str]:
        runs = task_runs(flow_run_id, ("score", "admit", "train"))["score"]
        runs = sorted(runs, key=lambda run: run.start_time or run.expected_start_time) if isinstance(runs, list) else [runs]
        return [run.state.name for run in runs]

    # deleted: the bug this guards against — the record pointed at a file that was gone (file_not_found, exit 3)
    scored.unlink()
    state, again = run_pipeline(spec)
    assert score_states(state.state_details.flow_run_id) == ["Cached", "Completed"]
    assert again["status"] == "success" and scored.read_bytes() == original

    # changed: a line appended to the scored corpus is not the recorded digest; the teacher scores it again
    scored.write_bytes(original + b'{"messages": []}\n')
    state, changed = run_pipeline(spec)
    assert score_states(state.state_details.flow_run_id) == ["Cached", "Completed"]
    assert changed["status"] == "success" and scored.read_bytes() == original
    assert changed["dataset_sha256"] == first["dataset_sha256"]


# ---------------------------------------------------------------------------------------------
# 3. retry from checkpoint


@pytest.mark.parametrize(("seed", "fail_at"), [(SEED, 3), (None, 5)], ids=["explicit-seed", "derived-seed"])
def test_retry_resumes_from_checkpoint_byte_identical(world, reference, monkeypatch, seed, fail_at):
    import kiln_core.training.trainer as trainer
    from kiln_core.training.checkpoint import checkpoint_basename
    from test_trainer import crash_after

    label = "explicit" if seed is not None else "derived"
    if seed is None:
        _, uninterrupted = run_pipeline(spec_dict(world, world.base / f"plain-{label}", seed=None))
    else:
        uninterrupted = reference.summary

    real_train_opd, calls = trainer.train_opd, []

    def first_attempt_crashes(plan, *args, **kwargs):  # the train task's first attempt dies right after step `fail_at`
        calls.append(plan.resume)
        hook = crash_after(fail_at) if len(calls) == 1 else None
        return real_train_opd(plan, *args, **{**kwargs, "on_step_committed": hook})

    monkeypatch.setattr(trainer, "train_opd", first_attempt_crashes)
    state, summary = run_pipeline(spec_dict(world, world.base / f"retry-{label}", seed=seed, train_retries=1))
    assert calls == [None, checkpoint_basename(ADAPTER, fail_at - fail_at % INTERVAL)]

    runs = task_runs(state.state_details.flow_run_id, ("train",))
    assert runs["train"].run_count == 2, f"train ran {runs['train'].run_count} time(s)"
    assert runs["train"].state.is_completed()

    receipt = read_receipt(summary)
    assert receipt["status"] == "success"
    resumed_at = fail_at - fail_at % INTERVAL  # the newest checkpoint committed before the crash
    assert receipt["data"]["resumed_from_checkpoint"] == checkpoint_basename(ADAPTER, resumed_at)
    assert len(summary["loss_history"]) == STEPS
    assert summary["loss_history"] == uninterrupted["loss_history"]

    # same run key under another storage root → same seed → same bytes
    assert run_dir_of(summary).name == run_dir_of(uninterrupted).name
    reference_receipt = read_receipt(uninterrupted)
    assert receipt["hyperparameters"]["seed"] == reference_receipt["hyperparameters"]["seed"]
    if seed is None:
        assert receipt["hyperparameters"]["seed"] == int(run_dir_of(summary).name, 16) % (2**63)
    else:
        assert receipt["hyperparameters"]["seed"] == seed
    assert adapter_bytes(summary) == adapter_bytes(uninterrupted)
    assert receipt["adapters"]["output"]["adapter_model_sha256"] == reference_receipt["adapters"]["output"]["adapter_model_sha256"]


# ---------------------------------------------------------------------------------------------
# 4. a crashed (SIGKILLed) worker process


HANG_HOOK = textwrap.dedent(
    """
    # Test hook (only on this subprocess's PYTHONPATH): hang right after each checkpoint commits, so
    # the test can SIGKILL the process at a known point instead of racing the training loop.
    import os
    import time

    if os.environ.get("KILN_TEST_HANG_AFTER_CHECKPOINT"):
        import kiln_core.training.checkpoint as _ckpt

        _write = _ckpt.write_checkpoint

        def _write_then_hang(*args, **kwargs):
            name = _write(*args, **kwargs)
            print("checkpoint committed:", name, flush=True)
            time.sleep(float(os.environ["KILN_TEST_HANG_AFTER_CHECKPOINT"]))
            return name

        _ckpt.write_checkpoint = _write_then_hang
    """
)


def _worker_command(spec_path: Path) -> list[str]:
    assert os.path.exists(KILN_FLOWS), f"no kiln-flows console script beside {sys.executable}: pip install -e ."
    return [KILN_FLOWS, "run", str(spec_path), "--json"]


def test_crashed_worker_resumes_from_checkpoint(world, reference, tmp_path):
    import prefect.settings
    import yaml

    from kiln_core.training.checkpoint import MANIFEST_FILE, checkpoint_basename

    root = world.base / "crash"
    spec = spec_dict(world, root)
    spec_path = tmp_path / "pipeline.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HANG_HOOK)

    env = dict(os.environ)
    env.update({
        "PREFECT_API_URL": prefect.settings.PREFECT_API_URL.value(),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
        "PYTHONPATH": str(hook_dir),
        "KILN_TEST_HANG_AFTER_CHECKPOINT": "600",
    })
    log_path = tmp_path / "worker.log"
    first = checkpoint_basename(ADAPTER, INTERVAL)
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(_worker_command(spec_path), cwd=tmp_path, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            committed = None
            while committed is None:
                assert worker.poll() is None, f"worker exited early ({worker.returncode}):\n{log_path.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"no checkpoint in time:\n{log_path.read_text()[-4000:]}"
                found = list((root / "runs" / ADAPTER).glob(f"*/{first}/{MANIFEST_FILE}"))
                committed = found[0].parent if found else None
                time.sleep(0.2)
        finally:
            if worker.poll() is None:
                os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=60)
    assert worker.returncode == -signal.SIGKILL
    run = committed.parent
    assert not (run / "adapter").exists() and not (run / "train_receipt.json").exists()
    assert [n for n in listing(run) if n.endswith(".kiln-checkpoint")] == [first]

    # the same spec again (here, in the test process): resumes from the crashed run's checkpoint
    state, summary = run_pipeline(spec)
    assert run_dir_of(summary) == run
    receipt = read_receipt(summary)
    assert receipt["status"] == "success"
    assert receipt["data"]["resumed_from_checkpoint"] == first
    assert summary["loss_history"] == reference.summary["loss_history"]
    assert adapter_bytes(summary) == adapter_bytes(reference.summary)


# ---------------------------------------------------------------------------------------------
# 6. a rejected corpus


def _bad_corpus(world, path: Path) -> tuple[Path, int]:
    """The corpus with one teacher_tokens entry dropped from the second example (line 3)."""
    lines = Path(world.corpus).read_text().splitlines()
    record = json.loads(lines[2])
    record["teacher_tokens"] = record["teacher_tokens"][:-1]
    lines[2] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    return path, 3


def test_rejected_corpus_fails_in_admit_and_writes_nothing(world, prefect_harness, tmp_path):
    from flows.opd_distill import opd_distill
    from flows.spec import parse_spec

    bad, line = _bad_corpus(world, tmp_path / "bad-corpus.jsonl")
    root = tmp_path / "root"
    state = opd_distill(parse_spec(spec_dict(world, root, corpus=str(bad))), return_state=True)
    assert state.is_failed(), f"{state.type}: {state.message}"
    assert "token_count_mismatch" in state.message, state.message
    assert f"line {line}" in state.message, state.message
    assert listing(root / "corpora") == [] and listing(root / "runs") == []

    runs = task_runs(state.state_details.flow_run_id, ("admit",))
    assert runs["admit"].state.is_failed()
    assert "materialize" not in runs and "train" not in runs


# ---------------------------------------------------------------------------------------------
# 7. validate_corpus


def test_validate_corpus_admitted(world, prefect_harness, tmp_path):
    import shutil

    from prefect.artifacts import Artifact

    from flows.validate_corpus import validate_corpus
    from tasks.artifacts import artifact_key

    corpus = tmp_path / "validate-ok.jsonl"
    shutil.copy(world.corpus, corpus)
    state = validate_corpus(str(corpus), world.student, top_k=16, return_state=True)
    assert state.is_completed(), state.message
    verdict = state.result()
    assert verdict["status"] == "admitted"
    assert verdict["examples"] == EXAMPLES and verdict["effective_top_k"] == 16
    assert verdict["materialized"] is None
    key = artifact_key("verdict", corpus.name)
    assert key == "verdict-validate-ok-jsonl"
    artifact = Artifact.get(key)
    assert artifact is not None and artifact.type == "table"
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    assert {row["field"]: row["value"] for row in rows}["status"] == "admitted"


def test_validate_corpus_rejected(world, prefect_harness, tmp_path):
    from prefect.artifacts import Artifact

    from flows.validate_corpus import validate_corpus
    from tasks.artifacts import artifact_key

    bad, line = _bad_corpus(world, tmp_path / "validate-bad.jsonl")
    state = validate_corpus(str(bad), world.student, top_k=16, return_state=True)
    assert state.is_failed(), f"{state.type}: {state.message}"
    assert f"[token_count_mismatch] line {line}" in state.message, state.message
    artifact = Artifact.get(artifact_key("verdict", bad.name))
    assert artifact is not None and artifact.type == "table"
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    fields = {row["field"]: row["value"] for row in rows}
    assert fields["status"] == "rejected" and fields["code"] == "token_count_mismatch" and fields["line"] == str(line)
    assert not list(tmp_path.glob("**/corpora"))


# ---------------------------------------------------------------------------------------------
# 8. the examples path: score first, then the pipeline


def test_examples_are_scored_then_trained_and_reused(world, prefect_harness, tmp_path):
    try:
        import kiln_core.scoring  # noqa: F401
    except ImportError as error:
        pytest.skip(f"kiln_core.scoring is not available: {error}")
    import random

    from kiln_core.synthetic import synthetic_example

    rng = random.Random(3)
    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps(synthetic_example(rng, words=6, index=i)) + "\n" for i in range(EXAMPLES)))
    root = tmp_path / "root"
    spec = spec_dict(world, root, examples=str(examples))
    spec["config"]["epochs"] = 1

    state, summary = run_pipeline(spec)
    runs = task_runs(state.state_details.flow_run_id, ("score", "admit", "train"))
    assert runs["score"].state.name != "Cached"
    assert summary["status"] == "success"
    assert len(summary["loss_history"]) == EXAMPLES
    scored = list((root / "scored").glob("*.jsonl"))
    assert len(scored) == 1
    assert scored[0].read_text().splitlines()[0] == world.manifest_line
    receipt = read_receipt(summary)
    assert receipt["training_data"]["sha256"] == summary["dataset_sha256"]

    before = scored[0].stat().st_mtime_ns
    state, again = run_pipeline(spec)
    runs = task_runs(state.state_details.flow_run_id, ("score", "admit", "materialize"))
    assert runs["score"].state.name == "Cached", runs["score"].state
    assert runs["admit"].state.name == "Cached", runs["admit"].state
    assert scored[0].stat().st_mtime_ns == before
    assert again["receipt"] == summary["receipt"]


# ---------------------------------------------------------------------------------------------
# 5. invalid specs fail before any work, naming the field


def _invalid_cases():
    def loss(d):
        d["config"]["loss"] = "sampled_token"

    def top_k(d):
        d["config"]["top_k"] = 8

    def adapter(d):
        d["adapter"] = "team/adapter"

    def no_data(d):
        d.pop("corpus", None)
        d.pop("examples", None)

    return [
        pytest.param(loss, "config.loss", id="loss-sampled_token"),
        pytest.param(top_k, "config.top_k", id="top_k-8"),
        pytest.param(adapter, "adapter", id="adapter-slash"),
        pytest.param(no_data, "corpus", id="no-corpus-no-examples"),
    ]


@pytest.mark.parametrize(("mutate", "field"), _invalid_cases())
def test_parse_spec_names_the_invalid_field(world, tmp_path, mutate, field):
    from flows.spec import SpecError, parse_spec

    spec = spec_dict(world, tmp_path / "root")
    mutate(spec)
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert f"`{field}`" in str(caught.value) or field in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("mutate", "field"), _invalid_cases())
def test_flow_rejects_invalid_spec_before_any_work(world, prefect_harness, tmp_path, mutate, field):
    from flows.opd_distill import opd_distill

    root = tmp_path / "root"
    spec = spec_dict(world, root)
    mutate(spec)
    state = opd_distill(spec, return_state=True)
    assert state.is_failed(), f"{state.type}: {state.message}"
    assert field in (state.message or ""), state.message
    assert not root.exists(), f"created {sorted(str(p) for p in root.rglob('*'))}"
