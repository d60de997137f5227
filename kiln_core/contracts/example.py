"""The example record of an OPD teacher corpus (Kiln's crates/kiln-train/src/opd.rs, docs/OPD_TEACHER_JSONL.md).

These models document the record field by field, with the shapes Kiln's serde derives accept
(opd.rs ``OffPolicyDistillationExample``, ``TeacherActionToken``, ``TeacherTopLogprob``;
trajectory.rs ``TurnSegment``): an array field with a default may be missing but not null, an enum is
never null, an optional field may be null. Admission does not validate a corpus through them line by
line (it parses columns, see ``kiln_core.admission``). Unknown fields are ignored, as Kiln's parser
ignores them (compatibility, not an extension point).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.errors import TokenizationError

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


class ContentPart(BaseModel):
    """One structured content part; its ``text`` is what the chat template sees."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None
    text: str | None = None


class ChatMessage(BaseModel):
    """A student-visible chat message."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    """Chat role; controls rendering only."""
    content: str | list[ContentPart] | None = None
    """Text, null (empty) or an array of parts (joined as text)."""
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None


def normalize_content(content: Any) -> str:
    """Message content as text: a string as is, null as "", a list of parts as their joined text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise TokenizationError("content parts must be objects")
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
        return "".join(texts)
    raise TokenizationError("content must be a string, null or an array of parts")


class TopLogprob(BaseModel):
    """One ranked teacher candidate."""

    model_config = ConfigDict(strict=True, extra="ignore")
    token_id: int = Field(ge=0, le=U32_MAX)
    """Vocabulary id; must be < the student's ``vocab_size`` for the consumed candidates."""
    logprob: float
    """Raw full-vocabulary log-probability; finite and ≤ 0 for the consumed candidates."""


class TeacherToken(BaseModel):
    """The teacher's scores for one action target, in target order."""

    model_config = ConfigDict(strict=True, extra="ignore")
    token: str | None = None
    """Audit text only; never used for the loss or identity."""
    token_id: int | None = Field(default=None, ge=0, le=U32_MAX)
    """If present, must equal the tokenized action target at this position."""
    logprob: float | None = None
    """Audit value for the selected token; its presence still means numeric logits."""
    top_logprobs: list[TopLogprob] = Field(default_factory=list)
    """Ranked candidates; the first ``top_k`` are consumed and validated (missing = none; null is refused)."""


class TrajectorySegment(BaseModel):
    """One replayed segment; ``kind`` (not ``role``) decides supervision."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str
    kind: Literal["context", "action", "observation"] = "context"
    """``action`` → reverse-KL targets, ``observation`` → ECHO targets, ``context`` (or missing) → none."""
    tool_call_id: str | None = None
    warning_prefix_len: int | None = Field(default=None, ge=0, le=U64_MAX)
    """Leading content bytes left out of the ECHO env mask when the warning filter is on; Kiln clamps
    it to the content, so a longer value means the whole observation is warning."""


class OpdExample(BaseModel):
    """One scored example line of the corpus."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    """Caller label; part of the file hash, not copied into receipts."""
    messages: list[ChatMessage]
    """Non-empty student-visible prompt."""
    teacher_response: str
    """Non-empty assistant text (appended as the assistant turn when there is no trajectory)."""
    teacher_tokens: list[TeacherToken] = Field(default_factory=list)
    """One entry per action target, in target order."""
    trajectory: list[TrajectorySegment] = Field(default_factory=list)
    """When non-empty, the replayed training sequence (missing = none; null is refused)."""
    metadata: Any = None
    """Arbitrary caller JSON; part of the file hash only."""
