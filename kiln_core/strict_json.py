"""Strict JSON parsing (Kiln's ``scripts/qualification/strict_json.py``) and serde_json's nesting limit, for every reader.

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
  "non-canonical float literal";
* nesting too deep for Python's recursion → ``nesting_too_deep``.

**Nesting.** Kiln reads its JSON with serde_json, whose deserializer starts with
``remaining_depth: 128``, decrements it on entering each array or object and refuses the container
that brings it to zero (``check_recursion!`` in serde_json's ``src/de.rs``): 127 nested containers
parse, the 128th is refused. ``check_nesting`` (parsed values) and ``check_text_nesting`` (raw
text, strings skipped) apply that limit wherever a reader must refuse what Kiln refuses; both raise
``NestingTooDeep``, a ``Rejection`` with the stable code ``nesting_too_deep``.

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

import numpy as np

from kiln_core.errors import Rejection

MAX_INTEGER_DIGITS = 4096
SERDE_JSON_RECURSION_LIMIT = 128
"""serde_json's starting ``remaining_depth``: the 128th nested array or object is refused."""

STRICT_JSON_RULES = ("invalid_json", "duplicate_key", "non_finite_number", "nesting_too_deep")

# Everything but the bytes that open or close a string or container.
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'"[]{}')


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
        raise StrictJsonError("nesting_too_deep", "document nests too deeply for the parser's recursion limit") from None


# --- nesting -------------------------------------------------------------------------------------


class NestingTooDeep(Rejection):
    """JSON that nests arrays and objects as deep as serde_json's recursion limit, or deeper.

    Attributes:
        depth: How deep the document nests (at least the limit).
    """

    def __init__(self, message: str, *, depth: int | None = None, line: int | None = None,
                 field: str | None = None, file: str | None = None) -> None:
        super().__init__("nesting_too_deep", message, line=line, field=field, file=file)
        self.depth = depth


def too_deep(depth: int, *, limit: int = SERDE_JSON_RECURSION_LIMIT, where: str = "the document",
             line: int | None = None, file: str | None = None) -> NestingTooDeep:
    """The one ``nesting_too_deep`` rejection every reader raises (also readers that count depth
    themselves, like the pipeline YAML's event stream).

    Example:
        >>> too_deep(128, where="pipeline spec p.yaml", line=3).code
        'nesting_too_deep'
    """
    return NestingTooDeep(
        f"{where} nests {depth} arrays/objects deep; Kiln's parser (serde_json) refuses the {limit}th nested "
        f"container, so at most {limit - 1} levels are allowed",
        depth=depth, line=line, file=file,
    )


def check_nesting(value: Any, *, limit: int = SERDE_JSON_RECURSION_LIMIT, where: str = "the document",
                  file: str | None = None) -> None:
    """Refuse a parsed JSON value that nests ``limit`` containers deep, as serde_json would.

    Args:
        value: A parsed value (dicts, lists, scalars).
        limit: The recursion limit; a value nesting ``limit`` containers is refused.
        where: How the message names the document.
        file: The file the error names, if any.

    Raises:
        NestingTooDeep: With the document's depth.

    Example:
        >>> check_nesting([[[]]], limit=4)
        >>> check_nesting([[[[]]]], limit=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        kiln_core.strict_json.NestingTooDeep: [nesting_too_deep] the document nests 4 arrays/objects deep; ...
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest >= limit:
            raise too_deep(deepest, limit=limit, where=where, file=file)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def text_nesting_depth(data: bytes | str) -> int:
    """How deep JSON text nests arrays and objects, brackets inside strings not counted.

    Works on a whole buffer of JSON lines (each balanced) or on the prefix of one line, in a few
    C-speed passes: escaped quotes (those after an odd run of backslashes) are blanked first, then
    everything but quotes and brackets is dropped; adjacent quotes are dropped next (removing a pair
    keeps every other quote's parity), and only when quotes remain — strings holding brackets — does
    a parity scan skip string contents.

    Example:
        >>> text_nesting_depth('{"a": [1, "]]"], "b": {}}')
        2
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    if b"\\" in data:
        data = _escaped_quotes_blanked(data)
    structural = data.translate(None, _NOT_STRUCTURAL).replace(b'""', b"")
    codes = np.frombuffer(structural, dtype=np.uint8)
    if b'"' in structural:
        quotes = codes == ord('"')
        inside = np.bitwise_xor.accumulate(quotes.view(np.uint8)).astype(bool)
        codes = codes[~quotes & ~inside]
    if not codes.size:
        return 0
    opens = (codes == ord("[")) | (codes == ord("{"))
    return int(np.cumsum(opens.astype(np.int32) * 2 - 1).max())


def _escaped_quotes_blanked(data: bytes) -> bytearray:
    """A copy of ``data`` with every escaped quote — one right after an odd run of backslashes — made
    a space. Found with numpy over the backslash positions: replacing escape pairs in the bytes took
    two more copies of the whole corpus, the slowest part of the scan when text holds escapes."""
    codes = np.frombuffer(data, dtype=np.uint8)
    backslashes = np.flatnonzero(codes == ord("\\"))
    breaks = np.flatnonzero(np.diff(backslashes) != 1)  # a run of backslashes ends after each break
    run_starts = backslashes[np.concatenate([[0], breaks + 1])]
    run_ends = backslashes[np.concatenate([breaks, [backslashes.size - 1]])] + 1  # one past the run
    after_odd_run = run_ends[((run_ends - run_starts) % 2 == 1) & (run_ends < codes.size)]
    escaped_quotes = after_odd_run[codes[after_odd_run] == ord('"')]
    blanked = bytearray(data)
    np.frombuffer(blanked, dtype=np.uint8)[escaped_quotes] = ord(" ")
    return blanked


def check_text_nesting(text: bytes | str, *, limit: int = SERDE_JSON_RECURSION_LIMIT, where: str = "the document",
                       file: str | None = None) -> None:
    """``check_nesting`` for raw JSON text (no need to parse it first).

    Raises:
        NestingTooDeep: With the text's depth.
    """
    depth = text_nesting_depth(text)
    if depth >= limit:
        raise too_deep(depth, limit=limit, where=where, file=file)


def loads_nesting_limited(text: str, *, limit: int = SERDE_JSON_RECURSION_LIMIT, where: str = "the document",
                          file: str | None = None, **json_options: Any) -> Any:
    """``json.loads`` that refuses what serde_json refuses for depth, in serde_json's reading order.

    A too-deep container is reported even when a syntax error follows it (serde_json reads left to
    right and stops at the first problem); a syntax error before it stays a ``json.JSONDecodeError``.

    Args:
        text: One JSON document.
        limit: The recursion limit.
        where: How the message names the document.
        file: The file the error names, if any.
        **json_options: Passed to ``json.loads`` (hooks).

    Raises:
        NestingTooDeep: The document nests ``limit`` containers or more.
        json.JSONDecodeError: Not valid JSON.

    Example:
        >>> loads_nesting_limited('{"a": [1, 2]}')
        {'a': [1, 2]}
    """
    try:
        value = json.loads(text, **json_options)
    except RecursionError:
        raise NestingTooDeep(
            f"{where} nests arrays/objects deeper than Python can parse, beyond serde_json's limit of {limit - 1} levels",
            file=file) from None
    except json.JSONDecodeError as error:
        check_text_nesting(text[: error.pos], limit=limit, where=where, file=file)
        raise
    check_text_nesting(text, limit=limit, where=where, file=file)
    return value

