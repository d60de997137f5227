"""Submit-time checks of on-policy requests (Kiln's ``validate_opd_request_at_submit`` and friends).

What a user depends on: a bad on-policy request is refused before any model weights load, with
Kiln's rule and message and a stable code; a good one resolves Kiln's effective S and K.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln_core.contracts.identity import KILN_VLLM_PROTOCOL, TeacherIdentity, build_manifest_line
from kiln_core.contracts.opd_prompt import prompts_content_sha256
from kiln_core.errors import Rejection
from kiln_core.on_policy.render import encode_text
from kiln_core.on_policy.submit import bind_teacher, check_request, check_teacher, plan_on_policy, student_facts
from kiln_core.teachers.local_registry import register_local_teacher
from on_policy_support import chat, request, student_with_template


@pytest.fixture(scope="module")
def registry(tiny_teacher, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("on-policy-registry")
    register_local_teacher(root, "tiny-teacher", tiny_teacher, max_top_k=32, device_kind="cpu")
    register_local_teacher(root, "narrow-teacher", tiny_teacher, max_top_k=20, device_kind="cpu")
    register_local_teacher(root, "tiny-k-teacher", tiny_teacher, max_top_k=8, device_kind="cpu")
    register_local_teacher(root, "short-teacher", tiny_teacher, max_model_len=40, device_kind="cpu")
    return str(root)


@pytest.fixture(scope="module")
def other_teachers(models_dir, tmp_path_factory) -> dict[str, Path]:
    from kiln_core.tiny_models import build_tiny_model

    return {
        "wide": build_tiny_model(models_dir / "teacher-wide-vocab", seed=3, vocab_size=512),
        "other_tokens": build_tiny_model(models_dir / "teacher-other-tokens", seed=3, tokenizer_vocab_size=320),
    }


PROMPTS = [chat("What is two plus two?"), chat("List files under src/.", system="Answer with JSON only."),
           chat("hi", dummy=False)]


def _rejected(fn, code: str, fragment: str, field: str | None = None) -> Rejection:
    with pytest.raises(Rejection) as caught:
        fn()
    assert caught.value.code == code, caught.value.describe()
    assert fragment in caught.value.message
    if field is not None:
        assert caught.value.field == field
    return caught.value


def test_a_valid_request_plans_without_loading_any_weights(registry, tiny_student, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("submit checks must not load model weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    req = request(PROMPTS, max_tokens=64)
    plan = plan_on_policy(req, teacher=bind_teacher(registry, "tiny-teacher"), student_dir=str(tiny_student))
    assert (plan.samples_per_prompt, plan.top_k, plan.warnings) == (64, 32, ())
    assert plan.content_sha256 == prompts_content_sha256(req.prompts)
    facts, student = student_facts(str(tiny_student))
    texts = [student.tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    lengths = [len(student.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    assert plan.longest_prompt_tokens == max(lengths)


def test_samples_per_prompt_counts_every_prompt_of_the_request(registry, tiny_student):
    teacher = bind_teacher(registry, "tiny-teacher")
    for count, expected in ((49, 64), (50, 16), (199, 16), (200, 4)):
        prompts = [chat(f"q{i}", dummy=i % 2 == 0) for i in range(count)]  # half would be dropped later
        plan = plan_on_policy(request(prompts, max_tokens=8), teacher=teacher, student_dir=str(tiny_student))
        assert plan.samples_per_prompt == expected
    plan = plan_on_policy(request(PROMPTS, samples_per_prompt=3, max_tokens=8), teacher=teacher,
                          student_dir=str(tiny_student))
    assert plan.samples_per_prompt == 3


@pytest.mark.parametrize("body, code, fragment, field", [
    ({"teacher": "t", "prompts": []}, "source_not_exactly_one",
     "OPD request must use exactly one of non-empty prompts or dataset_path", "prompts"),
    ({"teacher": "t", "prompts": [chat("q")], "dataset_path": "/d.jsonl"}, "source_not_exactly_one", "exactly one",
     None),
    ({"teacher": "t", "prompts": [], "dataset_path": "   "}, "source_not_exactly_one", "exactly one", None),
    ({"teacher": " ", "prompts": [chat("q")]}, "teacher_missing", "OPD request must specify a teacher alias",
     "teacher"),
    ({"teacher": "t", "dataset_path": "/d.jsonl"}, "invalid_config",
     'OPD teacher-logprob JSONL requires config.training_mode="off_policy"', "config.training_mode"),
    ({"teacher": "t", "dataset_path": "agent_traces:last-week"}, "unsupported", "agent_traces:", "dataset_path"),
    ({"teacher": "t", "prompts": [chat("q"), {"messages": []}]}, "prompt_no_messages", "OPD prompt 1 has no messages",
     "prompts[1].messages"),
    ({"teacher": "t", "prompts": [chat("q")], "config": {"training_mode": "off_policy"}}, "prompt_no_action",
     "OPD prompt 0 requires a non-empty assistant action for off-policy scoring", "prompts[0]"),
    ({"teacher": "t", "prompts": [{"messages": [{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a"}]}],
      "config": {"training_mode": "off_policy"}}, "unsupported", "off-policy training on inline prompts", None),
    ({"teacher": "t", "prompts": [chat("q")], "config": {"discount": 0.5}}, "invalid_config",
     "OPD discount=0.5 is unsupported because discounted advantages are not wired; use 0", "config.discount"),
    ({"teacher": "t", "prompts": [chat("q")], "config": {"loss": "full_vocab"}}, "invalid_config",
     "full_vocab has no concrete server-built teacher source", "config.loss"),
    ({"teacher": "t", "prompts": [chat("q")], "config": {"top_k": 0}}, "invalid_config", "OPD top_k must be > 0",
     "config.top_k"),
    ({"teacher": "t", "prompts": [chat("q")], "config": {"samples_per_prompt": 0}}, "invalid_config",
     "OPD samples_per_prompt must be > 0", "config.samples_per_prompt"),
    ({"teacher": "t", "prompts": [chat("q")], "config": {"sampler_segments": 0}}, "invalid_config",
     "OPD sampler_segments must be greater than zero", "config.sampler_segments"),
])
def test_request_rules_refuse_with_kilns_message(body, code, fragment, field):
    from kiln_core.contracts.opd_config import parse_opd_request

    _rejected(lambda: check_request(parse_opd_request(body)), code, fragment, field)


def test_an_off_policy_corpus_request_is_not_an_on_policy_request():
    from kiln_core.contracts.opd_config import parse_opd_request

    with pytest.raises(ValueError):
        check_request(parse_opd_request({"teacher": "t", "dataset_path": "/d.jsonl",
                                         "config": {"training_mode": "off_policy"}}))


def test_the_prompt_count_and_size_limits(monkeypatch):
    import kiln_core.on_policy.submit as submit

    monkeypatch.setattr(submit, "MAX_PROMPTS", 3)
    _rejected(lambda: check_request(request([chat("q")] * 4)), "too_many_prompts",
              "resolved to 4 prompts; maximum is 3")
    assert check_request(request([chat("q")] * 3)) == []
    monkeypatch.setattr(submit, "MAX_PROMPT_BYTES", 200)
    _rejected(lambda: check_request(request([chat("q" * 150)] * 2)), "prompts_too_large", "more than 200 bytes")


def test_post_eval_is_no_warning_it_gates_the_run():
    from kiln_core.contracts.opd_config import parse_opd_request

    req = parse_opd_request({"teacher": "t", "prompts": [chat("q")], "post_eval": {"suite": "s"}})
    assert check_request(req) == []


def test_teacher_rules(registry, tiny_student, other_teachers, tmp_path):
    facts, _ = student_facts(str(tiny_student))
    req = request(PROMPTS)
    _rejected(lambda: check_teacher(req, bind_teacher(registry, "nobody"), facts), "teacher_not_registered",
              "OPD teacher alias 'tiny-teacher' is not registered", "teacher")

    local = bind_teacher(registry, "tiny-teacher")
    assert local.kind == "local" and local.teacher_dir
    remote_identity = TeacherIdentity.model_validate({**local.identity.as_ordered_dict(),
                                                      "protocol": KILN_VLLM_PROTOCOL})
    manifest = tmp_path / "remote-manifest.jsonl"
    manifest.write_text(build_manifest_line(remote_identity) + "\n", encoding="utf-8")
    remote = bind_teacher(registry, str(manifest))
    assert remote.kind == "remote"
    _rejected(lambda: check_teacher(req, remote, facts), "remote_teacher_on_policy",
              'OPD cannot use a remote teacher with training_mode="on_policy": remote logits must be prefetched before '
              'GPU coordination; use training_mode="off_policy" with fixed assistant actions')

    for name in ("wide", "other_tokens"):
        register_local_teacher(registry, f"{name}-teacher", other_teachers[name], device_kind="cpu")
    _rejected(lambda: check_teacher(req, bind_teacher(registry, "wide-teacher"), facts), "teacher_vocab_mismatch",
              "vocab_size 512 but the student's is 400")
    _rejected(lambda: check_teacher(req, bind_teacher(registry, "other_tokens-teacher"), facts),
              "teacher_vocab_mismatch", "tokenizes with another vocabulary")


def test_top_k_resolves_under_the_teachers_max_top_k(registry, tiny_student):
    facts, _ = student_facts(str(tiny_student))
    assert check_teacher(request(PROMPTS), bind_teacher(registry, "tiny-teacher"), facts) == (32, [])
    assert check_teacher(request(PROMPTS, top_k=64), bind_teacher(registry, "tiny-teacher"), facts)[0] == 32
    k, warnings = check_teacher(request(PROMPTS), bind_teacher(registry, "narrow-teacher"), facts)
    assert k == 16 and warnings == ["Requested top_k 32 was resolved to effective top_k 16 for the teacher and "
                                    "active OPD kernel."]
    _rejected(lambda: check_teacher(request(PROMPTS), bind_teacher(registry, "tiny-k-teacher"), facts),
              "top_k_unsupported", "OPD top_k 32 is not executable with source cap 8: OPD teacher_top_k has no "
              "executable support size: requested 32, source cap 8, KT kernels require one of {16, 32}", "config.top_k")
    _rejected(lambda: check_teacher(request(PROMPTS, top_k=10), bind_teacher(registry, "tiny-teacher"), facts),
              "top_k_unsupported", "requested 10, source cap 32")


def test_a_prompt_that_cannot_fit_with_max_tokens_is_refused(registry, tiny_student):
    teacher = bind_teacher(registry, "tiny-teacher")
    facts, student = student_facts(str(tiny_student))
    longest = max(int(encode_text(student.tokenizer, student.tokenizer.apply_chat_template(
        p["messages"], add_generation_prompt=True, tokenize=False)).shape[0]) for p in PROMPTS)
    fits = request(PROMPTS, max_tokens=2048 - longest)
    assert plan_on_policy(fits, teacher=teacher, student_dir=str(tiny_student)).longest_prompt_tokens == longest
    _rejected(lambda: plan_on_policy(request(PROMPTS, max_tokens=2049 - longest), teacher=teacher,
                                     student_dir=str(tiny_student)),
              "training_will_not_fit", "more than the student's context (max_position_embeddings) of 2048",
              "config.max_tokens")
    extra = [{**chat("q"), "teacher_extra_messages": [{"role": "user", "content": "a long teacher-only hint " * 4}]}]
    assert plan_on_policy(request(extra, max_tokens=8), teacher=teacher, student_dir=str(tiny_student))
    _rejected(lambda: plan_on_policy(request(extra, max_tokens=8), teacher=bind_teacher(registry, "short-teacher"),
                                     student_dir=str(tiny_student)),
              "training_will_not_fit", "the teacher's max_model_len of 40")


def test_a_prompt_the_template_refuses_is_named(registry, tiny_student, tmp_path):
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
                "{% endif %}{{ m['content'] }}{% endfor %}")
    student = student_with_template(tiny_student, tmp_path / "no-system", template)
    _rejected(lambda: plan_on_policy(request(PROMPTS, max_tokens=8), teacher=bind_teacher(registry, "tiny-teacher"),
                                     student_dir=str(student)),
              "prompt_render_failed", "OPD prompt 1 failed chat-template rendering during admission: no system turns",
              "prompts[1]")


def test_an_unusable_student_or_registry_is_a_rejection(registry, tmp_path):
    _rejected(lambda: plan_on_policy(request(PROMPTS), teacher=bind_teacher(registry, "tiny-teacher"),
                                     student_dir=str(tmp_path / "missing")), "student_invalid", "does not exist")
    (tmp_path / "teachers.json").write_text("{not json", encoding="utf-8")
    _rejected(lambda: bind_teacher(str(tmp_path), "tiny-teacher"), "corrupt_registry",
              "not a readable teacher registry")

