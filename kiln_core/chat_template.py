"""The student's tokenizer and chat template: loading, rendering as Kiln renders, byte-exact encoding.

Kiln renders a conversation in two ways, and the mask builders above this module use both:

* **Kiln's ordinary render** (``KilnTokenizer::apply_chat_template``, crates/kiln-core/src/tokenizer.rs),
  used for trajectories: every message is ``{role, content}`` only, ``add_generation_prompt`` is
  true, ``bos_token`` and ``eos_token`` are empty strings, ``tools`` and ``tool_choice`` are null.
* **The training render** (``apply_chat_template_for_training_with_spans``, used by
  crates/kiln-train/src/trainer/sft_data.rs), used without a trajectory: the same context with
  ``add_generation_prompt`` false, and the assistant spans the template marks with ``{% generation %}``
  blocks.

Neither render hands the template the tokenizer's BOS or EOS, and nothing encodes with special tokens: a
template that writes ``{{ bos_token }}`` (Gemma, Llama 3, Mistral) or ``eos_token`` (Mistral) renders as
Kiln trains it, without them (docs/chat-templates.md).

Kiln encodes with the Rust ``tokenizers`` crate, whose offsets are *byte* offsets; the Python binding
reports *character* offsets. ``encode_texts`` converts them back to bytes exactly, including tokens
that split one multi-byte character (byte-level BPE), because Kiln's warning filter trims a byte
count that may end inside a character.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kiln_core.canonical import sha256_hex
from kiln_core.contracts.example import normalize_content
from kiln_core.errors import TokenizationError
from kiln_core.strict_json import NestingTooDeep, loads_nesting_limited

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Fields of a chat message Kiln's ChatMessage carries to the training template (kiln-core tokenizer.rs).
TRAINING_MESSAGE_FIELDS = ("role", "content", "tool_calls", "name", "tool_call_id")


@dataclass(frozen=True)
class Segment:
    """One trajectory segment, normalized (content is text, kind is explicit).

    ``warning_prefix_len`` is a byte count; it may exceed the content (Kiln clamps it).
    """

    role: str
    content: str
    kind: str = "context"
    tool_call_id: str | None = None
    warning_prefix_len: int = 0


@dataclass(frozen=True)
class Conversation:
    """What the mask builders need from one example.

    ``messages`` are plain dicts with string ``content`` (null → "", parts → joined text).
    """

    messages: list[dict[str, Any]]
    teacher_response: str
    trajectory: list[Segment] | None = None


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

    from kiln_core.identity.hashing import IdentityHashError, model_vocab_size

    model_dir = str(model_dir)
    if not Path(model_dir).is_dir():
        raise TokenizationError(f"student directory {model_dir} does not exist")
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


# --- rendering -------------------------------------------------------------------------------------


def render_kiln(student: StudentTokenizer, chats: Sequence[list[dict[str, Any]]]) -> list[str]:
    """Kiln's ordinary render of each chat: ``{role, content}`` only, generation prompt on, empty BOS/EOS.

    Raises:
        TokenizationError: The template failed to render (the first failing chat).
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    plain = [[{"role": m["role"], "content": m["content"]} for m in chat] for chat in chats]
    try:
        texts, _ = render_jinja_template(
            conversations=plain,
            chat_template=student.chat_template,
            add_generation_prompt=True,
            tools=None,
            tool_choice=None,
            bos_token="",
            eos_token="",
        )
    except Exception as error:  # a user template can raise anything
        raise TokenizationError(f"chat template failed to render: {error}") from None
    return list(texts)


def render_training(
    student: StudentTokenizer, chats: Sequence[list[dict[str, Any]]], *, with_spans: bool
) -> tuple[list[str], list[list[tuple[int, int]]] | None]:
    """The training render of each chat, and the character spans of its ``{% generation %}`` blocks.

    Returns:
        ``(texts, spans)``; ``spans`` is None unless ``with_spans`` and the template has blocks.

    Raises:
        TokenizationError: The template failed to render (the first failing chat).
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    wanted = with_spans and student.has_generation_blocks
    messages = [[training_message(m) for m in chat] for chat in chats]
    try:
        texts, spans = render_jinja_template(
            conversations=messages,
            chat_template=student.chat_template,
            return_assistant_tokens_mask=wanted,
            add_generation_prompt=False,
            bos_token="",
            eos_token="",
        )
    except Exception as error:  # a user template can raise anything
        raise TokenizationError(f"chat template failed to render: {error}") from None
    return list(texts), ([list(s) for s in spans] if wanted else None)


def training_message(message: dict[str, Any]) -> dict[str, Any]:
    """The fields of a message Kiln hands the training template (unknown fields never reach it).

    Like Kiln's renderer (kiln-core tokenizer.rs ``deserialize_arguments_in_place``), a tool call's
    ``arguments`` given as a JSON string reaches the template parsed, in both the OpenAI
    ``{function: {name, arguments}}`` envelope and the flat ``{name, arguments}`` one.
    """
    kept = {key: message[key] for key in TRAINING_MESSAGE_FIELDS if message.get(key) is not None}
    if isinstance(kept.get("tool_calls"), list):
        kept["tool_calls"] = [_with_parsed_arguments(call, nested=True) for call in kept["tool_calls"]]
    return kept


def _not_json(literal: str) -> Any:
    raise ValueError(f"{literal} is not JSON")  # serde_json refuses NaN and Infinity


def _with_parsed_arguments(call: Any, *, nested: bool) -> Any:
    if not isinstance(call, dict):
        return call
    call = dict(call)
    if isinstance(call.get("arguments"), str):
        try:
            call["arguments"] = loads_nesting_limited(call["arguments"], parse_constant=_not_json)
        except (ValueError, NestingTooDeep):
            pass  # not JSON serde_json would read: left as text for the template to decide
    if nested and isinstance(call.get("function"), dict):
        call["function"] = _with_parsed_arguments(call["function"], nested=False)
    return call


# --- encoding --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedText:
    """One rendered text, tokenized without special tokens, with Kiln's byte offsets.

    Attributes:
        text: The rendered text.
        data: Its UTF-8 bytes (what Kiln searches in).
        ids: ``int32 [n]`` token ids.
        starts: ``int64 [n]`` byte offset where each token starts.
        ends: ``int64 [n]`` byte offset where each token ends (``start == end``: zero width).
        char_to_byte: ``int64 [len(text) + 1]`` byte offset of each character, or None for ASCII.
    """

    text: str
    data: bytes
    ids: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    char_to_byte: np.ndarray | None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def byte_offset(self, char_offset: int) -> int:
        """The byte offset of a character offset of ``text``."""
        return char_offset if self.char_to_byte is None else int(self.char_to_byte[char_offset])

    def overlapping(self, start: int, end: int) -> np.ndarray:
        """Tokens of non-zero width overlapping the byte range ``[start, end)`` (Kiln's marking rule)."""
        return (self.starts != self.ends) & (self.starts < end) & (self.ends > start)


def encode_texts(student: StudentTokenizer, texts: Sequence[str]) -> list[EncodedText]:
    """Tokenize texts in one batch, as Kiln's ``encode_with_offsets`` does (no special tokens added)."""
    # The Rust backend directly: the transformers wrapper's per-example conversions cost more than
    # the tokenization itself on large corpora.
    encodings = student.tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [_with_byte_offsets(text, encoding) for text, encoding in zip(texts, encodings)]


def count_tokens(student: StudentTokenizer, texts: Sequence[str]) -> list[int]:
    """Number of tokens of each text (Kiln's ``encode(text).len()``)."""
    if not texts:
        return []
    encodings = student.tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [len(encoding.ids) for encoding in encodings]


def _with_byte_offsets(text: str, encoding) -> EncodedText:
    data = text.encode("utf-8")
    ids = np.asarray(encoding.ids, dtype=np.int32)
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    if len(data) == len(text):  # ASCII: characters are bytes
        return EncodedText(text, data, ids, offsets[:, 0].copy(), offsets[:, 1].copy(), None)
    char_to_byte = _char_to_byte(text)
    starts, ends = char_to_byte[offsets[:, 0]], char_to_byte[offsets[:, 1]]
    _split_characters(encoding.tokens, offsets, char_to_byte, starts, ends)
    return EncodedText(text, data, ids, starts, ends, char_to_byte)


def _char_to_byte(text: str) -> np.ndarray:
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (codepoints >= 0x80).astype(np.int64) + (codepoints >= 0x800) + (codepoints >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)


def _split_characters(tokens, offsets: np.ndarray, char_to_byte: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
    """Move token boundaries that fall inside a multi-byte character to the byte where they fall.

    The Python binding gives every token that holds part of a character the whole character, so two
    neighbours share it; the raw bytes of the left token say how many of the character's bytes are
    its own.
    """
    shared = np.flatnonzero(offsets[:-1, 1] > offsets[1:, 0])  # token i and i + 1 share a character
    for i in shared:
        character = int(offsets[i + 1, 0])
        first, last = int(char_to_byte[character]), int(char_to_byte[character + 1])
        raw = _token_bytes(tokens[i])
        if starts[i] > first:  # token i is itself a middle piece of the character
            boundary = int(starts[i]) + len(raw)
        else:
            boundary = first + _incomplete_tail(raw)
        if first < boundary < last:
            ends[i] = boundary
            starts[i + 1] = boundary


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's printable stand-ins for raw bytes), character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters)}


def _token_bytes(token: str) -> bytes:
    """The raw bytes a token stands for: byte-fallback ``<0xHH>``, byte-level BPE, or its UTF-8."""
    fallback = _BYTE_FALLBACK_TOKEN.fullmatch(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    alphabet = _byte_level_alphabet()
    try:
        return bytes(alphabet[character] for character in token)
    except KeyError:
        return token.encode("utf-8")


def _incomplete_tail(raw: bytes) -> int:
    """How many bytes at the end of ``raw`` begin a UTF-8 character they do not finish."""
    for back in range(1, min(4, len(raw)) + 1):
        byte = raw[-back]
        if byte & 0xC0 != 0x80:  # a lead (or ASCII) byte
            needed = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return back if back < needed else 0
    return 0
