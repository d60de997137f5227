"""Prompt preparation and the candidate schedule (Kiln's ``opd_train`` before the first rollout).

What a user depends on: which prompts train (the rest dropped with a reason), where the student's
rollout starts (the legacy action boundary or the re-rendered chat template), what the teacher sees
when a prompt carries teacher-only messages, and the exact candidate order, seeds and RNG position
that make a resumed run sample what an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from kiln_core.errors import Rejection
from kiln_core.on_policy.prepare import (
    CandidateSequences,
    PreparedPrompt,
    candidate_sequences,
    check_target_pairs,
    prepare_prompts,
)
from kiln_core.on_policy.schedule import candidate_seed, iter_candidates, rollout_rng_state, token_seed
from kiln_core.tokenization import EncodedConversation, load_student_tokenizer
from on_policy_support import chat, request, student_with_template


@pytest.fixture(scope="module")
def student(tiny_student):
    return load_student_tokenizer(tiny_student)


def _encode(student, text: str) -> list[int]:
    return student.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_legacy_prefix_is_the_training_tokens_before_the_first_action(student):
    prompts = request([
        chat("What is two plus two?", system="Be brief."),
        chat("hi", dummy=False),  # user only: no action token, dropped
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}]},  # the first assistant turn decides
        {"messages": [{"role": "user", "content": "d"}], "trajectory": [
            {"role": "assistant", "content": "e", "kind": "action"}]},
    ]).prompts
    prepared = prepare_prompts(prompts, student)
    assert prepared.source_indices == [0, 2, 3] and prepared.source_count == 4
    assert [(d.source_index, d.reason) for d in prepared.dropped] == [(1, "no action tokens")]
    expected = [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nd<|im_end|>\n<|im_start|>assistant\n",
    ]
    for prompt, text in zip(prepared.prompts, expected):
        assert prompt.rollout_prefix.tolist() == _encode(student, text)
        assert prompt.rollout_prefix.tolist() == prompt.input_ids[: prompt.action_positions[0]].tolist()
        assert prompt.teacher_prefix is None and not prompt.skipped
    assert prepared.candidates_per_epoch(4) == 12


def test_chat_template_prefix_drops_trailing_assistants_and_passes_enable_thinking(tiny_student, tmp_path):
    chatml = (tiny_student / "chat_template.jinja").read_text(encoding="utf-8")
    thinking = chatml.replace("{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
                              "{{- '<|im_start|>assistant\\n' -}}{%- if enable_thinking is defined and not "
                              "enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}")
    assert thinking != chatml
    student = load_student_tokenizer(student_with_template(tiny_student, tmp_path / "thinking", thinking))
    two_dummies = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"},
                                {"role": "assistant", "content": "y"}]}
    prepared = prepare_prompts(request([two_dummies, chat("hi", dummy=False)]).prompts, student,
                               rendering="chat_template")
    assert prepared.source_indices == [0]  # the user-only prompt still has no action token: dropped
    assert prepared.prompts[0].rollout_prefix.tolist() == _encode(
        student, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_render_failures_refuse_the_run(tiny_student, tmp_path):
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
                "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
                "{% else %}"
                "{{ m['content'] }}{% endif %}{% endfor %}")
    student = load_student_tokenizer(student_with_template(tiny_student, tmp_path / "strict", template))
    prompts = request([chat("q"), chat("r", system="s")]).prompts
    # The legacy path drops the prompt it cannot tokenize, with a warning, as Kiln does ...
    legacy = prepare_prompts(prompts, student)
    assert legacy.source_indices == [0] and legacy.dropped[0].source_index == 1
    assert "no system" in legacy.dropped[0].reason
    # ... while the chat-template path renders every prompt and refuses the run.
    with pytest.raises(Rejection) as caught:
        prepare_prompts(prompts, student, rendering="chat_template")
    assert caught.value.code == "rollout_render_failed"
    assert caught.value.message.startswith("opd_train: render rollout chat template for prompt 1: ")


def test_no_prompt_with_an_action_token_refuses_the_run(student):
    with pytest.raises(Rejection) as caught:
        prepare_prompts(request([chat("a", dummy=False), chat("b", dummy=False)]).prompts, student)
    assert caught.value.code == "no_valid_prompts"
    assert "opd_train: no valid prompts after tokenization" in caught.value.message


def test_a_first_action_at_position_zero_keeps_the_prompt_but_skips_its_candidates(student, monkeypatch):
    import kiln_core.on_policy.prepare as prepare

    def at_zero(_student, conversations):
        return [EncodedConversation(np.array([7, 8, 9], np.int32), np.array([0, 1], np.int32),
                                    np.zeros(0, np.int32), np.zeros(0, bool)) for _ in conversations]

    monkeypatch.setattr(prepare, "encode_conversations", at_zero)
    prepared = prepare_prompts(request([chat("q"), chat("r")]).prompts, student)
    assert prepared.source_indices == [0, 1] and all(p.skipped for p in prepared.prompts)
    assert [c.skipped for c in iter_candidates(prepared, 2, 1)] == [True] * 4


def test_refusals_the_mask_builder_reports_drop_the_prompt_except_an_action_at_position_zero(student, monkeypatch):
    """A Kiln-exact builder reports what Kiln refuses on the result (``problem``) instead of raising."""
    import kiln_core.on_policy.prepare as prepare

    @dataclass(frozen=True)
    class Reported:
        input_ids: np.ndarray
        action_positions: np.ndarray
        env_positions: np.ndarray
        env_in_warning_prefix: np.ndarray
        problem: object = None

    problems = {"q": None, "r": ("overlapping_masks", "masks overlap at token index 3"),
                "s": ("target_at_position_zero", "the action mask holds token position 0")}

    def reporting(_student, conversations):
        results = []
        for conversation in conversations:
            problem = problems[conversation.messages[-1]["content"]]
            first = 0 if problem and problem[0] == "target_at_position_zero" else 2
            results.append(Reported(np.array([7, 8, 9, 10], np.int32), np.array([first, 3], np.int32),
                                    np.zeros(0, np.int32), np.zeros(0, bool),
                                    SimpleNamespace(code=problem[0], message=problem[1]) if problem else None))
        return results

    monkeypatch.setattr(prepare, "encode_conversations", reporting)
    prepared = prepare_prompts(request([chat("q"), chat("r"), chat("s")]).prompts, student)
    assert prepared.source_indices == [0, 2]
    assert prepared.dropped[0].source_index == 1 and "overlapping_masks" in prepared.dropped[0].reason
    kept, at_zero = prepared.prompts
    assert kept.rollout_prefix.tolist() == [7, 8] and not kept.skipped
    assert at_zero.skipped  # kept in the schedule; its candidates are consumed without updates
    assert [c.skipped for c in iter_candidates(prepared, 2, 1)] == [False, False, True, True]


def test_teacher_prompt_merges_the_extra_contents_into_the_system_turn(student):
    extras = [{"role": "user", "content": "Hint one."}, {"role": "assistant", "content": "Hint two."}]
    with_system = {**chat("q", system="Be brief."), "teacher_extra_messages": extras}
    without_system = {**chat("q"), "teacher_extra_messages": extras}
    prepared = prepare_prompts(request([with_system, without_system]).prompts, student)
    first, second = prepared.prompts
    assert first.teacher_prefix.tolist() == _encode(
        student, "<|im_start|>system\nHint one.\n\nHint two.\n\nBe brief.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
                 "<|im_start|>assistant\n")
    assert second.teacher_prefix.tolist() == _encode(
        student, "<|im_start|>system\nHint one.\n\nHint two.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
                 "<|im_start|>assistant\n")
    # the student never sees the extras
    assert first.rollout_prefix.tolist() == _encode(
        student, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")


def test_candidate_sequences_shift_targets_into_the_teachers_frame():
    sampled = [40, 41, 42]
    symmetric = PreparedPrompt(3, np.zeros(0, np.int32), np.zeros(0, np.int32), np.array([1, 2], np.int32), None)
    seq = candidate_sequences(symmetric, sampled)
    assert seq.student_ids.tolist() == [1, 2, 40, 41, 42] and seq.student_positions.tolist() == [2, 3, 4]
    assert seq.teacher_ids is seq.student_ids
    asymmetric = PreparedPrompt(3, np.zeros(0, np.int32), np.zeros(0, np.int32), np.array([1, 2], np.int32),
                                np.array([9, 9, 9, 9, 2], np.int32))
    seq = candidate_sequences(asymmetric, sampled)
    assert seq.teacher_ids.tolist() == [9, 9, 9, 9, 2, 40, 41, 42] and seq.teacher_positions.tolist() == [5, 6, 7]
    check_target_pairs(seq)
    for bad in (dict(), dict(prompt=PreparedPrompt(3, np.zeros(0), np.zeros(0), None, None))):
        with pytest.raises(ValueError):
            candidate_sequences(bad.get("prompt", symmetric), [] if not bad else sampled)


def test_pairing_check_refuses_mismatched_targets():
    ids = np.array([1, 2, 40, 41], np.int32)
    with pytest.raises(Rejection) as caught:
        check_target_pairs(CandidateSequences(ids, np.array([2, 3], np.int32), np.array([5, 40, 7], np.int32),
                                              np.array([1, 2], np.int32)))
    assert caught.value.code == "asymmetric_target_mismatch"
    assert caught.value.message == "asymmetric target pair 1 has student token 41 at 3 but teacher token 7 at 2"
    for teacher_positions in ([1], [0, 1], [2, 1], [2, 5]):
        with pytest.raises(Rejection) as caught:
            check_target_pairs(CandidateSequences(ids, np.array([2, 3], np.int32), np.array([5, 40, 41, 7], np.int32),
                                                  np.array(teacher_positions, np.int32)))
        assert caught.value.code == "invalid_rollout"


def test_candidate_order_cursor_and_resume_start(student):
    prepared = prepare_prompts(request([chat("a"), chat("b", dummy=False), chat("c")]).prompts, student)
    order = [(c.epoch, c.cursor, c.prepared_index, c.source_index, c.sample_index) for c in
             iter_candidates(prepared, 2, 2)]
    assert order == [(0, 0, 0, 0, 0), (0, 1, 0, 0, 1), (0, 2, 1, 2, 0), (0, 3, 1, 2, 1),
                     (1, 0, 0, 0, 0), (1, 1, 0, 0, 1), (1, 2, 1, 2, 0), (1, 3, 1, 2, 1)]
    resumed = [(c.epoch, c.cursor) for c in iter_candidates(prepared, 2, 2, start_epoch=0, start_cursor=3)]
    assert resumed == [(0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    last = list(iter_candidates(prepared, 2, 2))[-1]
    assert last.consumed_after(prepared.candidates_per_epoch(2)) == 8
    with pytest.raises(ValueError):
        list(iter_candidates(prepared, 2, 2, start_cursor=4))


def test_rollout_seeds_wrap_like_u64_and_the_rng_state_is_kilns():
    def reference(seed, step, source, sample):  # Rust's wrapping_add chain
        value = seed
        for term in (step, source * 1_000_003, sample * 1_000_033):
            value = (value + term) & 0xFFFFFFFFFFFFFFFF
        return value

    for args in ((0, 0, 0, 0), (42, 7, 3, 5), (2**64 - 1, 1, 0, 0), (2**64 - 3, 10, 2**20, 2**20)):
        assert candidate_seed(*args) == reference(*args)
    assert token_seed(2**64 - 1, 2) == 1
    assert candidate_seed(5, 1, 0, 0) != candidate_seed(5, 0, 0, 0)  # the step counter moves the seed
    assert rollout_rng_state(9, 17) == {"algorithm": "kiln.opd-rollout-candidate.v1", "seed": 9, "position": 17}
