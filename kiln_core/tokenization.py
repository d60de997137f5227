"""The student's tokenizer and chat template, and the action/observation masks (DESIGN.md decision 3).

Without ``trajectory``: the conversation ``messages + [assistant: teacher_response]`` is rendered
once; action targets are the tokens overlapping the character spans the template marks with
``{% generation %}`` (the transformers assistant mask). A template without generation blocks falls
back to ChatML: from just after ``<|im_start|>assistant\\n`` through ``<|im_end|>`` and the newline
after it, for every assistant turn.

With ``trajectory``: ``messages + segments`` is rendered once; the tokens overlapping a segment's
content are that segment's tokens. ``kind`` decides supervision (``action`` → action targets,
``observation`` → ECHO env targets, ``context``/missing → none); ``role`` only affects rendering.
Observation tokens entirely inside the first ``warning_prefix_len`` content bytes are flagged so the
trainer can leave them out of the ECHO loss while still counting them in |O|.

Position 0 has no causal row and is never a target. Only fast tokenizers are accepted, and every
corpus is encoded in one batched call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kiln_core.canonical import sha256_hex
from kiln_core.errors import Rejection

CHATML_ASSISTANT_HEADER = "<|im_start|>assistant\n"
CHATML_END = "<|im_end|>"
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TokenizationError(Rejection, ValueError):
    """A student directory or an example that cannot be tokenized (a rejection everywhere)."""

    def __init__(self, message: str, code: str = "invalid_student") -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Segment:
    """One trajectory segment, normalized (content is text, kind is explicit)."""

    role: str
    content: str
    kind: str = "context"
    tool_call_id: str | None = None
    warning_prefix_len: int = 0


@dataclass(frozen=True)
class Conversation:
    """What the mask builder needs from one example.

    ``messages`` are plain dicts with string ``content`` (null → "", parts → joined text).
    """

    messages: list[dict[str, Any]]
    teacher_response: str
    trajectory: list[Segment] | None = None


@dataclass(frozen=True)
class EncodedConversation:
    """Token ids and target positions of one rendered conversation (all ``int32`` / ``bool``)."""

    input_ids: np.ndarray
    action_positions: np.ndarray
    env_positions: np.ndarray
    env_in_warning_prefix: np.ndarray


@dataclass(frozen=True)
class StudentTokenizer:
    """A student's fast tokenizer, chat template and logit width.

    Attributes:
        tokenizer: The transformers fast tokenizer.
        chat_template: The template text used for rendering.
        has_generation_blocks: Whether the template marks assistant spans with ``{% generation %}``.
        vocab_size: The model's logit width from ``config.json`` (may exceed the tokenizer size).
        model_dir: Where it was loaded from.
    """

    tokenizer: Any
    chat_template: str
    has_generation_blocks: bool
    vocab_size: int
    model_dir: str

    def identity(self) -> dict[str, Any]:
        """Digests that pin what this tokenizer does (recorded in ``admission.json``)."""
        from kiln_core.identity.hashing import tokenizer_config_sha256, tokenizer_vocab_sha256

        return {
            "tokenizer_vocab_sha256": tokenizer_vocab_sha256(self.tokenizer),
            "tokenizer_config_sha256": tokenizer_config_sha256(self.tokenizer),
            "chat_template_sha256": sha256_hex(self.chat_template.encode("utf-8")),
            "vocab_size": self.vocab_size,
        }


def load_student_tokenizer(model_dir: str | Path) -> StudentTokenizer:
    """Load a student's fast tokenizer and chat template.

    Args:
        model_dir: A directory with ``config.json``, ``tokenizer.json`` and a chat template
            (``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``).

    Raises:
        TokenizationError: No fast tokenizer, no chat template, or no usable ``vocab_size``.

    Example:
        >>> student = load_student_tokenizer("./student")  # doctest: +SKIP
        >>> student.vocab_size  # doctest: +SKIP
        400
    """
    from transformers import AutoTokenizer

    model_dir = str(model_dir)
    if not Path(model_dir).is_dir():
        raise TokenizationError(f"student directory {model_dir} does not exist")
    from kiln_core.identity.hashing import IdentityHashError, model_vocab_size

    try:
        vocab_size = model_vocab_size(model_dir)
    except IdentityHashError as error:
        raise TokenizationError(f"student {model_dir}: {error}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, use_fast=True, local_files_only=True)
    except Exception as error:  # transformers raises many types for a broken dir
        raise TokenizationError(f"cannot load the tokenizer in {model_dir}: {error}") from None
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise TokenizationError(f"{model_dir}: only fast tokenizers (tokenizer.json) are supported")
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise TokenizationError(f"{model_dir} has no chat template")
    return StudentTokenizer(
        tokenizer=tokenizer,
        chat_template=template,
        has_generation_blocks=bool(_GENERATION_BLOCK.search(template)),
        vocab_size=vocab_size,
        model_dir=model_dir,
    )


def encode_conversations(student: StudentTokenizer, conversations: Sequence[Conversation]) -> list[EncodedConversation]:
    """Render and tokenize conversations in one batch and build their target masks.

    Returns:
        One ``EncodedConversation`` per input, in order.

    Raises:
        TokenizationError: With ``index`` set to the failing conversation.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    plain = [c for c in conversations if not c.trajectory]
    chats = [_conversation_messages(c) for c in conversations]
    template_kwargs = dict(student.tokenizer.special_tokens_map)
    try:
        texts, generation_spans = render_jinja_template(
            conversations=chats,
            chat_template=student.chat_template,
            return_assistant_tokens_mask=student.has_generation_blocks and bool(plain),
            add_generation_prompt=False,
            **template_kwargs,
        )
    except Exception as error:
        raise TokenizationError(f"chat template failed to render: {error}") from None
    # The Rust backend directly: the transformers wrapper's per-example conversions cost more than
    # the tokenization itself on large corpora.
    encodings = student.tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    prompt_texts = _render_prompt_scaffolds(student, conversations, template_kwargs)

    results = []
    for i, conversation in enumerate(conversations):
        ids = np.asarray(encodings[i].ids, dtype=np.int32)
        offsets = np.asarray(encodings[i].offsets, dtype=np.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], offsets[:, 1]
        text = texts[i]
        if conversation.trajectory:
            action, env, warning = _trajectory_masks(conversation, text, prompt_texts[i], starts, ends, i)
        else:
            spans = generation_spans[i] if student.has_generation_blocks else _chatml_assistant_spans(text)
            action = _overlap_mask(starts, ends, spans)
            env = np.zeros(len(ids), dtype=bool)
            warning = np.zeros(len(ids), dtype=bool)
        action[:1] = False  # position 0 has no causal row
        env[:1] = False
        env &= ~action  # the masks are disjoint; a token in both supervises the action
        env_positions = np.flatnonzero(env).astype(np.int32)
        results.append(
            EncodedConversation(
                input_ids=ids,
                action_positions=np.flatnonzero(action).astype(np.int32),
                env_positions=env_positions,
                env_in_warning_prefix=warning[env_positions],
            )
        )
    return results


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


def _conversation_messages(conversation: Conversation) -> list[dict[str, Any]]:
    if conversation.trajectory:
        tail = [_segment_message(s) for s in conversation.trajectory]
    else:
        tail = [{"role": "assistant", "content": conversation.teacher_response}]
    return list(conversation.messages) + tail


def _segment_message(segment: Segment) -> dict[str, Any]:
    message: dict[str, Any] = {"role": segment.role, "content": segment.content}
    if segment.tool_call_id is not None:
        message["tool_call_id"] = segment.tool_call_id
    return message


def _render_prompt_scaffolds(student, conversations, template_kwargs) -> list[str | None]:
    """For trajectory examples, the rendering of ``messages`` alone: segment search starts after it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    wanted = [i for i, c in enumerate(conversations) if c.trajectory and c.messages]
    scaffolds: list[str | None] = [None] * len(conversations)
    if not wanted:
        return scaffolds
    try:
        rendered, _ = render_jinja_template(
            conversations=[list(conversations[i].messages) for i in wanted],
            chat_template=student.chat_template,
            add_generation_prompt=False,
            **template_kwargs,
        )
    except Exception:
        return scaffolds  # fall back to searching from the start of the text
    for i, text in zip(wanted, rendered):
        scaffolds[i] = text
    return scaffolds


def _chatml_assistant_spans(text: str) -> list[tuple[int, int]]:
    """ChatML fallback: after each assistant header through ``<|im_end|>`` and a following newline."""
    spans = []
    cursor = 0
    while True:
        header = text.find(CHATML_ASSISTANT_HEADER, cursor)
        if header < 0:
            return spans
        start = header + len(CHATML_ASSISTANT_HEADER)
        end_marker = text.find(CHATML_END, start)
        if end_marker < 0:
            end = len(text)
        else:
            end = end_marker + len(CHATML_END)
            if text.startswith("\n", end):
                end += 1
        spans.append((start, end))
        cursor = end


def _overlap_mask(starts: np.ndarray, ends: np.ndarray, spans) -> np.ndarray:
    """True for tokens whose character range overlaps any span (the transformers assistant-mask rule)."""
    mask = np.zeros(starts.shape[0], dtype=bool)
    for span_start, span_end in spans:
        if span_end > span_start:
            mask |= (starts < span_end) & (ends > span_start)
    return mask


def _trajectory_masks(conversation, text, scaffold, starts, ends, index):
    cursor = len(scaffold) if scaffold is not None and text.startswith(scaffold) else 0
    n = starts.shape[0]
    action = np.zeros(n, dtype=bool)
    env = np.zeros(n, dtype=bool)
    kept = np.zeros(n, dtype=bool)
    for number, segment in enumerate(conversation.trajectory):
        if not segment.content:
            continue
        found = text.find(segment.content, cursor)
        if found < 0:
            raise TokenizationError(
                f"trajectory segment {number} content was not found in the rendered chat template"
            )
        span = (found, found + len(segment.content))
        cursor = span[1]
        if segment.kind == "action":
            action |= _overlap_mask(starts, ends, [span])
        elif segment.kind == "observation":
            env |= _overlap_mask(starts, ends, [span])
            prefix_chars = len(segment.content.encode("utf-8")[: segment.warning_prefix_len].decode("utf-8", "ignore"))
            kept |= _overlap_mask(starts, ends, [(span[0] + prefix_chars, span[1])])
    warning = env & ~kept
    return action, env, warning
