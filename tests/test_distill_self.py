"""``distill self``: Kiln's DistillSelfRequest rules, the privileged teacher's corpus, the CLI and the flow.

Fast tests cover every submit-time rule (Kiln's message, the code, the dotted field), the privileged texts
and the alignment. The model tests check the corpus against an independent reference (a plain transformers
forward of the teacher sequence with the privileged system message, log_softmax, top-K at the teacher's
action rows), run the CLI end to end (receipts name the recipe, mode and teacher; a retry reuses the corpus),
refuse bad input before any model loads, score with a registered LoRA teacher, and run the flow on the
Prefect harness.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln_core.errors import Rejection

CONCISENESS = ("Privileged context (visible only to the teacher): respond with maximal concision; trim every "
               "unnecessary word; never explain reasoning unless explicitly asked.")
CONFIG = {"top_k": 16, "learning_rate": 0.01, "lora_rank": 4, "lora_alpha": 8, "optimizer": {"kind": "adam_w"},
          "seed": 5, "checkpoint_interval": 2}


def prompt(question: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


PROMPTS = [
    prompt("What is two plus two?", "Two plus two is four."),
    prompt("What is the capital of France?", "The capital of France is Paris.", system="You are a helpful assistant."),
    prompt("Translate to French: good morning", "good morning -> bonjour."),
]


def request_value(**changes) -> dict:
    return {"name": "terse", "mode": "conciseness", "prompts": PROMPTS, "config": dict(CONFIG), **changes}


def rejection(value, **kwargs) -> Rejection:
    from kiln_core.contracts.distill_self import check_distill_self_request

    with pytest.raises(Rejection) as caught:
        check_distill_self_request(value, **kwargs)
    return caught.value


# ---------------------------------------------------------------------------------------------------------
# 1. the request: Kiln's submit-time rules


@pytest.mark.fast
def test_training_mode_defaults_to_off_policy_with_or_without_a_config_object():
    from kiln_core.contracts.distill_self import check_distill_self_request

    without = check_distill_self_request({"name": "terse", "mode": "conciseness", "prompts": PROMPTS})
    inside = check_distill_self_request(request_value(config={"lora_rank": 32}))
    assert without.config.training_mode == inside.config.training_mode == "off_policy"
    assert inside.config.lora_rank == 32 and without.config.top_k == 32 and without.post_eval is None


@pytest.mark.fast
@pytest.mark.parametrize("changes, code, field, message", [
    ({"config": [1]}, "invalid_request", "config", "OPD config must be a JSON object"),
    ({"config": None}, "invalid_request", "config", "OPD config must be a JSON object"),
    ({"nmae": "x"}, "invalid_request", "nmae", "`nmae`: unknown key (not a field of Kiln's DistillSelfRequest); did you mean `name`?"),
    ({"config": {"learnign_rate": 1.0}}, "invalid_request", "config.learnign_rate", "did you mean `learning_rate`?"),
    ({"mode": "terse"}, "invalid_request", "mode", "invalid distill/self request JSON: `mode`"),
    ({"prompts": [{"messages": "hi"}]}, "invalid_request", "prompts[0].messages", "invalid distill/self request JSON"),
    ({"name": "  "}, "invalid_adapter_name", "name", "distill/self: name must be non-empty"),
    ({"name": "a/b"}, "invalid_adapter_name", "name", "must be 1-128 characters"),
    ({"mode": "reverse_teacher"}, "reverse_teacher_unsupported", "mode",
     "distill/self: reverse_teacher requires a distinct reverse objective"),
    ({"config": {"training_mode": "on_policy"}}, "invalid_config", "config.training_mode",
     'distill/self materializes teacher logits for fixed action sequences and requires config.training_mode="off_policy"'),
    ({"config": {"lora_rank": 4, "lora_alpha": 16}}, "unsafe_lora_scale", "config.lora_alpha", "unsafe LoRA scaling"),
    ({"config": {"top_k": 8}}, "top_k_unsupported", "config.top_k", "OPD top_k 8 is not executable with source cap 8"),
    ({"config": {"loss": "full_vocab"}}, "invalid_config", "config.loss", "full_vocab"),
    ({"prompts": None}, "prompts_missing", "prompts",
     "distill/self requires explicit off-policy prompts with assistant actions"),
    ({"prompts": []}, "no_prompts", "prompts", "distill/self requires at least one prompt"),
    ({"prompts": [PROMPTS[0], {"messages": []}]}, "prompt_no_messages", "prompts[1].messages",
     "distill/self prompt 1 has no messages"),
    ({"prompts": [prompt("Hi?", "  ")]}, "prompt_no_action", "prompts[0]",
     "distill/self prompt 0 requires a non-empty assistant action for off-policy scoring"),
    ({"mode": "ground_truth_conditioning"}, "ground_truth_missing", "ground_truth",
     "distill/self: ground_truth_conditioning requires `ground_truth`"),
    ({"mode": "ground_truth_conditioning", "ground_truth": ["4", "Paris"]}, "ground_truth_mismatch", "ground_truth",
     "distill/self: ground_truth must contain one non-empty answer per prompt (3 prompts, 2 answers)"),
    ({"mode": "ground_truth_conditioning", "ground_truth": ["4", " ", "bonjour"]}, "ground_truth_mismatch",
     "ground_truth[1]", "(3 prompts, 3 answers)"),
    ({"mode": "document_as_pi"}, "documents_missing", "documents", "distill/self: document_as_pi requires `documents`"),
    ({"mode": "document_as_pi", "documents": ["d"] * 4}, "documents_mismatch", "documents",
     "distill/self: documents must contain one non-empty context per prompt (3 prompts, 4 documents)"),
    ({"post_eval": {"suite": "math", "min_accuracy": 1.5}}, "post_eval_min_accuracy_out_of_range",
     "post_eval.min_accuracy", "post_eval.min_accuracy must be finite and in [0.0, 1.0]"),
    ({"post_eval": {"suite": 3}}, "post_eval_invalid_config", "post_eval.suite", "post_eval.suite"),
    ({"post_eval": {"suite": "s", "min_acuracy": 0.5}}, "invalid_request", "post_eval.min_acuracy",
     "did you mean `min_accuracy`?"),
])
def test_every_submit_rule_names_its_code_field_and_kilns_message(changes, code, field, message):
    error = rejection(request_value(**changes))
    assert (error.code, error.field) == (code, field), error
    assert message in error.message


@pytest.mark.fast
def test_kilns_order_reverse_teacher_before_the_config_and_the_config_before_the_prompts():
    assert rejection(request_value(mode="reverse_teacher", config={"training_mode": "on_policy"})).code == \
        "reverse_teacher_unsupported"
    assert rejection(request_value(config={"training_mode": "on_policy"}, prompts=None)).field == "config.training_mode"


@pytest.mark.fast
@pytest.mark.parametrize("bad, detail", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "and?"}]}, "its last message is not an assistant turn"),
    ({"messages": [{"role": "user", "content": "q"}],
      "trajectory": [{"role": "assistant", "content": "a", "kind": "action"}]}, "it has no assistant message"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "assistant", "content": ""}]}, "its final assistant message is blank"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                      "tool_calls": [{"id": "1"}]}]}, "tool_calls"),
])
def test_a_prompt_that_is_not_one_corpus_row_is_refused_naming_it(bad, detail):
    error = rejection(request_value(prompts=[PROMPTS[0], bad]))
    assert (error.code, error.field) == ("prompt_not_trainable", "prompts[1].messages")
    assert error.message.startswith("distill/self prompt 1: ") and detail in error.message


@pytest.mark.fast
def test_kilns_admission_limits_and_the_file_named_by_every_rejection(monkeypatch):
    from kiln_core.contracts import distill_self

    monkeypatch.setattr(distill_self, "MAX_PROMPTS", 2)
    error = rejection(request_value(), file="self.json")
    assert (error.code, error.file) == ("too_many_prompts", "self.json")
    assert error.message == "distill/self resolved to 3 prompts; maximum is 2" and "self.json" in str(error)
    monkeypatch.setattr(distill_self, "MAX_PROMPTS", 10)
    monkeypatch.setattr(distill_self, "MAX_PROMPT_BYTES", 100)
    assert rejection(request_value()).code == "prompts_too_large"
    assert rejection([]).code == "invalid_request"


@pytest.mark.fast
def test_warnings_name_the_resolved_top_k_and_the_teacher_id_is_kilns():
    from kiln_core.contracts.distill_self import check_distill_self_request, request_warnings, self_teacher_id

    request = check_distill_self_request(request_value(mode="document_as_pi", documents=["a", "b", "c"],
                                                       config={"top_k": 64}))
    assert request_warnings(request) == [
        "Requested top_k 64 was resolved to effective top_k 32 for the teacher and active OPD kernel."]
    assert self_teacher_id(request) == "self-terse:DocumentAsPi"


# ---------------------------------------------------------------------------------------------------------
# 2. privileged texts, tokenization and alignment (tokenizer only)


@pytest.mark.fast
def test_privileged_texts_are_kilns_and_come_first_before_any_system_message():
    from kiln_core.contracts.distill_self import check_distill_self_request
    from kiln_core.recipes.distill_self import teacher_messages

    truth = check_distill_self_request(request_value(mode="ground_truth_conditioning", ground_truth=["4", "Paris", "x"]))
    docs = check_distill_self_request(request_value(mode="document_as_pi", documents=["d0", "Paris is in France.", "d2"]))
    concise = check_distill_self_request(request_value())
    assert teacher_messages(truth, 0)[0] == {
        "role": "system", "content": "Privileged context (visible only to the teacher): the correct answer is: 4"}
    assert teacher_messages(docs, 1)[0]["content"] == ("Privileged context (visible only to the teacher) \u2014 use the "
                                                        "following retrieved document to answer:\n\nParis is in France.")
    assert teacher_messages(concise, 2)[0]["content"] == CONCISENESS
    # the prompt's own system message stays: the teacher sees two, the privileged one first
    assert [m["role"] for m in teacher_messages(concise, 1)] == ["system", "system", "user", "assistant"]
    assert teacher_messages(concise, 1)[1:] == PROMPTS[1]["messages"]


@pytest.mark.fast
def test_both_sequences_carry_the_same_action_tokens_and_the_row_is_the_students(tiny_student):
    from kiln_core.contracts.distill_self import check_distill_self_request
    from kiln_core.recipes.distill_self import tokenize_prompts
    from kiln_core.tokenization import load_student_tokenizer

    pairs = tokenize_prompts(check_distill_self_request(request_value()), load_student_tokenizer(tiny_student))
    for pair, original in zip(pairs, PROMPTS):
        assert pair.record == {"messages": original["messages"][:-1], "teacher_response": original["messages"][-1]["content"]}
        assert len(pair.teacher_ids) > len(pair.student_ids) and len(pair.student_targets) > 0
        assert pair.student_ids[pair.student_targets].tolist() == pair.teacher_ids[pair.teacher_targets].tolist()
        # the teacher sequence is the student's with the privileged system turn inserted before it
        shift = len(pair.teacher_ids) - len(pair.student_ids)
        assert pair.teacher_ids[shift:].tolist() == pair.student_ids.tolist()


def misaligning_copy(model_dir: Path, out: Path) -> Path:
    """The model with a chat template that opens the assistant turn with 'ok. ' when a system message leads:
    the teacher's (privileged) sequence then has more action tokens than the student's."""
    shutil.copytree(model_dir, out)
    template = (out / "chat_template.jinja").read_text()
    opened = "{% generation %}{% if messages[0]['role'] == 'system' %}{{- 'ok. ' -}}{% endif %}"
    (out / "chat_template.jinja").write_text(template.replace("{% generation %}", opened))
    return out


@pytest.mark.fast
def test_a_template_that_changes_the_action_is_refused_with_kilns_alignment_error(tiny_student, tmp_path):
    from kiln_core.contracts.distill_self import check_distill_self_request
    from kiln_core.recipes.distill_self import tokenize_prompts
    from kiln_core.tokenization import load_student_tokenizer

    student = load_student_tokenizer(misaligning_copy(tiny_student, tmp_path / "misaligned"))
    with pytest.raises(Rejection) as caught:
        tokenize_prompts(check_distill_self_request(request_value()), student)
    error = caught.value
    assert (error.code, error.field) == ("self_distill_misaligned", "prompts[0]")
    assert error.message.startswith("self-distill prompt 0 has ") and " student action tokens but " in error.message
    assert error.message.endswith(" teacher action tokens")


@pytest.mark.fast
def test_an_action_token_that_differs_is_named_by_its_pair():
    import numpy as np

    from kiln_core.recipes.distill_self import check_alignment

    check_alignment(0, np.array([1, 5, 6]), np.array([1, 2]), np.array([9, 9, 5, 6]), np.array([2, 3]))
    with pytest.raises(Rejection, match="self-distill prompt 3 action pair 0 differs: student token 5 at 1, "
                                        "teacher token 4 at 2$") as caught:
        check_alignment(3, np.array([1, 5, 6]), np.array([1, 2]), np.array([9, 9, 4, 6]), np.array([2, 3]))
    assert caught.value.code == "self_distill_misaligned"


# ---------------------------------------------------------------------------------------------------------
# 3. the teacher's corpus against an independent reference


def reference_rows(model_dir: Path, messages: list[dict], k: int):
    """Independent reference: transformers renders the teacher's messages (its own assistant mask), one plain
    forward, fp32 log_softmax, top-K at row q-1 of every assistant token q."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = torch.tensor([encoded["input_ids"]])
    targets = [q for q, marked in enumerate(encoded["assistant_masks"]) if marked]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    rows = []
    for q in targets:
        values, top = torch.topk(logprobs[q - 1], k)
        rows.append({"token_id": int(ids[0, q]), "logprob": float(logprobs[q - 1, ids[0, q]]),
                     "top": dict(zip(top.tolist(), values.tolist()))})
    return rows


def corpus_lines(spec) -> list[dict]:
    return [json.loads(line) for line in Path(spec.corpus).read_text().splitlines()]


@pytest.mark.usefixtures("one_torch_thread")
def test_teacher_tokens_at_the_students_rows_equal_a_plain_forward_of_the_privileged_sequence(tiny_student, tmp_path,
                                                                                                 monkeypatch):
    from kiln_core.contracts.distill_self import check_distill_self_request
    from kiln_core.recipes.distill_self import prepare_distill_self, teacher_messages

    request = check_distill_self_request(request_value(mode="ground_truth_conditioning",
                                                       ground_truth=["four", "Paris", "bonjour"]))
    spec = prepare_distill_self(request, student_dir=str(tiny_student), out_root=str(tmp_path), device="cpu")
    manifest, *rows = corpus_lines(spec)
    assert manifest["teacher_identity"]["served_model_id"] == "self-terse:GroundTruthConditioning"
    assert manifest["teacher_identity"]["adapter"] is None and len(rows) == len(PROMPTS)
    for index, row in enumerate(rows):
        assert row["messages"] == PROMPTS[index]["messages"][:-1]  # the student's prompt, no privileged context
        expected = reference_rows(tiny_student, teacher_messages(request, index), 16)
        assert len(row["teacher_tokens"]) == len(expected) > 0
        for got, want in zip(row["teacher_tokens"], expected):
            assert got["token_id"] == want["token_id"]
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-5)
            top = {c["token_id"]: c["logprob"] for c in got["top_logprobs"]}
            assert set(top) == set(want["top"])
            assert all(top[i] == pytest.approx(v, abs=1e-5) for i, v in want["top"].items())
        # and the privileged context changes the teacher: scored without it, the first row differs
        plain = reference_rows(tiny_student, PROMPTS[index]["messages"], 16)
        assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(row["teacher_tokens"], plain)) > 1e-3

    # the spec trains that corpus off-policy, names the recipe, and keeps the request whole
    assert spec.teacher.kind == "manifest_file" and spec.teacher.path == spec.corpus
    assert spec.adapter == "terse" and spec.config.training_mode == "off_policy"
    assert spec.config.output_name == "terse" and spec.config.auto_load is False
    assert spec.recipe.kind == "distill_self" and spec.recipe.mode == "ground_truth_conditioning"
    assert spec.recipe.teacher.alias == spec.recipe.teacher.model_id == "self-terse:GroundTruthConditioning"
    assert spec.recipe.request["ground_truth"] == ["four", "Paris", "bonjour"]
    assert spec.recipe.request["prompts"] == PROMPTS and spec.recipe.request["config"]["lora_rank"] == 4

    # the same inputs again: the corpus is found, the teacher is not loaded; a chained warm start is set
    from kiln_core.scoring import local

    monkeypatch.setattr(local.LocalTeacher, "load", classmethod(lambda *a, **k: pytest.fail("teacher loaded again")))
    again = prepare_distill_self(request, student_dir=str(tiny_student), out_root=str(tmp_path), device="cpu",
                                 base_adapter="warm", recipe="my-recipe", step=2)
    assert again.corpus == spec.corpus and again.config.base_adapter == "warm"
    assert (again.recipe.recipe, again.recipe.step) == ("my-recipe", 2)


@pytest.mark.usefixtures("one_torch_thread")
def test_prompts_sharing_a_student_sequence_but_not_the_teachers_are_refused_before_the_teacher_loads(
        tiny_student, tmp_path, monkeypatch):
    from kiln_core.contracts.distill_self import check_distill_self_request
    from kiln_core.recipes.distill_self import prepare_distill_self
    from kiln_core.scoring import local

    monkeypatch.setattr(local.LocalTeacher, "load", classmethod(lambda *a, **k: pytest.fail("teacher loaded")))
    request = check_distill_self_request(request_value(mode="ground_truth_conditioning", prompts=[PROMPTS[0]] * 2,
                                                       ground_truth=["four", "4"]))
    with pytest.raises(Rejection) as caught:
        prepare_distill_self(request, student_dir=str(tiny_student), out_root=str(tmp_path), device="cpu")
    assert (caught.value.code, caught.value.field) == ("self_distill_conflicting_rows", "prompts[1]")
    assert not (tmp_path / "recipes" / "distill_self").exists() or not any((tmp_path / "recipes" / "distill_self").iterdir())


# ---------------------------------------------------------------------------------------------------------
# 4. the CLI end to end


def write_request(path: Path, value: dict) -> str:
    path.write_text(json.dumps(value))
    return str(path)


def cli(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.usefixtures("one_torch_thread")
def test_distill_self_cli_trains_publishes_and_records_the_recipe(tiny_student, tmp_path, monkeypatch):
    root = tmp_path / "root"
    request = write_request(tmp_path / "self.json", request_value(config={**CONFIG, "epochs": 2}))
    code, out, err = cli("distill", "self", "--request", request, "--student", str(tiny_student), "--out", str(root),
                         "--device", "cpu", "--json")
    assert code == 0, out + err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "success" and len(summary["loss_history"]) == 2 * len(PROMPTS)
    receipt = json.loads(Path(summary["receipt"]).read_text())
    [corpus] = (root / "recipes" / "distill_self").glob("*.jsonl")
    manifest = json.loads(corpus.read_text().splitlines()[0])
    from kiln_core.contracts.identity import TeacherIdentity

    revision = TeacherIdentity.model_validate(manifest["teacher_identity"]).identity_revision()
    recipe = receipt["recipe"]
    assert (recipe["kind"], recipe["mode"], recipe["name"]) == ("distill_self", "conciseness", "terse")
    assert recipe["teacher"] == {"alias": "self-terse:Conciseness", "model_id": "self-terse:Conciseness",
                                 "model_version_hash": None, "identity": None}
    assert recipe["teacher_identity_revision"] == revision and recipe["sources"] == []
    assert recipe["teacher_identity"] == manifest["teacher_identity"]
    assert recipe["request"]["prompts"] == PROMPTS and recipe["request"]["mode"] == "conciseness"
    legacy = json.loads((Path(summary["adapter"]) / "receipt.json").read_text())
    assert legacy["source_kind"] == "distill_self" and legacy["hyperparameters"] == recipe["request"]
    assert legacy["teacher"] == recipe["teacher"] and legacy["seed"] == 5
    assert json.loads(Path(summary["latest"]).read_text())["run"] == summary["run"]

    # the same command again: the run is found finished, and the corpus is reused (the teacher never loads)
    from kiln_core.scoring import local

    monkeypatch.setattr(local.LocalTeacher, "load", classmethod(lambda *a, **k: pytest.fail("teacher loaded again")))
    code, out, err = cli("distill", "self", "--request", request, "--student", str(tiny_student), "--out", str(root),
                         "--device", "cpu")
    assert code == 0, out + err
    assert "already trained terse (distill self, conciseness)" in out
    assert [path.name for path in (root / "recipes" / "distill_self").iterdir()] == [corpus.name]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("case", ["reverse_teacher", "misaligned", "no_suite", "unknown_teacher", "bad_json"])
def test_bad_input_exits_2_before_any_model_loads_and_trains_nothing(case, tiny_student, tmp_path, monkeypatch):
    from kiln_core.scoring import local

    monkeypatch.setattr(local.LocalTeacher, "load", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    student, extra, value = tiny_student, [], request_value()
    expected = {"reverse_teacher": ("reverse_teacher_unsupported", "mode"),
                "misaligned": ("self_distill_misaligned", "prompts[0]"),
                "no_suite": ("post_eval_suite_not_installed", "post_eval.suite"),
                "unknown_teacher": ("teacher_not_registered", "teacher"),
                "bad_json": ("invalid_request", None)}[case]
    if case == "reverse_teacher":
        value["mode"] = "reverse_teacher"
    elif case == "misaligned":
        student = misaligning_copy(tiny_student, tmp_path / "misaligned")
    elif case == "no_suite":
        value["post_eval"] = {"suite": "held-out-math", "min_accuracy": 0.5}
    elif case == "unknown_teacher":
        extra = ["--teacher", "nobody"]
    request = write_request(tmp_path / "self.json", value)
    if case == "bad_json":
        Path(request).write_text("{not json")
    root = tmp_path / "root"
    code, out, err = cli("distill", "self", "--request", request, "--student", str(student), "--out", str(root),
                         "--device", "cpu", "--json", *extra)
    assert code == 2, out + err
    error = json.loads(out.strip().splitlines()[-1])
    assert (error["status"], error["code"], error["field"]) == ("rejected", *expected)
    assert not (root / "runs").exists()


# ---------------------------------------------------------------------------------------------------------
# 5. a registered local teacher wearing a LoRA


@pytest.fixture(scope="module")
def lora_teacher(tmp_path_factory, tiny_student):
    """A PEFT adapter with non-zero random weights on the tiny student, registered as a local teacher."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kiln_core.teachers.local_registry import register_local_teacher

    base = AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    root = tmp_path_factory.mktemp("lora-root")
    adapter = root / "prior-self"
    model.save_pretrained(adapter)
    entry = register_local_teacher(root, "prior-self", adapter, device_kind="cpu")
    return root, entry


@pytest.mark.usefixtures("one_torch_thread")
def test_a_registered_lora_teacher_scores_and_is_the_recorded_identity(tiny_student, lora_teacher):
    from kiln_core.contracts.distill_self import check_distill_self_request
    from kiln_core.recipes.distill_self import prepare_distill_self

    root, entry = lora_teacher
    request = check_distill_self_request(request_value())
    with_lora = prepare_distill_self(request, student_dir=str(tiny_student), out_root=str(root), teacher="prior-self",
                                     device="cpu")
    bare = prepare_distill_self(request, student_dir=str(tiny_student), out_root=str(root), device="cpu")
    manifest, *rows = corpus_lines(with_lora)
    identity = manifest["teacher_identity"]
    assert identity == entry.identity and with_lora.recipe.teacher_identity_revision == entry.identity_revision
    assert set(identity["adapter"]) == {"name", "weights_sha256", "config_sha256"}
    assert with_lora.recipe.teacher_identity == identity  # the LoRA's digests are in the receipt's recipe block
    assert with_lora.recipe.teacher.alias == "self-terse:Conciseness"  # Kiln's descriptor for the recipe
    _, *bare_rows = corpus_lines(bare)
    assert with_lora.corpus != bare.corpus
    assert rows[0]["teacher_tokens"][0]["logprob"] != bare_rows[0]["teacher_tokens"][0]["logprob"]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_lora_teacher_whose_adapter_changed_is_refused_before_it_loads(tiny_student, lora_teacher, tmp_path):
    from kiln_core.contracts.distill_self import check_distill_self_request
    from kiln_core.recipes.distill_self import prepare_distill_self
    from kiln_core.teachers.local_registry import register_local_teacher

    root, entry = lora_teacher
    changed = tmp_path / "changed"
    shutil.copytree(entry.teacher_dir, changed)
    register_local_teacher(root, "changing", changed, device_kind="cpu")
    config = json.loads((changed / "adapter_config.json").read_text())
    (changed / "adapter_config.json").write_text(json.dumps({**config, "lora_dropout": 0.5}))
    with pytest.raises(Rejection) as caught:
        prepare_distill_self(check_distill_self_request(request_value()), student_dir=str(tiny_student),
                             out_root=str(root), teacher="changing", device="cpu")
    assert (caught.value.code, caught.value.field) == ("teacher_changed", "teacher")


# ---------------------------------------------------------------------------------------------------------
# 6. the flow on the Prefect harness


@pytest.mark.usefixtures("one_torch_thread")
def test_distill_self_flow_trains_through_the_engine_and_a_bad_request_fails_the_run_in_one_line(
        prefect_harness, tiny_student, tmp_path):
    from flows.distill_self import distill_self

    root = tmp_path / "root"
    state = distill_self(request=request_value(), student=str(tiny_student), storage_root=str(root),
                         return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["status"] == "success" and len(summary["loss_history"]) == len(PROMPTS)
    receipt = json.loads(Path(summary["receipt"]).read_text())
    assert receipt["recipe"]["kind"] == "distill_self" and receipt["recipe"]["teacher"]["alias"] == "self-terse:Conciseness"
    assert (Path(summary["adapter"]) / "receipt.json").is_file()

    bad = distill_self(request=request_value(name="other", mode="reverse_teacher"), student=str(tiny_student),
                       storage_root=str(root), return_state=True)
    assert bad.is_failed()
    assert bad.message == ("rejected (reverse_teacher_unsupported) mode: distill/self: reverse_teacher requires a "
                           "distinct reverse objective")
    assert not (root / "runs" / "other").exists()


# ---------------------------------------------------------------------------------------------------------
# 7. the thin layers, without a model or a server


@pytest.mark.fast
def test_the_cli_refuses_a_bad_request_before_reading_the_student(tmp_path):
    request = write_request(tmp_path / "self.json", request_value(mode="reverse_teacher"))
    code, out, _ = cli("distill", "self", "--request", request, "--student", str(tmp_path / "nowhere"), "--out",
                       str(tmp_path / "root"), "--json")
    error = json.loads(out.strip().splitlines()[-1])
    assert code == 2 and (error["code"], error["field"], error["file"]) == ("reverse_teacher_unsupported", "mode", request)
    code, out, _ = cli("distill", "self", "--request", str(tmp_path / "missing.json"), "--student", "x", "--json")
    assert code == 2 and json.loads(out.strip().splitlines()[-1])["code"] == "invalid_request"
    assert not (tmp_path / "root").exists()


@pytest.mark.fast
def test_the_task_and_the_flow_take_their_names_from_the_request_and_refuse_a_missing_student(tmp_path):
    from flows.distill_self import run_name
    from flows.run_log import request_adapter
    from kiln_core.contracts.distill_self import check_distill_self_request
    from tasks.distill_self import prepare_distill_self_task

    assert request_adapter(request_value()) == "terse" and request_adapter({"name": " "}) is None
    assert request_adapter("not a request") is None and run_name() == "distill-self-run"
    with pytest.raises(Rejection) as caught:
        prepare_distill_self_task.fn(check_distill_self_request(request_value()), str(tmp_path / "nowhere"),
                                     str(tmp_path))
    assert (caught.value.code, caught.value.field) == ("student_invalid", "student")
