"""Reading an answer out of a completion, the way Kiln's scorers do.

Each helper ports one Kiln routine; the Rust semantics that Python does differently are handled
explicitly (Unicode ``White_Space`` for ``trim``/``split_whitespace``, serde_json's typed equality
where ``1 != 1.0`` and ``true != 1``, serde_json's JSON Pointer index rules).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "WHITE_SPACE",
    "ThinkingSplit",
    "split_thinking",
    "rust_trim",
    "rust_split_whitespace",
    "extract_last_number",
    "parse_target_number",
    "extract_json_body",
    "parse_json_value",
    "json_pointer_exists",
    "json_equal",
    "json_kind",
    "detect_choice",
]

# Unicode White_Space: what Rust's `str::trim` and `split_whitespace` strip. Python's `str.strip()`
# also strips U+001C..U+001F, which Rust keeps.
WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
_WHITE_SPACE_RUN = re.compile(f"[{re.escape(WHITE_SPACE)}]+")


def rust_trim(text: str) -> str:
    """``str::trim``."""
    return text.strip(WHITE_SPACE)


def rust_split_whitespace(text: str) -> list[str]:
    """``str::split_whitespace`` (no empty parts)."""
    return [part for part in _WHITE_SPACE_RUN.split(text) if part]


# ---- reasoning blocks [crates/kiln-eval/src/qwen3.rs · split_thinking]


@dataclass(frozen=True)
class ThinkingSplit:
    reasoning: str | None
    answer: str
    had_thinking: bool
    unclosed: bool


def _trim_one_leading_newline(text: str) -> str:
    for prefix in ("\n\n", "\n"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def split_thinking(raw: str) -> ThinkingSplit:
    """Separate a leading ``<think>…</think>`` block from the answer [qwen3.rs · split_thinking].

    Example:
        >>> split_thinking("<think>\\nhmm\\n</think>\\n\\nParis").answer
        'Paris'
    """
    trimmed = raw.lstrip(WHITE_SPACE)
    open_index = raw.find("<think>")
    if open_index < 0 or rust_trim(raw[:open_index]):
        return ThinkingSplit(None, _trim_one_leading_newline(trimmed), False, False)
    body = raw[open_index + len("<think>"):]
    close_index = body.find("</think>")
    if close_index < 0:
        return ThinkingSplit(body.strip("\n"), "", True, True)
    after = body[close_index + len("</think>"):].lstrip("\n")
    return ThinkingSplit(body[:close_index].strip("\n"), _trim_one_leading_newline(after), True, False)


# ---- numeric_tolerance [crates/kiln-eval/src/scorers/numeric.rs · parse_number, extract_last_number]


def parse_target_number(target: str) -> float | None:
    """Keep only ``0-9 . - + e E`` and parse what is left (Kiln's ``parse_number``)."""
    cleaned = "".join(c for c in target if c.isascii() and (c.isdigit() or c in ".-+eE"))
    return _rust_parse_f64(cleaned)


def _rust_parse_f64(text: str) -> float | None:
    # The filtered alphabet leaves no room for Rust/Python differences except the empty string and
    # forms Python also refuses ("e5", "1e", "."), so float() decides like `str::parse::<f64>`.
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def extract_last_number(text: str) -> float | None:
    """The last signed decimal number in ``text``, after dropping ``,`` and blanking ``$``/``%``.

    Example:
        >>> extract_last_number("price is $1,234.50"), extract_last_number("none")
        (1234.5, None)
    """
    scrubbed = text.replace(",", "").replace("$", " ").replace("%", " ").encode("utf-8")
    last = None
    i, size = 0, len(scrubbed)
    digit = frozenset(b"0123456789")
    while i < size:
        c = scrubbed[i]
        signed = c in b"-+" and i + 1 < size and (scrubbed[i + 1] in digit or scrubbed[i + 1] == ord("."))
        if c in digit or c == ord(".") or signed:
            start = i
            if c in b"-+":
                i += 1
            saw_digit = saw_dot = saw_exp = False
            while i < size:
                ch = scrubbed[i]
                if ch in digit:
                    saw_digit, i = True, i + 1
                elif ch == ord(".") and not saw_dot and not saw_exp:
                    saw_dot, i = True, i + 1
                elif ch in b"eE" and saw_digit and not saw_exp:
                    saw_exp, i = True, i + 1
                    if i < size and scrubbed[i] in b"-+":
                        i += 1
                else:
                    break
            if saw_digit:
                value = _rust_parse_f64(scrubbed[start:i].decode("ascii"))
                if value is not None:
                    last = value
        else:
            i += 1
    return last


# ---- json_validity [crates/kiln-eval/src/scorers/json_validity.rs · score, extract_json_body, canonicalize]


def extract_json_body(text: str) -> str:
    """From the first ``{``/``[`` to its matching closer (strings and escapes respected), else all."""
    starts = [pos for pos in (text.find("{"), text.find("[")) if pos >= 0]
    if not starts:
        return text
    start = min(starts)
    opener = text[start]
    closer = "}" if opener == "{" else "]"
    depth, in_string, escaped = 0, False, False
    for pos in range(start, len(text)):
        char = text[pos]
        if escaped:
            escaped = False
            continue
        if in_string:
            if char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char == opener:
            depth += 1
        elif char == closer:
            depth -= 1
            if depth == 0:
                return text[start:pos + 1]
    return text[start:]


def _refuse_constant(literal: str) -> Any:
    raise ValueError(f"{literal} is not JSON")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value


def parse_json_value(text: str) -> Any:
    """``serde_json::from_str::<Value>``: NaN/Infinity and out-of-range numbers refused.

    Raises:
        ValueError: With the parser's reason.
    """
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def json_pointer_exists(document: Any, pointer: str) -> bool:
    """``Value::pointer(path).is_some()`` with serde_json's RFC 6901 rules."""
    if pointer == "":
        return True
    if not pointer.startswith("/"):
        return False
    target = document
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict):
            if token not in target:
                return False
            target = target[token]
        elif isinstance(target, list):
            if token.startswith("+") or (token.startswith("0") and len(token) != 1) or not token.isdigit():
                return False
            index = int(token)
            if index >= len(target):
                return False
            target = target[index]
        else:
            return False
    return True


def _typed(value: Any) -> Any:
    # serde_json::Value equality: numbers compare within their kind (1 != 1.0), bool is not a number.
    if isinstance(value, dict):
        return ("object", tuple(sorted((key, _typed(item)) for key, item in value.items())))
    if isinstance(value, list):
        return ("array", tuple(_typed(item) for item in value))
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value)
    return (type(value).__name__, value)


def json_equal(left: Any, right: Any) -> bool:
    """Structural equality of two parsed documents as serde_json compares ``Value``s."""
    return _typed(left) == _typed(right)


def json_kind(value: Any) -> str:
    """``value_kind``: null, bool, number, string, array or object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


# ---- multiple_choice [crates/kiln-eval/src/scorers/multiple_choice.rs · detect_answer, next_letter]

_MARKERS = ("ANSWER:", "ANSWER IS", "FINAL ANSWER:", "FINAL ANSWER IS")


def _next_label(text: str, valid: list[str]) -> str | None:
    # ASCII alphanumeric runs are tokens; every other byte (non-ASCII included) separates them.
    for token in re.findall(rb"[A-Za-z0-9]+", text.encode("utf-8")):
        label = token.decode("ascii")
        if label in valid:
            return label
    return None


def detect_choice(text: str, valid: list[str]) -> str | None:
    """The answer label: after an ``Answer:``-style marker, else leading, else anywhere.

    Example:
        >>> detect_choice("I think (C) is correct", ["A", "B", "C", "D"])
        'C'
    """
    upper = text.upper()
    for marker in _MARKERS:
        index = upper.find(marker)
        if index >= 0:
            label = _next_label(upper[index + len(marker):], valid)
            if label is not None:
                return label
    label = _next_label(upper.lstrip(WHITE_SPACE), valid)
    if label is not None:
        return label
    return _next_label(upper, valid)
