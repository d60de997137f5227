"""``ResolvedSettings``: every effective value of a run, resolved once, right after the teacher's manifest.

A request says what it wants (``OpdConfig``: ``top_k: 20``, an empty learning rate, the default samples per
prompt, a null seed); a run trains with effective values (top-K 16, Muon's 2e-3, 64 rollouts per prompt on a
small prompt list, a seed drawn from the run key). ``ResolvedSettings`` is the one place where the second is
derived from the first, by Kiln's rules (``kiln_core.contracts.opd_config``: ``resolve_top_k``,
``resolve_learning_rate``, ``effective_samples_per_prompt``). The engine resolves it before any data stage
(``kiln_core.engine.pipeline.prepare``), and every later reader takes its values as they are: admission and
the held-out corpora (top-K), the run key, the checkpoint contract, the trainers and the receipt.

The three records a run writes of its settings are projections of this one model:

* ``run_key_config`` — the part of the run key that comes from the settings (``kiln_core.engine.runs``);
* ``kiln_effective_config`` — Kiln's checkpoint ``effective_config`` (``opd.rs``
  ``opd_checkpoint_effective_config``), compared key for key on resume;
* ``receipt_config`` — the receipt's ``config``: the request with the effective top-K, samples per prompt
  and seed.

Each keeps the exact bytes runs already on storage hold (``tests/test_run_compat.py`` pins them).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.contracts.opd_config import (ConfigError, OpdConfig, drop_unused_step_extensions,
                                            effective_samples_per_prompt, resolve_learning_rate, resolve_top_k)

__all__ = ["TRAINED_LOSSES", "ResolvedSettings", "check_one_process", "kiln_loss", "kiln_optimizer_json",
           "legacy_loss_record", "seed_from_run_key"]

TRAINED_LOSSES = ("teacher_top_k", "teacher_top_k_tail", "teacher_token_ce", "teacher_top_k_forward",
                  "teacher_top_k_tail_forward")
"""The losses kiln-flows trains (``kiln_core.training.objectives.STEP_LOSSES``); Kiln's ``sampled_token`` and
``full_vocab`` are refused at submit."""


def kiln_loss(loss: str) -> str:
    """The loss name Kiln's checkpoint ``effective_config`` records for ``loss``: the tail bucket is our extension
    of Kiln's ``teacher_top_k`` and is written as it; every other name is written as is.

    Example:
        >>> kiln_loss("teacher_top_k_tail"), kiln_loss("teacher_token_ce")
        ('teacher_top_k', 'teacher_token_ce')
    """
    return "teacher_top_k" if loss == "teacher_top_k_tail" else loss


def legacy_loss_record(loss: str) -> str:
    """What ``kiln_flows_state.json`` said of ``loss`` before it recorded the loss trained by name (issue 31): the
    tail bucket by name, every other loss as ``teacher_top_k``. A resume accepts that record still; an identity
    computed from it stays as it was (an on-policy run's rollout key, ``kiln_core.training.on_policy_plan``).

    Example:
        >>> legacy_loss_record("teacher_token_ce"), legacy_loss_record("teacher_top_k_tail")
        ('teacher_top_k', 'teacher_top_k_tail')
    """
    return "teacher_top_k_tail" if loss == "teacher_top_k_tail" else "teacher_top_k"


def seed_from_run_key(run_key: str) -> int:
    """The seed of a run whose request leaves it null: Kiln draws one per job; deriving it from the run key gives
    every attempt of the run (a retry, a resume, another machine) the same one. A run key is hex; the directory
    of a direct call of the trainers may be named otherwise, and is digested first.

    Example:
        >>> seed_from_run_key("0000000000000010"), seed_from_run_key("bench") == seed_from_run_key("bench")
        (16, True)
    """
    try:
        value = int(run_key, 16)
    except ValueError:
        value = int(hashlib.sha256(run_key.encode("utf-8")).hexdigest()[:16], 16)
    return value % (2**63)


def check_one_process(*, world_size: int = 1, ray: bool = False, strategy: str = "ddp", field: str) -> None:
    """Refuse to run on-policy training on more than one process: each rollout is sampled from the weights its
    predecessor's step produced, one candidate per optimizer step, as Kiln trains it.

    Args:
        world_size: Processes the run asks for (``--nproc``, ``distributed.world_size``).
        ray: The run asks for a Ray cluster.
        strategy: ``distributed.strategy`` (``fsdp`` needs several processes).
        field: Where the request said so, for the refusal.

    Raises:
        ConfigError: ``unsupported`` (Ray, several processes) or ``unsupported_strategy`` (fsdp).

    Example:
        >>> check_one_process(world_size=1, field="nproc")
    """
    if ray:
        raise ConfigError("on-policy training runs in one process, not on Ray", field, code="unsupported")
    if strategy != "ddp":
        raise ConfigError(f"on-policy training runs in one process; strategy {strategy} needs several", field,
                          code="unsupported_strategy")
    if world_size != 1:
        raise ConfigError(f"on-policy training runs in one process (one candidate per step); got {world_size}", field,
                          code="unsupported")


def _f32(value: float) -> float:
    """An f32 field as ``serde_json::Value`` holds it: rounded to f32, then widened to f64."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def kiln_optimizer_json(spec: Any) -> dict[str, Any]:
    """``lib.rs`` ``Optimizer`` as serde writes it into a ``Value`` (tag ``kind``, f32 fields widened).

    Example:
        >>> kiln_optimizer_json(OpdConfig().optimizer)["momentum"]
        0.949999988079071
    """
    if spec.kind == "muon":
        return {"kind": "muon", "momentum": _f32(spec.momentum), "nesterov": bool(spec.nesterov),
                "ns_iters": int(spec.ns_iters), "weight_decay": _f32(spec.weight_decay)}
    if spec.kind == "adam_w":
        return {"kind": "adam_w", "beta1": _f32(spec.beta1), "beta2": _f32(spec.beta2), "eps": _f32(spec.eps),
                "weight_decay": _f32(spec.weight_decay)}
    return {"kind": "sgd"}


class ResolvedSettings(BaseModel):
    """What a run trains with: the request as asked, and every value Kiln's rules derive from it.

    Frozen and exactly round-tripped through JSON, like the ``TrainPlan`` that carries it to a Prefect task, a
    ``torchrun`` rank or a Ray worker.

    Example:
        >>> settings = ResolvedSettings.resolve(OpdConfig(training_mode="off_policy", top_k=20), adapter="demo")
        >>> settings.top_k, settings.learning_rate, settings.samples_per_prompt
        (16, 0.002, 1)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: OpdConfig
    """The request's config as the run records it: ``output_name`` is the adapter, ``resume_checkpoint`` is
    dropped (where a run resumes is not part of what it is), ``seed`` is as requested (null: ``seed_for``)."""
    top_k: int
    """Effective top-K (Kiln's ``resolve_opd_top_k``: 32 or 16), under the teacher's cap on-policy."""
    learning_rate: float
    """The config's learning rate, else the optimizer's Kiln default; a schedule scales it step by step."""
    samples_per_prompt: int
    """Effective samples per prompt: on-policy, Kiln's default 4 auto-scaled from the prompt count; off-policy,
    the default means each example once."""
    world_size: int = Field(default=1, ge=1)
    """Processes (torchrun ranks or Ray workers) that train together; it decides which candidates share a step."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """``fsdp`` shards the base weights across the ranks; it trains the bytes ddp trains at the same world size."""
    lora_targets: LoraTargets | None = Field(default=None, exclude_if=lambda value: value is None)
    """The student's LoRA targets, resolved from its ``config.json`` (``kiln_core.training.lora_targets``); None
    for a direct call of the trainers, which resolve them from the student when they plan."""

    @classmethod
    def resolve(cls, config: OpdConfig, *, adapter: str, teacher_cap: int | None = None, prompt_count: int | None = None,
                world_size: int = 1, strategy: Literal["ddp", "fsdp"] = "ddp",
                lora_targets: LoraTargets | None = None) -> "ResolvedSettings":
        """Resolve a request's config for a run of ``adapter``.

        Args:
            config: The request's (or spec's) ``OpdConfig``.
            adapter: The adapter the run produces (the config's ``output_name``).
            teacher_cap: What the pinned teacher serves (``min(max_top_k, vocab_size)``) when it scores the
                student's own samples (on-policy); None for a pre-scored corpus, whose cap is the request's K.
            prompt_count: On-policy: the request's prompts, every one counted (Kiln auto-scales from it).
            world_size, strategy: The run's processes and how they share the base weights.
            lora_targets: The student's LoRA targets (``resolve_lora_targets``).

        Raises:
            ConfigError: ``invalid_config`` or ``top_k_unsupported`` (``resolve_top_k``).
        """
        recorded = config.model_copy(update={"output_name": adapter, "resume_checkpoint": None})
        return cls(config=recorded, top_k=resolve_top_k(config.top_k, source_cap=teacher_cap),
                   learning_rate=resolve_learning_rate(config),
                   samples_per_prompt=effective_samples_per_prompt(config, prompt_count), world_size=world_size,
                   strategy=strategy, lora_targets=lora_targets)

    @property
    def loss(self) -> str:
        """The loss the run trains, by its own name (what the checkpoint state and the receipt record)."""
        return self.config.loss

    @property
    def on_policy(self) -> bool:
        return self.config.training_mode == "on_policy"

    def seed_for(self, run_key: str) -> int:
        """The run's seed: the requested one, else the one its run key gives (``seed_from_run_key``)."""
        return self.config.seed if self.config.seed is not None else seed_from_run_key(run_key)

    def run_key_config(self) -> dict[str, Any]:
        """The part of the run key that comes from the settings: every field of the config that decides what
        trains (not ``publish_guard``, which decides only whether the result is published; not a step extension
        left at Kiln's behaviour), and the world size above one process (it decides which candidates share a
        step; the strategy does not).

        Example:
            >>> "publish_guard" in ResolvedSettings.resolve(OpdConfig(), adapter="a").run_key_config()
            False
        """
        decides = self.config.model_dump(mode="json", by_alias=True)
        decides.pop("publish_guard")
        drop_unused_step_extensions(decides)
        if self.world_size > 1:
            decides["world_size"] = self.world_size
        return decides

    def kiln_effective_config(self, seed: int) -> dict[str, Any]:
        """Kiln's checkpoint ``effective_config`` (keys sorted, as a ``Value`` holds them).

        Kiln serializes f32 fields (``lora_alpha``, the optimizer's coefficients) through ``serde_json::Value``,
        which widens them to f64 (``0.95`` is written ``0.949999988079071``); ``Option`` fields marked
        ``skip_serializing_if`` are left out, the others are ``null``. Our extensions are not Kiln fields: they live
        in the checkpoint's extension file, and ``loss`` is written as the Kiln loss it extends (``kiln_loss``).

        Example:
            >>> effective = ResolvedSettings.resolve(OpdConfig(training_mode="off_policy"), adapter="a")
            >>> cfg = effective.kiln_effective_config(7)
            >>> cfg["optimizer"]["momentum"], "sampler_segments" in cfg, cfg["checkpoint_interval"], cfg["seed"]
            (0.949999988079071, False, 25, 7)
        """
        config = self.config
        value: dict[str, Any] = {
            "training_mode": config.training_mode,
            "objective": config.objective,
            "loss": kiln_loss(config.loss),
            "top_k": int(config.top_k),
            "samples_per_prompt": int(config.samples_per_prompt),
            "temperature": float(config.temperature),
            "top_p": float(config.top_p),
            "max_tokens": int(config.max_tokens),
            "rollout_prompt_rendering": config.rollout_prompt_rendering,
            "stable_opd": config.stable_opd.model_dump(mode="json"),
            "discount": float(config.discount),
            "clip_epsilon": float(config.clip_epsilon),
            "learning_rate": float(self.learning_rate),
            "lora_rank": int(config.lora_rank),
            "lora_alpha": _f32(config.lora_alpha),
            "allow_high_lora_scale": bool(config.allow_high_lora_scale),
            "base_adapter": config.base_adapter,
            "output_name": config.output_name,
            "auto_load": bool(config.auto_load),
            "checkpoint_interval": config.checkpoint_interval,
            "detect_anomaly": bool(config.detect_anomaly),
            "seed": int(seed),
            "optimizer": kiln_optimizer_json(config.optimizer),
            "echo": config.echo.model_dump(mode="json", by_alias=True) if config.echo is not None else None,
            "epochs": int(config.epochs),
            "max_cost_usd": config.max_cost_usd,
            "effective_top_k": int(self.top_k),
            "effective_samples_per_prompt": int(self.samples_per_prompt),
        }
        if config.sampler_segments is not None:  # skip_serializing_if = "Option::is_none"
            value["sampler_segments"] = int(config.sampler_segments)
        return json.loads(json.dumps(value, sort_keys=True))  # what a round trip through Value gives

    def receipt_config(self, seed: int) -> OpdConfig:
        """The receipt's ``config``: the request as the run records it, with the effective top-K, samples per prompt
        and seed in place of the requested ones."""
        return self.config.model_copy(update={"top_k": self.top_k, "samples_per_prompt": self.samples_per_prompt,
                                              "seed": seed})
