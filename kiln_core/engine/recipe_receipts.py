"""A recipe run's records: the ``recipe`` block of ``train_receipt.json`` and Kiln's ``receipt.json``.

``run_pipeline`` calls ``record_recipe`` once training succeeded and before the gate: the gate may rename
the run, and ``latest.json`` pins the receipt's digest, so the receipt must be final before either. A run
found finished (``reused``) already carries its records and is left as it is.
"""

from __future__ import annotations

from kiln_core.contracts.recipe_record import LEGACY_RECEIPT_FILE, AdapterReceipt, RecipeRecord
from kiln_core.contracts.stage_refs import TrainRef
from kiln_core.storage import resolve, write_bytes_atomic


def legacy_receipt(record: RecipeRecord, receipt) -> AdapterReceipt:
    """Kiln's ``AdapterReceipt`` for a recipe's adapter, from its train receipt (seed, time, final loss).

    Example:
        >>> legacy_receipt(record, read_receipt(run)).source_kind  # doctest: +SKIP
        'distill_self'
    """
    import kiln_core

    summary = {"final_loss": receipt.opd.final_opd_loss} if receipt.opd.final_opd_loss is not None else {}
    return AdapterReceipt(
        adapter=record.name, produced_at=receipt.produced_at, kiln_version=f"kiln-flows/{kiln_core.__version__}",
        kernel_versions={"kiln-flows": kiln_core.__version__}, seed=receipt.hyperparameters.seed or 0,
        source_kind=record.kind, teacher=record.teacher, hyperparameters=record.request, diagnostic_summary=summary)


def record_recipe(trained: TrainRef, record: RecipeRecord) -> None:
    """Add ``record`` to the run's ``train_receipt.json`` and write Kiln's ``receipt.json`` into its adapter.

    Both writes are atomic; the legacy receipt is written first, so a train receipt that names a recipe
    always has its Kiln receipt beside the adapter.
    """
    from kiln_core.engine.runs import ADAPTER_DIR
    from kiln_core.training.receipt import read_receipt, write_receipt

    run = resolve(trained.run_uri)
    receipt = read_receipt(run)
    legacy = legacy_receipt(record, receipt)
    write_bytes_atomic(run.child(ADAPTER_DIR).child(LEGACY_RECEIPT_FILE),
                       legacy.model_dump_json(indent=2).encode("utf-8"))
    write_receipt(run, receipt.model_copy(update={"recipe": record.model_dump(mode="json")}))
