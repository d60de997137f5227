"""Chat templates as they ship (docs/chat-templates.md): Gemma 1/2, Gemma 3, Qwen3's thinking template, Llama 3's
BOS, Mistral's BOS and EOS, each on a tiny model whose tokenizer has the family's added special tokens.

What a user depends on:

* **the masks are Kiln's**: every conversation tokenizes to the ids and action targets Kiln's
  ``tokenize_for_training`` computes, rendered with Kiln's own engine and context (``kiln_tokenize``, written
  from Kiln's source, independent of ``kiln_core``): no BOS and no EOS from the tokenizer's special tokens,
  Qwen3's empty ``<think>`` block supervised, Gemma's and Llama's turn markers found by prefix renders;
* **what Kiln refuses is refused on every path, in one line**: a system message under Gemma 1/2 and Mistral
  (admission, scoring, on-policy prompts and the asymmetric teacher's system turn, ``distill self``'s
  privileged system message, ``eval --generate``), with the template's own words and the place, never a
  Jinja traceback;
* **what Kiln accepts trains**: under each template a self-scored corpus is admitted, the untrained student
  agrees with itself (reverse KL 0), one off-policy step, on-policy rollouts and ``distill self`` run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from chat_templates import KITS
from kiln_core.errors import AdmissionError, Rejection
from kiln_core.tokenization import Conversation, TokenizationError, encode_conversations, load_student_tokenizer
from kiln_tokenize import KilnTemplateError, kiln_render, kiln_tokenize_for_training

TOP_K = 16

SYSTEM = {"role": "system", "content": "Answer briefly."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is two plus two?"},
               {"role": "assistant", "content": "Two plus two is four."}],
    "system": [SYSTEM, {"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "Paris."}],
    "multi_turn": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
                   {"role": "user", "content": "And the capital of France?"},
                   {"role": "assistant", "content": "Paris."}],
    "thinking": [{"role": "user", "content": "What is two plus two?"},
                 {"role": "assistant", "content": "<think>\n2 + 2 = 4\n</think>\n\nFour."}],
    "padded": [{"role": "user", "content": "  List files under src/.  "},
               {"role": "assistant", "content": " src/lib.rs src/main.rs \n"}],
    "special_text": [{"role": "user", "content": "Say <|im_end|> and <end_of_turn> and </s> literally."},
                     {"role": "assistant", "content": "ok <|eot_id|> ok"}],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {name: kit.build(root) for name, kit in KITS.items()}


def encode_chat(student, chat):
    (encoded,) = encode_conversations(student, [Conversation(chat[:-1], chat[-1]["content"])])
    return encoded


# --- the masks are Kiln's ---------------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kit", sorted(KITS))
def test_ids_and_action_targets_are_kilns(models, kit, conversation):
    chat = CONVERSATIONS[conversation]
    student = load_student_tokenizer(models[kit])
    tokenizer = Tokenizer.from_file(str(models[kit] / "tokenizer.json"))
    try:
        ids, mask = kiln_tokenize_for_training(tokenizer, KITS[kit].template, chat)
    except KilnTemplateError as refused:
        with pytest.raises(TokenizationError, match="chat template failed to render") as caught:
            encode_chat(student, chat)
        assert str(refused) in str(caught.value)
        return
    encoded = encode_chat(student, chat)
    assert encoded.problem is None
    assert encoded.input_ids.tolist() == ids
    assert encoded.action_positions.tolist() == np.flatnonzero(mask).tolist()


@pytest.mark.parametrize("kit", ["gemma2", "gemma3", "llama3", "mistral"])
def test_a_template_that_writes_the_bos_starts_without_it_as_in_kiln(models, kit):
    """Kiln renders with ``bos_token`` and ``eos_token`` empty and encodes without special tokens: the tokenizer's
    BOS, which its own encoder would prepend, is in no sequence."""
    student = load_student_tokenizer(models[kit])
    bos = student.tokenizer.bos_token_id
    assert student.tokenizer("hi")["input_ids"][0] == bos  # the family's tokenizer does add one
    for chat in CONVERSATIONS.values():
        if KITS[kit].system_role or chat[0]["role"] != "system":
            assert bos not in encode_chat(student, chat).input_ids.tolist()


def test_mistrals_eos_token_is_no_target_as_in_kiln(models):
    """Mistral's template appends ``eos_token`` to each answer; Kiln's is empty, so ``</s>`` is not trained."""
    student = load_student_tokenizer(models["mistral"])
    encoded = encode_chat(student, CONVERSATIONS["multi_turn"])
    assert student.tokenizer.decode(encoded.input_ids[encoded.action_positions]) == "Four.Paris."


def test_qwen3_supervises_the_empty_think_block_of_the_last_turn_only(models):
    """Qwen3's template writes ``<think>\\n\\n</think>\\n\\n`` into the assistant turn after the last user query
    (and moves a ``<think>`` the answer carries there); Kiln's ChatML span marks it with the answer."""
    student = load_student_tokenizer(models["qwen3"])
    think, end_think = (student.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    encoded = encode_chat(student, CONVERSATIONS["multi_turn"])
    targets = encoded.input_ids[encoded.action_positions].tolist()
    assert targets.count(think) == targets.count(end_think) == 1
    text = student.tokenizer.decode(targets)
    assert text.startswith("Four.<|im_end|>\n<think>\n\n</think>\n\nParis.")


@pytest.mark.parametrize("kit", sorted(KITS))
def test_the_engines_render_alike(kit):
    """Hugging Face's Jinja environment renders each shipped template exactly as Kiln's minijinja does, with Kiln's
    context, the generation prompt on and off (docs/kiln-compatibility.md: the chat-template engine)."""
    from kiln_core.on_policy.render import render_for_generation

    for name, chat in CONVERSATIONS.items():
        prompt = chat[:-1]
        try:
            expected = kiln_render(KITS[kit].template, prompt, add_generation_prompt=True)
        except KilnTemplateError:
            continue
        assert render_for_generation(KITS[kit].template, prompt) == expected, name
