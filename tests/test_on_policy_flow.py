"""The ``opd_distill`` flow with on-policy ``prompts`` (real test-harness Prefect server), and the spec rules.

What a user depends on: a spec naming a prompt file (instead of a corpus) runs manifest → prompts →
train → publish as Prefect tasks, with the same run directory and ``latest.json`` as a corpus; a
training attempt that dies is retried by the task, resumes from the newest checkpoint, reads the
rollouts committed before the crash back instead of sampling them again, and ends with the adapter
bytes of an uninterrupted run; a spec with two sources or none is one clear ``invalid_spec``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from on_policy_support import chat

pytestmark = pytest.mark.integration

ADAPTER = "onpol-flow"
INTERVAL = 2
PROMPTS = [chat("What is two plus two?"), chat("Name a colour."),
           {**chat("List files under src/."), "teacher_extra_messages": [{"role": "user", "content": "JSON only."}]}]


def spec_dict(world, root: Path, **options) -> dict:
    return {
        "teacher": {"kind": "local_dir", "path": world.teacher},
        "prompts": world.prompts,
        "student": world.student,
        "storage_root": str(root),
        "adapter": ADAPTER,
        "config": {"training_mode": "on_policy", "samples_per_prompt": 2, "max_tokens": 4, "top_k": 16,
                   "lora_rank": 4, "lora_alpha": 8.0, "seed": 9, "learning_rate": 2e-2,
                   "checkpoint_interval": INTERVAL, "epochs": 1},
        "options": {"progress_every_seconds": 0.2, "cancel_poll_seconds": 5.0, **options},
    }


def run_flow(spec: dict):
    from flows.opd_distill import opd_distill
    from flows.spec import parse_spec

    state = opd_distill(parse_spec(spec), return_state=True)
    assert state.is_completed(), f"{state.type}: {state.message}"
    return state, state.result()


def adapter_bytes(summary: dict) -> bytes:
    return (Path(summary["adapter"]) / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def world(tiny_student, tiny_teacher, tmp_path_factory):
    base = tmp_path_factory.mktemp("on-policy-flow")
    prompts = base / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return SimpleNamespace(base=base, student=str(tiny_student), teacher=str(tiny_teacher), prompts=str(prompts))


@pytest.fixture(scope="module")
def reference(world, prefect_harness):
    root = world.base / "ref"
    state, summary = run_flow(spec_dict(world, root))
    return SimpleNamespace(root=root, state=state, summary=summary)


def test_flow_trains_prompts_through_the_same_stages(world, reference):
    from test_pipeline_flow import task_runs

    summary = reference.summary
    assert summary["status"] == "success" and summary["total_steps"] == 6
    run_dir = Path(summary["run"])
    assert run_dir.parent == reference.root / "runs" / ADAPTER
    latest = json.loads((reference.root / "runs" / ADAPTER / "latest.json").read_text())
    assert latest["adapter"] == summary["adapter"]
    receipt = json.loads(Path(summary["receipt"]).read_text())
    assert receipt["opd"]["training_mode"] == "on_policy" and receipt["opd"]["samples_per_prompt"] == 2
    assert any((run_dir / "rollouts").rglob("*.parquet"))
    runs = task_runs(reference.state.state_details.flow_run_id, ("manifest", "prompts", "train", "publish"))
    assert "admit" not in runs and "fingerprint" not in runs  # the source decides the data stage only
    assert all(runs[stage].state.is_completed() for stage in ("prompts", "train", "publish"))
    from prefect.artifacts import Artifact

    from tasks.artifacts import artifact_key

    progress = Artifact.get(artifact_key("train-progress", ADAPTER))
    assert float(progress.data) == pytest.approx(100.0)
    assert "rollouts/s" in progress.description and "teacher tokens scored" in progress.description


def test_a_retried_train_task_resumes_and_reuses_committed_rollouts(world, reference, monkeypatch):
    import kiln_core.training.on_policy_trainer as trainer
    from kiln_core.training.checkpoint import checkpoint_basename
    from test_trainer import crash_after

    real, calls, results = trainer.train_on_policy, [], []

    def first_attempt_crashes(plan, *args, **kwargs):  # the first attempt dies right after committing step 3
        calls.append(plan.resume)
        result = real(plan, *args, **{**kwargs, "on_step_committed": crash_after(3) if len(calls) == 1 else None})
        results.append(result)
        return result

    monkeypatch.setattr(trainer, "train_on_policy", first_attempt_crashes)
    _, summary = run_flow(spec_dict(world, world.base / "retry", train_retries=1))
    assert calls == [None, checkpoint_basename(ADAPTER, 2)]
    assert results[-1].rollouts_reused >= 1  # step 3's rollout was committed before the crash: read back
    assert Path(summary["run"]).name == Path(reference.summary["run"]).name
    assert summary["loss_history"] == reference.summary["loss_history"]
    assert adapter_bytes(summary) == adapter_bytes(reference.summary)


def test_kiln_flows_run_watches_and_gates_an_on_policy_run(world, prefect_harness, tmp_path, capsys):
    """``kiln-flows run`` with prompts, ``eval:`` and a failing ``quality_gate:``: the curve in the receipt,
    the adapter held back (exit 4, ``.failed``, the reason in the receipt), the rejected event and the
    before/after table, as for a corpus."""
    import yaml
    from prefect.artifacts import Artifact

    from flows.cli import main
    from kiln_core.scoring import score_examples
    from test_evaluation import examples, write_jsonl
    from test_gate_flow import adapter_events

    source = write_jsonl(tmp_path / "heldout-examples.jsonl", examples([("Name a fruit.", "Apple."), ("Say hi.", "Hi.")]))
    held_out = tmp_path / "heldout.jsonl"
    score_examples(str(source), teacher_dir=world.teacher, student_dir=world.student, top_k=16, out_uri=str(held_out),
                   device="cpu")
    adapter = "onpol-flow-gated"
    spec = {**spec_dict(world, tmp_path / "root"), "adapter": adapter,
            "eval": {"corpus": str(held_out), "every_steps": 2, "flat_window": None},
            "quality_gate": {"corpus": str(held_out), "max_reverse_kl": 0.0}}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(spec))
    code = main(["run", str(tmp_path / "pipeline.yaml"), "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 4 and summary["status"] == "success" and summary["gate"]["outcome"] == "demoted", summary
    assert summary["run"].endswith(f"/{adapter}.failed") and summary["latest"] is None
    receipt = json.loads(Path(summary["receipt"]).read_text())
    assert receipt["opd"]["training_mode"] == "on_policy" and receipt["gate_outcome"] == "demoted"
    assert receipt["quality_gate"]["failures"][0].startswith("reverse_kl ")
    assert [point["step"] for point in receipt["eval_curve"]["points"]] == [0, 2, 4, 6]
    assert [event.event for event in adapter_events(adapter)] == ["kiln-flows.adapter.rejected"]
    table = json.loads(Artifact.get(f"before-after-{adapter}").data)
    assert [row["metric"] for row in table] == ["reverse_kl", "top1_agreement", "teacher_token_nll"]


def test_flow_refuses_a_prompt_file_it_cannot_run(world, prefect_harness, tmp_path):
    from flows.opd_distill import opd_distill

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROMPTS[0]) + "\n\n{\"messages\": []}\n")
    spec = {**spec_dict(world, tmp_path / "root"), "prompts": str(bad)}
    state = opd_distill(spec, return_state=True)
    assert state.is_failed() and "prompt_no_messages" in (state.message or "") + repr(state.result(raise_on_failure=False))
    assert not (tmp_path / "root" / "runs").exists()


@pytest.mark.parametrize(("sources", "named"), [
    ({"prompts": "p.jsonl", "corpus": "c.jsonl"}, "got `corpus` and `prompts`"),
    ({"prompts": "p.jsonl", "examples": "e.jsonl"}, "got `examples` and `prompts`"),
    ({}, "got none"),
])
def test_a_spec_needs_exactly_one_source(sources, named):
    from flows.spec import SpecError, parse_spec

    spec = {"teacher": {"kind": "local_dir", "path": "t"}, "student": "s", "adapter": "a", **sources}
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert caught.value.code == "invalid_spec" and named in caught.value.message
    assert "`corpus`" in caught.value.message and "`prompts`" in caught.value.message


def test_a_prompts_spec_defaults_to_kiln_on_policy_config_and_refuses_off_policy():
    from flows.spec import SpecError, parse_spec

    base = {"teacher": {"kind": "local_registry", "alias": "t"}, "student": "s", "adapter": "a", "prompts": "p.jsonl"}
    assert parse_spec(base).config.training_mode == "on_policy"
    for config, field in (({"training_mode": "off_policy"}, "config.training_mode"),
                          ({"training_mode": "on_policy", "sequences_per_step": 1, "loss": "sampled_token"},
                           "config.loss")):
        with pytest.raises(SpecError) as caught:
            parse_spec({**base, "config": config})
        assert caught.value.code == "invalid_spec" and f"`{field}`" in caught.value.message, caught.value.message
    with pytest.raises(SpecError) as caught:
        parse_spec({**base, "distributed": {"nproc": 2}})
    assert "`distributed.nproc`" in caught.value.message
