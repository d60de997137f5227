"""Chat templates as the model families ship them, and a tiny model of each (no hub downloads).

The template texts are the ``chat_template`` of each family's instruct tokenizer, verbatim:

* ``GEMMA``: Gemma 1 and Gemma 2 (``google/gemma-7b-it``, ``google/gemma-2-2b-it``): ``{{ bos_token }}`` first,
  ``raise_exception('System role not supported')`` on a leading system message, roles must alternate, the
  assistant speaks as ``model`` between ``<start_of_turn>`` and ``<end_of_turn>``, contents trimmed;
* ``GEMMA3``: Gemma 3 (``google/gemma-3-1b-it``): a leading system message is folded into the first user turn
  (its text and a blank line), roles must alternate after it;
* ``QWEN3``: Qwen3's thinking template (``Qwen/Qwen3-0.6B``): the assistant turn after the last user query
  carries a ``<think>`` block (empty when the answer has none), ``enable_thinking=false`` closes an empty one
  after the generation prompt;
* ``LLAMA3``: Llama 3 (``meta-llama/Meta-Llama-3-8B-Instruct``): ``bos_token`` before the first message,
  ``<|start_header_id|>role<|end_header_id|>`` headers, ``<|eot_id|>`` after each trimmed content;
* ``MISTRAL``: Mistral and Mixtral v0.1 (``mistralai/Mixtral-8x7B-Instruct-v0.1``): ``{{ bos_token }}`` first,
  ``[INST] … [/INST]`` user turns, ``eos_token`` after each assistant content, user and assistant roles only.

Each ``TemplateKit`` pairs a template with the tokens its tokenizer has (``kiln_core.tiny_models.ChatTokens``):
Gemma's and Llama 3's turn markers, and every BOS and EOS, are special tokens, and those tokenizers prepend the
BOS when encoding with special tokens; Qwen3's ``<think>`` and tool tags are ordinary added tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln_core.tiny_models import ChatTokens

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

GEMMA_TOKENS = ChatTokens(special=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                          bos_token="<bos>", eos_token="<eos>")
QWEN3_TOKENS = ChatTokens(added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                                 "</think>"))
LLAMA3_TOKENS = ChatTokens(special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "<|eot_id|>"),
                           bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
MISTRAL_TOKENS = ChatTokens(special=("<unk>", "<s>", "</s>"), bos_token="<s>", eos_token="</s>")


@dataclass(frozen=True)
class TemplateKit:
    """A family's shipped template, the tokens its tokenizer has, and the architecture it ships with.

    Attributes:
        name: How tests name it (``gemma2``, ``gemma3``, ``qwen3``, ``llama3``, ``mistral``).
        template: The template text, verbatim.
        tokens: The tokenizer's added tokens, BOS and EOS.
        architecture: A ``kiln_core.tiny_models.TINY_ARCHITECTURES`` key.
        system_role: Whether a leading system message renders (Gemma 1/2 and Mistral raise on it).
    """

    name: str
    template: str
    tokens: ChatTokens
    architecture: str
    system_role: bool = True

    def build(self, root: Path, *, seed: int = 3) -> Path:
        """A tiny model of this family with this template, in ``root/<name>-<seed>`` (built once)."""
        from kiln_core.tiny_models import build_tiny_model

        out = root / f"{self.name}-{seed}"
        if not (out / "config.json").exists():
            build_tiny_model(out, seed=seed, architecture=self.architecture, chat_template=self.template,
                             chat_tokens=self.tokens)
        return out


KITS = {
    "gemma2": TemplateKit("gemma2", GEMMA, GEMMA_TOKENS, "gemma2", system_role=False),
    "gemma3": TemplateKit("gemma3", GEMMA3, GEMMA_TOKENS, "gemma3_text"),
    "qwen3": TemplateKit("qwen3", QWEN3, QWEN3_TOKENS, "qwen3"),
    "llama3": TemplateKit("llama3", LLAMA3, LLAMA3_TOKENS, "llama"),
    "mistral": TemplateKit("mistral", MISTRAL, MISTRAL_TOKENS, "mistral", system_role=False),
}
