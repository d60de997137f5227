"""The engine's training plan: typed, frozen, resolved once, and exactly what a worker receives.

A Prefect task's parameter, a ``torchrun`` rank's job file and (next) a Ray worker all get the plan as
JSON, so it must come back equal, field for field, with no ``dict`` config left to re-validate.
"""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel, ValidationError

from kiln_core.contracts.eval_watch import EvalWatch
from kiln_core.contracts.opd_config import ConfigError, parse_opd_config, resolve_learning_rate
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.contracts.spec_blocks import VllmBackends
from kiln_core.contracts.stage_refs import HeldOutRef, TrainPlan
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
        settings=ResolvedSettings(config=parse_opd_config({**EVERY_BLOCK, **config}), top_k=16, learning_rate=3e-4,
                                  samples_per_prompt=1, world_size=2),
        seed=2**63 - 7, resume="demo-checkpoint-step-00000004.kiln-checkpoint", backend="gloo", device="cpu",
        precision="fp32", gradient_checkpointing=True,
        eval_watch=EvalWatch(corpus="heldout.jsonl", every_steps=5, stop_on_divergence=True),
        held_out=HeldOutRef(uri="s3://bucket/kiln/corpora/" + "cd" * 32, corpus_sha256="sha256:" + "cd" * 32,
                            examples=3, action_tokens=17),
        vllm=VllmBackends(rollouts_url="http://127.0.0.1:8000", sync_dir="/shared/sync"),
        base_adapter=BaseAdapter(name="warm", uri="/root/runs/warm/k/adapter", adapter_model_sha256="sha256:" + "ab" * 32,
                                 adapter_model_bytes=4096, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))


def test_a_plan_round_trips_through_json_exactly():
    plan = _plan()
    again = TrainPlan.model_validate_json(plan.model_dump_json())
    assert again == plan
    assert again.model_dump_json() == plan.model_dump_json()  # byte-identical on the second trip too
    assert again.settings.config.echo.lambda_ == 0.25 and again.settings.config.seed == 2**63 - 7 == again.seed
    assert TrainPlan.model_validate(plan.model_dump(mode="json")) == plan  # a Prefect parameter's JSON form


def test_the_plans_base_adapter_is_recorded_as_kilns_receipt_names_it():
    # Kiln's receipt ``adapters.base`` (crates/kiln-train/src/train_receipt.rs): path, weights digest and size
    base = _plan().base_adapter
    assert base.receipt_record() == {"path": "/root/runs/warm/k/adapter", "adapter_model_sha256": "sha256:" + "ab" * 32,
                                     "adapter_model_bytes": 4096}


@pytest.mark.parametrize("config", [{"training_mode": "on_policy", "samples_per_prompt": 4, "temperature": 0.7},
                                    {"optimizer": {"kind": "muon"}, "learning_rate": None, "seed": 0},
                                    {"loss": "teacher_top_k_tail", "echo": None}])
def test_every_config_shape_round_trips(config):
    plan = _plan(**config)
    assert TrainPlan.model_validate_json(plan.model_dump_json()) == plan


def test_a_plan_is_frozen_and_refuses_unknown_fields():
    plan = _plan()
    with pytest.raises(ValidationError):
        plan.seed = 32
    with pytest.raises(ValidationError):
        plan.settings.top_k = 32
    with pytest.raises(ValidationError):
        TrainPlan.model_validate({**plan.model_dump(mode="json"), "learnign_rate": 1.0})


def test_a_watched_plan_carries_its_admitted_held_out_corpus_and_only_then():
    plan = _plan()
    with pytest.raises(ValidationError, match="eval_watch and held_out go together"):
        TrainPlan.model_validate({**plan.model_dump(mode="json"), "held_out": None})
    with pytest.raises(ValidationError, match="eval_watch and held_out go together"):
        TrainPlan.model_validate({**plan.model_dump(mode="json"), "eval_watch": None})
    unwatched = TrainPlan.model_validate({**plan.model_dump(mode="json"), "eval_watch": None, "held_out": None})
    assert TrainPlan.model_validate_json(unwatched.model_dump_json()) == unwatched


def test_a_plan_for_a_direct_call_resolves_what_the_engine_resolves():
    """``TrainPlan.for_config`` (benchmarks, notebooks): the same settings rules as the engine's."""
    config = parse_opd_config({**EVERY_BLOCK, "top_k": 20, "learning_rate": None, "samples_per_prompt": 4})
    plan = TrainPlan.for_config(config, "runs/demo/k1", "demo", device="cpu")
    settings = plan.settings
    assert (settings.top_k, settings.samples_per_prompt, plan.inputs_key, plan.resume) == (16, 1, "k1", None)
    assert settings.learning_rate == resolve_learning_rate(config) and plan.device == "cpu"
    assert settings.config.output_name == "demo" and plan.seed == config.seed  # a given seed is kept
    assert TrainPlan.for_config(config, "runs/demo/k1", "demo", top_k=32, samples_per_prompt=3).settings.top_k == 32
    below_every_supported_k = parse_opd_config({**EVERY_BLOCK, "top_k": 8})
    with pytest.raises(ConfigError):  # the one top-K rule, as admission applies it
        TrainPlan.for_config(below_every_supported_k, "runs/demo/k1", "demo")


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


def _job(plan: TrainPlan, tiny_student) -> DistributedJob:
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef
    from kiln_core.synthetic import synthetic_identity

    line = build_manifest_line(synthetic_identity(tiny_student))
    corpus = CorpusRef(uri="s3://bucket/kiln/corpora/ab", dataset_sha256="sha256:" + "0" * 64, source_uri="/c.jsonl",
                       examples=5, action_tokens=40, env_tokens=12, effective_top_k=16, teacher_identity_revision="r")
    manifest = ManifestRef(manifest_line=line, identity_revision="r", teacher="t", source="manifest_file")
    return DistributedJob(plan=plan, corpus=corpus, manifest=manifest, student_dir="/s")


def test_a_torchrun_job_carries_the_plan_whole_and_round_trips_exactly(tiny_student):
    plan = _plan()
    job = _job(plan, tiny_student)
    again = DistributedJob.model_validate_json(job.model_dump_json())
    assert again == job and again.plan == plan  # every resolved value, the base adapter and the watch included
    assert again.model_dump_json() == job.model_dump_json()
    assert again.manifest.teacher_identity == job.manifest.teacher_identity  # the worker's teacher, from the line
    with pytest.raises(ValidationError):  # the plan's fields no longer travel one by one
        DistributedJob.model_validate({**job.model_dump(mode="json"),
                                       "config": plan.settings.config.model_dump(mode="json")})


def test_a_manifest_ref_parses_its_teacher_once_and_serializes_only_the_line(tiny_student):
    from kiln_core.contracts.identity import build_manifest_line, parse_manifest_line
    from kiln_core.contracts.stage_refs import ManifestRef
    from kiln_core.synthetic import synthetic_identity

    line = build_manifest_line(synthetic_identity(tiny_student))
    ref = ManifestRef(manifest_line=line, identity_revision="r", teacher="t", source="manifest_file")
    assert ref.teacher_identity == parse_manifest_line(line).teacher_identity
    assert ref.teacher_identity is ref.teacher_identity  # parsed once
    assert "teacher_identity" not in ref.model_dump() and ManifestRef.model_validate_json(ref.model_dump_json()) == ref
