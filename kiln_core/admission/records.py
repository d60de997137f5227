"""Parsing corpus lines into a columnar ``ParsedCorpus``.

Two parsers produce the same result:

* the **fast path** (``columnar.py``) hands the whole buffer to ``pyarrow.json`` with an explicit
  schema, so the millions of top-K candidates become flat numpy arrays without a Python object
  each. It accepts only corpora whose every field has the expected JSON type; at the first sign of
  anything else it steps aside;
* the **exact path** parses line by line in Python and is the authority on structural errors: it
  finds the first bad line and names the field (``invalid_json``, ``not_an_object``,
  ``invalid_record``) and handles everything the fast path declines (content parts, tool calls,
  Unicode whitespace around a line, duplicate keys).

Manifest-position rules (``manifest_not_first``, ``manifest_invalid``, ``manifest_not_canonical``)
are applied to either result by ``check_manifest_records``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln_core.admission.source import LineIndex
from kiln_core.contracts.identity import MANIFEST_SCHEMA
from kiln_core.errors import AdmissionError, Rejection
from kiln_core.tokenization import Conversation, Segment, TokenizationError, normalize_content

U32_MAX = 2**32 - 1
SEGMENT_KINDS = ("context", "action", "observation")
# Rust's char::is_whitespace, which Kiln's line trim uses (Python's str.strip also strips \x1c-\x1f).
RUST_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


@dataclass
class ParsedCorpus:
    """Every non-blank line of a corpus, split into the manifest and columnar examples.

    Attributes:
        manifest_records: ``(line, raw line text, decoded object)`` for each manifest-like record.
        example_lines: ``int64 [N]`` physical line of each example.
        first_example_line: Line of the first example (manifest-first rule), or None.
        conversations: One ``Conversation`` per example (for tokenization).
        messages_count: ``int64 [N]``.
        response_empty: ``bool [N]``.
        token_offsets: ``int64 [N+1]`` teacher tokens of example i are ``token_offsets[i]:[i+1]``.
        declared_token_ids: ``int64 [T]``; −1 where ``token_id`` is absent.
        candidate_offsets: ``int64 [T+1]`` over the flat candidate arrays.
        candidate_ids: ``int64 [C]``.
        candidate_logprobs: ``float64 [C]`` (f32 rounding happens in the rules).
        numeric_logits: Whether any teacher token carries a ``logprob`` or a non-empty ``top_logprobs``.
        parser: ``"fast"`` or ``"exact"`` (for benchmarks and logs).
    """

    manifest_records: list[tuple[int, str, Any]] = field(default_factory=list)
    example_lines: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    first_example_line: int | None = None
    conversations: list[Conversation] = field(default_factory=list)
    messages_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    response_empty: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    token_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    declared_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    candidate_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    candidate_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    candidate_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    numeric_logits: bool = False
    parser: str = "exact"

    @property
    def num_examples(self) -> int:
        return int(self.example_lines.shape[0])


# --- exact path ---------------------------------------------------------------------------------


class RecordError(Rejection):
    """A field of an example record with the wrong type or shape (``invalid_record``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__("invalid_record", message, field=where)

    def __str__(self) -> str:
        return f"`{self.field}` {self.message}"


class JsonObject(dict):
    """A decoded JSON object that remembers which keys appeared more than once (last value kept)."""

    duplicates: frozenset[str] = frozenset()


def json_object(pairs: list[tuple[str, Any]]) -> JsonObject:
    """``object_pairs_hook`` that keeps duplicate keys visible to the field checks.

    serde (Kiln's parser) refuses a *known* field given twice but ignores duplicates among fields it
    ignores, so duplicates are only an error where a field rule looks at them.
    """
    result = JsonObject(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        result.duplicates = frozenset(key for key, _ in pairs if key in seen or seen.add(key))
    return result


def _integer(literal: str) -> int | float:
    """A JSON integer literal; one too long for ``int()`` (4,300 digits) is a float, ±inf, as pyarrow reads it."""
    return int(literal) if len(literal) <= 4000 else float(literal)


def decode_json_line(text: str) -> Any:
    """Decode one JSON line, objects as ``JsonObject``."""
    return json.loads(text, object_pairs_hook=json_object, parse_int=_integer)


def check_known_fields(value: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """Refuse a known field given twice (``invalid_record``)."""
    repeated = sorted(set(getattr(value, "duplicates", ())) & set(known))
    if repeated:
        prefix = f"{where}." if where else ""
        raise RecordError(f"{prefix}{repeated[0]}", "is given more than once")


RECORD_FIELDS = ("id", "messages", "teacher_response", "teacher_tokens", "trajectory", "metadata")
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id", "tool_calls")
TOKEN_FIELDS = ("token", "token_id", "logprob", "top_logprobs")
CANDIDATE_FIELDS = ("token_id", "logprob")
SEGMENT_FIELDS = ("role", "content", "kind", "tool_call_id", "warning_prefix_len")


def parse_exact(data: bytes, lines: LineIndex) -> ParsedCorpus:
    text_lines = data.decode("utf-8").split("\n")
    if text_lines and text_lines[-1] == "" and data.endswith(b"\n"):
        text_lines.pop()
    builder = _ColumnBuilder()
    parsed = ParsedCorpus(parser="exact")
    for number, raw in enumerate(text_lines, start=1):
        if raw.endswith("\r") and number <= len(lines) and lines.ends[number - 1] < len(data):
            raw = raw[:-1]
        trimmed = raw.strip(RUST_WHITESPACE)
        if not trimmed:
            continue
        try:
            value = decode_json_line(trimmed)
        except ValueError as error:
            raise AdmissionError("invalid_json", number, f"line is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise AdmissionError("not_an_object", number, f"line is a JSON {type(value).__name__}, not an object")
        if value.get("schema") == MANIFEST_SCHEMA:
            parsed.manifest_records.append((number, raw, value))
            continue
        if parsed.first_example_line is None:
            parsed.first_example_line = number
        try:
            builder.add(number, value)
        except RecordError as error:
            raise AdmissionError("invalid_record", number, f"example {len(builder.lines)}: {error}") from None
    builder.finish(parsed)
    return parsed


class _ColumnBuilder:
    """Accumulates validated example records into flat columns."""

    def __init__(self) -> None:
        self.lines: list[int] = []
        self.conversations: list[Conversation] = []
        self.messages_count: list[int] = []
        self.response_empty: list[bool] = []
        self.tokens_per_example: list[int] = []
        self.declared: list[int] = []
        self.counts: list[int] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.numeric = False

    def add(self, line: int, record: dict[str, Any]) -> None:
        check_known_fields(record, RECORD_FIELDS, "")
        messages = require_field(record, "messages", list)
        normalized = [parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        response = require_field(record, "teacher_response", str)
        if "id" in record and record["id"] is not None and not isinstance(record["id"], str):
            raise RecordError("id", "must be a string")
        trajectory = record.get("trajectory")
        segments = None
        if trajectory is not None:
            if not isinstance(trajectory, list):
                raise RecordError("trajectory", "must be an array")
            segments = [parse_segment(s, f"trajectory[{i}]") for i, s in enumerate(trajectory)]
        tokens = record.get("teacher_tokens", [])
        if not isinstance(tokens, list):
            raise RecordError("teacher_tokens", "must be an array")
        for k, token in enumerate(tokens):
            self._add_token(token, f"teacher_tokens[{k}]")
        self.lines.append(line)
        self.conversations.append(Conversation(messages=normalized, teacher_response=response, trajectory=segments or None))
        self.messages_count.append(len(messages))
        self.response_empty.append(response == "")
        self.tokens_per_example.append(len(tokens))

    def _add_token(self, token: Any, where: str) -> None:
        if not isinstance(token, dict):
            raise RecordError(where, "must be an object")
        check_known_fields(token, TOKEN_FIELDS, where)
        declared = token.get("token_id")
        self.declared.append(-1 if declared is None else _u32(declared, f"{where}.token_id"))
        if token.get("token") is not None and not isinstance(token["token"], str):
            raise RecordError(f"{where}.token", "must be a string")
        if token.get("logprob") is not None:
            _number(token["logprob"], f"{where}.logprob")
            self.numeric = True
        if "top_logprobs" not in token:
            raise RecordError(f"{where}.top_logprobs", "is required")
        candidates = token["top_logprobs"]
        if not isinstance(candidates, list):
            raise RecordError(f"{where}.top_logprobs", "must be an array")
        if candidates:
            self.numeric = True
        for j, candidate in enumerate(candidates):
            place = f"{where}.top_logprobs[{j}]"
            if not isinstance(candidate, dict):
                raise RecordError(place, "must be an object")
            check_known_fields(candidate, CANDIDATE_FIELDS, place)
            if "token_id" not in candidate or "logprob" not in candidate:
                raise RecordError(place, "needs `token_id` and `logprob`")
            self.ids.append(_u32(candidate["token_id"], f"{place}.token_id"))
            self.logprobs.append(_number(candidate["logprob"], f"{place}.logprob"))
        self.counts.append(len(candidates))

    def finish(self, parsed: ParsedCorpus) -> None:
        parsed.example_lines = np.asarray(self.lines, dtype=np.int64)
        parsed.conversations = self.conversations
        parsed.messages_count = np.asarray(self.messages_count, dtype=np.int64)
        parsed.response_empty = np.asarray(self.response_empty, dtype=bool)
        parsed.token_offsets = offsets_of(self.tokens_per_example)
        parsed.declared_token_ids = np.asarray(self.declared, dtype=np.int64)
        parsed.candidate_offsets = offsets_of(self.counts)
        parsed.candidate_ids = np.asarray(self.ids, dtype=np.int64)
        parsed.candidate_logprobs = np.asarray(self.logprobs, dtype=np.float64)
        parsed.numeric_logits = self.numeric


def offsets_of(counts: list[int] | np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)


def require_field(record: dict[str, Any], key: str, kind: type) -> Any:
    if key not in record:
        raise RecordError(key, "is required")
    value = record[key]
    if not isinstance(value, kind):
        raise RecordError(key, f"must be {'an array' if kind is list else 'a string'}")
    return value


def _u32(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U32_MAX:
        raise RecordError(where, "must be an unsigned 32-bit integer")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(where, "must be a number")
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range: infinite, as the fast parser reads it
        return math.inf if value > 0 else -math.inf


def parse_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RecordError(where, "must be an object")
    check_known_fields(message, MESSAGE_FIELDS, where)
    role = message.get("role")
    if not isinstance(role, str):
        raise RecordError(f"{where}.role", "must be a string")
    try:
        content = normalize_content(message.get("content"))
    except TokenizationError as error:
        raise RecordError(f"{where}.content", str(error)) from None
    normalized = {key: value for key, value in message.items() if value is not None}
    normalized["role"] = role
    normalized["content"] = content
    return normalized


def parse_segment(segment: Any, where: str) -> Segment:
    if not isinstance(segment, dict):
        raise RecordError(where, "must be an object")
    check_known_fields(segment, SEGMENT_FIELDS, where)
    role = segment.get("role")
    if not isinstance(role, str):
        raise RecordError(f"{where}.role", "must be a string")
    content = segment.get("content")
    if not isinstance(content, str):
        raise RecordError(f"{where}.content", "must be a string")
    kind = segment.get("kind")
    if kind is None:
        kind = "context"
    if kind not in SEGMENT_KINDS:
        raise RecordError(f"{where}.kind", f"must be one of {list(SEGMENT_KINDS)}")
    tool_call_id = segment.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise RecordError(f"{where}.tool_call_id", "must be a string")
    prefix = segment.get("warning_prefix_len")
    prefix = 0 if prefix is None else _u32(prefix, f"{where}.warning_prefix_len")
    if prefix > len(content.encode("utf-8")):
        raise RecordError(f"{where}.warning_prefix_len", "exceeds the content's byte length")
    return Segment(role=role, content=content, kind=kind, tool_call_id=tool_call_id, warning_prefix_len=prefix)
