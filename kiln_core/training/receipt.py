"""``train_receipt.json``: what one OPD training run did, in Kiln's receipt shape (reference §7.1).

The receipt is written at the end of every run that got past input validation: ``status: success``
with the adapter's digest, or ``status: failed`` with a ``failure_reason`` from Kiln's enum (a
cancelled run is ``failed`` + ``cancelled``, as in Kiln). It is pretty JSON without a trailing newline.
Every digest is ``sha256:``-prefixed except inside ``teacher_identity``, which keeps Kiln's raw hex.

On a resumed run, counters, ``loss_history`` and ``token_counts`` cover the whole run (they are
restored from the checkpoint), while ``runtime`` and ``phase_timings`` cover this process only.

Only facts go in: paths, digests, counters, timings, versions. No environment variables, tokens or
storage options are ever copied, so the receipt cannot leak secrets.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from kiln_core.canonical import canonical_sha256
from kiln_core.storage import Location, write_bytes_atomic

RECEIPT_FILE = "train_receipt.json"
TRAINING_DATA_SOURCE = "jsonl_off_policy_opd_teacher"
LOSS_GRANULARITY = "sequence_token_mean"  # mean KL over one sequence's action targets
FAILURE_REASONS = (
    "data_schema_error",
    "adapter_load_failed",
    "zero_groups",
    "zero_action_tokens",
    "zero_env_tokens",
    "cancelled",
    "unsupported_loss_config",
    "nan_loss",
    "oom",
    "shape_mismatch",
    "unsafe_lora_scale",
    "base_adapter_missing",
    "training_error",
)
TOKEN_COUNT_KEYS = (
    "action_tokens",
    "env_tokens",
    "env_tokens_before_warning_filter",
    "env_tokens_after_warning_filter",
    "warning_tokens_filtered",
    "context_tokens",
)


@dataclass(frozen=True)
class RunFacts:
    """What is fixed before the first step: inputs, identities and the resolved configuration."""

    adapter_name: str
    student_dir: str
    student_identity: dict[str, str]
    dataset_path: str
    dataset_sha256: str
    effective_config: dict[str, Any]
    seed: int
    learning_rate: float
    top_k: int
    samples_per_prompt: int
    teacher_alias: str
    teacher_identity: dict[str, Any] | None
    teacher_identity_revision: str | None
    examples_read: int
    candidates_per_epoch: int
    total_steps: int
    device: str
    precision_policy: dict[str, Any]
    library_versions: dict[str, str]


@dataclass
class RunOutcome:
    """What the run produced (filled in as it goes)."""

    status: Literal["success", "failed"] = "failed"
    failure_reason: str | None = None
    failure_message: str | None = None
    adapter_uri: str | None = None
    adapter_sha256: str | None = None
    adapter_bytes: int | None = None
    global_step: int = 0
    loss_history: list[float] = field(default_factory=list)
    token_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_COUNT_KEYS, 0))
    echo_fired: bool = False
    final_env_ce: float | None = None
    lora_grad_norms: list[float] = field(default_factory=list)
    lora_delta_norms: list[dict[str, Any]] = field(default_factory=list)
    phase_timings_ms: dict[str, float] = field(default_factory=dict)
    wall_clock_ms: float = 0.0
    peak_memory_mib: float | None = None  # CUDA max allocated on a GPU run, else the process's peak RSS
    peak_rss_mib: float | None = None
    peak_vram_mib: float | None = None
    resumed_from: str | None = None


def _prefixed(raw_hex: str | None) -> str | None:
    return None if raw_hex is None else ("sha256:" + raw_hex if not raw_hex.startswith("sha256:") else raw_hex)


def build_receipt(facts: RunFacts, outcome: RunOutcome) -> dict[str, Any]:
    """The receipt as a JSON-able dict, keys in Kiln's order.

    Example:
        >>> receipt = build_receipt(facts, outcome)  # doctest: +SKIP
        >>> receipt["receipt_type"]  # doctest: +SKIP
        'kiln_train_receipt'
    """
    if outcome.failure_reason is not None and outcome.failure_reason not in FAILURE_REASONS:
        raise ValueError(f"unknown failure_reason {outcome.failure_reason!r}")
    config = facts.effective_config
    echo = config.get("echo")
    final_loss = outcome.loss_history[-1] if outcome.loss_history else None
    identity = facts.student_identity
    effective = dict(config, top_k=facts.top_k, samples_per_prompt=facts.samples_per_prompt, seed=facts.seed)
    return {
        "schema_version": 1,
        "receipt_type": "kiln_train_receipt",
        "adapter_name": facts.adapter_name,
        "produced_at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "status": outcome.status,
        "failure_reason": outcome.failure_reason,
        "failure_message": outcome.failure_message,
        "kiln": {
            "git_commit": None,
            "git_dirty": None,
            "git_source": None,
            "package_version": facts.library_versions.get("kiln-flows"),
            "implementation": "kiln-flows",
        },
        "model": {
            "path": facts.student_dir,
            "config_hash": _prefixed(identity.get("model_config_sha256")),
            "base_weights_hash": _prefixed(identity.get("base_model_weights_sha256")),
        },
        "tokenizer": {
            "config_hash": _prefixed(identity.get("tokenizer_config_sha256")),
            "vocab_hash": _prefixed(identity.get("tokenizer_vocab_sha256")),
            "chat_template_hash": _prefixed(identity.get("chat_template_sha256")),
        },
        "adapters": {
            "base": None,
            "output": None
            if outcome.adapter_uri is None
            else {
                "path": outcome.adapter_uri,
                "adapter_model_sha256": outcome.adapter_sha256,
                "adapter_model_bytes": outcome.adapter_bytes,
            },
        },
        "training_data": {"source": TRAINING_DATA_SOURCE, "path": facts.dataset_path, "sha256": facts.dataset_sha256},
        "hyperparameters": {
            "mode": "opd",
            "rank": config["lora_rank"],
            "alpha": config["lora_alpha"],
            "alpha_over_rank": config["lora_alpha"] / config["lora_rank"],
            "learning_rate": facts.learning_rate,
            "epochs": config["epochs"],
            "seed": facts.seed,
            "shuffle": False,
            "optimizer": config["optimizer"]["kind"],
            "sequences_per_step": config["sequences_per_step"],
        },
        "grpo": None,
        "opd": {
            "training_mode": config["training_mode"],
            "objective": config["objective"],
            "loss": config["loss"],
            "loss_granularity": LOSS_GRANULARITY,
            "teacher_id": facts.teacher_alias,
            "teacher_identity": facts.teacher_identity,
            "teacher_identity_revision": facts.teacher_identity_revision,
            "top_k": facts.top_k,
            "samples_per_prompt": facts.samples_per_prompt,
            "action_tokens": outcome.token_counts["action_tokens"],
            "env_tokens": outcome.token_counts["env_tokens"],
            "echo_combined": outcome.echo_fired,
            "echo_lambda": echo["lambda"] if echo else None,
            "initial_opd_loss": None,
            "final_opd_loss": final_loss,
        },
        "echo": _echo_block(echo, outcome),
        "no_policy_loss": False,
        "data": {
            "examples_read": facts.examples_read,
            "examples_filtered": 0,
            "examples_trained": outcome.global_step,
            "candidates_per_epoch": facts.candidates_per_epoch,
            "total_steps": facts.total_steps,
            "resumed_from_checkpoint": outcome.resumed_from,
        },
        "rewards": {},
        "token_counts": dict(outcome.token_counts),
        "loss_history": list(outcome.loss_history),
        "phase_timings": {key: round(value, 3) for key, value in outcome.phase_timings_ms.items()},
        "runtime": {
            "wall_clock_ms": round(outcome.wall_clock_ms, 3),
            "peak_memory_mib": outcome.peak_memory_mib,
            "peak_rss_mib": outcome.peak_rss_mib,
            "peak_vram_mib": outcome.peak_vram_mib,
            "device": facts.device,
            "training_precision": facts.precision_policy,
        },
        "config_hashes": {
            "effective_config": canonical_sha256(config),
            "model_config": _prefixed(identity.get("model_config_sha256")),
            "tokenizer_config": _prefixed(identity.get("tokenizer_config_sha256")),
            "chat_template": _prefixed(identity.get("chat_template_sha256")),
        },
        "library_versions": dict(facts.library_versions),
        "lora_delta_norms": outcome.lora_delta_norms,
        "lora_grad_norms": list(outcome.lora_grad_norms),
        "config": effective,
    }


def _echo_block(echo: dict[str, Any] | None, outcome: RunOutcome) -> dict[str, Any]:
    if echo is None:
        return {"enabled": False, "configured": False, "lambda": None, "env_mask_mode": None, "warning_filter": None,
                "initial_env_ce": None, "final_env_ce": None}
    block = {
        "enabled": outcome.echo_fired,
        "configured": True,
        "lambda": echo["lambda"],
        "env_mask_mode": echo["env_mask_mode"],
        "warning_filter": echo["warning_filter"],
        "initial_env_ce": None,
        "final_env_ce": outcome.final_env_ce,
    }
    if not outcome.echo_fired and outcome.global_step > 0:
        block["dropped_reason"] = (
            "echo.lambda is 0" if echo["lambda"] == 0 else "no observation (env) tokens in the trained candidates"
        )
    return block


def write_receipt(run_dir: Location, receipt: dict[str, Any]) -> str:
    """Write ``train_receipt.json`` (pretty, no trailing newline) atomically; return its URI."""
    location = run_dir.child(RECEIPT_FILE)
    write_bytes_atomic(location, json.dumps(receipt, indent=2, allow_nan=False).encode("utf-8"))
    return location.uri


def library_versions() -> dict[str, str]:
    """Versions that decide the numerics of a run (recorded, and part of the resume identity)."""
    import peft
    import safetensors
    import torch
    import transformers

    from kiln_core import __version__

    return {
        "kiln-flows": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "safetensors": safetensors.__version__,
        "platform": sys.platform,
    }
