"""Publication: verify what training wrote and point ``<root>/runs/<adapter>/latest.json`` at it.

Training already wrote the checkpoints, the adapter and the receipt. Publishing checks the adapter
bytes against the receipt's digest, then atomically (re)writes ``latest.json`` — the one file a
consumer reads to find the newest adapter of a name. ``kiln-flows train`` and the pipeline both
publish, and the post-eval gate's promotion (``kiln_core.engine.fate``) writes the pointer
through the same two functions here (``latest_pointer``, ``write_latest``), so the document is the
same whoever writes it.
"""

from __future__ import annotations

from typing import Any

from kiln_core.contracts.latest import LATEST_FILE, LatestPointer, encode_latest
from kiln_core.contracts.receipt import RECEIPT_FILE
from kiln_core.contracts.stage_refs import PublishRef, TrainRef
from kiln_core.engine.runs import ADAPTER_DIR
from kiln_core.errors import EnvironmentFailure
from kiln_core.storage import Location, resolve


class AdapterMismatch(EnvironmentFailure):
    """The stored adapter is not the one the run's receipt records (code ``adapter_mismatch``)."""


def receipt_summary(receipt: Any) -> dict[str, Any]:
    """The fields of a ``TrainReceipt`` a person looks at first."""
    return {
        "status": receipt.status,
        "failure_reason": receipt.failure_reason,
        "final_opd_loss": receipt.opd.final_opd_loss,
        "steps": receipt.data.examples_trained,
        "action_tokens": receipt.token_counts.action_tokens,
        "env_tokens": receipt.token_counts.env_tokens,
        "context_tokens": receipt.token_counts.context_tokens,
        "top_k": receipt.opd.top_k,
        "dataset_sha256": receipt.training_data.sha256,
        "teacher_identity_revision": receipt.opd.teacher_identity_revision,
        "teacher_content_revision": receipt.opd.teacher_content_revision,
        "adapter_model_sha256": receipt.adapters.output.adapter_model_sha256,
        "wall_clock_ms": receipt.runtime.wall_clock_ms,
    }


def latest_location(run: Location | str) -> Location:
    """``<root>/runs/<adapter>/latest.json`` for a run directory ``<root>/runs/<adapter>/<run key>``."""
    run = resolve(run) if isinstance(run, str) else run
    parent_path, _, _ = run.path.rstrip("/").rpartition("/")
    parent_uri, _, _ = run.uri.rstrip("/").rpartition("/")
    return Location(run.fs, parent_path, parent_uri).child(LATEST_FILE)


def latest_pointer(run: Location | str) -> LatestPointer:
    """The ``latest.json`` document for the adapter of a finished run, checked against its receipt.

    Raises:
        ReceiptError: ``receipt_missing``/``receipt_invalid`` — no valid ``TrainReceipt`` in the run.
        AdapterMismatch: ``adapter_mismatch`` — the adapter bytes are not the receipt's (storage damage).
        FileNotFoundError: the run has no adapter.

    Example:
        >>> latest_pointer("kiln-data/runs/demo/3f2a9c0d1e2b4a5c").adapter_model_sha256  # doctest: +SKIP
        'sha256:…'
    """
    from kiln_core.canonical import sha256_hex, sha256_prefixed
    from kiln_core.training.receipt import read_receipt

    run = resolve(run) if isinstance(run, str) else run
    receipt_location = run.child(RECEIPT_FILE)
    receipt = read_receipt(receipt_location)
    receipt_bytes = receipt_location.read_bytes()
    adapter = run.child(ADAPTER_DIR)
    adapter_file = adapter.child("adapter_model.safetensors")
    actual = sha256_prefixed(adapter_file.read_bytes())
    expected = receipt.adapters.output.adapter_model_sha256
    if actual != expected:
        raise AdapterMismatch("adapter_mismatch", f"{adapter_file.uri} is {actual}, but the receipt records {expected}",
                              file=adapter_file.uri)
    return LatestPointer(adapter=adapter.uri, receipt=receipt_location.uri,
                         receipt_sha256="sha256:" + sha256_hex(receipt_bytes), run=run.uri,
                         adapter_model_sha256=actual, dataset_sha256=receipt.training_data.sha256,
                         produced_at=receipt.produced_at)


def write_latest(run: Location | str, pointer: LatestPointer | None = None) -> Location:
    """Atomically (re)write the adapter's ``latest.json`` to point at ``run``; returns its location.

    Args:
        run: The run directory ``<root>/runs/<adapter>/<run key>``.
        pointer: The document; default ``latest_pointer(run)``.
    """
    from kiln_core.storage import write_bytes_atomic

    run = resolve(run) if isinstance(run, str) else run
    document = pointer if pointer is not None else latest_pointer(run)
    latest = latest_location(run)
    write_bytes_atomic(latest, encode_latest(document))
    return latest


def publish(train: TrainRef, storage_root: str, adapter: str) -> PublishRef:
    """Verify the adapter against its receipt and write ``latest.json``.

    Raises:
        EnvironmentFailure: ``adapter_mismatch`` when the stored adapter is not the one the receipt
            records (storage damage); ``nothing_to_publish`` for a run without an adapter.
        ReceiptError: the run's receipt is missing or not a ``TrainReceipt``.

    Example:
        >>> published = publish(train_ref, "./kiln-data", "demo")  # doctest: +SKIP
        >>> published.latest_uri  # doctest: +SKIP
        '/abs/kiln-data/runs/demo/latest.json'
    """
    from kiln_core.training.checkpoint import committed_checkpoints

    if train.adapter_uri is None:
        raise EnvironmentFailure("nothing_to_publish", f"run {train.run_uri} has no adapter (status {train.status})")
    run = resolve(train.run_uri)  # <storage_root>/runs/<adapter>/<run key> (kiln_core.engine.runs)
    pointer = latest_pointer(run)
    latest = write_latest(run, pointer)
    return PublishRef(adapter_uri=pointer.adapter, receipt_uri=pointer.receipt,
                      receipt_sha256=pointer.receipt_sha256, latest_uri=latest.uri,
                      checkpoints=[run.child(name).uri for _, name in committed_checkpoints(run, adapter)])
