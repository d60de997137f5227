"""A run's records, each written once by its owner, and the one composer of ``train_receipt.json``.

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

Kiln keeps ``train_receipt.json`` inside the adapter directory; kiln-flows keeps it in the run directory, one
level above ``adapter/`` (beside the checkpoints it summarizes). Kiln's ``restore`` copies ``files.*`` from the
manifest's own directory and verifies ``receipt_hash`` against the copy, so the manifest names no receipt
(``files.train_receipt`` and ``receipt_hash`` null): an adapter restored by Kiln carries its weights and
config, verified; its receipt stays with the run (docs/kiln-compatibility.md).
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from kiln_core.canonical import sha256_prefixed
from kiln_core.contracts.adapter_manifest import ADAPTER_MANIFEST_FILE, AdapterManifest, AdapterManifestFiles
from kiln_core.contracts.outcomes import GateDecision
from kiln_core.contracts.receipt import RECEIPT_FILE, TrainReceipt, encode_receipt, gate_decision
from kiln_core.contracts.recipe_record import LEGACY_RECEIPT_FILE, AdapterReceipt, RecipeRecord
from kiln_core.storage import Location, write_bytes_atomic
from kiln_core.contracts.training_record import TRAINING_RECORD_FILE, TrainingRecord
from kiln_core.training.receipt import ReceiptError, build_receipt, check_kiln_rules, read_receipt, receipt_status

__all__ = ["TRAINING_RECORD_FILE", "TrainingRecord", "write_training_record", "read_training_record",
           "training_finished", "compose_receipt", "adapter_manifest", "recipe_receipt"]

ADAPTER_DIR = "adapter"


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
