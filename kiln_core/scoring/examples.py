"""The unscored examples ``kiln-flows score`` reads, and the error every scoring stage raises.

An input file is JSONL with one example per line: ``messages``, ``teacher_response``, optional
``trajectory``, ``id`` and ``metadata`` (Kiln's crates/kiln-train/src/opd.rs, without ``teacher_tokens``).
Each line is checked with the *same* field rules admission applies (``kiln_core.admission.records``),
so an example that scores is an example admission can parse, and a bad line is reported by its
1-based physical line number before any teacher is loaded.

Lines are read one at a time (bounded memory): ``iter_examples`` is a generator over the file, and
``count_examples`` runs the same checks over the whole file without keeping anything.

A file that is already a scored corpus may be re-scored: a leading manifest record is skipped and any
``teacher_tokens`` are replaced by the new teacher's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

# The admission parser's field rules, reused on purpose: scoring must accept exactly the shapes
# admission accepts (content parts, tool calls, segment kinds, warning prefixes).
from kiln_core.admission.parsed import RUST_WHITESPACE, decode_json_line
from kiln_core.admission.records import (
    RecordError,
    default_array,
    optional_string,
    parse_message,
    parse_segment,
    require_field,
)
from kiln_core.contracts.identity import MANIFEST_SCHEMA
from kiln_core.errors import EnvironmentFailure, KilnFlowsError, Rejection, pick_kind
from kiln_core.strict_json import NestingTooDeep
from kiln_core.tokenization import Conversation

COPIED_FIELDS = ("id", "messages", "teacher_response", "trajectory", "metadata")
"""Input fields copied, as given and in this order, into each scored row (before ``teacher_tokens``)."""

# Codes whose cause is the environment (network, storage) rather than the input: the CLI exits 3.
TRANSIENT_CODES = frozenset({"vllm_unreachable", "vllm_http_error", "storage_error"})


class ScoringError(KilnFlowsError):
    """A scoring run that was refused or failed; ``code`` is stable, the message says what to fix.

    Codes: ``invalid_option``, ``file_not_found``, ``invalid_example``, ``nesting_too_deep``,
    ``no_examples``, ``tokenization_failed``, ``no_action_tokens``, ``overlapping_masks``,
    ``target_at_position_zero``, ``context_too_long``, ``teacher_invalid``,
    ``teacher_mismatch``, ``teacher_changed``, ``teacher_adapter_changed``, ``teacher_output``, ``vllm_request``,
    ``vllm_response``, ``vllm_unreachable``, ``vllm_http_error``, ``storage_error``; scoring into
    shards adds ``out_not_directory``, ``row_exceeds_shard_size`` and ``scored_set_mismatch``. The
    ``TRANSIENT_CODES`` construct a ``ScoringFailure`` (``EnvironmentFailure``), the rest a
    ``ScoringRejection``.

    Attributes:
        code: Stable machine-readable reason.
        line: 1-based physical line of the examples file the error is about, or None.
        message: Human-readable explanation (without the line prefix).
    """

    def __new__(cls, code: str | None = None, *args: Any, **kwargs: Any):
        if cls is ScoringError:
            cls = pick_kind(ScoringError, code or "", TRANSIENT_CODES)
        return super().__new__(cls)

    def __init__(self, code: str, message: str, *, line: int | None = None) -> None:
        super().__init__(code, message, line=line)

    def __str__(self) -> str:
        where = f"examples line {self.line}: " if self.line is not None else ""
        return f"[{self.code}] {where}{self.message}"

    @property
    def transient(self) -> bool:
        """Whether the failure is the network's or the storage's (worth retrying), not the input's."""
        return self.code in TRANSIENT_CODES


class ScoringRejection(ScoringError, Rejection):
    """Bad examples, options or teacher: exit 2."""


class ScoringFailure(ScoringError, EnvironmentFailure):
    """vLLM or storage failed: exit 3, retried."""


@dataclass(frozen=True)
class ScoringExample:
    """One validated input example.

    Attributes:
        line: 1-based physical line in the examples file.
        record: The ``COPIED_FIELDS`` present in the input, as given.
        conversation: What the mask builder needs (normalized messages, response, trajectory).
    """

    line: int
    record: dict[str, Any]
    conversation: Conversation


@dataclass(frozen=True)
class ScoreRequest:
    """One tokenized example for a teacher: score ``input_ids[q]`` from row ``q - 1`` for each q.

    Attributes:
        line: Physical line of the example (for error messages).
        input_ids: ``int32 [T]`` the student tokenizer's ids for the rendered conversation.
        positions: ``int32 [n]`` action target positions, strictly increasing, all ≥ 1.
    """

    line: int
    input_ids: np.ndarray
    positions: np.ndarray


def iter_examples(uri: str, storage_options: dict | None = None) -> Iterator[ScoringExample]:
    """Yield the validated examples of a JSONL file in order, one line in memory at a time.

    Args:
        uri: Local path or fsspec URI of the examples file.
        storage_options: fsspec options for remote files.

    Raises:
        ScoringError: ``file_not_found``, or ``invalid_example`` naming the first bad line.

    Example:
        >>> for example in iter_examples("examples.jsonl"):  # doctest: +SKIP
        ...     print(example.line, example.record.get("id"))
    """
    from kiln_core.storage import resolve

    location = resolve(uri, storage_options)
    try:
        handle = location.fs.open(location.path, "rb")
    except FileNotFoundError:
        raise ScoringError("file_not_found", f"examples file {location.uri} does not exist") from None
    except IsADirectoryError:
        raise ScoringError("file_not_found", f"examples file {location.uri} is a directory") from None
    with handle:
        seen_example = False
        # Binary iteration splits on b"\n" only, like Rust's str::lines() (a lone \r is not a break).
        for number, raw in enumerate(handle, start=1):
            example = _parse_line(raw, number, seen_example)
            if example is not None:
                seen_example = True
                yield example


def count_examples(uri: str, storage_options: dict | None = None) -> int:
    """Validate every line of an examples file and return how many examples it holds.

    Raises:
        ScoringError: as ``iter_examples``, plus ``no_examples`` for a file without examples.
    """
    count = sum(1 for _ in iter_examples(uri, storage_options))
    if count == 0:
        raise ScoringError("no_examples", f"examples file {uri} holds no examples")
    return count


def batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Split an iterable into lists of at most ``size`` items, in order."""
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _parse_line(raw: bytes, number: int, seen_example: bool) -> ScoringExample | None:
    """One physical line → an example, ``None`` for a blank line or a leading manifest."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ScoringError("invalid_example", f"not valid UTF-8 (byte {error.start})", line=number) from None
    if text.endswith("\n"):
        text = text[:-1]
        if text.endswith("\r"):
            text = text[:-1]
    text = text.strip(RUST_WHITESPACE)
    if not text:
        return None
    try:
        value = decode_json_line(text)
    except NestingTooDeep as error:
        raise ScoringError("nesting_too_deep", error.message, line=number) from None
    except ValueError as error:
        raise ScoringError("invalid_example", f"line is not valid JSON: {error}", line=number) from None
    if not isinstance(value, dict):
        raise ScoringError("invalid_example", f"line is a JSON {type(value).__name__}, not an object", line=number)
    if value.get("schema") == MANIFEST_SCHEMA:
        if seen_example:
            raise ScoringError("invalid_example", "a manifest record after the first example", line=number)
        return None  # re-scoring a scored corpus: the new teacher's manifest replaces it
    try:
        return _example(value, number)
    except RecordError as error:
        raise ScoringError("invalid_example", str(error), line=number) from None


def _example(record: dict[str, Any], number: int) -> ScoringExample:
    messages = require_field(record, "messages", list)
    if not messages:
        raise RecordError("messages", "must not be empty")
    normalized = [parse_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    response = require_field(record, "teacher_response", str)
    if not response:
        raise RecordError("teacher_response", "must not be empty")
    optional_string(record, "id", "id")
    trajectory = default_array(record, "trajectory", "trajectory")
    segments = [parse_segment(segment, f"trajectory[{i}]") for i, segment in enumerate(trajectory)] or None
    copied = {key: record[key] for key in COPIED_FIELDS if key in record}
    conversation = Conversation(messages=normalized, teacher_response=response, trajectory=segments)
    return ScoringExample(line=number, record=copied, conversation=conversation)
