"""Kiln's submit-time rules for an ``OpdRequest``/``OpdConfig``: what Kiln's server refuses (or warns
about) when a request is submitted, with Kiln's messages (crates/kiln-train/src/opd.rs;
crates/kiln-server/src/api/training.rs). Parsing (``kiln_core.contracts.opd_config``) accepts every
wire value; these functions then say why a value cannot run.

Example:
    >>> from kiln_core.contracts.opd_config import OpdConfig
    >>> validate_config_rules(OpdConfig())
    []
"""

from __future__ import annotations

import math

from kiln_core.contracts.opd_config import (
    ConfigError,
    OpdConfig,
    OpdRequest,
    default_learning_rate,
    resolve_top_k,
)

__all__ = ["validate_for_offline_training", "validate_config_rules", "validate_request_for_offline_training"]

LORA_SCALE_LIMIT = 2.0
LR_WARNING_FACTOR = 50.0

def validate_for_offline_training(config: OpdConfig) -> list[str]:
    """Apply Kiln's submit-time rejections for a teacher-logprob JSONL (``dataset_path``) run.

    Returns:
        Warnings that do not block the run (an explicit learning rate far from the default).

    Raises:
        ConfigError: the first rule the config breaks, with Kiln's message.

    Example:
        >>> validate_for_offline_training(OpdConfig(training_mode="off_policy"))
        []
    """
    if config.training_mode != "off_policy":
        raise ConfigError(
            'OPD teacher-logprob JSONL requires config.training_mode="off_policy"; a dataset_path corpus '
            'is pre-scored, so set "training_mode": "off_policy" in the request config',
            "config.training_mode",
        )
    return validate_config_rules(config)


def validate_config_rules(config: OpdConfig, *, pre_scored: bool = True) -> list[str]:
    """Kiln's submit-time config rules shared by both training modes (no source or mode rule).

    ``pre_scored`` (a ``dataset_path`` corpus): ``top_k`` is resolved against itself as Kiln does at
    submit. Otherwise (on-policy) only ``top_k > 0`` is checked here; the source cap is the teacher's
    ``max_top_k``, resolved once the teacher is known (``kiln_core.on_policy.submit``).

    Returns:
        Warnings that do not block the run (an explicit learning rate far from the default).

    Raises:
        ConfigError: the first rule the config breaks, with Kiln's message.

    Example:
        >>> validate_config_rules(OpdConfig())
        []
    """
    if config.objective == "cross_entropy":
        raise ConfigError(
            "OPD objective: cross_entropy is not wired into the production OPD loss root; use reverse_kl",
            "config.objective",
        )
    if config.loss == "sampled_token":
        raise ConfigError(
            "OPD loss is unavailable: sampled_token is unsupported: the teacher contract does not return "
            "the sampled token's logprob, and using ranked top-1 would produce an identically zero loss",
            "config.loss",
        )
    if config.loss == "full_vocab":
        raise ConfigError(
            "OPD loss is unavailable: full_vocab has no concrete server-built teacher source; use teacher_top_k",
            "config.loss",
        )
    if config.stable_opd.mode != "off":
        raise ConfigError(
            'OPD stable_opd: Stable-OPD is not wired into the production loss root; use {"mode":"off"}',
            "config.stable_opd",
        )
    if config.discount != 0.0:
        raise ConfigError(
            f"OPD discount={config.discount} is unsupported because discounted advantages are not wired; use 0",
            "config.discount",
        )
    if config.clip_epsilon != 0.0:
        raise ConfigError(
            f"OPD clip_epsilon={config.clip_epsilon} is unsupported because importance-ratio clipping is "
            "not wired; use 0",
            "config.clip_epsilon",
        )
    if config.max_cost_usd is not None:
        raise ConfigError(
            "OPD max_cost_usd is unavailable: cost budgets are not enforced for OPD training; use null",
            "config.max_cost_usd",
        )
    if pre_scored:
        resolve_top_k(config.top_k)  # "> 0" first, then the {16, 32} support sizes
    elif config.top_k <= 0:
        raise ConfigError("OPD top_k must be > 0", "config.top_k")
    if config.samples_per_prompt <= 0:
        raise ConfigError("OPD samples_per_prompt must be > 0", "config.samples_per_prompt")
    if config.sampler_segments == 0:
        raise ConfigError("OPD sampler_segments must be greater than zero", "config.sampler_segments")
    if config.checkpoint_interval == 0:
        raise ConfigError(
            "OPD checkpoint_interval must be greater than zero; use null to disable periodic checkpoints",
            "config.checkpoint_interval",
        )
    _check_lora_scale(config)
    if config.base_adapter is not None and config.resume_checkpoint is not None:
        # A warm-started run resumes with `kiln-flows train --resume-checkpoint` (or the pipeline's
        # `resume: latest`): the request keeps its base_adapter, the checkpoint restores the LoRA.
        raise ConfigError(
            "OPD base_adapter cannot be combined with resume_checkpoint: exact resume restores the "
            "adapter from the checkpoint",
            "config.base_adapter",
        )
    if config.base_adapter is not None and not config.base_adapter.strip():
        raise ConfigError("OPD base_adapter must not be blank; use null for a cold start", "config.base_adapter",
                          code="base_adapter_missing")
    return _learning_rate_warnings(config)


def validate_request_for_offline_training(request: OpdRequest) -> list[str]:
    """Request-level rules (exactly one source; only ``dataset_path`` runs offline), then the config.

    Raises:
        ConfigError: as Kiln's submit validation would.
    """
    if not request.teacher.strip():
        raise ConfigError("OPD request teacher must be a non-blank registered alias", "teacher",
                          code="teacher_not_registered")
    has_prompts = bool(request.prompts)
    if has_prompts == (request.dataset_path is not None):
        raise ConfigError("OPD request must use exactly one of non-empty prompts or dataset_path", "dataset_path")
    if has_prompts:
        raise ConfigError(
            "OPD prompts (on-policy rollouts) are not supported by kiln-flows; provide a teacher-scored "
            "dataset_path",
            "prompts",
            code="unsupported",
        )
    return validate_for_offline_training(request.config)


def _check_lora_scale(config: OpdConfig) -> None:
    alpha = config.lora_alpha
    if not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"OPD lora_alpha must be a positive finite number; got {alpha}", "config.lora_alpha")
    ratio = alpha / config.lora_rank
    if ratio > LORA_SCALE_LIMIT and not config.allow_high_lora_scale:
        raise ConfigError(
            f"unsafe LoRA scaling: alpha/rank = {ratio:.3f} exceeds the default limit of {LORA_SCALE_LIMIT:.3f}; "
            "lower lora_alpha or raise lora_rank, or set allow_high_lora_scale=true to train anyway",
            "config.lora_alpha",
            code="unsafe_lora_scale",
        )


def _learning_rate_warnings(config: OpdConfig) -> list[str]:
    if config.learning_rate is None:
        return []
    default = default_learning_rate(config.optimizer.kind)
    lr = config.learning_rate
    if lr <= 0 or not math.isfinite(lr):
        raise ConfigError(f"OPD learning_rate must be a positive finite number; got {lr}", "config.learning_rate")
    if lr > default * LR_WARNING_FACTOR or lr < default / LR_WARNING_FACTOR:
        return [
            f"learning_rate {lr:g} is more than {LR_WARNING_FACTOR:g}x away from the {config.optimizer.kind} "
            f"default {default:g}"
        ]
    return []
