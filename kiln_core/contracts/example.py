"""The example record of an OPD teacher corpus (seeds/opd-teacher-jsonl.txt, kiln-opd-spec.md §2.3).

These models document the record field by field and give typed access to one example. Admission
does not validate a corpus through them line by line (it parses columns, see
``kiln_core.admission``); they are the reference the columnar parser is tested against. Unknown
top-level fields are ignored, as Kiln's parser ignores them (compatibility, not an extension point).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

U32_MAX = 2**32 - 1


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
    top_logprobs: list[TopLogprob]
    """Ranked candidates; the first ``top_k`` are consumed and validated."""


class TrajectorySegment(BaseModel):
    """One replayed segment; ``kind`` (not ``role``) decides supervision."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str
    kind: Literal["context", "action", "observation"] | None = None
    """``action`` → reverse-KL targets, ``observation`` → ECHO targets, ``context``/missing → none."""
    tool_call_id: str | None = None
    warning_prefix_len: int | None = Field(default=None, ge=0, le=U32_MAX)
    """Leading content bytes left out of the ECHO loss when the warning filter is on."""


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
    trajectory: list[TrajectorySegment] | None = None
    """When non-empty, the replayed training sequence."""
    metadata: Any = None
    """Arbitrary caller JSON; part of the file hash only."""
