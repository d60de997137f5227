"""Token ids and target masks of every example, built exactly as Kiln builds them (docs/architecture.md, decision 3).

One implementation serves admission and ``kiln-flows score``: ``encode_conversations`` renders a
batch, tokenizes it in one call, and runs Kiln's mask builders on each example:

* without ``trajectory``: ``assistant_mask`` (Kiln's ``tokenize_for_training``): every assistant
  turn as the template's ``{% generation %}`` blocks mark it, else the ChatML fallback;
* with ``trajectory``: ``trajectory_mask`` (Kiln's ``build_masks_from_trajectory``): byte search
  for each segment's content, else cumulative prefix re-tokenization. ``kind`` decides supervision
  (``action`` → targets, ``observation`` → ECHO env targets, ``context`` → none); ``role`` only
  affects rendering.

What Kiln refuses is reported, never repaired: an example whose masks overlap, whose action mask
holds position 0 (no causal row), or that has no action target carries a ``MaskProblem`` with the
admission rule it breaks. Admission and scoring turn it into a rejection of that example's line.

The types and loaders of ``kiln_core.chat_template`` are re-exported here for callers that only
need "the tokenizer".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kiln_core.assistant_mask import assistant_chat, build_assistant_mask
from kiln_core.chat_template import (
    Conversation,
    EncodedText,
    Segment,
    StudentTokenizer,
    TokenizationError,
    encode_texts,
    load_student_tokenizer,
    normalize_content,
    render_kiln,
    render_training,
)
from kiln_core.trajectory_mask import build_trajectory_masks, trajectory_chat

__all__ = [
    "Conversation",
    "EncodedConversation",
    "MaskProblem",
    "Segment",
    "StudentTokenizer",
    "TokenizationError",
    "encode_conversations",
    "load_student_tokenizer",
    "normalize_content",
]


@dataclass(frozen=True)
class MaskProblem:
    """Why Kiln refuses an example's tokenization or masks.

    Attributes:
        code: The admission rule: ``invalid_record`` (the template or tokenizer refused it),
            ``overlapping_masks``, ``no_action_tokens`` or ``target_at_position_zero``.
        message: What happened, naming the token position where there is one.
    """

    code: str
    message: str


POSITION_ZERO = MaskProblem(
    "target_at_position_zero",
    "the action mask holds token position 0, which has no preceding logits row to score it from",
)


@dataclass(frozen=True)
class EncodedConversation:
    """Token ids and target positions of one rendered conversation.

    Attributes:
        input_ids: ``int32 [n]``.
        action_positions: ``int32 [A]`` reverse-KL targets (Kiln's action mask), increasing.
        env_positions: ``int32 [E]`` observation tokens with no warning trimming, increasing, ≥ 1
            (position 0 has no causal row and is never an ECHO target).
        env_in_warning_prefix: ``bool [E]`` True where Kiln's default warning filter leaves the token
            out of the env mask (it lies inside ``warning_prefix_len``).
        observation_tokens: ECHO's |O|: the observation segments' token span widths before trimming.
        problem: The rule Kiln's tokenization breaks, or None.
    """

    input_ids: np.ndarray
    action_positions: np.ndarray
    env_positions: np.ndarray
    env_in_warning_prefix: np.ndarray
    observation_tokens: int = 0
    problem: MaskProblem | None = None


def encode_conversations(student: StudentTokenizer, conversations: Sequence[Conversation]) -> list[EncodedConversation]:
    """Render and tokenize conversations in one batch and build Kiln's masks for each.

    Returns:
        One ``EncodedConversation`` per input, in order.

    Raises:
        TokenizationError: The chat template failed to render one of them (the caller retries
            one at a time to find which).

    Example:
        >>> (encoded,) = encode_conversations(student, [Conversation(messages, "Paris.")])  # doctest: +SKIP
        >>> encoded.action_positions  # doctest: +SKIP
        array([17, 18, 19, 20], dtype=int32)
    """
    plain = [i for i, c in enumerate(conversations) if not c.trajectory]
    agentic = [i for i, c in enumerate(conversations) if c.trajectory]
    chats: dict[int, list[dict]] = {}
    texts: dict[int, str] = {}
    spans: dict[int, list | None] = {}
    if plain:
        for i in plain:
            chats[i] = assistant_chat(conversations[i].messages, conversations[i].teacher_response)
        rendered, generation = render_training(student, [chats[i] for i in plain], with_spans=True)
        for k, i in enumerate(plain):
            texts[i], spans[i] = rendered[k], (generation[k] if generation is not None else None)
    if agentic:
        rendered = render_kiln(student, [trajectory_chat(conversations[i]) for i in agentic])
        texts.update(zip(agentic, rendered))
    order = range(len(conversations))
    encoded = encode_texts(student, [texts[i] for i in order])
    results = []
    for i, conversation in enumerate(conversations):
        if conversation.trajectory:
            results.append(_trajectory_example(student, conversation, encoded[i]))
        else:
            results.append(_plain_example(student, chats[i], encoded[i], spans[i]))
    return results


def _plain_example(student, chat, encoded: EncodedText, spans) -> EncodedConversation:
    action, refused = build_assistant_mask(student, chat, encoded, spans)
    problem = MaskProblem(*refused) if refused else (POSITION_ZERO if action[0] else None)
    return EncodedConversation(
        input_ids=encoded.ids,
        action_positions=np.flatnonzero(action).astype(np.int32),
        env_positions=np.zeros(0, dtype=np.int32),
        env_in_warning_prefix=np.zeros(0, dtype=bool),
        problem=problem,
    )


def _trajectory_example(student, conversation: Conversation, encoded: EncodedText) -> EncodedConversation:
    if len(encoded) == 0:
        masks, problem = None, MaskProblem("invalid_record", "build_masks_from_trajectory: empty tokenization result")
        action = env = kept = np.zeros(0, dtype=bool)
    else:
        masks = build_trajectory_masks(student, conversation, encoded)
        action, env, kept = masks.action, masks.env_full.copy(), masks.env_filtered
        problem = _trajectory_problem(masks)
    env[:1] = False  # no causal row: Kiln's ECHO kernel skips position 0 too
    env_positions = np.flatnonzero(env).astype(np.int32)
    return EncodedConversation(
        input_ids=encoded.ids,
        action_positions=np.flatnonzero(action).astype(np.int32),
        env_positions=env_positions,
        env_in_warning_prefix=~kept[env_positions],
        observation_tokens=masks.observation_tokens if masks else 0,
        problem=problem,
    )


def _trajectory_problem(masks) -> MaskProblem | None:
    overlap = masks.first_overlap()
    if overlap is not None:
        return MaskProblem(
            "overlapping_masks",
            f"action_mask and env_mask overlap at token index {overlap} ({masks.strategy}); Kiln refuses "
            f"a token that is both an action target and an observation",
        )
    if not masks.action.any():
        return MaskProblem("no_action_tokens", "the trajectory has no action tokens")
    return POSITION_ZERO if masks.action[0] else None
