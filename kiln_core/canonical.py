"""The canonical JSON encodings Kiln uses, and the SHA-256 helpers built on them.

Kiln has three different ideas of "canonical JSON", and mixing them up silently changes digests:

* **Kiln compact** (`kiln_compact_json`): serde_json's compact output of a struct, keys in
  *declaration order*, raw UTF-8, no whitespace. Teacher identities and off-policy manifests are
  compared byte for byte in this form (Kiln's crates/kiln-train/src/teacher_identity.rs).
* **serde_json's own bytes** (``kiln_core.serde_json``): what ``serde_json::to_vec`` writes — keys
  sorted for a ``Value``, floats in Ryū's shortest form. Kiln digests prompt lists and eval suites this way.
* **Sorted-keys ASCII** (`canonical_json_bytes`, `canonical_sha256`): Python's
  ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)``. The
  HF oracle contracts hash requests, results and id lists this way (the next-token oracle's request
  and result digests).
  Floats keep Python's ``repr`` form (``300.0`` stays ``300.0``); this is not RFC 8785.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SHA256_PREFIX = "sha256:"


def kiln_compact_json(value: Any) -> str:
    """Encode ``value`` as Kiln's compact, declaration-order JSON.

    Keys keep the order of the mapping (build dicts in the contract's field order); non-ASCII is
    written as raw UTF-8; NaN and infinities are refused.

    Example:
        >>> kiln_compact_json({"schema": "x", "adapter": None})
        '{"schema":"x","adapter":null}'
    """
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def canonical_json_bytes(value: Any) -> bytes:
    """Encode ``value`` as sorted-keys, ASCII-only, compact JSON bytes (the oracle's canonical form).

    Example:
        >>> canonical_json_bytes({"b": 1, "a": "é"})
        b'{"a":"\\\\u00e9","b":1}'
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.encode("ascii")


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data`` (no prefix)."""
    return hashlib.sha256(data).hexdigest()


def sha256_prefixed(data: bytes) -> str:
    """``sha256:`` + lowercase hex SHA-256 of ``data``."""
    return SHA256_PREFIX + sha256_hex(data)


def canonical_sha256(value: Any) -> str:
    """``sha256:`` digest of the sorted-keys ASCII canonical JSON of ``value``.

    Example:
        >>> canonical_sha256([1, 2, 3])[:15]
        'sha256:a615eeae'
    """
    return sha256_prefixed(canonical_json_bytes(value))


def self_hash(record: dict[str, Any], field: str) -> str:
    """Canonical digest of ``record`` with its own digest ``field`` removed (Kiln's self-hash rule)."""
    return canonical_sha256({key: value for key, value in record.items() if key != field})


def strip_sha256_prefix(digest: str) -> str:
    """Return the hex part of a ``sha256:`` digest; raise ``ValueError`` if it is not one."""
    if not digest.startswith(SHA256_PREFIX):
        raise ValueError(f"expected a 'sha256:' digest, got {digest!r}")
    return digest[len(SHA256_PREFIX):]
