"""Kiln's ``data.content_sha256`` of a corpus: the SHA-256 of the prompt list Kiln trains on.

Kiln's ``opd_train`` hashes the ``prompts`` it was given (``opd.rs``:
``train_receipt::sha256_json_serializable(&prompts)``, then ``trainer/checkpointing.rs``
``checkpoint_sha256_hex`` strips the ``sha256:`` prefix). For a ``dataset_path`` corpus those prompts
are built by ``prepare_off_policy_distillation_dataset_with_identity``: each example's ``messages``
plus an ``assistant`` turn holding ``teacher_response`` when it has no trajectory, else its
``messages`` and ``trajectory``. The prompt list is converted to a ``serde_json::Value`` (object keys
sorted, no ``preserve_order``) and written compactly.

Computed at admission (where the corpus bytes are) and carried on ``CorpusTables``; a checkpoint
binds it and a resume compares it, so it must be byte-for-byte Kiln's. The published behaviour is
the prompt digest; Kiln's newest docs mention binding the JSONL file hash instead
(Kiln's docs/OPD_TEACHER_JSONL.md against crates/kiln-train/src/opd.rs). We follow the code.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

from kiln_core.serde_json import serde_json_text

__all__ = ["kiln_prompts_sha256"]

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
    digest = hashlib.sha256(b"[")
    first = True
    for record in _example_records(corpus):
        if not first:
            digest.update(b",")
        first = False
        digest.update(serde_json_text(_opd_prompt(record)).encode("utf-8"))
    digest.update(b"]")
    return digest.hexdigest()


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


def _opd_prompt(record: dict[str, Any]) -> dict[str, Any]:
    messages = [_chat_message(m) for m in record.get("messages") or []]
    trajectory = record.get("trajectory") or []
    if trajectory:
        return {"messages": messages, "trajectory": [_turn_segment(s) for s in trajectory]}
    return {"messages": messages + [{"role": "assistant", "content": record.get("teacher_response")}]}
