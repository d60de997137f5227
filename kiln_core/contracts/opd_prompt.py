"""``OpdPrompt``: one on-policy prompt, and the digest Kiln binds a prompt list into receipts and checkpoints.

Kiln's ``OpdPrompt`` (``crates/kiln-train/src/opd.rs`` · ``OpdPrompt``) is ``{messages,
teacher_extra_messages, trajectory}``: the student rolls out from ``messages``; the teacher alone also
sees ``teacher_extra_messages``; ``trajectory`` (TurnSegments) only shapes the legacy rollout prefix.
Unknown fields are ignored, as serde ignores them; ``null`` where Kiln expects a list is refused.

The prompt list's identity is Kiln's ``sha256_json_serializable(&prompts)``
(``crates/kiln-train/src/train_receipt.rs``; reference/kiln-checkpoint-format.md §2.3): the list as
Kiln *re-serializes* it — each message reduced to ``role``, ``content`` (as text) and the optional
``tool_calls`` / ``name`` / ``tool_call_id`` that are not null, each segment to ``role``, ``content``,
``kind`` and the optional fields, empty lists omitted — converted to a ``serde_json::Value`` (object
keys sorted by bytes, no ``preserve_order``) and written compactly. ``serde_json_text`` reproduces
serde's output byte for byte, floats included (ryu's shortest-digit notation, ``1e20`` not
``1e+20``).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.contracts.example import ChatMessage, TrajectorySegment

__all__ = [
    "OpdPrompt",
    "kiln_prompt_value",
    "prompts_content_sha256",
    "serde_json_text",
    "training_data_receipt",
]

INLINE_PROMPTS_SOURCE = "inline_opd_prompts"
_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1


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


def serde_json_text(value: Any) -> str:
    """Compact JSON exactly as ``serde_json::to_vec(&serde_json::Value)`` writes it.

    Object keys sorted by UTF-8 bytes; raw UTF-8 strings with serde's escapes; integers outside
    i64/u64 become floats (serde parses them as f64); floats in ryu's notation.

    Example:
        >>> serde_json_text({"b": [1.0, 1e20, 2e-7], "a": "é"})
        '{"a":"é","b":[1.0,1e20,2e-7]}'
    """
    import json

    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value) if _I64_MIN <= value <= _U64_MAX else _ryu(float(value))
    if isinstance(value, float):
        return _ryu(value)
    if isinstance(value, str):
        value.encode("utf-8")  # a lone surrogate cannot be serialized (serde refuses it when parsing)
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(serde_json_text(item) for item in value) + "]"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: item[0].encode("utf-8"))
        return "{" + ",".join(f"{serde_json_text(k)}:{serde_json_text(v)}" for k, v in items) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _ryu(number: float) -> str:
    """serde_json's float text (the ``ryu`` crate's ``format64``): shortest digits, Rust's layout."""
    if not math.isfinite(number):
        raise ValueError("JSON has no representation for a non-finite float")
    if number == 0.0:
        return "-0.0" if math.copysign(1.0, number) < 0 else "0.0"
    sign = "-" if number < 0 else ""
    mantissa, _, exponent = repr(abs(number)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    point = len(whole) + (int(exponent) if exponent else 0)  # value = 0.<digits> × 10^point
    stripped = digits.lstrip("0")
    point -= len(digits) - len(stripped)
    digits = stripped.rstrip("0")
    length, kk = len(digits), point
    if length <= kk <= 16:  # 1234e7 -> 12340000000.0
        text = digits + "0" * (kk - length) + ".0"
    elif 0 < kk <= 16:  # 1234e-2 -> 12.34
        text = digits[:kk] + "." + digits[kk:]
    elif -5 < kk <= 0:  # 1234e-6 -> 0.001234
        text = "0." + "0" * -kk + digits
    elif length == 1:  # 1e30
        text = f"{digits}e{kk - 1}"
    else:  # 1234e30 -> 1.234e33
        text = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return sign + text


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
