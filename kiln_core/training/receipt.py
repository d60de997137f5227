"""Writing and reading ``train_receipt.json`` (the ``TrainReceipt`` model, reference §7.1).

The receipt is written at the end of every run that got past input validation: ``status: success``
with the adapter's digest, or ``status: failed`` with a ``failure_reason`` from Kiln's enum (a
cancelled run is ``failed`` + ``cancelled``, as in Kiln). A run the held-out watch stopped is
``failed`` + ``training_error`` — Kiln's enum has no value for it, and an unknown one would stop
Kiln's reader — with a ``failure_message`` naming the rule and our ``stop_reason`` field. A run the
publish guard refused (``training_diverged``) is ``failed`` + ``training_error`` too, our
``publish_guard`` block naming the rule with its measured values and thresholds. Pretty JSON, no trailing newline. Every
digest is ``sha256:``-prefixed except inside ``teacher_identity``, which keeps Kiln's raw hex.

On a resumed run, counters, ``loss_history``, ``token_counts`` and the gradient-norm summaries cover
the whole run (restored from the checkpoint); ``runtime`` and the timings cover this process only.

Only facts go in: paths, digests, counters, timings, versions. No environment variables, tokens or
storage options are copied, so a receipt cannot leak secrets.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kiln_core.canonical import canonical_sha256
from kiln_core.contracts.eval_curve import EvalCurve
from kiln_core.contracts.opd_config import EchoConfig
from kiln_core.contracts.receipt import (
    FAILURE_REASONS,
    RECEIPT_FILE,
    AdapterFileReceipt,
    AdapterReceiptSet,
    ConfigHashesReceipt,
    DataReceipt,
    DistributedReceipt,
    EchoReceipt,
    HyperparameterReceipt,
    KilnSourceReceipt,
    LoraDeltaNormSummary,
    LoraGradNormSummary,
    ModelReceipt,
    OpdReceipt,
    PhaseTimingsReceipt,
    RuntimeReceipt,
    ShardingReceipt,
    TokenizerReceipt,
    TrainingDataReceipt,
    TrainReceipt,
    encode_receipt,
)
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.errors import Rejection
from kiln_core.storage import Location, resolve, write_bytes_atomic

__all__ = ["TRAINING_DATA_SOURCE", "RunFacts", "RunOutcome", "ReceiptError", "build_receipt", "write_receipt",
           "read_receipt", "receipt_status", "library_versions"]

TRAINING_DATA_SOURCE = "jsonl_off_policy_opd_teacher"
LOSS_GRANULARITY = "teacher_top_k"
# Our failure codes that Kiln's closed ``failure_reason`` enum lacks, written as its ``training_error`` (an
# unknown value would stop Kiln's reader); the receipt's own block says which (``publish_guard``).
KILN_FAILURE_REASON = {"training_diverged": "training_error"}


class ReceiptError(Rejection):
    """A ``train_receipt.json`` that is missing or does not parse as ``TrainReceipt``."""


class RunFacts(BaseModel):
    """What is fixed before the first step: inputs, identities and the run's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter_name: str
    student_dir: str
    student_identity: dict[str, str | None]
    shard_manifest: dict[str, Any]
    execution_provenance: dict[str, Any]
    precision_policy: dict[str, Any]
    dataset_path: str | None
    """The corpus path as given; None for inline on-policy prompts."""
    dataset_sha256: str
    """``sha256:`` of the corpus bytes, or of the prompt list (on-policy)."""
    settings: ResolvedSettings
    """The run's settings (its LoRA targets resolved): the receipt's ``config``, hyperparameters, top-K, samples
    per prompt and loss, and the digest of Kiln's effective config, all read from here."""
    seed: int
    teacher_alias: str
    teacher_identity: dict[str, Any] | None
    teacher_identity_revision: str | None
    teacher_content_revision: str
    examples_read: int
    candidates_per_epoch: int
    total_steps: int
    device: str
    library_versions: dict[str, str]
    distributed: DistributedReceipt | None = None
    training_data_source: str = TRAINING_DATA_SOURCE
    """The receipt's ``training_data.source``: a JSONL corpus, or ``inline_opd_prompts`` (on-policy)."""
    examples_filtered: int = 0
    """Prompts dropped at tokenization (on-policy)."""
    base_adapter: dict[str, Any] | None = None
    """The warm start's receipt ``adapters.base`` (``{path, adapter_model_sha256, adapter_model_bytes}``), or None."""


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
    token_counts: dict[str, int] = field(default_factory=dict)
    final_env_ce: float | None = None
    lora_grad_norms: list[dict[str, Any]] = field(default_factory=list)
    lora_delta_norms: list[dict[str, Any]] = field(default_factory=list)
    phase_timings_ms: dict[str, float] = field(default_factory=dict)
    wall_clock_ms: float = 0.0
    peak_memory_mib: float | None = None
    peak_rss_mib: float | None = None
    peak_vram_mib: float | None = None
    resumed_from: str | None = None
    stop_reason: str | None = None
    """Ours: the held-out watch rule that stopped the run (``diverged``, ``stalled``, ``flat``)."""
    eval_curve: EvalCurve | None = None
    """Ours: the held-out curve of a watched run."""
    rollout_backend: str | None = None
    """Ours, on-policy: what sampled the rollouts (``local``: the training process; ``vllm``)."""
    teacher_backend: str | None = None
    """Ours, on-policy: what scored them (``local``; ``vllm``)."""
    publish_guard: dict[str, Any] | None = None
    """Ours: the publish guard's block (``kiln_core.training.publish_guard``), once it ran or was turned off."""
    sharding: dict[str, int] | None = None
    """Ours, ``strategy: fsdp``: rank 0's view of the sharded base weights (the receipt's ``distributed.fsdp``)."""


def _prefixed(raw_hex: str | None) -> str | None:
    return None if raw_hex is None else (raw_hex if raw_hex.startswith("sha256:") else "sha256:" + raw_hex)


def build_receipt(facts: RunFacts, outcome: RunOutcome) -> TrainReceipt:
    """The receipt of a run.

    Example:
        >>> build_receipt(facts, outcome).receipt_type  # doctest: +SKIP
        'kiln_train_receipt'
    """
    failure_reason = KILN_FAILURE_REASON.get(outcome.failure_reason, outcome.failure_reason)
    if failure_reason is not None and failure_reason not in FAILURE_REASONS:
        raise ValueError(f"unknown failure_reason {outcome.failure_reason!r}")
    settings, identity = facts.settings, facts.student_identity
    config = settings.config
    echo = config.echo
    fired = outcome.final_env_ce is not None
    timings = outcome.phase_timings_ms
    model_hash = _prefixed(identity.get("model_config_sha256"))
    tokenizer_hash = _prefixed(identity.get("tokenizer_config_sha256"))
    template_hash = _prefixed(identity.get("chat_template_sha256"))
    return TrainReceipt(
        adapter_name=facts.adapter_name,
        produced_at=datetime.now(timezone.utc).isoformat(),
        status=outcome.status,
        failure_reason=failure_reason,
        failure_message=outcome.failure_message,
        kiln=KilnSourceReceipt(package_version=facts.library_versions.get("kiln-flows", "unknown")),
        model=ModelReceipt(path=facts.student_dir, config_hash=model_hash, base_weight_shard_manifest=facts.shard_manifest),
        tokenizer=TokenizerReceipt(config_hash=tokenizer_hash, tokenizer_config_hash=tokenizer_hash,
                                   chat_template_hash=template_hash, vocab_hash=_prefixed(identity.get("tokenizer_vocab_sha256"))),
        adapters=AdapterReceiptSet(base=AdapterFileReceipt(**(facts.base_adapter or {})), output=AdapterFileReceipt(path=outcome.adapter_uri, adapter_model_sha256=outcome.adapter_sha256,
                                                             adapter_model_bytes=outcome.adapter_bytes)),
        training_data=TrainingDataReceipt(source=facts.training_data_source, path=facts.dataset_path,
                                          sha256=facts.dataset_sha256),
        hyperparameters=HyperparameterReceipt(
            rank=config.lora_rank, alpha=float(config.lora_alpha), alpha_over_rank=config.lora_alpha / config.lora_rank,
            learning_rate=settings.learning_rate, epochs=config.epochs, seed=facts.seed,
            optimizer=config.optimizer.kind, sequences_per_step=config.sequences_per_step,
            lora_targets=settings.lora_targets),
        opd=OpdReceipt(
            training_mode=config.training_mode, objective=config.objective, loss_granularity=LOSS_GRANULARITY,
            teacher_id=facts.teacher_alias, teacher_content_revision=facts.teacher_content_revision,
            teacher_identity=facts.teacher_identity, top_k=settings.top_k, samples_per_prompt=settings.samples_per_prompt,
            action_tokens=outcome.token_counts.get("action_tokens", 0), env_tokens=outcome.token_counts.get("env_tokens", 0),
            echo_combined=fired, echo_lambda=echo.lambda_ if echo else None,
            final_opd_loss=outcome.loss_history[-1] if outcome.loss_history else None, loss=settings.loss,
            teacher_identity_revision=facts.teacher_identity_revision, rollout_backend=outcome.rollout_backend,
            teacher_backend=outcome.teacher_backend),
        echo=_echo_receipt(echo, outcome),
        data=DataReceipt(examples_read=facts.examples_read, examples_filtered=facts.examples_filtered,
                         examples_trained=outcome.global_step,
                         candidates_per_epoch=facts.candidates_per_epoch, total_steps=facts.total_steps,
                         resumed_from_checkpoint=outcome.resumed_from),
        token_counts=outcome.token_counts,
        phase_timings=PhaseTimingsReceipt(policy_forward_ms=timings.get("forward", 0.0), backward_ms=timings.get("backward", 0.0),
                                          optimizer_ms=timings.get("optimizer", 0.0)),
        runtime=RuntimeReceipt(
            wall_clock_ms=int(round(outcome.wall_clock_ms)),
            peak_vram_mib=None if outcome.peak_vram_mib is None else int(round(outcome.peak_vram_mib)),
            execution_provenance=facts.execution_provenance, training_precision=facts.precision_policy,
            device=facts.device, peak_memory_mib=outcome.peak_memory_mib, peak_rss_mib=outcome.peak_rss_mib),
        config_hashes=ConfigHashesReceipt(model_config_hash=model_hash, tokenizer_config_hash=tokenizer_hash,
                                          chat_template_hash=template_hash,
                                          effective_config=canonical_sha256(settings.kiln_effective_config(facts.seed))),
        lora_delta_norms=[LoraDeltaNormSummary(**row) for row in outcome.lora_delta_norms],
        lora_grad_norms=[LoraGradNormSummary(**row) for row in outcome.lora_grad_norms],
        config=settings.receipt_config(facts.seed).model_dump(mode="json", by_alias=True),
        loss_history=list(outcome.loss_history),
        phase_timings_ms={key: round(value, 3) for key, value in timings.items()},
        library_versions=dict(facts.library_versions),
        distributed=_distributed_receipt(facts.distributed, outcome.sharding),
        stop_reason=outcome.stop_reason,
        eval_curve=outcome.eval_curve,
        publish_guard=outcome.publish_guard,
    )


def _distributed_receipt(planned: DistributedReceipt | None, sharding: dict[str, int] | None) -> DistributedReceipt | None:
    """The planned ``distributed`` block, with what FSDP sharded once the student loaded (``fsdp`` only)."""
    if planned is None or sharding is None:
        return planned
    return planned.model_copy(update={"fsdp": ShardingReceipt(**sharding)})


def _echo_receipt(echo: EchoConfig | None, outcome: RunOutcome) -> EchoReceipt:
    if echo is None:
        return EchoReceipt(enabled=False)
    fired = outcome.final_env_ce is not None
    dropped = None
    if not fired and outcome.global_step > 0:
        dropped = "echo.lambda is 0" if echo.lambda_ == 0 else "no observation (env) tokens in the trained candidates"
    return EchoReceipt(enabled=fired, configured=True, lambda_=echo.lambda_, env_mask_mode=echo.env_mask_mode,
                       warning_filter=echo.warning_filter, final_env_ce=outcome.final_env_ce, dropped_reason=dropped)


def write_receipt(run_dir: Location, receipt: TrainReceipt) -> str:
    """Write ``train_receipt.json`` (``encode_receipt``'s bytes) atomically; return its URI.

    The one writer of the file: training's finish, the gate's evidence and the ignored request keys
    all rewrite the receipt through it.
    """
    location = run_dir.child(RECEIPT_FILE)
    write_bytes_atomic(location, encode_receipt(receipt))
    return location.uri


def _receipt_location(where: Location | str) -> Location:
    location = where if isinstance(where, Location) else resolve(where)
    return location if location.uri.endswith(RECEIPT_FILE) else location.child(RECEIPT_FILE)


def read_receipt(where: Location | str) -> TrainReceipt:
    """Read and validate a run's receipt (``where``: the run directory or the receipt itself).

    Raises:
        ReceiptError: ``receipt_missing`` or ``receipt_invalid`` (names the field).

    Example:
        >>> read_receipt("kiln-data/runs/demo").status  # doctest: +SKIP
        'success'
    """
    location = _receipt_location(where)
    if not location.exists():
        raise ReceiptError("receipt_missing", f"no {RECEIPT_FILE} at {location.uri}", file=location.uri)
    try:
        return TrainReceipt.model_validate_json(location.read_bytes())
    except ValidationError as error:
        first = error.errors()[0]
        place = ".".join(str(part) for part in first["loc"]) or "document"
        raise ReceiptError("receipt_invalid", f"{RECEIPT_FILE} is not a kiln-flows train receipt: field `{place}`: "
                           f"{first['msg']}", file=location.uri, field=place) from None


def receipt_status(where: Location | str) -> str | None:
    """The ``status`` of a run's receipt, or None when there is none. Reads only that field, so a
    receipt written by an older kiln-flows still answers."""
    location = _receipt_location(where)
    if not location.exists():
        return None
    try:
        status = json.loads(location.read_bytes()).get("status")
    except (ValueError, AttributeError):
        return None
    return status if isinstance(status, str) else None


def library_versions() -> dict[str, str]:
    """Versions that decide the numerics of a run (recorded in receipts and the execution provenance)."""
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
