"""The adapter's fate after a gate: latest.json only on promotion, losers renamed .failed, the receipt block.

Kiln source: crates/kiln-server/src/eval/worker.rs · apply_post_eval_gate (rename to <name>.failed, or
<name>.failed-<unix_ms> when taken; only promoted makes the adapter active). The pointer is
checked against publication's (kiln_core.engine.publish), which writes it with the same function.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import fsspec
import pytest

from kiln_core.canonical import sha256_prefixed
from kiln_core.errors import EnvironmentFailure
from kiln_core.engine.fate import KILN_RENAMED_OUTCOMES, apply_gate_outcome, latest_pointer, post_eval_receipt_block
from kiln_core.post_eval import PostEvalRejection
from kiln_core.post_eval.evaluate import PostEvalResult
from kiln_core.post_eval.gate import PostEvalGateEvidence, SuiteRun
from kiln_core.contracts.post_eval.suite import Single

RUN_KEY = "3f2a9c0d1e2b4a5c"


@pytest.fixture(scope="module")
def trained(tiny_student, tmp_path_factory) -> Path:
    """One real training run (adapter and typed ``train_receipt.json``), copied by ``write_run``."""
    import torch

    from test_trainer import make_config, run, synthetic_tables

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        directory = tmp_path_factory.mktemp("fate-run")
        result = run(tiny_student, directory, make_config(checkpoint_interval=None), tables=synthetic_tables(n=2))
    finally:
        torch.set_num_threads(threads)
    assert result.status == "success"
    return directory


@pytest.fixture
def write_run(trained):
    """``write_run(root)``: a finished run directory ``<root>/runs/<adapter>/<run key>`` as training
    leaves it (adapter/, train_receipt.json), where the engine's run directory rule puts it."""
    def write(root: Path, adapter: str = "demo") -> Path:
        run = root / "runs" / adapter / RUN_KEY
        shutil.copytree(trained, run, ignore=shutil.ignore_patterns("*.kiln-checkpoint"))
        return run
    return write


def adapter_digest(run: Path) -> str:
    return sha256_prefixed((run / "adapter" / "adapter_model.safetensors").read_bytes())


def evidence(**changes) -> PostEvalGateEvidence:
    values = dict(policy_version="paired_wilson_v1", suite_policy="single_versioned_suite", eval_job_id="post-eval-1",
                  suite_name="s", suite_hash="sha256:s", effective_generation_hash="sha256:g", baseline_adapter=None,
                  candidate_adapter="demo", aggregation="single", minimum_paired_examples=20, paired_examples=40,
                  improved=0, regressed=0, tied=40, exact_sign_test_p_value=1.0, exact_sign_test_alpha=0.05,
                  baseline_accuracy=0.0, baseline_accuracy_lower_bound=0.0, baseline_accuracy_upper_bound=0.08,
                  candidate_accuracy=0.0, candidate_accuracy_lower_bound=0.0, candidate_accuracy_upper_bound=0.08,
                  accuracy_confidence_level=0.95, minimum_accuracy=0.9)
    return PostEvalGateEvidence(**{**values, **changes})


def test_promotion_writes_the_same_pointer_publish_writes(tmp_path, write_run):
    from kiln_core.engine.publish import publish
    from kiln_core.contracts.stage_refs import TrainRef

    run = write_run(tmp_path / "published")
    latest = run.parent / "latest.json"  # runs/<adapter>/latest.json, beside the adapter's runs
    train = TrainRef(run_uri=str(run), receipt_uri=str(run / "train_receipt.json"), adapter_uri=str(run / "adapter"),
                     status="success", latest_checkpoint=None, final_loss=None, steps=2)
    published_ref = publish(train, str(tmp_path / "published"), "demo")
    published = json.loads(latest.read_text())
    assert published_ref.latest_uri == str(latest) and published["adapter_model_sha256"] == adapter_digest(run)
    latest.unlink()
    fate = apply_gate_outcome(str(run), "demo", "promoted", evidence(), verdict="PASSED: ...")
    assert json.loads(latest.read_text()) == published
    assert fate.latest_uri == str(latest) and fate.renamed_to is None
    assert fate.evidence["outcome"] == "promoted"


@pytest.mark.parametrize("outcome", ["kept", "inconclusive", "error"])
def test_non_losing_outcomes_leave_the_adapter_unpromoted(tmp_path, write_run, outcome):
    run = write_run(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    fate = apply_gate_outcome(str(run), "demo", outcome, evidence(), verdict="v")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert not (run.parent / "latest.json").exists()
    assert (fate.outcome, fate.verdict, fate.run_uri, fate.latest_uri) == (outcome, "v", str(run), None)


def test_demoted_run_is_renamed_failed_and_then_failed_with_a_timestamp(tmp_path, write_run):
    runs = tmp_path / "runs" / "demo"
    run = write_run(tmp_path)
    fate = apply_gate_outcome(str(run), "demo", "demoted", evidence(), verdict="FAILED: x; adapter `demo` NOT promoted")
    assert not run.exists() and (runs / "demo.failed" / "adapter" / "adapter_model.safetensors").exists()
    assert fate.verdict == "FAILED: x; adapter `demo` NOT promoted, renamed to `demo.failed`"
    assert fate.run_uri == fate.renamed_to == str(runs / "demo.failed")
    assert fate.evidence["outcome"] == "demoted"
    again = write_run(tmp_path)  # the same inputs train afresh; that run fails too
    fate = apply_gate_outcome(str(again), "demo", "demoted", None, now_ms=1_700_000_000_123)
    assert fate.renamed_to == str(runs / "demo.failed-1700000000123")
    assert (runs / "demo.failed").exists() and fate.evidence is None and fate.verdict is None


def test_a_losing_run_leaves_the_serving_pointer_alone(tmp_path, write_run):
    run = write_run(tmp_path)
    latest = apply_gate_outcome(str(run), "demo", "promoted", evidence()).latest_uri
    pointer = json.loads(Path(latest).read_text())
    loser = run.parent / "0123456789abcdef"
    shutil.copytree(run, loser)
    apply_gate_outcome(str(loser), "demo", "demoted", evidence())
    assert json.loads(Path(latest).read_text()) == pointer and run.exists()  # the promoted run still serves
    assert sorted(os.listdir(run.parent)) == sorted([RUN_KEY, "demo.failed", "latest.json"])


def test_regression_is_a_losing_outcome_by_default_but_not_for_kiln(tmp_path, write_run):
    run = write_run(tmp_path / "ours")
    fate = apply_gate_outcome(str(run), "demo", "regression", evidence(), verdict="REGRESSION: ... — NOT promoted")
    assert fate.renamed_to.endswith("demo.failed") and fate.verdict.endswith("NOT promoted; renamed to `demo.failed`")
    kiln = write_run(tmp_path / "kiln")
    fate = apply_gate_outcome(str(kiln), "demo", "regression", evidence(), losing_outcomes=KILN_RENAMED_OUTCOMES)
    assert kiln.exists() and fate.renamed_to is None


def test_repeating_a_demotion_after_the_rename_changes_nothing(tmp_path, write_run):
    run = write_run(tmp_path)
    apply_gate_outcome(str(run), "demo", "demoted", evidence())
    fate = apply_gate_outcome(str(run), "demo", "demoted", evidence())
    assert fate.renamed_to is None and sorted(os.listdir(run.parent)) == ["demo.failed"]


def test_fate_on_an_fsspec_store(tmp_path, write_run):
    local = write_run(tmp_path)
    fs = fsspec.filesystem("memory")
    root = f"memory://fate-{tmp_path.name}"
    runs = f"/fate-{tmp_path.name}/runs/demo"
    fs.put(str(local), f"{runs}/{RUN_KEY}", recursive=True)
    fate = apply_gate_outcome(f"{root}/runs/demo/{RUN_KEY}", "demo", "promoted", evidence())
    assert json.loads(fs.cat(f"{runs}/latest.json"))["adapter_model_sha256"] == adapter_digest(local)
    assert fate.latest_uri == f"{root}/runs/demo/latest.json"
    fate = apply_gate_outcome(f"{root}/runs/demo/{RUN_KEY}", "demo", "demoted", evidence())
    assert fs.exists(f"{runs}/demo.failed/train_receipt.json")
    assert not fs.exists(f"{runs}/{RUN_KEY}/train_receipt.json")


def test_promoting_an_adapter_that_does_not_match_its_receipt_is_refused(tmp_path, write_run):
    run = write_run(tmp_path)
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(PostEvalRejection) as caught:
        apply_gate_outcome(str(run), "demo", "promoted", evidence())
    assert caught.value.code == "adapter_receipt_mismatch" and not (run.parent / "latest.json").exists()


def test_promoting_a_run_without_a_typed_receipt_is_refused(tmp_path, write_run):
    from kiln_core.training.receipt import ReceiptError

    run = write_run(tmp_path)
    receipt = json.loads((run / "train_receipt.json").read_text())
    del receipt["opd"]
    (run / "train_receipt.json").write_text(json.dumps(receipt))
    with pytest.raises(ReceiptError) as caught:
        apply_gate_outcome(str(run), "demo", "promoted", evidence())
    assert (caught.value.code, caught.value.field) == ("receipt_invalid", "opd")
    assert not (run.parent / "latest.json").exists()


def test_storage_failure_is_an_environment_failure(tmp_path, write_run):
    run = write_run(tmp_path)
    (run.parent / "latest.json").mkdir()  # a directory where the pointer must go: the atomic replace fails, even as root
    with pytest.raises(EnvironmentFailure) as caught:
        apply_gate_outcome(str(run), "demo", "promoted", evidence())
    assert caught.value.code == "storage_failed" and caught.value.retryable and caught.value.exit_code == 3
    assert sorted(os.listdir(run.parent)) == sorted([RUN_KEY, "latest.json"])  # no temp file left behind


def test_unknown_outcome_is_a_programming_error(tmp_path, write_run):
    with pytest.raises(ValueError):
        apply_gate_outcome(str(write_run(tmp_path)), "demo", "maybe", None)


def test_receipt_block_uses_kiln_training_job_field_names(tmp_path, write_run):
    run = SuiteRun("s", "demo", Single(), [], "sha256:s", "sha256:g", 7, metrics={"accuracy": 0.5})
    result = PostEvalResult(suite="s", data_scope="held-out", min_accuracy=0.5, gated=True, eval_job_id="post-eval-1",
                            effective_seed=7, outcome="demoted", verdict="FAILED: x", evidence=evidence(),
                            candidate=run, baseline=run)
    fate = apply_gate_outcome(str(write_run(tmp_path)), "demo", result.outcome, result.evidence, verdict=result.verdict)
    block = post_eval_receipt_block(result, fate).model_dump(mode="json")  # the receipt's JSON block
    assert block["gate_outcome"] == "demoted"
    assert block["post_eval_verdict"] == "FAILED: x, renamed to `demo.failed`"
    assert block["post_eval_gate_evidence"][0]["outcome"] == "demoted"
    assert block["post_eval_gate_evidence"][0]["policy_version"] == "paired_wilson_v1"
    assert block["adapter_location"].endswith("demo.failed") and block["effective_seed"] == "7"
    assert block["metrics"] == {"candidate": {"accuracy": 0.5}, "baseline": {"accuracy": 0.5}}
    json.dumps(block)  # JSON-ready
    ungated = post_eval_receipt_block(PostEvalResult("s", "held-out", None, False, "post-eval-2", 7, candidate=run))
    assert (ungated.gate_outcome, ungated.post_eval_gate_evidence, ungated.latest) == (None, [], None)


def test_latest_pointer_reads_the_run(tmp_path, write_run):
    run = write_run(tmp_path)
    pointer = latest_pointer(str(run))
    assert pointer.adapter == str(run / "adapter") and pointer.run == str(run)
    assert pointer.dataset_sha256 == json.loads((run / "train_receipt.json").read_text())["training_data"]["sha256"]
    shutil.rmtree(run / "adapter")
    with pytest.raises(FileNotFoundError):
        latest_pointer(str(run))
