"""A warm start in the ``opd_distill`` flow: the spec (what the UI's run form submits) names a published
adapter in ``config.base_adapter``, and a retried ``train`` task (``resume: latest``) ends with the same
adapter bytes as an uninterrupted warm-started run; a missing base adapter fails the flow at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_pipeline_flow import adapter_bytes, read_receipt, run_pipeline, spec_dict, task_runs, world  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

BASE = "flow-base"
INTERVAL = 2


def warm_spec(world, root: Path, adapter: str, base_adapter: str = BASE, **options) -> dict:  # noqa: F811
    spec = spec_dict(world, root, adapter=adapter, **options)
    spec["config"]["base_adapter"] = base_adapter
    return spec


@pytest.fixture(scope="module")
def root(world, prefect_harness) -> Path:  # noqa: F811
    """A storage root where the flow published ``BASE``: the off-policy adapter the warm runs start from."""
    directory = world.base / "warm-flow"
    run_pipeline(spec_dict(world, directory, adapter=BASE))
    return directory


def test_a_warm_started_flow_run_retries_to_the_same_adapter(world, root, monkeypatch):  # noqa: F811
    import kiln_core.training.trainer as trainer
    from kiln_core.training.checkpoint import checkpoint_basename
    from test_trainer import crash_after

    latest = json.loads((root / "runs" / BASE / "latest.json").read_text())
    _, plain = run_pipeline(warm_spec(world, root, "flow-warm"))
    receipt = read_receipt(plain)
    assert receipt["config"]["base_adapter"] == BASE
    assert receipt["adapters"]["base"]["path"] == latest["adapter"]
    assert receipt["adapters"]["base"]["adapter_model_sha256"] == latest["adapter_model_sha256"]

    real_train_opd, calls = trainer.train_opd, []

    def first_attempt_crashes(plan, *args, **kwargs):  # the train task's first attempt dies right after step 3
        calls.append(plan.resume)
        assert plan.base_adapter.adapter_model_sha256 == latest["adapter_model_sha256"]
        return real_train_opd(plan, *args, **{**kwargs, "on_step_committed": crash_after(3) if len(calls) == 1 else None})

    monkeypatch.setattr(trainer, "train_opd", first_attempt_crashes)
    state, retried = run_pipeline(warm_spec(world, root, "flow-warm-retried", train_retries=1))
    assert calls == [None, checkpoint_basename("flow-warm-retried", 2)]
    assert task_runs(state.state_details.flow_run_id, ("train",))["train"].run_count == 2
    assert read_receipt(retried)["data"]["resumed_from_checkpoint"] == checkpoint_basename("flow-warm-retried", 2)
    assert adapter_bytes(retried) == adapter_bytes(plain)


def test_a_missing_base_adapter_fails_the_flow_before_any_work(world, prefect_harness, tmp_path):  # noqa: F811
    from flows.opd_distill import opd_distill
    from flows.spec import parse_spec

    root = tmp_path / "root"
    state = opd_distill(parse_spec(warm_spec(world, root, "flow-refused", base_adapter="never-published")),
                        return_state=True)
    assert state.is_failed(), f"{state.type}: {state.message}"
    assert "base_adapter_missing" in state.message and "never-published" in state.message, state.message
    assert not (root / "corpora").exists() and not (root / "runs" / "flow-refused").exists()


def test_a_yaml_spec_names_the_base_adapter_in_its_config(world, root, tmp_path, capsys):  # noqa: F811
    """``kiln-flows run spec.yaml``: ``config.base_adapter`` in YAML, here an adapter directory."""
    from flows.cli import main

    base = json.loads((root / "runs" / BASE / "latest.json").read_text())
    spec = tmp_path / "warm.yaml"
    spec.write_text(
        f"teacher: {{kind: local_dir, path: {world.teacher}}}\n"
        f"corpus: {world.corpus}\n"
        f"student: {world.student}\n"
        f"storage_root: {tmp_path / 'root'}\n"
        "adapter: yaml-warm\n"
        "config: {training_mode: off_policy, top_k: 16, epochs: 1, lora_rank: 4, lora_alpha: 8, seed: 7,\n"
        f"         base_adapter: {base['adapter']}}}\n")
    code = main(["run", str(spec), "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["status"] == "success", result
    receipt = json.loads(Path(result["receipt"]).read_text())
    assert receipt["config"]["base_adapter"] == base["adapter"]
    assert receipt["adapters"]["base"]["adapter_model_sha256"] == base["adapter_model_sha256"]
