"""What parsing a corpus produces, shared by the fast (``columnar``) and exact (``records``) parsers.

Both parsers build a ``ParsedCorpus``; neither imports the other. Kiln decodes every line to a
``serde_json::Value`` first (opd.rs ``parse_off_policy_distillation_dataset_str``), so every line,
manifest or example, is held to serde_json's nesting limit before anything else is looked at.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln_core.chat_template import Conversation
from kiln_core.contracts.identity import OffPolicyManifest
from kiln_core.kiln_prompts import KilnPromptDigest
from kiln_core.strict_json import loads_nesting_limited

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
SEGMENT_KINDS = ("context", "action", "observation")
# Rust's char::is_whitespace, which Kiln's line trim uses (Python's str.strip also strips \x1c-\x1f).
RUST_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


@dataclass
class ParsedCorpus:
    """Every non-blank line of a corpus, split into the manifest and columnar examples.

    Attributes:
        manifest_records: ``(line, raw line text, decoded object)`` for each manifest-like record.
        manifest: The validated manifest (set once the manifest rules have passed), or None.
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
        kiln_prompts_sha256: Kiln's prompt-list digest (``kiln_core.kiln_prompts``), taken from this
            parse so the bytes are read once.
        parser: ``"fast"`` or ``"exact"`` (for benchmarks and logs).
    """

    manifest_records: list[tuple[int, str, Any]] = field(default_factory=list)
    manifest: OffPolicyManifest | None = None
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
    kiln_prompts_sha256: str = KilnPromptDigest().hexdigest()
    parser: str = "exact"

    @property
    def num_examples(self) -> int:
        return int(self.example_lines.shape[0])

    @property
    def manifest_line_number(self) -> int | None:
        return self.manifest_records[0][0] if self.manifest_records else None


def offsets_of(counts: list[int] | np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)


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


NUMBER_OUT_OF_RANGE = "number out of range"
"""serde_json's error for a number literal beyond an f64 (Kiln builds serde_json without
``arbitrary_precision``, so an integer beyond u64 is read as an f64 too)."""

_MAX_DIGITS_OF_A_DOUBLE = 309  # 10^308 < f64::MAX < 10^309; JSON allows no leading zeros


def _integer(literal: str) -> int:
    """A JSON integer literal, refused when no f64 holds it (``1`` followed by 400 zeros)."""
    if len(literal.lstrip("-")) > _MAX_DIGITS_OF_A_DOUBLE:
        raise ValueError(NUMBER_OUT_OF_RANGE)
    value = int(literal)
    try:
        float(value)
    except OverflowError:
        raise ValueError(NUMBER_OUT_OF_RANGE) from None
    return value


def _float(literal: str) -> float:
    """A JSON number literal with a fraction or exponent, refused when it overflows an f64 (``1e400``);
    one that underflows is 0, as in serde_json (``1e-400``)."""
    value = float(literal)
    if math.isinf(value):
        raise ValueError(NUMBER_OUT_OF_RANGE)
    return value


def decode_json_line(text: str) -> Any:
    """Decode one JSON line the way Kiln's first ``serde_json::Value`` pass sees it (opd.rs
    ``parse_off_policy_distillation_dataset_str``: ``serde_json::from_str::<Value>`` of every line), objects
    as ``JsonObject``.

    Raises:
        NestingTooDeep: The line nests ``SERDE_JSON_RECURSION_LIMIT`` containers or more.
        ValueError: Not valid JSON, or a number beyond an f64 (``NUMBER_OUT_OF_RANGE``).
    """
    return loads_nesting_limited(text, where="the line", object_pairs_hook=json_object, parse_int=_integer,
                                 parse_float=_float)
