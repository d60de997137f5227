"""Strict JSON parsing for oracle requests, receipts and results (kiln-hf-oracle-spec.md §0.6).

Python's ``json`` module is lenient in ways that change what a document *means*: it keeps the last of
two duplicate keys, accepts ``NaN``/``Infinity``, and silently rounds number literals that no float
can represent. Every hash in the oracle contracts is computed over the parsed value, so a lenient
parse could make two different files hash alike. This loader refuses those inputs instead.

Rules and the ``StrictJsonError.rule`` each one raises:

* invalid UTF-8, invalid JSON syntax, an integer literal longer than 4096 digits → ``invalid_json``;
* the same key twice in one object → ``duplicate_key``;
* ``NaN``, ``Infinity``, ``-Infinity``, or a literal that overflows to infinity → ``non_finite_number``;
* a float literal that is not exactly the value of the float it parses to (``0.10000000000000001``,
  or a non-zero literal that underflows to ``0.0``) → ``invalid_json``. We chose not to add a
  separate rule so the oracle's list of stable rejection names stays as published; the message says
  "non-canonical float literal".

Example:
    >>> loads_strict('{"a": 300.0, "b": 1e-07}')
    {'a': 300.0, 'b': 1e-07}
    >>> loads_strict('{"a": 1, "a": 2}')
    Traceback (most recent call last):
    ...
    kiln_core.strict_json.StrictJsonError: duplicate_key: duplicate object key 'a'
"""

from __future__ import annotations

import json
import math
from decimal import Decimal, InvalidOperation
from typing import Any

from kiln_core.errors import Rejection

MAX_INTEGER_DIGITS = 4096

STRICT_JSON_RULES = ("invalid_json", "duplicate_key", "non_finite_number")


class StrictJsonError(Rejection, ValueError):
    """A document that strict JSON parsing refuses.

    Attributes:
        rule: One of ``STRICT_JSON_RULES`` (also ``code``).
        message: Human-readable detail naming the offending key or literal.
    """

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(rule, message)
        self.rule = rule

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise StrictJsonError("duplicate_key", f"duplicate object key {key!r}")
        result[key] = value
    return result


def _reject_constant(literal: str) -> Any:
    raise StrictJsonError("non_finite_number", f"non-finite number {literal} is not allowed")


def _exact_float(literal: str) -> float:
    try:
        exact = Decimal(literal)
        value = float(literal)
    except (InvalidOperation, ValueError, OverflowError):
        raise StrictJsonError("invalid_json", f"invalid number literal {literal[:40]!r}") from None
    if not math.isfinite(value):
        raise StrictJsonError("non_finite_number", f"number literal {literal[:40]!r} overflows to infinity")
    # Decimal comparison is numeric, so "1.50" equals 1.5 but "0.10000000000000001" does not equal
    # the double 0.1; an underflowing non-zero literal compares unequal to 0.0 the same way.
    if Decimal(repr(value)) != exact:
        raise StrictJsonError(
            "invalid_json", f"non-canonical float literal {literal[:40]!r} is not exactly representable"
        )
    return value


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise StrictJsonError("invalid_json", f"integer literal exceeds {MAX_INTEGER_DIGITS} digits")
    return int(literal)


def loads_strict(payload: str | bytes | bytearray) -> Any:
    """Parse one JSON document under the strict rules of this module.

    Args:
        payload: The document; bytes are decoded as UTF-8 (a BOM is refused by ``json``).

    Returns:
        The parsed value (dicts, lists, str, int, float, bool, None).

    Raises:
        StrictJsonError: With ``rule`` in ``STRICT_JSON_RULES``.

    Example:
        >>> loads_strict(b'[1, 2.5, "x"]')
        [1, 2.5, 'x']
    """
    if isinstance(payload, (bytes, bytearray)):
        try:
            payload = bytes(payload).decode("utf-8")
        except UnicodeDecodeError as error:
            raise StrictJsonError("invalid_json", f"not valid UTF-8 at byte {error.start}") from None
    try:
        return json.loads(
            payload,
            object_pairs_hook=_unique_object,
            parse_constant=_reject_constant,
            parse_float=_exact_float,
            parse_int=_bounded_int,
        )
    except json.JSONDecodeError as error:
        raise StrictJsonError("invalid_json", f"{error.msg} at line {error.lineno} column {error.colno}") from None
    except RecursionError:
        raise StrictJsonError("invalid_json", "document nests too deeply") from None
