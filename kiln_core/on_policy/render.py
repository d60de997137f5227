"""Chat-template rendering the way Kiln's tokenizer renders a prompt for generation.

Kiln's ``KilnTokenizer`` (``crates/kiln-core/src/tokenizer.rs`` · ``render_jinja_template``) renders
the template with ``add_generation_prompt`` true, ``bos_token`` and ``eos_token`` empty, messages as
``{role, content, tool_calls?, name?, tool_call_id?}`` (a tool call's JSON-string ``arguments`` parsed
into an object first), and encodes the text without adding special tokens. On-policy OPD renders
this way three times (``crates/kiln-train/src/opd.rs``): the ``chat_template`` rollout prefix and
the asymmetric teacher prompt (both with ``enable_thinking=false`` and trailing assistant turns
dropped), and the submit-time length preflight (``crates/kiln-server/src/api/training.rs`` ·
``exact_opd_admission_max_seq_len``, plain messages).

The training-path masks (where the legacy rollout prefix ends) come from ``kiln_core.tokenization``;
this module only renders prompts that end at the assistant cue.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from kiln_core.errors import Rejection

# Template variables Kiln sets itself; a suite's chat_template_kwargs may not name them (tokenizer.rs).
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "tool_choice", "add_generation_prompt", "bos_token", "eos_token")

# Kiln's ``eos_token_ids``: special added tokens with exactly these texts stop a rollout.
KILN_EOS_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|end|>", "</s>")


class RenderError(ValueError):
    """A chat template that failed to render, or text that failed to encode."""


def teacher_prompt_refused(index: int, error: RenderError) -> Rejection:
    """Kiln's refusal of prompt ``index``'s asymmetric teacher prompt (``opd.rs`` · ``render_teacher_prompt_tokens``).

    The extra messages reach the teacher as a system turn (``teacher_messages``), so a template without a system
    role (Gemma 1/2, Mistral) refuses every prompt that carries ``teacher_extra_messages``.

    Example:
        >>> teacher_prompt_refused(0, RenderError("System role not supported")).field
        'prompts[0].teacher_extra_messages'
    """
    return Rejection("teacher_prompt_render_failed", f"opd_train: render asymmetric teacher chat template for prompt "
                     f"{index}: {error}", field=f"prompts[{index}].teacher_extra_messages")


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as Kiln hands them to a template: optional fields only when set, tool arguments parsed.

    Example:
        >>> template_messages([{"role": "assistant", "content": "", "tool_calls": [
        ...     {"function": {"name": "f", "arguments": '{"x": 1}'}}]}])[0]["tool_calls"][0]["function"]
        {'name': 'f', 'arguments': {'x': 1}}
    """
    rendered = []
    for message in messages:
        value: dict[str, Any] = {"role": message["role"], "content": message["content"]}
        for optional in ("tool_calls", "name", "tool_call_id"):
            if message.get(optional) is not None:
                value[optional] = json.loads(json.dumps(message[optional]))  # a private deep copy
        for call in value.get("tool_calls") or []:
            if isinstance(call, dict):
                _parse_arguments(call)
                if isinstance(call.get("function"), dict):
                    _parse_arguments(call["function"])
        rendered.append(value)
    return rendered


def _parse_arguments(holder: dict[str, Any]) -> None:
    arguments = holder.get("arguments")
    if isinstance(arguments, str):
        try:
            holder["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # Kiln leaves a non-JSON string for the template to handle


def render_for_generation(chat_template: str, messages: Sequence[dict[str, Any]], *,
                          enable_thinking: bool | None = None, tools: Sequence[Any] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> str:
    """Render ``messages`` ending with the assistant cue, as Kiln's tokenizer does.

    Args:
        chat_template: The Jinja template text.
        messages: Kiln-shaped messages (``role``, text ``content``, optional tool fields).
        enable_thinking: When not None, passed to the template (Kiln passes ``false`` for rollouts).
        tools: Tool definitions handed to the template as ``tools`` (none, or an empty list: null, as Kiln does).
        template_kwargs: More template variables (a post-eval suite's ``chat_template_kwargs``); they may not
            name one Kiln sets itself (``RESERVED_TEMPLATE_VARIABLES``).

    Raises:
        RenderError: the template raised, or ``template_kwargs`` names a reserved variable.

    Example:
        >>> render_for_generation("{% for m in messages %}{{ m.content }}{% endfor %}"
        ...                       "{% if add_generation_prompt %}>{% endif %}", [{"role": "user", "content": "hi"}])
        'hi>'
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = dict(template_kwargs or {})
    for key in RESERVED_TEMPLATE_VARIABLES:
        if key in kwargs:  # Kiln's words (tokenizer.rs · render_jinja_template_with)
            raise RenderError(f"chat_template_kwargs cannot override reserved template variable `{key}`")
    kwargs.update(bos_token="", eos_token="")
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    try:
        texts, _ = render_jinja_template(
            conversations=[template_messages(messages)],
            chat_template=chat_template,
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            **kwargs,
        )
    except Exception as error:  # jinja raises many types, templates call raise_exception()
        raise RenderError(str(error) or type(error).__name__) from None
    return texts[0]


def encode_text(tokenizer: Any, text: str) -> np.ndarray:
    """Token ids of ``text`` without added special tokens (Kiln's ``encode(text, false)``), ``int32``."""
    try:
        ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    except Exception as error:
        raise RenderError(f"encoding failed: {error}") from None
    return np.asarray(ids, dtype=np.int32)


def without_trailing_assistant(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop every assistant message at the end (Kiln's ``chat_messages_without_trailing_assistant``)."""
    kept = list(messages)
    while kept and kept[-1]["role"] == "assistant":
        kept.pop()
    return kept


def rollout_messages(messages: Sequence[dict[str, Any]], rendering: str) -> list[dict[str, Any]]:
    """The conversation the student samples its answer after, as ``kiln_core.on_policy.prepare`` builds the
    rollout prefix: ``chat_template`` renders the messages without trailing assistant turns;
    ``legacy_action_boundary`` cuts the training render at its first action token, and every assistant
    turn is an action (``kiln_core.assistant_mask``), so the messages before the first assistant turn.

    Example:
        >>> chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...         {"role": "user", "content": "c"}, {"role": "assistant", "content": ""}]
        >>> [m["content"] for m in rollout_messages(chat, "legacy_action_boundary")]
        ['a']
        >>> [m["content"] for m in rollout_messages(chat, "chat_template")]
        ['a', 'b', 'c']
    """
    if rendering == "chat_template":
        return without_trailing_assistant(messages)
    first = next((i for i, message in enumerate(messages) if message["role"] == "assistant"), len(messages))
    return list(messages[:first])


def teacher_messages(messages: Sequence[dict[str, Any]], extra: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The asymmetric teacher's chat: extra contents joined by a blank line, merged into the system turn.

    Roles of the extra messages are ignored; a leading system message gets the joined text and a
    blank line prepended, otherwise a new system message is inserted first (``opd.rs`` ·
    ``render_teacher_prompt_tokens``).

    Example:
        >>> teacher_messages([{"role": "user", "content": "q"}], [{"role": "user", "content": "a"},
        ...                   {"role": "system", "content": "b"}])
        [{'role': 'system', 'content': 'a\\n\\nb'}, {'role': 'user', 'content': 'q'}]
    """
    merged = without_trailing_assistant(messages)
    joined = "\n\n".join(message["content"] for message in extra)
    if merged and merged[0]["role"] == "system":
        merged[0] = {**merged[0], "content": f"{joined}\n\n{merged[0]['content']}"}
    else:
        merged.insert(0, {"role": "system", "content": joined})
    return merged


def kiln_eos_token_ids(tokenizer: Any) -> list[int]:
    """Ids that end a rollout: special added tokens whose text Kiln treats as EOS, ascending.

    Example:
        >>> kiln_eos_token_ids(load_student_tokenizer("./student").tokenizer)  # doctest: +SKIP
        [0, 2]
    """
    decoder = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    return sorted(int(i) for i, token in decoder.items() if token.special and token.content in KILN_EOS_TEXTS)
