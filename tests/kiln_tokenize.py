"""Kiln's training tokenization, written again from Kiln's Rust source with Kiln's own template engine.

Independent of ``kiln_core``: a reference the mask tests compare kiln-flows with. Sources (github.com/ericflo/kiln,
852387a): ``crates/kiln-core/src/tokenizer.rs`` (``render_jinja_template_with``: a minijinja ``Environment`` with
its defaults, Python-compatible methods, a ``raise_exception`` function, and the context ``messages``, ``tools``
and ``tool_choice`` null, ``add_generation_prompt``, ``bos_token`` and ``eos_token`` both the empty string;
``apply_chat_template_for_training_with_spans``: ``add_generation_prompt`` false, and spans only for Kiln's pinned
Qwen3.5 template, so none here; ``encode``/``encode_with_offsets``: no special tokens added) and
``crates/kiln-train/src/trainer/sft_data.rs`` (``tokenize_for_training``: the ChatML span search, then prefix
renders, then prefix re-tokenization; at least 2 tokens and a label after position 0).

The texts here are ASCII, so the Python binding's character offsets are Kiln's byte offsets.
"""

from __future__ import annotations

from typing import Any

import minijinja

ASSISTANT_START = "<|im_start|>assistant\n"
MESSAGE_END = "<|im_end|>"


class KilnTemplateError(Exception):
    """Kiln's ``TokenizerError::ChatTemplate``: the template did not render."""


def kiln_render(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
    """Kiln's ``render_jinja_template_with`` for plain ``{role, content}`` messages."""

    def raise_exception(message: str) -> None:
        raise KilnTemplateError(message)

    environment = minijinja.Environment()
    environment.pycompat = True  # Kiln: minijinja_contrib::pycompat::unknown_method_callback
    environment.add_function("raise_exception", raise_exception)
    try:
        return environment.render_str(template, messages=[{"role": m["role"], "content": m["content"]}
                                                          for m in messages],
                                      tools=None, tool_choice=None, add_generation_prompt=add_generation_prompt,
                                      bos_token="", eos_token="")
    except KilnTemplateError:
        raise
    except Exception as error:  # minijinja wraps the function's error in its own
        raise KilnTemplateError(str(error)) from None


def kiln_tokenize_for_training(tokenizer, template: str, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
    """Kiln's ``tokenize_for_training``: ``(input_ids, label_mask)`` of a conversation, every assistant turn supervised.

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` (the student's ``tokenizer.json``).
        template: The chat template text.
        messages: The conversation, the teacher's response as its last assistant message.

    Raises:
        KilnTemplateError: the template refused the conversation or a prefix of it.
        ValueError: Kiln's "example too short" or "no supervised assistant tokens after next-token shift".
    """

    def render(chat):
        return kiln_render(template, chat, add_generation_prompt=False)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    full_text = render(messages)
    assert full_text.isascii(), "the reference compares character offsets with Kiln's byte offsets"
    encoding = encode(full_text)
    ids, offsets = list(encoding.ids), list(encoding.offsets)
    if not ids:
        raise ValueError("empty tokenization result")
    assistant_count = sum(m["role"] == "assistant" for m in messages)
    mask = _chatml_spans(full_text, offsets, assistant_count) or [False] * len(ids)
    if not any(mask):
        prefix: list[dict[str, Any]] = []
        for message in messages:
            if message["role"] == "assistant":
                before_text = render(prefix) if prefix else ""
                prefix.append(message)
                prefix_text = render(prefix)
                if not full_text.startswith(prefix_text) or len(before_text) > len(prefix_text):
                    mask = _by_prefix_tokenization(len(ids), messages, render, encode)
                    break
                _mark(mask, offsets, len(before_text), min(len(prefix_text), len(full_text)))
            else:
                prefix.append(message)
    if len(ids) < 2:
        raise ValueError(f"example too short ({len(ids)} tokens)")
    if not any(mask[1:]):
        raise ValueError("example has no supervised assistant tokens after next-token shift")
    return ids, mask


def _mark(mask: list[bool], offsets, start: int, end: int) -> None:
    for index, (token_start, token_end) in enumerate(offsets):
        if token_start != token_end and token_start < end and token_end > start:
            mask[index] = True


def _chatml_spans(text: str, offsets, expected: int) -> list[bool] | None:
    """``label_mask_from_rendered_assistant_spans``: header to ``<|im_end|>`` and one newline, per assistant turn."""
    mask = [False] * len(offsets)
    if expected == 0:
        return mask
    found, search_from = 0, 0
    while (start := text.find(ASSISTANT_START, search_from)) >= 0:
        content_start = start + len(ASSISTANT_START)
        end = text.find(MESSAGE_END, content_start)
        if end < 0:
            break
        end += len(MESSAGE_END)
        if text[end:end + 1] == "\n":
            end += 1
        _mark(mask, offsets, content_start, end)
        found += 1
        search_from = end
    return mask if found == expected else None


def _by_prefix_tokenization(n: int, messages, render, encode) -> list[bool]:
    """``label_mask_by_prefix_tokenization``: each assistant turn marks the tokens it adds to its prefix."""
    mask = [False] * n
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = len(encode(render(messages[: index + 1])).ids)
        before = len(encode(render(messages[:index])).ids) if index else 0
        for position in range(before, min(through, n)):
            mask[position] = True
    return mask
