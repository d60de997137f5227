"""Kiln's ``data.content_sha256`` of a corpus: the SHA-256 of the prompt list Kiln trains on.

Kiln's ``opd_train`` hashes the ``prompts`` it was given (``opd.rs``:
``train_receipt::sha256_json_serializable(&prompts)``, then ``trainer/checkpointing.rs``
``checkpoint_sha256_hex`` strips the ``sha256:`` prefix). For a ``dataset_path`` corpus those prompts
are built by ``prepare_off_policy_distillation_dataset_with_identity``: each example's ``messages``
plus an ``assistant`` turn holding ``teacher_response`` when it has no trajectory, else its
``messages`` and ``trajectory``. The prompt list is converted to a ``serde_json::Value`` (object keys
sorted, no ``preserve_order``) and written compactly.

Computed at admission from the one parse of the corpus: whichever parser reads the lines (the
columnar or the exact one) feeds each example to a ``KilnPromptDigest``, so the corpus bytes are not
parsed again for it. ``kiln_prompts_sha256`` is the same digest for a caller that only holds the bytes.
A checkpoint binds it and a resume compares it, so it must be byte-for-byte Kiln's. The published
behaviour is the prompt digest; Kiln's newest docs mention binding the JSONL file hash instead
(Kiln's docs/OPD_TEACHER_JSONL.md against crates/kiln-train/src/opd.rs). We follow the code.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Sequence

from kiln_core.serde_json import serde_json_text

__all__ = ["KilnPromptDigest", "kiln_prompts_sha256"]

MANIFEST_SCHEMA = "kiln.off-policy-distillation-manifest.v1"
# Rust's char::is_whitespace: what Kiln's `line.trim()` removes before parsing a JSONL line.
_RUST_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


# ---------------------------------------------------------------------------------------------
# data.content_sha256


def kiln_prompts_sha256(corpus: bytes) -> str:
    """Kiln's ``data.content_sha256`` of an admitted corpus: raw hex SHA-256 of its prompt list.

    ``corpus`` is the exact JSONL bytes (already admitted, so every line parses). Lines are trimmed
    and skipped when blank, and the manifest record is left out, as Kiln's parser does.

    Example:
        >>> line = b'{"messages":[{"role":"user","content":"hi"}],"teacher_response":"ok"}'
        >>> kiln_prompts_sha256(line) == hashlib.sha256(
        ...     b'[{"messages":[{"content":"hi","role":"user"},{"content":"ok","role":"assistant"}]}]').hexdigest()
        True
    """
    digest = KilnPromptDigest()
    for record in _example_records(corpus):
        digest.add(record.get("messages"), record.get("teacher_response"), record.get("trajectory"))
    return digest.hexdigest()


class KilnPromptDigest:
    """``kiln_prompts_sha256`` fed one example at a time, by the parser that reads the corpus.

    Each example is given as parsed, missing fields as None (Kiln's serde treats a missing and a null
    optional field alike, and so does the prompt it builds), so a parser that cannot tell the two
    apart (Arrow) feeds the same prompt as one that can.

    Example:
        >>> digest = KilnPromptDigest()
        >>> digest.add([{"role": "user", "content": "hi"}], "ok", None)
        >>> digest.hexdigest() == kiln_prompts_sha256(
        ...     b'{"messages":[{"role":"user","content":"hi"}],"teacher_response":"ok"}')
        True
    """

    def __init__(self) -> None:
        self._sha256 = hashlib.sha256(b"[")
        self._examples = 0

    def add(
        self,
        messages: Sequence[dict[str, Any]] | None,
        teacher_response: str | None,
        trajectory: Sequence[dict[str, Any]] | None,
    ) -> None:
        """Append one example's prompt (its ``messages``, ``teacher_response`` and ``trajectory``)."""
        if self._examples:
            self._sha256.update(b",")
        self._examples += 1
        self._sha256.update(serde_json_text(_opd_prompt(messages, teacher_response, trajectory)).encode("utf-8"))

    def hexdigest(self) -> str:
        """Raw hex SHA-256 of the prompt list so far (more examples may still be added)."""
        finished = self._sha256.copy()
        finished.update(b"]")
        return finished.hexdigest()


def _example_records(corpus: bytes) -> Iterable[dict[str, Any]]:
    for raw in corpus.decode("utf-8").split("\n"):
        line = raw.strip(_RUST_WHITESPACE)
        if not line:
            continue
        value = json.loads(line)
        if isinstance(value, dict) and value.get("schema") == MANIFEST_SCHEMA:
            continue
        yield value


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    # kiln_core::tokenizer::ChatMessage: role, content, and the optional fields only when present.
    from kiln_core.tokenization import normalize_content

    out = {"role": message.get("role"), "content": normalize_content(message.get("content"))}
    for key in ("tool_calls", "name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _turn_segment(segment: dict[str, Any]) -> dict[str, Any]:
    # trajectory.rs TurnSegment: kind is always written; tool_call_id/warning_prefix_len only when present.
    out = {"role": segment.get("role"), "content": segment.get("content"), "kind": segment.get("kind") or "context"}
    for key in ("tool_call_id", "warning_prefix_len"):
        if segment.get(key) is not None:
            out[key] = segment[key]
    return out


def _opd_prompt(
    messages: Sequence[dict[str, Any]] | None,
    teacher_response: str | None,
    trajectory: Sequence[dict[str, Any]] | None,
) -> dict[str, Any]:
    chat = [_chat_message(m) for m in messages or []]
    if trajectory:
        return {"messages": chat, "trajectory": [_turn_segment(s) for s in trajectory]}
    return {"messages": chat + [{"role": "assistant", "content": teacher_response}]}
