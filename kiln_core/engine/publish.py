"""Publication: verify what training wrote and point ``<root>/runs/<adapter>/latest.json`` at it.

Training already wrote the checkpoints, the adapter and the receipt. Publishing checks the adapter
bytes against the receipt's digest, then atomically (re)writes ``latest.json`` — the one file a
consumer reads to find the newest adapter of a name. ``kiln-flows train`` and the pipeline both
publish, so ``latest.json`` always names the newest successful run, whichever way it ran.
"""

from __future__ import annotations

import json
from typing import Any

from kiln_core.engine.refs import PublishRef, TrainRef
from kiln_core.engine.runs import LATEST_FILE, adapter_root
from kiln_core.errors import EnvironmentFailure


def receipt_summary(receipt: dict[str, Any]) -> dict[str, Any]:
    """The receipt fields a person looks at first."""
    opd = receipt.get("opd") or {}
    tokens = receipt.get("token_counts") or {}
    output = (receipt.get("adapters") or {}).get("output") or {}
    data = receipt.get("training_data") or {}
    return {
        "status": receipt.get("status"),
        "failure_reason": receipt.get("failure_reason"),
        "final_opd_loss": opd.get("final_opd_loss"),
        "steps": (receipt.get("data") or {}).get("examples_trained"),
        "action_tokens": tokens.get("action_tokens"),
        "env_tokens": tokens.get("env_tokens"),
        "context_tokens": tokens.get("context_tokens"),
        "top_k": opd.get("top_k"),
        "dataset_sha256": data.get("sha256"),
        "teacher_identity_revision": opd.get("teacher_identity_revision"),
        "adapter_model_sha256": output.get("adapter_model_sha256"),
        "wall_clock_ms": (receipt.get("runtime") or {}).get("wall_clock_ms"),
    }


def publish(train: TrainRef, storage_root: str, adapter: str) -> PublishRef:
    """Verify the adapter against its receipt and write ``latest.json``.

    Raises:
        EnvironmentFailure: ``adapter_mismatch`` when the stored adapter is not the one the receipt
            records (storage damage); ``nothing_to_publish`` for a run without an adapter.

    Example:
        >>> published = publish(train_ref, "./kiln-data", "demo")  # doctest: +SKIP
        >>> published.latest_uri  # doctest: +SKIP
        '/abs/kiln-data/runs/demo/latest.json'
    """
    from kiln_core.canonical import sha256_hex, sha256_prefixed
    from kiln_core.storage import resolve, write_bytes_atomic
    from kiln_core.training.checkpoint import committed_checkpoints

    if train.adapter_uri is None:
        raise EnvironmentFailure("nothing_to_publish", f"run {train.run_uri} has no adapter (status {train.status})")
    receipt_bytes = resolve(train.receipt_uri).read_bytes()
    receipt = json.loads(receipt_bytes)
    adapter_file = resolve(train.adapter_uri).child("adapter_model.safetensors")
    expected = ((receipt.get("adapters") or {}).get("output") or {}).get("adapter_model_sha256")
    actual = sha256_prefixed(adapter_file.read_bytes())
    if expected != actual:
        raise EnvironmentFailure("adapter_mismatch", f"{adapter_file.uri} is {actual}, but the receipt records "
                                 f"{expected}", file=adapter_file.uri)
    run = resolve(train.run_uri)
    latest = adapter_root(storage_root, adapter).child(LATEST_FILE)
    pointer = {
        "adapter": train.adapter_uri,
        "receipt": train.receipt_uri,
        "receipt_sha256": "sha256:" + sha256_hex(receipt_bytes),
        "run": train.run_uri,
        "adapter_model_sha256": actual,
        "dataset_sha256": (receipt.get("training_data") or {}).get("sha256"),
        "produced_at": receipt.get("produced_at"),
    }
    write_bytes_atomic(latest, json.dumps(pointer, indent=2).encode("utf-8"))
    return PublishRef(adapter_uri=train.adapter_uri, receipt_uri=train.receipt_uri,
                      receipt_sha256=pointer["receipt_sha256"], latest_uri=latest.uri,
                      checkpoints=[run.child(name).uri for _, name in committed_checkpoints(run, adapter)])
