"""Parsing corpus lines into a ``ParsedCorpus``: the dispatcher, the exact parser and the field rules.

Two parsers produce the same result:

* the **fast path** (``columnar.py``) hands the whole buffer to ``pyarrow.json`` with an explicit
  schema. It accepts only corpora whose every field has the expected JSON type; at the first sign
  of anything else it steps aside;
* the **exact path** (here) reads line by line, as Kiln does, and is the authority on errors: the
  first line Kiln would fail on is the line reported, whether it breaks JSON (``invalid_json``,
  ``nesting_too_deep``, ``not_an_object``), the example record's shape (``invalid_record``) or a
  manifest rule (``manifest_not_first``, ``manifest_invalid``, ``manifest_not_canonical``).

The field rules are Kiln's serde derives (opd.rs ``OffPolicyDistillationExample``,
``TeacherActionToken``, ``TeacherTopLogprob``; trajectory.rs ``TurnSegment``; kiln-core
``ChatMessage``): a required field may not be missing or null, an ``Option`` field may be null, a
``Vec`` field with ``#[serde(default)]`` may be missing but not null, a ``u32`` is an integer in
``0..2**32``, a ``usize`` one in ``0..2**64``, an enum is one of its names (never null), a known field
given twice is refused and unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln_core.admission import columnar
from kiln_core.admission.manifest import check_manifest_record, check_manifest_records
from kiln_core.admission.parsed import (
    RUST_WHITESPACE,
    SEGMENT_KINDS,
    U32_MAX,
    U64_MAX,
    ParsedCorpus,
    decode_json_line,
    offsets_of,
)
from kiln_core.admission.source import LineIndex, index_lines
from kiln_core.chat_template import Conversation, Segment, TokenizationError, normalize_content
from kiln_core.contracts.identity import MANIFEST_SCHEMA
from kiln_core.errors import AdmissionError, Rejection
from kiln_core.kiln_prompts import KilnPromptDigest
from kiln_core.strict_json import NestingTooDeep

RECORD_FIELDS = ("id", "messages", "teacher_response", "teacher_tokens", "trajectory", "metadata")
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id", "tool_calls")
TOKEN_FIELDS = ("token", "token_id", "logprob", "top_logprobs")
CANDIDATE_FIELDS = ("token_id", "logprob")
SEGMENT_FIELDS = ("role", "content", "kind", "tool_call_id", "warning_prefix_len")


def parse_corpus(data: bytes, *, kiln_strict: bool = False) -> ParsedCorpus:
    """Parse corpus bytes (already checked to be UTF-8) into a ``ParsedCorpus`` with its manifest checked.

    Args:
        data: The corpus bytes.
        kiln_strict: Accept only Kiln's vLLM protocol in the manifest.

    Raises:
        AdmissionError: The first line Kiln would fail on: ``invalid_json``, ``nesting_too_deep``,
            ``not_an_object``, ``invalid_record`` or a manifest rule.
    """
    lines = index_lines(data)
    parsed = columnar.parse_columnar(data, lines)
    if parsed is None:
        return _parse_exact(data, lines, kiln_strict)
    parsed.manifest = check_manifest_records(parsed.manifest_records, parsed.first_example_line, kiln_strict=kiln_strict)
    return parsed


# --- exact path ---------------------------------------------------------------------------------


class RecordError(Rejection):
    """A field of an example record with the wrong type or shape (``invalid_record``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__("invalid_record", message, field=where)

    def __str__(self) -> str:
        return f"`{self.field}` {self.message}"


def _parse_exact(data: bytes, lines: LineIndex, kiln_strict: bool) -> ParsedCorpus:
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
        except NestingTooDeep as error:
            raise AdmissionError("nesting_too_deep", number, error.message) from None
        except ValueError as error:
            raise AdmissionError("invalid_json", number, f"line is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise AdmissionError("not_an_object", number, f"line is a JSON {type(value).__name__}, not an object")
        if value.get("schema") == MANIFEST_SCHEMA:
            parsed.manifest = check_manifest_record(
                number, raw, value, kiln_strict=kiln_strict,
                seen_example=parsed.first_example_line is not None, seen_manifest=bool(parsed.manifest_records),
            )
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
        self.prompts = KilnPromptDigest()

    def add(self, line: int, record: dict[str, Any]) -> None:
        check_known_fields(record, RECORD_FIELDS, "")
        messages = require_field(record, "messages", list)
        normalized = [parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        response = require_field(record, "teacher_response", str)
        optional_string(record, "id", "id")
        tokens = default_array(record, "teacher_tokens", "teacher_tokens")
        trajectory = default_array(record, "trajectory", "trajectory")
        segments = [parse_segment(s, f"trajectory[{i}]") for i, s in enumerate(trajectory)]
        for k, token in enumerate(tokens):
            self._add_token(token, f"teacher_tokens[{k}]")
        self.lines.append(line)
        self.conversations.append(Conversation(messages=normalized, teacher_response=response, trajectory=segments or None))
        self.messages_count.append(len(messages))
        self.response_empty.append(response == "")
        self.tokens_per_example.append(len(tokens))
        self.prompts.add(messages, response, record.get("trajectory"))

    def _add_token(self, token: Any, where: str) -> None:
        if not isinstance(token, dict):
            raise RecordError(where, "must be an object")
        check_known_fields(token, TOKEN_FIELDS, where)
        declared = token.get("token_id")
        self.declared.append(-1 if declared is None else _u32(declared, f"{where}.token_id"))
        optional_string(token, "token", f"{where}.token")
        if token.get("logprob") is not None:
            _number(token["logprob"], f"{where}.logprob")
            self.numeric = True
        candidates = default_array(token, "top_logprobs", f"{where}.top_logprobs")
        if candidates:
            self.numeric = True
        for j, candidate in enumerate(candidates):
            place = f"{where}.top_logprobs[{j}]"
            if not isinstance(candidate, dict):
                raise RecordError(place, "must be an object")
            check_known_fields(candidate, CANDIDATE_FIELDS, place)
            self.ids.append(_u32(require_present(candidate, "token_id", place), f"{place}.token_id"))
            self.logprobs.append(_number(require_present(candidate, "logprob", place), f"{place}.logprob"))
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
        parsed.kiln_prompts_sha256 = self.prompts.hexdigest()


# --- field rules (also used by kiln_core.scoring for unscored examples) ---------------------------


def check_known_fields(value: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """Refuse a known field given twice (serde's "duplicate field")."""
    repeated = sorted(set(getattr(value, "duplicates", ())) & set(known))
    if repeated:
        prefix = f"{where}." if where else ""
        raise RecordError(f"{prefix}{repeated[0]}", "is given more than once")


def require_field(record: dict[str, Any], key: str, kind: type) -> Any:
    """A required field of type ``kind`` (``list`` or ``str``): missing and null are both refused."""
    if key not in record:
        raise RecordError(key, "is required")
    value = record[key]
    if not isinstance(value, kind):
        raise RecordError(key, f"must be {'an array' if kind is list else 'a string'}")
    return value


def require_present(value: dict[str, Any], key: str, where: str) -> Any:
    if key not in value:
        raise RecordError(f"{where}.{key}", "is required")
    return value[key]


def default_array(value: dict[str, Any], key: str, where: str) -> list[Any]:
    """A ``#[serde(default)] Vec`` field: missing means empty, null is refused."""
    if key not in value:
        return []
    if not isinstance(value[key], list):
        raise RecordError(where, "must be an array (null is not allowed)" if value[key] is None else "must be an array")
    return value[key]


def optional_string(value: dict[str, Any], key: str, where: str) -> str | None:
    """An ``Option<String>`` field: missing or null means None."""
    item = value.get(key)
    if item is not None and not isinstance(item, str):
        raise RecordError(where, "must be a string or null")
    return item


def _u32(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U32_MAX:
        raise RecordError(where, "must be an unsigned 32-bit integer")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(where, "must be a number")
    return float(value)  # decode_json_line already refused any number beyond an f64


def parse_message(message: Any, where: str) -> dict[str, Any]:
    """One chat message: ``role`` a string; ``content`` text, null or parts; ``name``/``tool_call_id``
    strings or null; ``tool_calls`` an array or null (its items are the template's business)."""
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
    for key in ("name", "tool_call_id"):
        optional_string(message, key, f"{where}.{key}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise RecordError(f"{where}.tool_calls", "must be an array or null")
    normalized = {key: message[key] for key in MESSAGE_FIELDS if message.get(key) is not None}
    normalized["role"] = role
    normalized["content"] = content
    return normalized


def parse_segment(segment: Any, where: str) -> Segment:
    """One ``TurnSegment``: ``kind`` may be missing (context) but not null; ``warning_prefix_len`` is
    a ``usize`` Kiln clamps to the content when it trims."""
    if not isinstance(segment, dict):
        raise RecordError(where, "must be an object")
    check_known_fields(segment, SEGMENT_FIELDS, where)
    role = segment.get("role")
    if not isinstance(role, str):
        raise RecordError(f"{where}.role", "must be a string")
    content = segment.get("content")
    if not isinstance(content, str):
        raise RecordError(f"{where}.content", "must be a string")
    kind = segment.get("kind", "context")
    if kind not in SEGMENT_KINDS:
        raise RecordError(f"{where}.kind", f"must be one of {list(SEGMENT_KINDS)} (null is not allowed)")
    tool_call_id = optional_string(segment, "tool_call_id", f"{where}.tool_call_id")
    prefix = segment.get("warning_prefix_len")
    if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, int) or not 0 <= prefix <= U64_MAX):
        raise RecordError(f"{where}.warning_prefix_len", "must be an unsigned 64-bit integer or null")
    return Segment(role=role, content=content, kind=kind, tool_call_id=tool_call_id, warning_prefix_len=prefix or 0)
