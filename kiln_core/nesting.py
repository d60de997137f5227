"""Nesting depth of decoded documents: deeper than Kiln's parser allows is a rejection, not a crash.

serde_json (Kiln's JSON parser) starts with ``remaining_depth = 128`` and fails when a nested array
or object brings it to 0, so 127 levels parse and 128 do not. The readers of our own files (pipeline
YAML, OPD request JSON) apply the same limit, so a document either loads everywhere or is refused
with ``nesting_too_deep`` — never a ``RecursionError`` traceback.

Example:
    >>> depth([[{"a": [1]}]])
    4
"""

from __future__ import annotations

from typing import Any

from kiln_core.errors import Rejection

MAX_NESTING_DEPTH = 127
"""Deepest nesting of arrays/objects that parses (serde_json's recursion limit 128, minus one)."""


class NestingTooDeep(Rejection, ValueError):
    """A document nested deeper than ``MAX_NESTING_DEPTH`` (code ``nesting_too_deep``)."""

    def __init__(self, what: str, *, file: str | None = None, line: int | None = None) -> None:
        super().__init__("nesting_too_deep",
                         f"{what} is nested deeper than {MAX_NESTING_DEPTH} levels of arrays and objects",
                         file=file, line=line)


def depth(value: Any) -> int:
    """Levels of list/dict nesting in a decoded value (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def check_depth(value: Any, what: str, *, file: str | None = None) -> Any:
    """Return ``value`` unless it nests deeper than ``MAX_NESTING_DEPTH``.

    Raises:
        NestingTooDeep: ``nesting_too_deep``.
    """
    if depth(value) > MAX_NESTING_DEPTH:
        raise NestingTooDeep(what, file=file)
    return value
