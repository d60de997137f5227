"""A ``TrainPlan`` for tests that call the trainers directly, resolved as the engine resolves one.

``kiln_core.engine.runs.plan_run`` fills a plan from a spec, an admitted corpus and a pinned teacher;
tests that train a hand-built table or an inline prompt list have none of those, so ``train_plan``
takes ``TrainPlan.for_config`` (the contract rules for top-K, learning rate, samples per prompt) and,
on-policy, the top-K under the teacher's cap and the samples per prompt auto-scaled from the prompt count,
as the engine's ``check_prompts`` resolves them.
"""

from __future__ import annotations

from typing import Any, Sequence

from kiln_core.contracts.opd_config import OpdConfig, effective_samples_per_prompt, resolve_top_k
from kiln_core.contracts.stage_refs import TrainPlan

PLAN_OPTIONS = ("resume_checkpoint", "device", "precision", "gradient_checkpointing", "base_adapter")
"""The keyword arguments the trainers took before the plan, which now travel in it."""


def train_plan(config: OpdConfig, run_root: str, adapter: str, *, prompts: Sequence | None = None, teacher=None,
               resume_checkpoint: str | None = None, **options: Any) -> TrainPlan:
    """The plan of a run of ``config`` into ``run_root``: off-policy, or on-policy over ``prompts`` scored by
    ``teacher`` (a ``TeacherSource``). ``options``: device, precision, gradient_checkpointing, base_adapter, nproc."""
    if prompts is None:
        return TrainPlan.for_config(config, str(run_root), adapter, resume=resume_checkpoint, **options)
    from kiln_core.on_policy.submit import teacher_top_k_cap

    return TrainPlan.for_config(config, str(run_root), adapter, resume=resume_checkpoint,
                                top_k=resolve_top_k(config.top_k, source_cap=teacher_top_k_cap(teacher.identity)),
                                samples_per_prompt=effective_samples_per_prompt(config, len(prompts)), **options)


def split_plan_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(plan options, the rest)`` of a test helper's keyword arguments."""
    return ({name: value for name, value in options.items() if name in PLAN_OPTIONS},
            {name: value for name, value in options.items() if name not in PLAN_OPTIONS})
