"""``runs/<adapter>/latest.json``: the pointer to an adapter's newest published run.

kiln-flows' own file (Kiln has no publication pointer): the publish stage and the gate's promotion
write it, and a later run's ``config.base_adapter`` name reads it. It names the run, its adapter and
receipt, and pins them by digest, so a reader can tell a damaged or half-published adapter from the
one that was published. Written as ``json.dumps(..., indent=2)`` in the field order below, no
trailing newline; ``encode_latest`` and ``decode_latest`` are the one writer and the one reader of
those bytes.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict

__all__ = ["LATEST_FILE", "LatestPointer", "encode_latest", "decode_latest"]

LATEST_FILE = "latest.json"


class LatestPointer(BaseModel):
    """The ``latest.json`` document. Field order is the file's key order."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    adapter: str
    """URI of the run's PEFT adapter directory (``<run>/adapter``)."""
    receipt: str
    """URI of the run's ``train_receipt.json``."""
    receipt_sha256: str
    """``sha256:`` of the receipt's bytes as they were when the pointer was written."""
    run: str
    """URI of the run directory ``<root>/runs/<adapter>/<run key>``."""
    adapter_model_sha256: str
    """``sha256:`` of ``adapter_model.safetensors``; equal to the receipt's ``adapters.output``."""
    dataset_sha256: str | None
    """The receipt's ``training_data.sha256``."""
    produced_at: str
    """The receipt's ``produced_at`` (ISO 8601, UTC)."""


def encode_latest(pointer: LatestPointer) -> bytes:
    """The bytes of ``latest.json``: pretty JSON (two-space indent), no trailing newline.

    Example:
        >>> encode_latest(pointer)[:14]  # doctest: +SKIP
        b'{\\n  "adapter":'
    """
    return json.dumps(pointer.model_dump(mode="json"), indent=2).encode("utf-8")


def decode_latest(data: bytes | str) -> LatestPointer:
    """Parse ``latest.json`` bytes.

    Raises:
        pydantic.ValidationError: not a ``LatestPointer`` (a ``ValueError``), naming the field.
    """
    return LatestPointer.model_validate_json(data)
