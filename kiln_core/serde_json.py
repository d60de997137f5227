"""serde_json's bytes, written from Python: the one writer for every digest Kiln takes over JSON.

Kiln hashes what ``serde_json::to_vec`` writes in several places: a prompt list as a
``serde_json::Value`` (the checkpoint's ``data.content_sha256``: ``serde_json_text``), and eval suites
and generation settings as structs, framed by a domain [crates/kiln-eval/src/replay.rs · hash_json]:

    hash_json(domain, value) = "sha256:" + hex(SHA-256(domain ‖ u64-LE(len(bytes)) ‖ bytes))
    bytes                    = serde_json::to_vec(value)

``serde_json::to_vec`` writes struct fields in declaration order, skips the fields marked
``skip_serializing_if``, and writes ``serde_json::Value`` maps with sorted keys (its default
``BTreeMap``). Floats go through Ryū: the shortest digits that round-trip *in the declared type*
(``f32`` for ``temperature``, ``top_p`` and ``weight``; ``f64`` elsewhere) laid out by Ryū's
"pretty" rules [dtolnay/ryu src/pretty/mod.rs · format32, format64]. This module reproduces that
encoding; the post-eval suite and scorer models (``kiln_core.contracts.post_eval``) supply the field order
(``wire()`` methods).
Byte parity with a Rust build is reasoned from those sources, not measured (no Rust crates offline).
"""

from __future__ import annotations

import hashlib
import math
import struct
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any

__all__ = ["F32", "to_f32", "format_float", "rust_display_float", "encode", "json_value", "serde_json_text",
           "hash_json", "rust_debug_str"]

_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)


class F32(float):
    """A value Kiln stores as ``f32``: ``encode`` prints f32's shortest round-trip digits."""


def to_f32(value: float) -> float:
    """Round a Python float to the nearest f32 (``x as f32`` in Rust); overflow gives ±inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _shortest_decimal(value: float, single: bool) -> tuple[str, int]:
    """Digits ``d`` and exponent ``e`` with ``value == d·10^e`` in the given width, ``d`` shortest."""
    if single:
        for precision in range(9):  # 9 significant digits always round-trip an f32
            text = f"{value:.{precision}e}"
            if to_f32(float(text)) == value:
                break
    else:
        text = repr(value)  # Python's repr is the shortest f64 round-trip string
    sign, digits, exponent = Decimal(text).normalize().as_tuple()
    return "".join(map(str, digits)), int(exponent)


def format_float(value: float, *, single: bool = False) -> str:
    """Ryū's ``format32``/``format64`` layout of a finite float (serde_json writes ``null`` otherwise).

    Example:
        >>> format_float(0.7, single=True), format_float(1e16), format_float(1e-6), format_float(2.0)
        ('0.7', '1e16', '1e-6', '2.0')
    """
    if not math.isfinite(value):
        return "null"
    sign = "-" if math.copysign(1.0, value) < 0 else ""
    if value == 0:
        return sign + "0.0"
    digits, k = _shortest_decimal(abs(value), single)
    length = len(digits)
    kk = length + k  # 10^(kk-1) <= |value| < 10^kk
    widest = 13 if single else 16
    smallest = -6 if single else -5
    if 0 <= k and kk <= widest:
        body = digits + "0" * k + ".0"
    elif 0 < kk <= widest:
        body = digits[:kk] + "." + digits[kk:]
    elif smallest < kk <= 0:
        body = "0." + "0" * (-kk) + digits
    elif length == 1:
        body = f"{digits}e{kk - 1}"
    else:
        body = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return sign + body


def rust_display_float(value: float, *, single: bool = False) -> str:
    """Rust's ``{}`` of a float: shortest digits, never an exponent (``1`` for 1.0, ``inf``, ``NaN``).

    Example:
        >>> rust_display_float(-1.0), rust_display_float(0.25), rust_display_float(float("inf"))
        ('-1', '0.25', 'inf')
    """
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    sign = "-" if math.copysign(1.0, value) < 0 else ""
    if value == 0:
        return sign + "0"
    digits, exponent = _shortest_decimal(abs(value), single)
    return sign + format(Decimal(int(digits)).scaleb(exponent), "f")


def _encode_str(text: str) -> str:
    """serde_json's string escaping: ``"``, ``\\`` and C0 controls only; everything else raw UTF-8.

    Python's ``json`` without ``ensure_ascii`` escapes exactly that set the same way (``\\b \\t \\n
    \\f \\r`` short, other controls as lowercase ``\\u00xx``, as serde_json's ``ESCAPE`` table does),
    in C (``json.encoder.encode_basestring`` is what ``json.dumps(text, ensure_ascii=False)`` calls):
    admission writes every prompt of a corpus through here.
    """
    return encode_basestring(text)


def _encode(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, F32):
        out.append(format_float(float(value), single=True))
    elif isinstance(value, float):
        out.append(format_float(value))
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, str):
        out.append(_encode_str(value))
    elif isinstance(value, dict):
        out.append("{")
        for index, (key, item) in enumerate(value.items()):
            if index:
                out.append(",")
            out.append(_encode_str(key))
            out.append(":")
            _encode(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _encode(item, out)
        out.append("]")
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as Kiln wire JSON")


def encode(value: Any) -> bytes:
    """``serde_json::to_vec`` of an already-ordered value (dicts keep their insertion order).

    Example:
        >>> encode({"b": F32(0.7), "a": [1, None, "x"]})
        b'{"b":0.7,"a":[1,null,"x"]}'
    """
    out: list[str] = []
    _encode(value, out)
    return "".join(out).encode("utf-8")


def json_value(value: Any) -> Any:
    """A parsed JSON document as a ``serde_json::Value`` serializes: object keys sorted.

    Integers outside i64/u64 are floats in serde_json (no ``arbitrary_precision``).
    """
    if isinstance(value, dict):
        return {key: json_value(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [json_value(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool) and not _I64_MIN <= value <= _U64_MAX:
        try:
            return float(value)
        except OverflowError:  # beyond a double: ±infinity, as a literal too long for int() or 1e400 parses
            return math.inf if value > 0 else -math.inf
    return value


def serde_json_text(value: Any) -> str:
    """``serde_json::to_vec(&serde_json::Value)`` of a parsed JSON document, as text: object keys
    sorted, raw UTF-8, floats in Ryū's layout (a lone surrogate cannot be written: UnicodeEncodeError).

    Example:
        >>> serde_json_text({"b": [1.0, 1e20, 2e-7], "a": "é"})
        '{"a":"é","b":[1.0,1e20,2e-7]}'
    """
    return encode(json_value(value)).decode("utf-8")


def hash_json(domain: bytes, value: Any) -> str:
    """Kiln's framed digest: ``sha256:`` hex of ``domain ‖ u64-LE(len) ‖ serde bytes``.

    Example:
        >>> hash_json(b"d\\0", [])[:15]
        'sha256:bed35e9d'
    """
    body = encode(value)
    digest = hashlib.sha256(domain + len(body).to_bytes(8, "little") + body).hexdigest()
    return "sha256:" + digest


def rust_debug_str(text: str) -> str:
    """Rust's ``{:?}`` of a string: quoted, with ``\\``/``"``/control characters escaped."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif char in "\n\r\t\0":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}[char])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{{{code:x}}}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)
