"""The fault drills of ``drills`` at CI size, each asserted to pass.

Full size (what the closing note quotes) is ``kiln-flows drill all --json``: sigkill 20 trials,
s3-outage 8, concurrent-materialize 12, corrupt-checkpoint 9, fuzz-admission and fuzz-oracle 10,000
cases each. Here sigkill keeps its full 20 trials (about two minutes on two busy cores); the others
run fewer, chosen so that every kill mode, outage point, schedule and damage kind runs at least once.
A failing drill prints its whole report, failure details first.
"""

from __future__ import annotations

import json

import pytest

from drills import run_drill

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def explain(report: dict) -> str:
    details = "\n".join(f"  - {d}" for d in report.get("failure_details", []))
    figures = {k: v for k, v in report.items() if k != "failure_details"}
    return f"drill {report['drill']} failed:\n{details}\nfigures: {json.dumps(figures, indent=1)}"


def check(report: dict) -> dict:
    assert report["passed"], explain(report)
    assert report["trials"] == report["passes"] and report["crashes"] == 0 and report["failures"] == 0
    return report


def test_sigkill_at_random_points_resumes_byte_identically(tmp_path):
    # The first 7 trials take each kill mode once, the other 3 modes drawn at random (`kiln-flows drill sigkill
    # --trials N` runs more); only a kill at a random delay may find the run already finished.
    report = check(run_drill("sigkill", workdir=str(tmp_path), trials=10, seed=0))
    assert report["kills"] + report.get("completed_before_kill", 0) == 10
    assert report["kills"] >= 10 - report["modes"].get("random", 0)
    assert set(report["modes"]) == {"step", "staged-file", "before-commit", "after-commit", "random", "cli", "twice"}


def test_s3_outage_leaves_nothing_partial_and_a_retry_completes(tmp_path):
    # trials 0-4 freeze the server at a corpus write, a checkpoint file, a checkpoint commit, an
    # adapter write/commit and the receipt, in that order
    report = check(run_drill("s3-outage", workdir=str(tmp_path), trials=5, seed=0))
    assert set(report["outages"]) == {"corpus", "checkpoint-file", "checkpoint-commit", "adapter", "receipt"}


def test_concurrent_materialization_commits_once(tmp_path):
    report = check(run_drill("concurrent-materialize", workdir=str(tmp_path), trials=8, seed=0))
    assert set(report["schedules"]) == {"threads", "threads-both-miss", "threads-commit-race", "processes"}


def test_corrupt_checkpoint_is_refused_naming_the_file_and_falls_back_only_on_request(tmp_path):
    report = check(run_drill("corrupt-checkpoint", workdir=str(tmp_path), trials=9, seed=0))
    assert report["refusals_naming_the_file"] == 9 and report["cli_checked"]
    assert report["fallback_to_previous"] == {"exact": 9}


def test_fuzz_admission_mutated_corpora_end_in_one_verdict(tmp_path):
    report = check(run_drill("fuzz-admission", workdir=str(tmp_path), examples=2000, seed=0))
    assert report["cases_tried"] == 2000 and report["admitted"] > 0 and report["codes_seen"] >= 8
    assert report["rejected"] == sum(report["rejected_by_code"].values())
    assert report.get("parity_mismatches", 0) == 0


def test_fuzz_oracle_mutated_requests_end_in_one_verdict(tmp_path):
    report = check(run_drill("fuzz-oracle", workdir=str(tmp_path), examples=2000, seed=0))
    assert report["cases_tried"] == 2000 and report["accepted"] > 0 and report["rules_seen"] >= 10
    assert {"parse", "receipts", "model_identity", "model_inputs"} <= set(report["rejected_at_stage"])


def test_drill_cli_prints_one_json_object_per_drill(tmp_path, capsys):
    from flows.cli import main

    code = main(["drill", "fuzz-oracle", "--examples", "40", "--seed", "3", "--workdir", str(tmp_path), "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert code == (0 if report["passed"] else 3)
    assert report["drill"] == "fuzz-oracle" and report["cases_tried"] == 40 and report["seed"] == 3
    assert {"trials", "passes", "failures", "crashes", "seconds"} <= set(report)
    assert (tmp_path / "fuzz-oracle" / "oracle" / "drill-request-1.json").is_file()  # --workdir keeps the inputs


def test_the_pipeline_train_task_refuses_a_corrupted_latest_checkpoint(tmp_path, prefect_harness, monkeypatch):
    """The train task resumes from the newest checkpoint; a damaged one is refused naming the file (and
    the refusal is not retried), never skipped for the checkpoint before it."""
    import torch

    import kiln_core.training.trainer as trainer
    from drills import prepare_training_inputs
    from kiln_core.admission import admit_corpus
    from kiln_core.contracts.opd_config import parse_opd_config
    from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan
    from kiln_core.storage import list_children, resolve
    from kiln_core.training.checkpoint import ADAPTER_FILE, CheckpointError, latest_checkpoint
    from tasks.retry import retry_unless_rejected
    from tasks.train import train_task
    from test_trainer import Crash, crash_after

    torch.set_num_threads(1)
    inputs = prepare_training_inputs(tmp_path / "fixture")
    request = json.loads(inputs.request(2).read_text())
    manifest_line = (inputs.directory / "inputs" / "teacher-manifest.jsonl").read_text().strip()
    admission = admit_corpus(str(inputs.corpus), str(inputs.student), top_k=16, pinned_manifest=manifest_line,
                             out_root=str(tmp_path / "root"))
    corpus = CorpusRef(uri=admission.materialized, dataset_sha256=admission.dataset_sha256, source_uri=admission.source_uri,
                       examples=admission.examples, action_tokens=admission.action_tokens, env_tokens=admission.env_tokens,
                       effective_top_k=admission.effective_top_k,
                       teacher_identity_revision=admission.teacher_identity.identity_revision())
    manifest = ManifestRef(manifest_line=manifest_line, identity_revision=admission.teacher_identity.identity_revision(),
                           teacher="synthetic-teacher", source="manifest_file")
    run_uri = str(tmp_path / "root" / "runs" / "pipeline" / "run")
    plan = TrainPlan.for_config(parse_opd_config(request["config"]), run_uri, "pipeline", top_k=corpus.effective_top_k,
                                samples_per_prompt=1, resume="latest")  # every retry of a pipeline run
    arguments = (plan, corpus, manifest, str(inputs.student))

    real_train_opd = trainer.train_opd
    monkeypatch.setattr(trainer, "train_opd",
                        lambda *args, **kwargs: real_train_opd(*args, **{**kwargs, "on_step_committed": crash_after(5)}))
    with pytest.raises(Crash):
        train_task.fn(*arguments)
    monkeypatch.setattr(trainer, "train_opd", real_train_opd)
    latest = latest_checkpoint(run_uri, "pipeline")
    assert latest == "pipeline-checkpoint-step-00000004.kiln-checkpoint"
    damaged = tmp_path / "root" / "runs" / "pipeline" / "run" / latest / ADAPTER_FILE
    data = damaged.read_bytes()
    damaged.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    before = list_children(resolve(run_uri))

    with pytest.raises(CheckpointError) as refused:
        train_task.fn(*arguments)
    assert refused.value.code == "checkpoint_file_sha256"
    assert ADAPTER_FILE in str(refused.value) and latest in str(refused.value)
    assert list_children(resolve(run_uri)) == before  # no fallback run wrote anything

    class Failed:
        def __init__(self, error):
            self.error = error

        def result(self):
            raise self.error

    assert retry_unless_rejected(None, None, Failed(refused.value)) is False
    assert retry_unless_rejected(None, None, Failed(OSError("disk full"))) is True
