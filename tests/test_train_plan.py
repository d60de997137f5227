"""The engine's training plan: typed, frozen, resolved once, and exactly what a worker receives.

A Prefect task's parameter, a ``torchrun`` rank's job file and (next) a Ray worker all get the plan as
JSON, so it must come back equal, field for field, with no ``dict`` config left to re-validate.
"""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel, ValidationError

from kiln_core.contracts.eval_watch import EvalWatch
from kiln_core.contracts.opd_config import parse_opd_config
from kiln_core.contracts.spec_blocks import VllmBackends
from kiln_core.contracts.stage_refs import TrainPlan
from kiln_core.contracts.base_adapter import BaseAdapter
from kiln_core.training.distributed.launcher import DistributedJob

EVERY_BLOCK = {
    "training_mode": "off_policy", "top_k": 20, "learning_rate": 3e-4, "seed": 2**63 - 7, "epochs": 3,
    "optimizer": {"kind": "adam_w", "beta1": 0.85, "beta2": 0.99, "eps": 1e-7, "weight_decay": 0.0},
    "echo": {"lambda": 0.25, "env_mask_mode": "full_obs", "warning_filter": False},
    "stable_opd": {"mode": "manual", "kl_beta": 0.5, "sft_lambda": 0.125},
    "checkpoint_interval": 4, "sequences_per_step": 2, "lora_rank": 4, "lora_alpha": 8.0,
    "post_eval": {"suite": "builtin:smoke", "min_accuracy": 0.5},
}


def _plan(**config) -> TrainPlan:
    return TrainPlan(
        run_uri="s3://bucket/kiln/runs/demo/0123456789abcdef", inputs_key="0123456789abcdef", adapter="demo",
        config=parse_opd_config({**EVERY_BLOCK, **config}), top_k=16, learning_rate=3e-4, samples_per_prompt=1,
        resume="demo-checkpoint-step-00000004.kiln-checkpoint", nproc=2, backend="gloo", device="cpu",
        precision="fp32", gradient_checkpointing=True,
        eval_watch=EvalWatch(corpus="heldout.jsonl", every_steps=5, stop_on_divergence=True),
        vllm=VllmBackends(rollouts_url="http://127.0.0.1:8000", sync_dir="/shared/sync"),
        base_adapter=BaseAdapter(name="warm", uri="/root/runs/warm/k/adapter", adapter_model_sha256="sha256:" + "ab" * 32,
                                 adapter_model_bytes=4096, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))


def test_a_plan_round_trips_through_json_exactly():
    plan = _plan()
    again = TrainPlan.model_validate_json(plan.model_dump_json())
    assert again == plan
    assert again.model_dump_json() == plan.model_dump_json()  # byte-identical on the second trip too
    assert again.config.echo.lambda_ == 0.25 and again.config.seed == 2**63 - 7 == again.seed
    assert TrainPlan.model_validate(plan.model_dump(mode="json")) == plan  # a Prefect parameter's JSON form


@pytest.mark.parametrize("config", [{"training_mode": "on_policy", "samples_per_prompt": 4, "temperature": 0.7},
                                    {"optimizer": {"kind": "muon"}, "learning_rate": None, "seed": 0},
                                    {"loss": "teacher_top_k_tail", "echo": None}])
def test_every_config_shape_round_trips(config):
    plan = _plan(**config)
    assert TrainPlan.model_validate_json(plan.model_dump_json()) == plan


def test_a_plan_is_frozen_and_refuses_unknown_fields():
    plan = _plan()
    with pytest.raises(ValidationError):
        plan.top_k = 32
    with pytest.raises(ValidationError):
        TrainPlan.model_validate({**plan.model_dump(mode="json"), "learnign_rate": 1.0})


def _annotations(model: type[BaseModel]) -> dict[str, object]:
    return {name: field.annotation for name, field in model.model_fields.items()}


def _holds_a_dict(annotation) -> bool:
    if annotation is dict or typing.get_origin(annotation) is dict:
        return True
    return any(_holds_a_dict(arg) for arg in typing.get_args(annotation))


@pytest.mark.parametrize("model", [TrainPlan, DistributedJob])
def test_no_dict_config_travels_past_the_engine_boundary(model):
    """What training receives is typed: the config, the watch, the vLLM block and the base adapter."""
    assert [name for name, annotation in _annotations(model).items() if _holds_a_dict(annotation)] == []


def test_a_torchrun_job_carries_the_typed_config_and_base_adapter():
    plan = _plan()
    job = DistributedJob(materialization="/m", dataset_sha256="sha256:" + "0" * 64, dataset_path="/c.jsonl",
                         student_dir="/s", adapter_name="demo", config=plan.config, run_root=plan.run_uri,
                         teacher_alias="t", base_adapter=plan.base_adapter)
    again = DistributedJob.model_validate_json(job.model_dump_json())
    assert again.config == plan.config and again.base_adapter == plan.base_adapter


def test_a_manifest_ref_parses_its_teacher_once_and_serializes_only_the_line(tiny_student):
    from kiln_core.contracts.identity import build_manifest_line, parse_manifest_line
    from kiln_core.contracts.stage_refs import ManifestRef
    from kiln_core.synthetic import synthetic_identity

    line = build_manifest_line(synthetic_identity(tiny_student))
    ref = ManifestRef(manifest_line=line, identity_revision="r", teacher="t", source="manifest_file")
    assert ref.teacher_identity == parse_manifest_line(line).teacher_identity
    assert ref.teacher_identity is ref.teacher_identity  # parsed once
    assert "teacher_identity" not in ref.model_dump() and ManifestRef.model_validate_json(ref.model_dump_json()) == ref
