"""Stage 5, ``publish``: verify what training wrote, point ``latest.json`` at it, and show it in the UI.

Training already wrote checkpoints, the adapter and the receipt through fsspec; publishing checks the
adapter bytes against the receipt's digest, then atomically (re)writes
``<root>/runs/<adapter>/latest.json`` — the one file a consumer reads to find the newest adapter —
and records table and markdown artifacts with the receipt summary and the output locations.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import task

from tasks.artifacts import artifact_key, markdown_links, table_rows
from tasks.refs import PublishRef, TrainRef


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


def publish(train: TrainRef, storage_root: str, adapter: str) -> PublishRef:
    """Verify the adapter against its receipt and write ``latest.json`` (plain function)."""
    from kiln_core.canonical import sha256_hex, sha256_prefixed
    from kiln_core.storage import resolve, write_bytes_atomic
    from kiln_core.training.checkpoint import committed_checkpoints
    from kiln_core.training.receipt import read_receipt

    receipt_location = resolve(train.receipt_uri)
    receipt_bytes = receipt_location.read_bytes()
    receipt = read_receipt(receipt_location)
    if train.adapter_uri is None:
        raise ValueError(f"run {train.run_uri} has no adapter to publish (status {train.status})")
    adapter_file = resolve(train.adapter_uri).child("adapter_model.safetensors")
    expected = receipt.adapters.output.adapter_model_sha256
    actual = sha256_prefixed(adapter_file.read_bytes())
    if expected != actual:
        raise ValueError(f"{adapter_file.uri} is {actual}, but the receipt records {expected}")
    run = resolve(train.run_uri)
    checkpoints = [name for _, name in committed_checkpoints(run, adapter)]
    latest = resolve(storage_root).child("runs", adapter, "latest.json")
    pointer = {
        "adapter": train.adapter_uri,
        "receipt": train.receipt_uri,
        "receipt_sha256": "sha256:" + sha256_hex(receipt_bytes),
        "run": train.run_uri,
        "adapter_model_sha256": actual,
        "dataset_sha256": receipt.training_data.sha256,
        "produced_at": receipt.produced_at,
    }
    write_bytes_atomic(latest, json.dumps(pointer, indent=2).encode("utf-8"))
    return PublishRef(
        adapter_uri=train.adapter_uri,
        receipt_uri=train.receipt_uri,
        receipt_sha256=pointer["receipt_sha256"],
        latest_uri=latest.uri,
        checkpoints=[run.child(name).uri for name in checkpoints],
    )


def record_artifacts(train: TrainRef, adapter: str, published: PublishRef | None) -> None:
    """Table artifact with the receipt summary, markdown artifact with the output links."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from kiln_core.storage import resolve
    from kiln_core.training.receipt import read_receipt

    receipt = read_receipt(resolve(train.receipt_uri))
    create_table_artifact(
        table_rows(receipt_summary(receipt)),
        key=artifact_key("receipt", adapter),
        description=f"train_receipt.json summary for {adapter}",
    )
    links = {"adapter": train.adapter_uri, "receipt": train.receipt_uri, "run directory": train.run_uri}
    if published is not None:
        links["latest.json"] = published.latest_uri
        for uri in published.checkpoints:
            links[uri.rsplit("/", 1)[-1]] = uri
    elif train.latest_checkpoint:
        links["latest checkpoint"] = resolve(train.run_uri).child(train.latest_checkpoint).uri
    create_markdown_artifact(
        markdown_links(f"Outputs of {adapter} ({train.status})", links),
        key=artifact_key("outputs", adapter),
        description=f"where {adapter}'s adapter, receipt and checkpoints are",
    )


@task(name="publish", task_run_name="publish-{adapter}", retries=2, retry_delay_seconds=[2, 10])
def publish_task(train: TrainRef, storage_root: str, adapter: str) -> PublishRef:
    """Verify and publish a successful training run, with artifacts.

    Example:
        ```python
        published = publish_task(train_ref, "./kiln-data", "demo")
        print(published.latest_uri)
        ```
    """
    published = publish(train, storage_root, adapter)
    record_artifacts(train, adapter, published)
    return published
