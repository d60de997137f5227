"""Prompt preparation: from ``OpdPrompt``s to the token prefixes the student samples from.

Kiln (``crates/kiln-train/src/opd.rs`` · ``prepare_opd_prompts_for_training``,
``render_rollout_prompt_prefixes``, ``render_teacher_prompt_tokens``):

1. Every prompt is tokenized with the *training* path: its ``messages`` as they are (no response is
   appended, so an on-policy prompt normally ends with a dummy assistant turn), or its
   ``trajectory`` over the ``messages`` scaffold. A prompt that yields no action token, or fails to
   tokenize, is dropped with a warning. If every prompt is dropped the run is refused.
2. The rollout prefix:
   * ``legacy_action_boundary`` (default): the training tokens before the first action position —
     the template's assistant header; the dummy content itself is discarded. A first action at
     position 0 has no prompt/assistant split: the prompt is kept (it still counts in the schedule)
     and all its candidates are consumed without updates.
   * ``chat_template``: every prompt (dropped ones included) re-rendered without trailing assistant
     turns and with ``enable_thinking=false``; a render or encode failure, or zero tokens, refuses
     the run.
3. The teacher prompt, only for prompts with ``teacher_extra_messages``: rendered like the
   ``chat_template`` prefix after merging the extras into the system message. The teacher scores the
   same sampled tokens after this prompt; targets shift by the difference of the prefix lengths and
   every pair must carry the same token id.

The training-path masks come from ``kiln_core.tokenization`` through ``encode_conversations``: a
prompt ending with assistant turns is passed as its earlier messages plus that final turn as the
response, which renders the same text unless that last turn carries ``tool_calls`` or a ``name``
(the builder's response slot holds text only). Where messages continue after the last assistant
turn, only the part up to that turn is rendered: the rollout prefix ends at the *first* action, so
the tokens after the last assistant turn are never used on-policy. A builder refusal — raised, or
reported on the result as ``problem`` (overlapping masks, ...) — drops the prompt, as Kiln drops a
prompt whose tokenization fails; the one exception is an action at position 0, which keeps the
prompt and skips its candidates (Kiln's "no prompt/assistant split"), whether the builder keeps
position 0 among the action positions or reports it as ``target_at_position_zero``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kiln_core.contracts.opd_prompt import OpdPrompt, kiln_prompt_value
from kiln_core.errors import Rejection
from kiln_core.on_policy.render import (
    RenderError,
    encode_text,
    render_for_generation,
    teacher_messages,
    teacher_prompt_refused,
    without_trailing_assistant,
)
from kiln_core.tokenization import Conversation, Segment, StudentTokenizer, TokenizationError, encode_conversations

__all__ = ["CandidateSequences", "DroppedPrompt", "PreparedPrompt", "PreparedPrompts", "candidate_sequences",
           "check_target_pairs", "prepare_prompts"]

LOG = logging.getLogger(__name__)
RENDERINGS = ("legacy_action_boundary", "chat_template")
POSITION_ZERO_CODE = "target_at_position_zero"  # the mask builder's name for an action at token 0


@dataclass(frozen=True)
class PreparedPrompt:
    """One kept prompt.

    Attributes:
        source_index: Index in the request's prompt list (dropped prompts counted).
        input_ids: ``int32`` training-path tokens of the prompt.
        action_positions: ``int32`` action positions of that tokenization (non-empty).
        rollout_prefix: ``int32`` tokens the student samples after, or None when the prompt has no
            prompt/assistant split (its candidates are consumed without updates).
        teacher_prefix: ``int32`` tokens the teacher sees before the sampled tokens, or None when the
            teacher scores the student's own sequence.
    """

    source_index: int
    input_ids: np.ndarray
    action_positions: np.ndarray
    rollout_prefix: np.ndarray | None
    teacher_prefix: np.ndarray | None

    @property
    def skipped(self) -> bool:
        """True when no candidate of this prompt can train (no prompt/assistant split)."""
        return self.rollout_prefix is None


@dataclass(frozen=True)
class DroppedPrompt:
    """A prompt left out of the schedule, and why (Kiln logs a warning and continues)."""

    source_index: int
    reason: str


@dataclass(frozen=True)
class PreparedPrompts:
    """The kept prompts in request order, the dropped ones, and what they were prepared with."""

    prompts: tuple[PreparedPrompt, ...]
    dropped: tuple[DroppedPrompt, ...]
    source_count: int
    rendering: str

    @property
    def source_indices(self) -> list[int]:
        """Kiln's ``prepared_source_indices`` (recorded in the checkpoint's auxiliary state)."""
        return [prompt.source_index for prompt in self.prompts]

    def candidates_per_epoch(self, samples_per_prompt: int) -> int:
        """Kept prompts × samples per prompt (Kiln's ``candidates_per_epoch``)."""
        return len(self.prompts) * samples_per_prompt


def prepare_prompts(prompts: Sequence[OpdPrompt], student: StudentTokenizer, *,
                    rendering: str = "legacy_action_boundary") -> PreparedPrompts:
    """Tokenize prompts with the training path and build their rollout and teacher prefixes.

    Args:
        prompts: The request's prompts, in order.
        student: The student's tokenizer and chat template.
        rendering: ``legacy_action_boundary`` or ``chat_template`` (``config.rollout_prompt_rendering``).

    Returns:
        ``PreparedPrompts``; kept prompts keep their source order.

    Raises:
        Rejection: ``no_valid_prompts`` when every prompt is dropped; ``rollout_render_failed`` /
            ``teacher_prompt_render_failed`` when a required render fails or encodes to nothing.

    Example:
        >>> prepared = prepare_prompts(request.prompts, load_student_tokenizer("./student"))  # doctest: +SKIP
        >>> prepared.candidates_per_epoch(64)  # doctest: +SKIP
        128
    """
    if rendering not in RENDERINGS:
        raise ValueError(f"unknown rollout_prompt_rendering {rendering!r}")
    values = [kiln_prompt_value(prompt) for prompt in prompts]
    encoded = _tokenize(student, [_training_conversation(value) for value in values])

    kept: list[tuple[int, Any]] = []
    dropped: list[DroppedPrompt] = []
    for index, result in enumerate(encoded):
        if isinstance(result, Exception):
            LOG.warning("skipping OPD prompt %d: %s", index, result)
            dropped.append(DroppedPrompt(index, f"tokenization failed: {result}"))
        elif (problem := _refusal(result)) is not None:
            LOG.warning("skipping OPD prompt %d: %s", index, problem)
            dropped.append(DroppedPrompt(index, problem))
        elif result is None or result.action_positions.size == 0:
            LOG.warning("skipping OPD prompt %d with no action tokens", index)
            dropped.append(DroppedPrompt(index, "no action tokens"))
        else:
            kept.append((index, result))
    if not kept:
        raise Rejection("no_valid_prompts", "opd_train: no valid prompts after tokenization "
                        f"({len(prompts)} prompts, none with an action token)", field="prompts")

    rollout_prefixes = _chat_template_prefixes(student, values) if rendering == "chat_template" else None
    teacher_prefixes = _teacher_prefixes(student, values)
    prepared = []
    for index, result in kept:
        if rollout_prefixes is not None:
            prefix = rollout_prefixes[index]
        else:
            first_action = int(result.action_positions[0])
            prefix = result.input_ids[:first_action] if 0 < first_action < result.input_ids.shape[0] else None
            if prefix is None:
                LOG.warning("skipping OPD prompt %d with no prompt/assistant split", index)
        prepared.append(PreparedPrompt(
            source_index=index,
            input_ids=np.asarray(result.input_ids, dtype=np.int32),
            action_positions=np.asarray(result.action_positions, dtype=np.int32),
            rollout_prefix=None if prefix is None else np.asarray(prefix, dtype=np.int32),
            teacher_prefix=teacher_prefixes[index],
        ))
    return PreparedPrompts(tuple(prepared), tuple(dropped), len(prompts), rendering)


def _refusal(result: Any) -> str | None:
    """Why the mask builder refuses a prompt's tokenization, if it reports one (``problem``); None otherwise.

    A first action at position 0 is not a refusal here: on-policy that prompt is kept, and its
    candidates are consumed without updates (no prompt/assistant split).
    """
    problem = getattr(result, "problem", None)
    if problem is None or problem.code == POSITION_ZERO_CODE:
        return None
    return f"{problem.code}: {problem.message}"


def _training_conversation(value: dict[str, Any]) -> Conversation | None:
    """The mask builder's input for one prompt (None when there is nothing to supervise)."""
    messages = value["messages"]
    if value.get("trajectory"):
        segments = [Segment(role=s["role"], content=s["content"], kind=s["kind"], tool_call_id=s.get("tool_call_id"),
                            warning_prefix_len=s.get("warning_prefix_len") or 0) for s in value["trajectory"]]
        return Conversation(messages=messages, teacher_response="", trajectory=segments)
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        return None  # rendered alone it holds no assistant span: no action token
    return Conversation(messages=messages[:last_assistant], teacher_response=messages[last_assistant]["content"])


def _tokenize(student: StudentTokenizer, conversations: list[Conversation | None]) -> list[Any]:
    """Encode in one batch; when the batch fails, one by one so that only the failing prompts drop."""
    present = [c for c in conversations if c is not None]
    try:
        encoded = iter(encode_conversations(student, present) if present else [])
        return [None if c is None else next(encoded) for c in conversations]
    except (TokenizationError, Rejection):
        results: list[Any] = []
        for conversation in conversations:
            if conversation is None:
                results.append(None)
                continue
            try:
                results.append(encode_conversations(student, [conversation])[0])
            except (TokenizationError, Rejection) as error:
                results.append(error)
        return results


def _render_tokens(student: StudentTokenizer, messages: list[dict[str, Any]]) -> np.ndarray:
    text = render_for_generation(student.chat_template, messages, enable_thinking=False)
    tokens = encode_text(student.tokenizer, text)
    if tokens.size == 0:
        raise RenderError("encoded to zero tokens")
    return tokens


def _chat_template_prefixes(student: StudentTokenizer, values: list[dict[str, Any]]) -> list[np.ndarray]:
    prefixes = []
    for index, value in enumerate(values):
        try:
            prefixes.append(_render_tokens(student, without_trailing_assistant(value["messages"])))
        except RenderError as error:
            raise Rejection("rollout_render_failed", f"opd_train: render rollout chat template for prompt {index}: "
                            f"{error}", field=f"prompts[{index}]") from None
    return prefixes


def _teacher_prefixes(student: StudentTokenizer, values: list[dict[str, Any]]) -> list[np.ndarray | None]:
    prefixes: list[np.ndarray | None] = []
    for index, value in enumerate(values):
        extra = value.get("teacher_extra_messages")
        if not extra:
            prefixes.append(None)
            continue
        try:
            prefixes.append(_render_tokens(student, teacher_messages(value["messages"], extra)))
        except RenderError as error:
            raise teacher_prompt_refused(index, error) from None
    return prefixes


@dataclass(frozen=True)
class CandidateSequences:
    """What one sampled candidate trains on and what the teacher is asked to score.

    Attributes:
        student_ids: ``int32`` rollout prefix ‖ sampled tokens.
        student_positions: ``int32`` the sampled tokens' positions (every one is a target).
        teacher_ids: ``int32`` the teacher's sequence (``student_ids`` when symmetric).
        teacher_positions: ``int32`` the same targets in the teacher's sequence.
    """

    student_ids: np.ndarray
    student_positions: np.ndarray
    teacher_ids: np.ndarray
    teacher_positions: np.ndarray


def candidate_sequences(prompt: PreparedPrompt, sampled: Sequence[int]) -> CandidateSequences:
    """Pair a rollout with its teacher query (``opd.rs`` · ``opd_train`` loop, ``prepare_opd_kernel_inputs``).

    Raises:
        ValueError: the prompt is skipped or nothing was sampled (such candidates are not scored).

    Example:
        >>> prefix = np.array([5, 6], np.int32)
        >>> candidate_sequences(PreparedPrompt(0, prefix, prefix[1:], prefix, None), [7]).student_positions
        array([2], dtype=int32)
    """
    if prompt.rollout_prefix is None or len(sampled) == 0:
        raise ValueError("only a non-empty rollout of a prompt with a rollout prefix is scored")
    tokens = np.asarray(sampled, dtype=np.int32)
    prefix = prompt.rollout_prefix
    student_ids = np.concatenate([prefix, tokens])
    student_positions = np.arange(prefix.shape[0], student_ids.shape[0], dtype=np.int32)
    if prompt.teacher_prefix is None:
        return CandidateSequences(student_ids, student_positions, student_ids, student_positions)
    teacher_ids = np.concatenate([prompt.teacher_prefix, tokens])
    # Kiln checks that every (student, teacher) target pair carries the same id; both sequences end
    # with the same sampled tokens, so the shifted positions pair them by construction.
    teacher_positions = (student_positions - prefix.shape[0] + prompt.teacher_prefix.shape[0]).astype(np.int32)
    return CandidateSequences(student_ids, student_positions, teacher_ids, teacher_positions)


def check_target_pairs(sequences: CandidateSequences) -> None:
    """Kiln's asymmetric pairing rule: target i carries the same token id on both sides.

    ``candidate_sequences`` pairs correctly by construction; this guards sequences that come from
    elsewhere (a stored rollout read back) before the teacher scores them.

    Raises:
        Rejection: ``asymmetric_target_mismatch`` (Kiln's message), or ``invalid_rollout`` when the
            two sides have different target counts or a target lies outside its sequence.
    """
    student_positions, teacher_positions = sequences.student_positions, sequences.teacher_positions
    if student_positions.shape != teacher_positions.shape:
        raise Rejection("invalid_rollout", f"teacher_active_positions.len() ({teacher_positions.shape[0]}) != "
                        f"active_positions.len() ({student_positions.shape[0]})")
    for name, ids, positions in (("student", sequences.student_ids, student_positions),
                                 ("teacher", sequences.teacher_ids, teacher_positions)):
        if positions.size and (positions.min() < 1 or positions.max() >= ids.shape[0]
                               or np.any(np.diff(positions) <= 0)):
            raise Rejection("invalid_rollout", f"{name} target positions must be strictly increasing, "
                            f"at least 1 and inside the {ids.shape[0]}-token sequence")
    mismatch = np.flatnonzero(sequences.student_ids[student_positions] != sequences.teacher_ids[teacher_positions])
    if mismatch.size:
        i = int(mismatch[0])
        raise Rejection(
            "asymmetric_target_mismatch",
            f"asymmetric target pair {i} has student token {sequences.student_ids[student_positions[i]]} at "
            f"{student_positions[i]} but teacher token {sequences.teacher_ids[teacher_positions[i]]} at "
            f"{teacher_positions[i]}",
        )
