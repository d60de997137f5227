"""The two canonical JSON encodings Kiln uses, and the SHA-256 helpers built on them.

Kiln has two different ideas of "canonical JSON", and mixing them up silently changes digests:

* **Kiln compact** (`kiln_compact_json`): serde_json's compact output of a struct, keys in
  *declaration order*, raw UTF-8, no whitespace. Teacher identities and off-policy manifests are
  compared byte for byte in this form (reference/kiln-opd-spec.md §1.3).
* **serde_json's ``Value`` text** (`serde_json_text`): what ``serde_json::to_vec(&Value)`` writes —
  keys sorted, raw UTF-8, floats in ryu's shortest form. Kiln digests prompt lists this way (the
  checkpoint's ``data.content_sha256``, on- and off-policy).
* **Sorted-keys ASCII** (`canonical_json_bytes`, `canonical_sha256`): Python's
  ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)``. The
  HF oracle contracts hash requests, results and id lists this way (kiln-hf-oracle-spec.md §0.1).
  Floats keep Python's ``repr`` form (``300.0`` stays ``300.0``); this is not RFC 8785.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

SHA256_PREFIX = "sha256:"
_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1


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


def serde_json_text(value: Any) -> str:
    """Compact JSON exactly as ``serde_json::to_vec(&serde_json::Value)`` writes it.

    Object keys sorted by UTF-8 bytes; raw UTF-8 strings with serde's escapes; integers outside
    i64/u64 become floats (serde parses them as f64); floats in ryu's notation.

    Example:
        >>> serde_json_text({"b": [1.0, 1e20, 2e-7], "a": "é"})
        '{"a":"é","b":[1.0,1e20,2e-7]}'
    """
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value) if _I64_MIN <= value <= _U64_MAX else _ryu(float(value))
    if isinstance(value, float):
        return _ryu(value)
    if isinstance(value, str):
        value.encode("utf-8")  # a lone surrogate cannot be serialized (serde refuses it when parsing)
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(serde_json_text(item) for item in value) + "]"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: item[0].encode("utf-8"))
        return "{" + ",".join(f"{serde_json_text(k)}:{serde_json_text(v)}" for k, v in items) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _ryu(number: float) -> str:
    """serde_json's float text (the ``ryu`` crate's ``format64``): shortest digits, Rust's layout."""
    if not math.isfinite(number):
        raise ValueError("JSON has no representation for a non-finite float")
    if number == 0.0:
        return "-0.0" if math.copysign(1.0, number) < 0 else "0.0"
    sign = "-" if number < 0 else ""
    mantissa, _, exponent = repr(abs(number)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    point = len(whole) + (int(exponent) if exponent else 0)  # value = 0.<digits> × 10^point
    stripped = digits.lstrip("0")
    point -= len(digits) - len(stripped)
    digits = stripped.rstrip("0")
    length, kk = len(digits), point
    if length <= kk <= 16:  # 1234e7 -> 12340000000.0
        text = digits + "0" * (kk - length) + ".0"
    elif 0 < kk <= 16:  # 1234e-2 -> 12.34
        text = digits[:kk] + "." + digits[kk:]
    elif -5 < kk <= 0:  # 1234e-6 -> 0.001234
        text = "0." + "0" * -kk + digits
    elif length == 1:  # 1e30
        text = f"{digits}e{kk - 1}"
    else:  # 1234e30 -> 1.234e33
        text = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return sign + text
