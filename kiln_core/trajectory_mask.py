"""Kiln's trajectory mask builder, rule for rule (crates/kiln-train/src/trajectory_mask.rs).

``messages`` then every segment, each as ``{role, content}`` only, are rendered once with Kiln's
ordinary render (``chat_template.render_kiln``) and tokenized with byte offsets. Then:

1. **Byte search** from the start of the text, with a cursor:

   * a ``context`` segment only moves the cursor: past its ``<|im_start|>{role}\\n`` if found, then
     past the next ``<|im_end|>`` if found;
   * an ``action`` segment is the content between the next ``<|im_start|>{role}\\n`` and the
     ``<|im_end|>`` after it;
   * an ``observation`` segment is the content between the next ``<tool_response>\\n`` and the
     ``\\n</tool_response>`` after it; with the warning filter on (Kiln's default) the env mask starts
     ``warning_prefix_len`` bytes in, clamped to the content.

   A token is marked when it has non-zero width and overlaps the range. Each supervised segment
   whose content overlaps at least one token records its token span; an observation's span width,
   before any trimming, is its share of ECHO's |O|.
2. If a marker is missing, or fewer spans were recorded than there are action and observation
   segments (an empty segment records none), every mask is rebuilt by **cumulative prefix
   re-tokenization**: supervised segment *i* marks token positions
   ``[len(render(prompt + segments[:i])), min(len(render(prompt + segments[:i+1])), n))``, whole
   token deltas with no warning trimming.

Kiln then requires the action and env masks to be disjoint; a token in both is an error, never
repaired (it surfaces as the ``overlapping_masks`` rule).

Example:
    >>> masks = build_trajectory_masks(student, conversation, encoded)  # doctest: +SKIP
    >>> masks.action.sum(), masks.observation_tokens  # doctest: +SKIP
    (8, 6)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln_core.chat_template import (
    Conversation,
    EncodedText,
    Segment,
    StudentTokenizer,
    count_tokens,
    render_kiln,
)

MESSAGE_END = b"<|im_end|>"
TOOL_RESPONSE_OPEN = b"<tool_response>\n"
TOOL_RESPONSE_CLOSE = b"\n</tool_response>"
SUPERVISED_KINDS = ("action", "observation")


@dataclass(frozen=True)
class TrajectoryMasks:
    """The masks Kiln builds for one trajectory.

    Attributes:
        action: ``bool [n]`` action targets.
        env_full: ``bool [n]`` observation tokens with no warning trimming (``warning_filter`` off,
            or ``env_mask_mode: full_obs``).
        env_filtered: ``bool [n]`` observation tokens under Kiln's default mask config (warning
            filter on, ``env_only``): the warning prefix left out.
        spans: ``(first token, end token, kind)`` of each supervised segment that marked tokens.
        strategy: ``byte_search`` or ``prefix_tokenization``.
    """

    action: np.ndarray
    env_full: np.ndarray
    env_filtered: np.ndarray
    spans: list[tuple[int, int, str]]
    strategy: str

    @property
    def observation_tokens(self) -> int:
        """ECHO's |O|: the summed width of the observation spans, before warning trimming."""
        return sum(end - start for start, end, kind in self.spans if kind == "observation" and end > start)

    def first_overlap(self) -> int | None:
        """The first position marked both action and env (Kiln's default masks), or None."""
        both = np.flatnonzero(self.action & self.env_filtered)
        return int(both[0]) if both.size else None


def trajectory_chat(conversation: Conversation) -> list[dict[str, Any]]:
    """The message list Kiln renders: the prompt messages, then every segment, ``{role, content}`` only."""
    prompt = [{"role": m["role"], "content": m["content"]} for m in conversation.messages]
    return prompt + [{"role": s.role, "content": s.content} for s in conversation.trajectory or ()]


def supervised_count(segments: list[Segment]) -> int:
    return sum(segment.kind in SUPERVISED_KINDS for segment in segments)


def build_trajectory_masks(student: StudentTokenizer, conversation: Conversation, encoded: EncodedText) -> TrajectoryMasks:
    """Kiln's masks for one trajectory: byte search, else cumulative prefix re-tokenization.

    Args:
        student: The student tokenizer (the fallback renders prefixes with it).
        conversation: The example; ``trajectory`` is non-empty.
        encoded: Its ``trajectory_chat`` rendered by ``render_kiln`` and encoded.

    Raises:
        TokenizationError: A prefix render failed in the fallback.
    """
    segments = list(conversation.trajectory or ())
    masks = byte_search(segments, encoded)
    if masks is None or len(masks.spans) != supervised_count(segments):
        masks = prefix_tokenization(student, conversation, len(encoded))
    return masks


def byte_search(segments: list[Segment], encoded: EncodedText) -> TrajectoryMasks | None:
    """Kiln's byte-search strategy, or None when a marker it needs is missing."""
    text, n = encoded.data, len(encoded)
    action, env_full, env_filtered = (np.zeros(n, dtype=bool) for _ in range(3))
    spans: list[tuple[int, int, str]] = []
    cursor = 0
    for segment in segments:
        marker = b"<|im_start|>" + segment.role.encode("utf-8") + b"\n"
        if segment.kind not in SUPERVISED_KINDS:
            found = text.find(marker, cursor)
            position = found + len(marker) if found >= 0 else cursor
            end = text.find(MESSAGE_END, position)
            cursor = end + len(MESSAGE_END) if end >= 0 else position
            continue
        if segment.kind == "observation":
            opened = text.find(TOOL_RESPONSE_OPEN, cursor)
            if opened < 0:
                return None
            start = opened + len(TOOL_RESPONSE_OPEN)
            end = text.find(TOOL_RESPONSE_CLOSE, start)
            if end < 0:
                return None
            cursor = end + len(TOOL_RESPONSE_CLOSE)
        else:
            opened = text.find(marker, cursor)
            if opened < 0:
                return None
            start = opened + len(marker)
            end = text.find(MESSAGE_END, start)
            if end < 0:
                return None
            cursor = end + len(MESSAGE_END)
        whole = encoded.overlapping(start, end)
        if segment.kind == "action":
            action |= whole
        else:
            env_full |= whole
            env_filtered |= encoded.overlapping(min(start + segment.warning_prefix_len, end), end)
        marked = np.flatnonzero(whole)
        if marked.size:
            spans.append((int(marked[0]), int(marked[-1]) + 1, segment.kind))
    return TrajectoryMasks(action, env_full, env_filtered, spans, "byte_search")


def prefix_tokenization(student: StudentTokenizer, conversation: Conversation, n: int) -> TrajectoryMasks:
    """Kiln's fallback: each supervised segment marks the tokens its turn adds to the rendered prefix."""
    chat = trajectory_chat(conversation)
    prompt = len(conversation.messages)
    prefixes = [chat[: prompt + i] for i in range(len(chat) - prompt + 1)]
    rendered = render_kiln(student, [p for p in prefixes if p])
    lengths = iter(count_tokens(student, rendered))
    sizes = [next(lengths) if prefix else 0 for prefix in prefixes]  # an empty list renders to no tokens
    action, env = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    spans: list[tuple[int, int, str]] = []
    for i, segment in enumerate(conversation.trajectory or ()):
        if segment.kind not in SUPERVISED_KINDS:
            continue
        start, end = sizes[i], min(sizes[i + 1], n)
        if end <= start:
            continue
        (action if segment.kind == "action" else env)[start:end] = True
        spans.append((start, end, segment.kind))
    return TrajectoryMasks(action, env, env.copy(), spans, "prefix_tokenization")
