"""``train_receipt.json`` and the records it is composed from: one module owns the file.

    trainer (rank 0)  ─► training_record.json        the run's facts and what training produced
    gate stage        ─► its decision (``GateDecision``), handed to the composer
    compose_receipt   ─► adapter/receipt.json        Kiln's legacy receipt of a recipe's adapter
                      ─► train_receipt.json          the receipt, checked against Kiln's validate() rules
                      ─► adapter/adapter_manifest.json   Kiln's adapter manifest, after a successful receipt

``compose_receipt`` is the one writer of ``train_receipt.json``. It runs once per outcome: when training ends
and nothing follows it — training did not succeed, or no gate was asked for, or the trainers were called
directly (a benchmark, a test) — the trainer calls it; after a gate decided, the gate stage does
(``kiln_core.engine.gate``), where the run directory is by then (a demoted run's is renamed). The trainer
leaves ``training_record.json`` in every case, so a composer in another process (the flow's gate task after
a ``torchrun`` or Ray job) builds the same receipt from it. A successful receipt is final: composing again
returns it unchanged, so a retry that finds the run finished writes nothing, and ``latest.json`` pins the
digest of the receipt that stays.

``build_receipt`` makes the receipt of the run's facts (``RunFacts``: fixed before the first step), its outcome
(``RunOutcome``) and the gate's decision. ``status: success`` carries the adapter's digest; ``status: failed``
a ``failure_reason`` from Kiln's enum (a cancelled run is ``failed`` + ``cancelled``, as in Kiln). A run the
held-out watch stopped is ``failed`` + ``training_error`` — Kiln's enum has no value for it, and an unknown one
would stop Kiln's reader — with a ``failure_message`` naming the rule and our ``stop_reason`` field. A run the
publish guard refused (``training_diverged``) is ``failed`` + ``training_error`` too, our ``publish_guard``
block naming the rule with its measured values and thresholds. Pretty JSON, no trailing newline. Every digest
is ``sha256:``-prefixed except inside ``teacher_identity``, which keeps Kiln's raw hex.

On a resumed run, counters, ``loss_history``, ``token_counts`` and the gradient-norm summaries cover
the whole run (restored from the checkpoint); ``runtime`` and the timings cover this process only.

Only facts go in: paths, digests, counters, timings, versions. No environment variables, tokens or
storage options are copied, so a receipt cannot leak secrets.

Kiln keeps ``train_receipt.json`` inside the adapter directory; kiln-flows keeps it in the run directory, one
level above ``adapter/`` (beside the checkpoints it summarizes). Kiln's ``restore`` copies ``files.*`` from the
manifest's own directory and verifies ``receipt_hash`` against the copy, so the manifest names no receipt
(``files.train_receipt`` and ``receipt_hash`` null): an adapter restored by Kiln carries its weights and
config, verified; its receipt stays with the run (docs/kiln-compatibility.md).
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from kiln_core.canonical import canonical_sha256, sha256_prefixed
from kiln_core.contracts.adapter_manifest import ADAPTER_MANIFEST_FILE, AdapterManifest, AdapterManifestFiles
from kiln_core.contracts.opd_config import EchoConfig
from kiln_core.contracts.outcomes import GateDecision
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
    ModelReceipt,
    OpdReceipt,
    PhaseTimingsReceipt,
    RuntimeReceipt,
    ShardingReceipt,
    TokenizerReceipt,
    TrainingDataReceipt,
    TrainReceipt,
    encode_receipt,
    gate_decision,
)
from kiln_core.contracts.receipt_rules import receipt_problem
from kiln_core.contracts.recipe_record import LEGACY_RECEIPT_FILE, AdapterReceipt, RecipeRecord
from kiln_core.contracts.training_record import TRAINING_RECORD_FILE, RunFacts, RunOutcome, TrainingRecord
from kiln_core.errors import Rejection
from kiln_core.storage import Location, resolve, write_bytes_atomic

__all__ = ["ReceiptError", "build_receipt", "check_kiln_rules", "read_receipt", "receipt_status", "library_versions",
           "write_training_record", "read_training_record", "training_finished", "compose_receipt",
           "adapter_manifest", "recipe_receipt"]

ADAPTER_DIR = "adapter"

LOSS_GRANULARITY = "teacher_top_k"
# Our failure codes that Kiln's closed ``failure_reason`` enum lacks, written as its ``training_error`` (an
# unknown value would stop Kiln's reader); the receipt's own block says which (``publish_guard``).
KILN_FAILURE_REASON = {"training_diverged": "training_error"}


class ReceiptError(Rejection):
    """A ``train_receipt.json`` that is missing or does not parse as ``TrainReceipt``."""


def _prefixed(raw_hex: str | None) -> str | None:
    return None if raw_hex is None else (raw_hex if raw_hex.startswith("sha256:") else "sha256:" + raw_hex)


def build_receipt(facts: RunFacts, outcome: RunOutcome, gate: GateDecision | None = None) -> TrainReceipt:
    """The receipt of a run: its facts, what training produced, and the gate's decision when one ran.

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
        lora_delta_norms=list(outcome.lora_delta_norms),
        lora_grad_norms=list(outcome.lora_grad_norms),
        config=settings.receipt_config(facts.seed),
        loss_history=list(outcome.loss_history),
        phase_timings_ms={key: round(value, 3) for key, value in timings.items()},
        library_versions=dict(facts.library_versions),
        distributed=_distributed_receipt(facts.distributed, outcome.sharding),
        stop_reason=outcome.stop_reason,
        eval_curve=outcome.eval_curve,
        publish_guard=outcome.publish_guard,
        recipe=facts.recipe,
        ignored_request_keys=list(facts.ignored_request_keys) or None,
        **({"gate_outcome": gate.outcome, "post_eval": gate.post_eval, "quality_gate": gate.quality_gate}
           if gate is not None else {}),
    )


def _distributed_receipt(planned: DistributedReceipt | None, sharding: ShardingReceipt | None) -> DistributedReceipt | None:
    """The planned ``distributed`` block, with what FSDP sharded once the student loaded (``fsdp`` only)."""
    if planned is None or sharding is None:
        return planned
    return planned.model_copy(update={"fsdp": sharding})


def _echo_receipt(echo: EchoConfig | None, outcome: RunOutcome) -> EchoReceipt:
    if echo is None:
        return EchoReceipt(enabled=False)
    fired = outcome.final_env_ce is not None
    dropped = None
    if not fired and outcome.global_step > 0:
        dropped = "echo.lambda is 0" if echo.lambda_ == 0 else "no observation (env) tokens in the trained candidates"
    return EchoReceipt(enabled=fired, configured=True, lambda_=echo.lambda_, env_mask_mode=echo.env_mask_mode,
                       warning_filter=echo.warning_filter, final_env_ce=outcome.final_env_ce, dropped_reason=dropped)


def _receipt_location(where: Location | str) -> Location:
    location = where if isinstance(where, Location) else resolve(where)
    return location if location.uri.endswith(RECEIPT_FILE) else location.child(RECEIPT_FILE)


def read_receipt(where: Location | str) -> TrainReceipt:
    """Read and validate a run's receipt (``where``: the run directory or the receipt itself): our model, then
    Kiln's ``validate()`` rules.

    Raises:
        ReceiptError: ``receipt_missing`` or ``receipt_invalid`` (names the field or Kiln's rule).

    Example:
        >>> read_receipt("kiln-data/runs/demo").status  # doctest: +SKIP
        'success'
    """
    location = _receipt_location(where)
    if not location.exists():
        raise ReceiptError("receipt_missing", f"no {RECEIPT_FILE} at {location.uri}", file=location.uri)
    data = location.read_bytes()
    try:
        receipt = TrainReceipt.model_validate_json(data)
    except ValidationError as error:
        first = error.errors()[0]
        place = ".".join(str(part) for part in first["loc"]) or "document"
        raise ReceiptError("receipt_invalid", f"{RECEIPT_FILE} is not a kiln-flows train receipt: field `{place}`: "
                           f"{first['msg']}", file=location.uri, field=place) from None
    check_kiln_rules(json.loads(data), location.uri)  # Kiln validates on read too
    return receipt


def check_kiln_rules(document: dict[str, Any], where: str) -> None:
    """Refuse a receipt Kiln's ``TrainReceipt::validate()`` would refuse (``kiln_core.contracts.receipt_rules``).

    Raises:
        ReceiptError: ``receipt_invalid``, naming the rule.
    """
    problem = receipt_problem(document)
    if problem is not None:
        raise ReceiptError("receipt_invalid", f"{RECEIPT_FILE} breaks Kiln's receipt rules: {problem}", file=where)


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


def write_training_record(run_dir: Location, record: TrainingRecord) -> None:
    """Write ``training_record.json`` atomically (rank 0, when the run ends, whatever its status)."""
    write_bytes_atomic(run_dir.child(TRAINING_RECORD_FILE), record.model_dump_json(indent=2).encode("utf-8"))


def read_training_record(run_dir: Location) -> TrainingRecord | None:
    """The run's ``training_record.json``, or None when training never ended in this directory (or ended
    before kiln-flows kept the record: such a run has its receipt).

    Raises:
        ReceiptError: ``receipt_invalid`` — the record does not parse.
    """
    location = run_dir.child(TRAINING_RECORD_FILE)
    if not location.exists():
        return None
    try:
        return TrainingRecord.model_validate_json(location.read_bytes())
    except ValidationError as error:
        raise ReceiptError("receipt_invalid", f"{TRAINING_RECORD_FILE} is not a training record: "
                           f"{error.errors()[0]['msg']}", file=location.uri) from None


def training_finished(run_dir: Location) -> bool:
    """Whether the run's training succeeded: its training record says so, or (a run trained before the record
    existed) its receipt. Reads only the status fields."""
    location = run_dir.child(TRAINING_RECORD_FILE)
    if location.exists():
        try:
            return json.loads(location.read_bytes())["outcome"]["status"] == "success"
        except (ValueError, KeyError, TypeError):
            return False
    return receipt_status(run_dir) == "success"


def compose_receipt(run_dir: Location, *, record: TrainingRecord | None = None,
                    gate: GateDecision | None = None) -> str:
    """Write the run's ``train_receipt.json`` once, and after a success Kiln's records beside the adapter;
    returns the receipt's URI.

    Args:
        run_dir: Where the run is now.
        record: The trainer's record (default: ``training_record.json`` of ``run_dir``).
        gate: The gate's decision, when a gate ran.

    Raises:
        ReceiptError: ``receipt_missing`` (no record to compose from), ``receipt_invalid`` (a receipt Kiln's
            rules refuse: a kiln-flows bug, never written).

    Example:
        >>> compose_receipt(resolve("kiln-data/runs/demo/3f2a9c0d1e2b4a5c"), gate=decision)  # doctest: +SKIP
        '/abs/kiln-data/runs/demo/3f2a9c0d1e2b4a5c/train_receipt.json'
    """
    location = run_dir.child(RECEIPT_FILE)
    existing = read_receipt(run_dir) if receipt_status(run_dir) == "success" else None
    if existing is not None and (gate is None or gate_decision(existing) is not None):
        return location.uri  # final: a retry found the run finished
    record = record if record is not None else read_training_record(run_dir)
    if record is not None:
        receipt = build_receipt(record.facts, record.outcome, gate)
    elif existing is not None:  # trained before the record existed: its receipt, and now the gate's decision
        receipt = existing.model_copy(update={"gate_outcome": gate.outcome, "post_eval": gate.post_eval,
                                              "quality_gate": gate.quality_gate})
    else:
        raise ReceiptError("receipt_missing", f"no {TRAINING_RECORD_FILE} in {run_dir.uri} to compose the receipt "
                           "from", file=run_dir.uri)
    data = encode_receipt(receipt)
    check_kiln_rules(json.loads(data), location.uri)  # Kiln validates on write too
    adapter = run_dir.child(ADAPTER_DIR)
    if receipt.status == "success" and receipt.recipe is not None:
        write_bytes_atomic(adapter.child(LEGACY_RECEIPT_FILE), recipe_receipt(receipt.recipe, receipt)
                           .model_dump_json(indent=2).encode("utf-8"))
    write_bytes_atomic(location, data)
    if receipt.status == "success" and all(adapter.child(name).exists()
                                           for name in ("adapter_model.safetensors", "adapter_config.json")):
        manifest = adapter_manifest(adapter, receipt)
        write_bytes_atomic(adapter.child(ADAPTER_MANIFEST_FILE),
                           json.dumps(manifest.model_dump(mode="json"), indent=2).encode("utf-8"))
    return location.uri


def adapter_manifest(adapter: Location, receipt: TrainReceipt) -> AdapterManifest:
    """Kiln's ``build_adapter_manifest_from_train_receipt`` for the adapter directory ``adapter``.

    No execution provenance: Kiln's record describes a Kiln process (its executable, its startup probe of the
    numerical runtime, its kernels), and Kiln's newest resume compares it with the running process's own;
    kiln-flows' record of a Python trainer proves nothing to Kiln (docs/kiln-compatibility.md).
    """
    base_adapter = receipt.config.base_adapter
    parent = base_adapter if base_adapter and base_adapter.strip() else receipt.adapters.base.path
    return AdapterManifest(
        adapter_name=receipt.adapter_name,
        safetensors_hash=sha256_prefixed(adapter.child("adapter_model.safetensors").read_bytes()),
        config_hash=sha256_prefixed(adapter.child("adapter_config.json").read_bytes()),
        receipt_hash=None, parent_adapter=parent,
        model_config_hash=receipt.model.config_hash or receipt.config_hashes.model_config_hash,
        training_chat_template_hash=receipt.tokenizer.training_chat_template_hash,
        base_weight_shard_manifest=receipt.model.base_weight_shard_manifest,
        training_precision=receipt.runtime.training_precision, kiln_commit=receipt.kiln.git_commit,
        training_data_hash=receipt.training_data.sha256, training_data_source=receipt.training_data.source,
        training_data_path=receipt.training_data.path or None, files=AdapterManifestFiles())


def recipe_receipt(record: RecipeRecord, receipt: TrainReceipt) -> AdapterReceipt:
    """Kiln's ``AdapterReceipt`` (``receipt.json``) for a recipe's adapter, from its train receipt (seed, time,
    final loss).

    Example:
        >>> recipe_receipt(record, read_receipt(run)).source_kind  # doctest: +SKIP
        'distill_self'
    """
    version = receipt.kiln.package_version
    summary = {"final_loss": receipt.opd.final_opd_loss} if receipt.opd.final_opd_loss is not None else {}
    return AdapterReceipt(
        adapter=record.name, produced_at=receipt.produced_at, kiln_version=f"kiln-flows/{version}",
        kernel_versions={"kiln-flows": version}, seed=receipt.hyperparameters.seed or 0, source_kind=record.kind,
        teacher=record.teacher, hyperparameters=record.request, diagnostic_summary=summary)
