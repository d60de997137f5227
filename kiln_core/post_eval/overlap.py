"""Held-out overlap: refuse training data that contains a ``held-out`` suite's examples.

Source: crates/kiln-eval/src/data_identity.rs · example_identity, canonical_json, normalized_json,
normalize_text, EvalContaminationIndex, ContaminationMatch; crates/kiln-server/src/api/training.rs ·
post_eval_contamination_index, check_prompt_variants, check_sft_contamination, contamination_error.

* An example's identity is SHA-256 of the sorted-keys compact JSON of ``{"messages", "target"}``
  (``content``); ``normalized`` is the same after every string value is whitespace-split,
  lowercased and re-joined with single spaces. Both are written ``sha256:<hex>``.
* Suites synthesized from a registered dataset carry ``metadata.kiln_dataset_provenance``; its row
  hashes, ``group_id`` and ``session_id`` are indexed too.
* Check order: exact prompt/target, normalized prompt/target, source row, normalized source row,
  source group, source session. Every assistant turn of a training conversation is checked as
  (messages before it, its text), each prompt in up to four variants: as is, without system
  messages, and each of those with trailing ``tool`` messages removed.
* ``train-set-eval`` skips the check (a diagnostic may overlap; it can never gate).

kiln-flows corpora are OPD examples: the conversation is ``messages`` followed by the assistant
``teacher_response``. A message's structured content (a list of parts) is compared as its joined
text, which is what the chat template sees. UNCONFIRMED: Kiln's ``assistant_target_text`` was not
readable; an assistant turn's target here is its text content, and a turn without text is skipped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable

from kiln_core.contracts.post_eval.answer_parsing import rust_split_whitespace, rust_trim
from kiln_core.contracts.post_eval.errors import PostEvalRejection
from kiln_core.serde_json import encode, json_value, rust_debug_str

__all__ = ["PROVENANCE_KEY", "example_identity", "row_identity", "EvalContaminationIndex", "TrainingConversation",
           "conversation_from_opd_example", "check_training_overlap"]

PROVENANCE_KEY = "kiln_dataset_provenance"
MATCH_LABELS = {
    "exact_example": "exact prompt/target",
    "normalized_example": "normalized prompt/target",
    "source_row": "source row",
    "normalized_source_row": "normalized source row",
    "group": "source group",
    "session": "source session",
}


def _sha256_json(value: Any) -> str:
    return "sha256:" + hashlib.sha256(encode(json_value(value))).hexdigest()


def _normalized(value: Any) -> Any:
    if isinstance(value, str):
        return " ".join(part.lower() for part in rust_split_whitespace(value))
    if isinstance(value, list):
        return [_normalized(item) for item in value]
    if isinstance(value, dict):
        return {key: _normalized(item) for key, item in value.items()}  # keys are not normalized
    return value


def _message_value(message: Any) -> dict[str, Any]:
    """A message as ``EvalChatMessage`` serializes (optional fields only when set)."""
    get = message.get if isinstance(message, dict) else lambda key, default=None: getattr(message, key, default)
    content = get("content")
    if isinstance(content, list):
        content = "".join(part.get("text") or "" if isinstance(part, dict) else getattr(part, "text", "") or ""
                          for part in content)
    value: dict[str, Any] = {"role": get("role"), "content": content or ""}
    for key in ("tool_calls", "name", "tool_call_id"):
        if get(key) is not None:
            value[key] = get(key)
    return value


def example_identity(messages: list[Any], target: str | None) -> tuple[str, str]:
    """``(content_sha256, normalized_sha256)`` of a prompt and its target.

    Example:
        >>> a = example_identity([{"role": "user", "content": "What is  2+2?"}], "4")
        >>> b = example_identity([{"role": "user", "content": "what is 2+2?"}], "4")
        >>> a[0] == b[0], a[1] == b[1]
        (False, True)
    """
    value = {"messages": [_message_value(message) for message in messages], "target": target}
    return _sha256_json(value), _sha256_json(_normalized(value))


def row_identity(row: dict[str, Any]) -> dict[str, Any]:
    """A raw training row's identity (data_identity.rs · row_identity): hashes, group and session."""

    def identity_field(name: str) -> str | None:
        for container in (row, *(row.get(key) for key in ("metadata", "provenance", "extra"))):
            value = container.get(name) if isinstance(container, dict) else None
            if isinstance(value, str) and rust_trim(value):
                return rust_trim(value)
        return None

    return {"content_sha256": _sha256_json(row), "normalized_sha256": _sha256_json(_normalized(row)),
            "group_id": identity_field("group_id"), "session_id": identity_field("session_id")}


def _provenance_row(metadata: Any) -> dict[str, Any] | None:
    # serde's deny_unknown_fields parse of DatasetExampleProvenance; anything else is ignored.
    provenance = metadata.get(PROVENANCE_KEY) if isinstance(metadata, dict) else None
    if not isinstance(provenance, dict) or set(provenance) != {"dataset", "source_split", "row"}:
        return None
    row = provenance["row"]
    required = {"row_number", "content_sha256", "normalized_sha256"}
    if (not isinstance(provenance["dataset"], str) or provenance["source_split"] not in ("train", "validation", "holdout")
            or not isinstance(row, dict) or not required <= set(row) <= required | {"group_id", "session_id"}):
        return None
    if not all(isinstance(row[key], str) for key in ("content_sha256", "normalized_sha256")):
        return None
    if any(row.get(key) is not None and not isinstance(row[key], str) for key in ("group_id", "session_id")):
        return None
    return row


class EvalContaminationIndex:
    """The identities of one suite's examples (and their dataset provenance)."""

    def __init__(self, suite: Any) -> None:
        self.example_content: set[str] = set()
        self.example_normalized: set[str] = set()
        self.source_content: set[str] = set()
        self.source_normalized: set[str] = set()
        self.group_ids: set[str] = set()
        self.session_ids: set[str] = set()
        for example in suite.examples:
            content, normalized = example_identity(example.messages, example.target)
            self.example_content.add(content)
            self.example_normalized.add(normalized)
            row = _provenance_row(example.metadata)
            if row is not None:
                self.source_content.add(row["content_sha256"])
                self.source_normalized.add(row["normalized_sha256"])
                if row.get("group_id") is not None:
                    self.group_ids.add(row["group_id"])
                if row.get("session_id") is not None:
                    self.session_ids.add(row["session_id"])

    @property
    def has_sources(self) -> bool:
        """Whether any example carried dataset provenance (else row checks cannot hit)."""
        return bool(self.source_content or self.source_normalized or self.group_ids or self.session_ids)

    def check_example(self, messages: list[Any], target: str | None) -> str | None:
        content, normalized = example_identity(messages, target)
        if content in self.example_content:
            return "exact_example"
        return "normalized_example" if normalized in self.example_normalized else None

    def check_source_row(self, identity: dict[str, Any]) -> str | None:
        if identity["content_sha256"] in self.source_content:
            return "source_row"
        if identity["normalized_sha256"] in self.source_normalized:
            return "normalized_source_row"
        if identity.get("group_id") is not None and identity["group_id"] in self.group_ids:
            return "group"
        if identity.get("session_id") is not None and identity["session_id"] in self.session_ids:
            return "session"
        return None

    def check_prompt_variants(self, messages: list[Any], target: str) -> str | None:
        """As is, without system messages, and each of those without trailing ``tool`` messages."""
        as_is = list(messages)
        without_system = [m for m in messages if _message_value(m)["role"] != "system"]
        variants = [as_is, without_system]
        for prompt in (as_is, without_system):
            trimmed = list(prompt)
            while trimmed and _message_value(trimmed[-1])["role"] == "tool":
                trimmed.pop()
            variants.append(trimmed)
        return next((hit for hit in (self.check_example(v, target) for v in variants) if hit), None)


@dataclass(frozen=True)
class TrainingConversation:
    """One training example: its full conversation (assistant turns included) and, optionally, its raw row."""

    messages: list[Any]
    row: dict[str, Any] | None = None


def conversation_from_opd_example(example: dict[str, Any]) -> TrainingConversation:
    """An OPD corpus line as a conversation: ``messages`` then the assistant ``teacher_response``."""
    messages = list(example.get("messages") or [])
    messages.append({"role": "assistant", "content": example.get("teacher_response") or ""})
    return TrainingConversation(messages, example)


def check_training_overlap(config: Any, suite: Any, conversations: Iterable[TrainingConversation]) -> None:
    """Reject on the first training conversation that overlaps a ``held-out`` suite.

    Args:
        config: The ``PostEvalConfig`` (None, or ``train-set-eval``, skips the check).
        suite: The suite ``config.suite`` names.
        conversations: The admitted training data, streamed.

    Raises:
        PostEvalRejection: ``post_eval_overlap`` with Kiln's message.

    Example:
        ``check_training_overlap(config, suite, map(conversation_from_opd_example, corpus_rows))``
    """
    if config is None or config.data_scope == "train-set-eval":
        return
    index = EvalContaminationIndex(suite)
    for conversation in conversations:
        hit = None
        for position, message in enumerate(conversation.messages):
            value = _message_value(message)
            if value["role"] == "assistant" and value["content"]:
                hit = index.check_prompt_variants(conversation.messages[:position], value["content"])
                if hit:
                    break
        if hit is None and conversation.row is not None and index.has_sources:
            hit = index.check_source_row(row_identity(conversation.row))
        if hit is not None:
            raise PostEvalRejection(
                "post_eval_overlap",
                f"post_eval suite {rust_debug_str(config.suite)} is declared held-out but overlaps admitted training "
                f"data via {MATCH_LABELS[hit]}; use a disjoint suite or explicitly set post_eval.data_scope to "
                '"train-set-eval" for a non-gating diagnostic', field="post_eval.data_scope")
