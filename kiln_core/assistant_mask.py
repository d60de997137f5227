"""Kiln's action mask for an example without a trajectory (crates/kiln-train/src/trainer/sft_data.rs).

The conversation is ``messages + [{"role": "assistant", "content": teacher_response}]``, rendered once
with the training render (``chat_template.render_training``) and tokenized with byte offsets. Every
assistant turn is supervised, including assistant turns already inside ``messages``. In Kiln's order:

1. **Generation spans**: a template with ``{% generation %}`` blocks marks one span per assistant
   message (a different count is an error); each span marks the non-zero-width tokens overlapping it.
2. **ChatML fallback** (no generation blocks): from just after each ``<|im_start|>assistant\\n``
   through the next ``<|im_end|>`` and a ``\\n`` right after it. The search starts at the top of the
   text; if it finds a different number of spans than assistant messages, nothing is marked.
3. **Prefix renders**, only when nothing is marked yet: each assistant turn marks the bytes its turn
   adds to the training render of the messages before it; if the full text does not start with a
   prefix's render, the whole mask is redone by prefix re-tokenization (whole token deltas).

The example then needs at least 2 tokens and a marked token after position 0.

Example:
    >>> mask, problem = build_assistant_mask(student, chat, encoded, spans)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln_core.chat_template import EncodedText, StudentTokenizer, count_tokens, render_training

ASSISTANT_START = b"<|im_start|>assistant\n"
MESSAGE_END = b"<|im_end|>"


def assistant_chat(messages: list[dict[str, Any]], teacher_response: str) -> list[dict[str, Any]]:
    """The messages Kiln renders for a plain example: the prompt, then the teacher's response."""
    return list(messages) + [{"role": "assistant", "content": teacher_response}]


def build_assistant_mask(
    student: StudentTokenizer,
    chat: list[dict[str, Any]],
    encoded: EncodedText,
    generation_spans: list[tuple[int, int]] | None,
) -> tuple[np.ndarray, tuple[str, str] | None]:
    """Kiln's action mask for one plain conversation.

    Args:
        student: The student tokenizer (fallbacks render prefixes with it).
        chat: ``assistant_chat`` of the example.
        encoded: ``chat`` rendered by ``render_training`` and encoded.
        generation_spans: Character spans of the template's generation blocks, or None when the
            template has none.

    Returns:
        ``(mask, problem)``: ``problem`` is ``(code, message)`` when Kiln's tokenization refuses the
        example (``invalid_record`` or ``no_action_tokens``), else None.
    """
    n = len(encoded)
    if n == 0:
        return np.zeros(0, dtype=bool), ("invalid_record", "empty tokenization result")
    assistant_count = sum(message["role"] == "assistant" for message in chat)
    if generation_spans is not None:
        if len(generation_spans) != assistant_count:
            return np.zeros(n, dtype=bool), (
                "invalid_record",
                f"training template returned {len(generation_spans)} assistant spans for {assistant_count} "
                f"assistant messages",
            )
        mask = np.zeros(n, dtype=bool)
        for start, end in generation_spans:
            mask |= encoded.overlapping(encoded.byte_offset(start), encoded.byte_offset(end))
    else:
        mask = chatml_assistant_mask(encoded, assistant_count)
    if not mask.any():
        mask = prefix_render_mask(student, chat, encoded)
    if n < 2:
        return mask, ("no_action_tokens", f"example too short ({n} tokens)")
    if not mask[1:].any():
        return mask, ("no_action_tokens", "example has no supervised assistant tokens after next-token shift")
    return mask, None


def chatml_assistant_mask(encoded: EncodedText, expected: int) -> np.ndarray:
    """ChatML fallback: every assistant turn's content, ``<|im_end|>`` and the newline after it."""
    text = encoded.data
    mask = np.zeros(len(encoded), dtype=bool)
    found, search_from = 0, 0
    while expected:
        header = text.find(ASSISTANT_START, search_from)
        if header < 0:
            break
        start = header + len(ASSISTANT_START)
        end = text.find(MESSAGE_END, start)
        if end < 0:
            break
        end += len(MESSAGE_END)
        if text[end : end + 1] == b"\n":
            end += 1
        mask |= encoded.overlapping(start, end)
        found += 1
        search_from = end
    return mask if found == expected else np.zeros(len(encoded), dtype=bool)


def prefix_render_mask(student: StudentTokenizer, chat: list[dict[str, Any]], encoded: EncodedText) -> np.ndarray:
    """Each assistant turn marks the bytes it adds to the rendered prefix (token deltas if not a prefix)."""
    turns = [i for i, message in enumerate(chat) if message["role"] == "assistant"]
    chats = [chat[:i] for i in turns] + [chat[: i + 1] for i in turns]
    renders = iter(render_training(student, [c for c in chats if c], with_spans=False)[0])
    texts = [next(renders) if c else "" for c in chats]
    mask = np.zeros(len(encoded), dtype=bool)
    for k in range(len(turns)):
        before_text, prefix_text = texts[k], texts[len(turns) + k]
        start, end = len(before_text.encode("utf-8")), len(prefix_text.encode("utf-8"))
        if not encoded.text.startswith(prefix_text) or start > end:
            return prefix_tokenization_mask(student, chat, len(encoded))
        mask |= encoded.overlapping(start, min(end, len(encoded.data)))
    return mask


def prefix_tokenization_mask(student: StudentTokenizer, chat: list[dict[str, Any]], n: int) -> np.ndarray:
    """Kiln's ``label_mask_by_prefix_tokenization``: each assistant turn marks its token delta."""
    turns = [i for i, message in enumerate(chat) if message["role"] == "assistant"]
    renders = iter(render_training(student, [chat[:i] for i in turns if i] + [chat[: i + 1] for i in turns], with_spans=False)[0])
    before = [next(renders) if i else "" for i in turns]  # nothing before the first message: no tokens
    through = [next(renders) for _ in turns]
    starts, ends = count_tokens(student, before), count_tokens(student, through)
    mask = np.zeros(n, dtype=bool)
    for start, end in zip(starts, ends):
        mask[start : min(end, n)] = True
    return mask
