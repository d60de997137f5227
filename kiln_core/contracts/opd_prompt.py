"""``OpdPrompt``: one on-policy prompt, and the digest Kiln binds a prompt list into receipts and checkpoints.

Kiln's ``OpdPrompt`` (``crates/kiln-train/src/opd.rs`` · ``OpdPrompt``) is ``{messages,
teacher_extra_messages, trajectory}``: the student rolls out from ``messages``; the teacher alone also
sees ``teacher_extra_messages``; ``trajectory`` (TurnSegments) only shapes the legacy rollout prefix.
Unknown fields are ignored, as serde ignores them; ``null`` where Kiln expects a list is refused.

The prompt list's identity is Kiln's ``sha256_json_serializable(&prompts)``
(``crates/kiln-train/src/train_receipt.rs``, called from ``opd.rs``): the list as
Kiln *re-serializes* it — each message reduced to ``role``, ``content`` (as text) and the optional
``tool_calls`` / ``name`` / ``tool_call_id`` that are not null, each segment to ``role``, ``content``,
``kind`` and the optional fields, empty lists omitted — converted to a ``serde_json::Value`` (object
keys sorted by bytes, no ``preserve_order``) and written compactly (``kiln_core.canonical.serde_json_text``,
serde's output byte for byte, floats included).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.serde_json import serde_json_text
from kiln_core.contracts.example import ChatMessage, TrajectorySegment

__all__ = [
    "OpdPrompt",
    "kiln_prompt_value",
    "prompts_content_sha256",
    "training_data_receipt",
]

INLINE_PROMPTS_SOURCE = "inline_opd_prompts"


class OpdPrompt(BaseModel):
    """One prompt of an on-policy ``OpdRequest`` (Kiln's ``OpdPrompt``).

    Example:
        >>> OpdPrompt.model_validate({"messages": [{"role": "user", "content": "hi"}]}).teacher_extra_messages
        []
    """

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    messages: list[ChatMessage]
    """Student-visible chat; on-policy it usually ends with a (dummy) assistant turn that marks where
    the rollout starts. Kiln refuses an empty list at submit time (``OPD prompt {i} has no messages``)."""
    teacher_extra_messages: list[ChatMessage] = Field(default_factory=list)
    """Teacher-only context: their contents, joined with a blank line, are merged into the teacher's
    system message. The student never sees them."""
    trajectory: list[TrajectorySegment] = Field(default_factory=list)
    """Optional replay segments; on-policy they only decide the legacy rollout prefix (first action)."""


def _message_value(message: ChatMessage) -> dict[str, Any]:
    from kiln_core.contracts.example import normalize_content

    raw = message.model_dump(mode="json", exclude_unset=False)
    value: dict[str, Any] = {"role": message.role, "content": normalize_content(raw.get("content"))}
    for optional in ("tool_calls", "name", "tool_call_id"):
        if raw.get(optional) is not None:
            value[optional] = raw[optional]
    return value


def _segment_value(segment: TrajectorySegment) -> dict[str, Any]:
    value: dict[str, Any] = {"role": segment.role, "content": segment.content, "kind": segment.kind or "context"}
    if segment.tool_call_id is not None:
        value["tool_call_id"] = segment.tool_call_id
    if segment.warning_prefix_len is not None:
        value["warning_prefix_len"] = segment.warning_prefix_len
    return value


def kiln_prompt_value(prompt: OpdPrompt) -> dict[str, Any]:
    """The prompt as Kiln re-serializes it (what its data digest covers).

    Example:
        >>> kiln_prompt_value(OpdPrompt.model_validate({"messages": [{"role": "user", "content": None}]}))
        {'messages': [{'role': 'user', 'content': ''}]}
    """
    value: dict[str, Any] = {"messages": [_message_value(m) for m in prompt.messages]}
    if prompt.teacher_extra_messages:
        value["teacher_extra_messages"] = [_message_value(m) for m in prompt.teacher_extra_messages]
    if prompt.trajectory:
        value["trajectory"] = [_segment_value(s) for s in prompt.trajectory]
    return value


def prompts_content_sha256(prompts: Sequence[OpdPrompt]) -> str:
    """Lowercase hex SHA-256 of Kiln's serialization of the whole prompt list (no ``sha256:`` prefix).

    This is the checkpoint's ``data.content_sha256``; receipts carry it with the ``sha256:`` prefix.
    It covers every prompt, including those later dropped for having no action tokens.

    Example:
        >>> p = OpdPrompt.model_validate({"messages": [{"role": "user", "content": "hi"}]})
        >>> len(prompts_content_sha256([p]))
        64
    """
    text = serde_json_text([kiln_prompt_value(prompt) for prompt in prompts])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def training_data_receipt(prompts: Sequence[OpdPrompt]) -> dict[str, Any]:
    """The receipt's ``training_data`` for inline prompts (``crates/kiln-server/src/training_queue.rs``).

    Example:
        >>> p = OpdPrompt.model_validate({"messages": [{"role": "user", "content": "hi"}]})
        >>> training_data_receipt([p])["source"]
        'inline_opd_prompts'
    """
    return {"source": INLINE_PROMPTS_SOURCE, "path": None, "sha256": "sha256:" + prompts_content_sha256(prompts)}
