"""A run's settings are resolved once, right after the teacher's manifest, and every later stage reads them.

``ResolvedSettings`` (``kiln_core.contracts.settings``) holds the effective top-K, learning rate, samples per
prompt, loss, world size and strategy, the seed rule and the LoRA targets; before it, the raw ``config.top_k``
travelled to the fingerprint, admission, held-out and gate stages and each resolved it again.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.contracts.settings import ResolvedSettings, seed_from_run_key
from kiln_core.synthetic import synthesize_corpus


def count_calls(function):
    """A profiler that counts the calls of ``function`` by calling file and line, while it is installed."""
    calls: Counter[str] = Counter()
    code = function.__code__

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code is code:
            calls[f"{frame.f_back.f_code.co_filename}:{frame.f_back.f_lineno}"] += 1

    return calls, profile


def test_preparing_a_run_resolves_top_k_once_for_every_stage(tiny_student, tmp_path):
    """Training corpus, held-out watch and quality gate all admitted at the one effective top-K."""
    from kiln_core.contracts import opd_config
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine.pipeline import prepare

    corpora = {name: synthesize_corpus(tiny_student, tmp_path / f"{name}.jsonl", n_examples=3, top_k=16, seed=seed)
               for name, seed in (("train", 0), ("watch", 1), ("gate", 2))}
    spec = parse_spec({
        "teacher": {"kind": "manifest_file", "path": str(corpora["train"])}, "student": str(tiny_student),
        "corpus": str(corpora["train"]), "storage_root": str(tmp_path / "root"), "adapter": "once",
        "config": {"training_mode": "off_policy", "top_k": 20},  # resolves to 16
        "eval": {"corpus": str(corpora["watch"]), "every_steps": 2},
        "quality_gate": {"corpus": str(corpora["gate"]), "max_reverse_kl": 10.0},
    })
    calls, profile = count_calls(opd_config.resolve_top_k)
    sys.setprofile(profile)
    try:
        ready = prepare(spec, device="cpu")
    finally:
        sys.setprofile(None)
    assert sum(calls.values()) == 1, dict(calls)
    assert next(iter(calls)).startswith(sys.modules["kiln_core.contracts.settings"].__file__)
    settings = ready.plan.settings
    assert settings.top_k == ready.corpus.effective_top_k == 16 and settings.config.top_k == 20
    assert ready.plan.held_out is not None and ready.gate_corpus is not None  # both admitted at that top-K


def test_the_settings_resolve_kilns_rules_in_one_place():
    on_policy = OpdConfig(top_k=32)  # Kiln's default mode, samples and optimizer
    settings = ResolvedSettings.resolve(on_policy, adapter="demo", teacher_cap=20, prompt_count=60, world_size=1)
    assert (settings.top_k, settings.samples_per_prompt, settings.learning_rate) == (16, 16, 2e-3)
    assert settings.config.output_name == "demo" and settings.loss == "teacher_top_k"
    with_resume = OpdConfig(training_mode="off_policy", resume_checkpoint="demo-checkpoint-step-00000002.kiln-checkpoint")
    assert ResolvedSettings.resolve(with_resume, adapter="demo").config.resume_checkpoint is None  # not part of a run
    assert ResolvedSettings.model_validate_json(settings.model_dump_json()) == settings


def test_a_null_seed_comes_from_the_run_key_never_at_random():
    """Kiln draws a seed once per job; a direct call of the trainers gets the same rule as the engine's runs."""
    from kiln_core.contracts.stage_refs import TrainPlan

    config = OpdConfig(training_mode="off_policy")
    plans = [TrainPlan.for_config(config, f"{root}/runs/demo/0123456789abcdef", "demo") for root in ("a", "b")]
    assert plans[0].seed == plans[1].seed == seed_from_run_key("0123456789abcdef") == 0x0123456789ABCDEF
    assert TrainPlan.for_config(config.model_copy(update={"seed": 7}), "runs/demo/k1", "demo").seed == 7


def test_a_direct_call_with_a_null_seed_trains_the_same_run_twice(tiny_student, tmp_path):
    """Before the settings, ``build_plan`` drew a random seed here: two runs of one plan differed."""
    from kiln_core.contracts.stage_refs import TrainPlan
    from kiln_core.training.distributed.world import World
    from kiln_core.training.plan import plan_off_policy_run
    from tests.test_trainer import synthetic_tables

    config = OpdConfig(training_mode="off_policy", top_k=16, checkpoint_interval=None)
    seeds = []
    for root in ("first", "second"):
        plan = TrainPlan.for_config(config, str(tmp_path / root / "runs" / "demo" / "0123456789abcdef"), "demo",
                                    device="cpu")
        run = plan_off_policy_run(plan, tables=synthetic_tables(), dataset_sha256="sha256:" + "cd" * 32,
                                  dataset_path="corpus.jsonl", student_dir=str(tiny_student), teacher_identity=None,
                                  teacher_alias="t", world=World())
        seeds.append((run.seed, run.contract.effective_config["seed"]))
    assert seeds[0] == seeds[1] == (0x0123456789ABCDEF, 0x0123456789ABCDEF)


@pytest.mark.parametrize("world_size, strategy", [(1, "ddp"), (2, "fsdp")])
def test_the_run_key_takes_the_world_size_above_one_process_and_never_the_strategy(world_size, strategy):
    settings = ResolvedSettings.resolve(OpdConfig(training_mode="off_policy"), adapter="a", world_size=world_size,
                                        strategy=strategy)
    decides = settings.run_key_config()
    assert decides.get("world_size") == (world_size if world_size > 1 else None)
    assert "strategy" not in decides and "publish_guard" not in decides
