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


# --- what Kiln refuses is refused, on every path, in one line ----------------------------------------------

REFUSING = {"gemma2": "System role not supported", "mistral": "Conversation roles must alternate"}
"""Templates with no system role, and the words their ``raise_exception`` says about a leading system message."""

PLAIN_EXAMPLE = {"messages": CONVERSATIONS["single"][:-1], "teacher_response": "Two plus two is four."}
SYSTEM_EXAMPLE = {"messages": CONVERSATIONS["system"][:-1], "teacher_response": "Paris."}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def score(model: Path, examples: list[dict], out: Path) -> Path:
    from kiln_core.scoring import score_examples

    score_examples(str(write_jsonl(out.with_suffix(".examples.jsonl"), examples)), teacher_dir=str(model),
                   student_dir=str(model), top_k=TOP_K, out_uri=str(out), device="cpu")
    return out


@pytest.mark.parametrize("kit", sorted(REFUSING))
def test_a_system_turn_is_refused_at_its_line_when_scoring_and_admitting(models, kit, tmp_path):
    """Kiln: ``tokenize off-policy OPD example i`` fails with the template's error; the corpus is refused."""
    from kiln_core.admission import admit_corpus
    from kiln_core.scoring.examples import ScoringError

    with pytest.raises(ScoringError) as caught:
        score(models[kit], [PLAIN_EXAMPLE, SYSTEM_EXAMPLE], tmp_path / "refused.jsonl")
    assert (caught.value.code, caught.value.line) == ("tokenization_failed", 2)
    assert REFUSING[kit] in caught.value.message and "\n" not in caught.value.describe()

    manifest, row = score(models[kit], [PLAIN_EXAMPLE], tmp_path / "scored.jsonl").read_text().splitlines()
    with_system = json.loads(row)
    with_system["messages"] = [SYSTEM, *with_system["messages"]]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [manifest, row, with_system])
    with pytest.raises(AdmissionError) as caught:
        admit_corpus(str(corpus), str(models[kit]), top_k=TOP_K)
    assert (caught.value.code, caught.value.line) == ("invalid_record", 3)
    assert REFUSING[kit] in caught.value.message


@pytest.fixture(scope="module")
def registry(models, tmp_path_factory) -> str:
    from kiln_core.teachers.local_registry import register_local_teacher

    root = tmp_path_factory.mktemp("template-teachers")
    for kit in REFUSING:
        register_local_teacher(root, f"{kit}-teacher", models[kit], max_top_k=32, device_kind="cpu")
    return str(root)


# The dummy assistant turn has content: Mistral's template writes no assistant header, so an empty turn adds no
# token and Kiln (and kiln-flows) drop the prompt as one with no action (docs/chat-templates.md).
USER_ONLY_PROMPT = {"messages": [*CONVERSATIONS["single"][:-1], {"role": "assistant", "content": "Four."}]}


def on_policy_request(kit: str, prompt: dict):
    """An on-policy request whose second prompt is ``prompt`` (the first renders under every template)."""
    from kiln_core.contracts.opd_config import parse_opd_request

    return parse_opd_request({"teacher": f"{kit}-teacher", "prompts": [USER_ONLY_PROMPT, prompt],
                              "config": {"max_tokens": 8, "top_k": TOP_K}})


@pytest.mark.parametrize("kit", sorted(REFUSING))
def test_on_policy_prompts_and_the_asymmetric_teachers_system_turn_are_refused_before_any_model_loads(
        models, registry, kit):
    """A prompt with a system turn: Kiln's submit preflight (``OPD prompt i failed chat-template rendering``). A
    prompt without one but with ``teacher_extra_messages``: the teacher's prompt opens with a system turn holding
    them (Kiln's ``render asymmetric teacher chat template``), refused naming that field, at submit and when the
    prompts are prepared."""
    from kiln_core.on_policy.prepare import prepare_prompts
    from kiln_core.on_policy.submit import bind_teacher, plan_on_policy

    teacher = bind_teacher(registry, f"{kit}-teacher")
    with_system = {"messages": [SYSTEM, *USER_ONLY_PROMPT["messages"]]}
    with pytest.raises(Rejection) as caught:
        plan_on_policy(on_policy_request(kit, with_system), teacher=teacher, student_dir=str(models[kit]))
    assert (caught.value.code, caught.value.field) == ("prompt_render_failed", "prompts[1]")
    assert REFUSING[kit] in caught.value.message

    extra = {**USER_ONLY_PROMPT, "teacher_extra_messages": [{"role": "user", "content": "Answer in one word."}]}
    request = on_policy_request(kit, extra)
    for refuse in (lambda: plan_on_policy(request, teacher=teacher, student_dir=str(models[kit])),
                   lambda: prepare_prompts(request.prompts, load_student_tokenizer(models[kit]))):
        with pytest.raises(Rejection) as caught:
            refuse()
        assert (caught.value.code, caught.value.field) == ("teacher_prompt_render_failed",
                                                           "prompts[1].teacher_extra_messages")
        assert REFUSING[kit] in caught.value.message


def distill_self_request(*prompts: list[dict]):
    from kiln_core.contracts.distill_self import check_distill_self_request

    return check_distill_self_request({"name": "terse", "mode": "conciseness",
                                       "prompts": [{"messages": chat} for chat in prompts],
                                       "config": {"top_k": TOP_K, "lora_rank": 4, "lora_alpha": 8}})


@pytest.mark.parametrize("kit", sorted(REFUSING))
def test_distill_self_is_refused_where_the_template_has_no_system_role(models, kit):
    """Kiln gives the teacher its privileged context as a system message before the prompt's own messages; a
    template without a system role refuses the teacher's side (Kiln: ``self-distill prompt i teacher tokenization
    failed``) before any model loads."""
    from kiln_core.recipes.distill_self import tokenize_prompts

    with pytest.raises(Rejection) as caught:
        tokenize_prompts(distill_self_request(CONVERSATIONS["single"]), load_student_tokenizer(models[kit]))
    assert (caught.value.code, caught.value.field) == ("prompt_tokenization_failed", "prompts[0]")
    assert "teacher tokenization failed" in caught.value.message and REFUSING[kit] in caught.value.message
    assert "privileged system message" in caught.value.message


def test_gemma3_folds_the_privileged_message_into_the_first_user_turn_but_refuses_a_second_system_turn(models):
    """Gemma 3 writes a leading system message into the first user turn: the teacher's sequence carries the
    privileged text there and the action tokens align with the student's. A prompt with its own system message
    gives the teacher two system turns in a row, which the template's alternation rule refuses, as in Kiln."""
    from kiln_core.recipes.distill_self import tokenize_prompts

    student = load_student_tokenizer(models["gemma3"])
    (pair,) = tokenize_prompts(distill_self_request(CONVERSATIONS["single"]), student)
    teacher_text = student.tokenizer.decode(pair.teacher_ids)
    assert teacher_text.startswith("<start_of_turn>user\nPrivileged context (visible only to the teacher)")
    assert pair.student_ids[pair.student_targets].tolist() == pair.teacher_ids[pair.teacher_targets].tolist()
    with pytest.raises(Rejection) as caught:
        tokenize_prompts(distill_self_request(CONVERSATIONS["single"], CONVERSATIONS["system"]), student)
    assert (caught.value.code, caught.value.field) == ("prompt_tokenization_failed", "prompts[1]")
    assert "Conversation roles must alternate" in caught.value.message


def test_eval_generate_names_the_line_a_models_template_refuses(models, tmp_path, capsys):
    """``eval --generate`` renders each held-out prompt with every model's template: a teacher whose template
    refuses a prompt the student accepts (Gemma 2 beside a Gemma 3 student, a system turn) is a rejection naming
    the corpus line, not an unexpected error."""
    from flows.cli import main

    corpus = score(models["gemma3"], [PLAIN_EXAMPLE, SYSTEM_EXAMPLE], tmp_path / "heldout.jsonl")
    code = main(["eval", "--student", str(models["gemma3"]), "--corpus", str(corpus), "--teacher",
                 str(models["gemma2"]), "--generate", "2", "--max-new-tokens", "2", "--top-k", str(TOP_K),
                 "--device", "cpu", "--json"])
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 2
    assert (error["code"], error["file"], error["line"]) == ("prompt_render_failed", str(corpus), 3)
    assert "System role not supported" in error["message"] and str(models["gemma2"]) in error["message"]


def test_qwen3_rollouts_start_after_the_header_or_after_an_empty_think_block(models):
    """Kiln's default (``legacy_action_boundary``) samples after the training render's assistant header; its
    ``chat_template`` rendering passes ``enable_thinking=false``, which Qwen3's template answers with a closed
    empty think block the student then answers after."""
    from kiln_core.contracts.opd_config import parse_opd_request
    from kiln_core.on_policy.prepare import prepare_prompts

    student = load_student_tokenizer(models["qwen3"])
    prompts = parse_opd_request({"teacher": "t", "prompts": [USER_ONLY_PROMPT]}).prompts
    prefixes = {rendering: student.tokenizer.decode(prepare_prompts(prompts, student, rendering=rendering)
                                                    .prompts[0].rollout_prefix)
                for rendering in ("legacy_action_boundary", "chat_template")}
    assert prefixes["legacy_action_boundary"].endswith("<|im_start|>assistant\n")
    assert prefixes["chat_template"] == prefixes["legacy_action_boundary"] + "<think>\n\n</think>\n\n"



@pytest.mark.parametrize("kit", ["gemma3", "llama3"])
def test_post_eval_prompts_are_rendered_as_kilns_eval_generator_renders_them(models, kit):
    """Kiln's eval generator renders a suite's prompt with the server's chat template (no BOS) and encodes it
    without special tokens; a ``chat_template_kwargs`` naming a variable Kiln sets is refused in Kiln's words."""
    import torch

    from kiln_core.contracts.post_eval.suite import EvalChatMessage, EvalGenerationParams
    from kiln_core.on_policy.render import RenderError
    from kiln_core.post_eval.runner import Arm, render_prompt

    student = load_student_tokenizer(models[kit])
    arm = Arm(model=None, tokenizer=student.tokenizer, device=torch.device("cpu"), eos_ids=frozenset(),
              max_positions=None)
    question = [EvalChatMessage(role="user", content="What is two plus two?")]
    expected = kiln_render(KITS[kit].template, [SYSTEM, {"role": "user", "content": "What is two plus two?"}],
                           add_generation_prompt=True)
    ids = render_prompt(arm, question, SYSTEM["content"], None, EvalGenerationParams())
    assert ids == Tokenizer.from_file(str(models[kit] / "tokenizer.json")).encode(
        expected, add_special_tokens=False).ids
    assert student.tokenizer.bos_token_id not in ids
    with pytest.raises(RenderError, match="cannot override reserved template variable `bos_token`"):
        render_prompt(arm, question, None, None, EvalGenerationParams(chat_template_kwargs={"bos_token": "<bos>"}))

# --- what Kiln accepts trains -----------------------------------------------------------------------------


def examples_for(kit: str) -> list[dict]:
    """Examples every template renders (and, with a system role, one with a system message)."""
    turns = CONVERSATIONS["multi_turn"]
    examples = [PLAIN_EXAMPLE, {"messages": turns[:-1], "teacher_response": turns[-1]["content"]},
                {"messages": CONVERSATIONS["thinking"][:-1], "teacher_response": CONVERSATIONS["thinking"][-1]["content"]}]
    return examples + ([SYSTEM_EXAMPLE] if KITS[kit].system_role else [])


@pytest.mark.slow
@pytest.mark.parametrize("kit", sorted(KITS))
def test_under_each_template_a_self_scored_corpus_trains_on_policy_runs_and_distill_self_scores(
        models, kit, tmp_path):
    """The student scores its own examples (as Kiln admits them), agrees with itself (reverse KL 0, top-1 100 %),
    takes off-policy steps from a loss of 0, samples and trains on-policy, and ``distill self``'s corpus (where
    the template has a system role) is one Kiln admits."""
    from kiln_core.admission import admit_corpus
    from kiln_core.contracts.opd_config import OpdConfig, parse_opd_request
    from kiln_core.contracts.stage_refs import TrainPlan
    from kiln_core.evaluation import evaluate_tables, load_eval_model
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherSource
    from kiln_core.recipes.distill_self import prepare_distill_self
    from kiln_core.training.on_policy_trainer import train_on_policy
    from kiln_core.training.trainer import train_opd

    model = models[kit]
    corpus = score(model, examples_for(kit), tmp_path / "self-scored.jsonl")
    tables = admit_corpus(str(corpus), str(model), top_k=TOP_K).tables
    metrics = evaluate_tables(load_eval_model(str(model), device="cpu"), tables)
    assert metrics.reverse_kl < 1e-6 and metrics.top1_agreement == 1.0

    settings = dict(top_k=TOP_K, lora_rank=4, lora_alpha=8.0, seed=5, learning_rate=2e-2, checkpoint_interval=None,
                    optimizer={"kind": "adam_w"})
    config = OpdConfig.model_validate(dict(training_mode="off_policy", **settings))
    plan = TrainPlan.for_config(config, str(tmp_path / "off-policy"), "templates", device="cpu")
    result = train_opd(plan, tables, dataset_sha256="sha256:" + "ab" * 32, dataset_path=str(corpus),
                       student_dir=str(model), teacher_alias="self")
    assert result.status == "success" and len(result.loss_history) == tables.num_examples
    assert abs(result.loss_history[0]) < 1e-5  # an untrained student on its own scores

    identity = local_teacher_identity(str(model), max_top_k=32, device_kind="cpu")
    teacher = TeacherSource.loaded(LiveLocalTeacher.load(str(model), identity=identity, top_k=TOP_K,
                                                         teacher_id="self", device="cpu"), "self")
    request = parse_opd_request({"teacher": "self", "prompts": [USER_ONLY_PROMPT],
                                 "config": {"samples_per_prompt": 2, "max_tokens": 4, **settings}})
    plan = TrainPlan.for_config(request.config, str(tmp_path / "on-policy"), "templates", top_k=TOP_K,
                                samples_per_prompt=2, device="cpu")
    assert train_on_policy(plan, request.prompts, student_dir=str(model), teacher=teacher).status == "success"

    if KITS[kit].system_role:
        # Gemma 3 refuses a prompt's own system turn after the privileged one (tested above).
        chats = [CONVERSATIONS["single"], CONVERSATIONS["multi_turn"]]
        chats += [CONVERSATIONS["system"]] if kit != "gemma3" else []
        spec = prepare_distill_self(distill_self_request(*chats), student_dir=str(model),
                                    out_root=str(tmp_path / "self"), device="cpu")
        assert admit_corpus(spec.corpus, str(model), top_k=TOP_K).tables.num_examples == len(chats)
