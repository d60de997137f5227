"""The held-out watch from a real teacher-scored corpus, and on an on-policy run.

``HeldOutSlice.admit`` is how a caller builds the watch: the held-out JSONL admitted with
``admit_eval_corpus``'s rules, plus the on-policy rule added here — a held-out prompt must not be one
of the training prompts (their messages without the trailing assistant turn). An on-policy run
watched on that slice trains exactly what it trains unwatched.
"""

from __future__ import annotations

import pytest

from kiln_core.contracts.eval_watch import EvalWatch
from kiln_core.evaluation import EvalInputError
from kiln_core.training.watch import HeldOutSlice
from on_policy_support import chat
from test_eval_watch import adapter_bytes
from test_evaluation import score
from test_on_policy_trainer import identity, make_request, run, teacher  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

HELD_OUT = [
    ("What is the capital of France?", "Paris."),
    ("Name a color.", "Blue."),
    ("Count to three.", "1 2 3"),
]


@pytest.fixture(scope="module")
def held_out_corpus(tmp_path_factory, tiny_teacher, tiny_student):
    return score(tmp_path_factory.mktemp("watch"), "heldout", HELD_OUT, tiny_teacher, tiny_student)


def watch(corpus, **overrides) -> EvalWatch:
    return EvalWatch(**{"corpus": str(corpus), "every_steps": 2, "stop_on_divergence": False, **overrides})


def test_admit_builds_the_slice_from_the_scored_corpus(held_out_corpus, tiny_student):
    held_out = HeldOutSlice.admit(watch(held_out_corpus, max_examples=2), str(tiny_student), top_k=16)
    record = held_out.record()
    assert held_out.tables.num_examples == 3 and held_out.corpus_sha256.startswith("sha256:")
    assert record.example_indices == [0, 1] and record.corpus == str(held_out_corpus)
    assert record.tokens == int(held_out.tables.action_offsets[2])


def test_a_held_out_prompt_that_is_a_training_prompt_is_refused(held_out_corpus, tiny_student):
    prompts = make_request([chat("Tell me a joke."), chat("Name a color.")]).prompts  # the second is held out
    with pytest.raises(EvalInputError) as refused:
        HeldOutSlice.admit(watch(held_out_corpus), str(tiny_student), top_k=16, train_prompts=prompts)
    # line 3: the manifest is line 1, "Name a color." the second example
    assert (refused.value.code, refused.value.line) == ("eval_train_overlap", 3) and "training prompt 1" in refused.value.message
    # the same prompt with another system turn is another conversation
    other = make_request([chat("Name a color.", system="Be brief.")]).prompts
    assert HeldOutSlice.admit(watch(held_out_corpus), str(tiny_student), top_k=16, train_prompts=other).tables.num_examples == 3


def test_an_on_policy_run_watched_trains_what_it_trains_unwatched(held_out_corpus, tiny_student, teacher, tmp_path):
    req = make_request(checkpoint_interval=None)
    held_out = HeldOutSlice.admit(watch(held_out_corpus), str(tiny_student), top_k=16, train_prompts=req.prompts)
    plain = run(tiny_student, teacher, tmp_path / "plain", req)
    watched = run(tiny_student, teacher, tmp_path / "watched", req, eval_watch=held_out)
    assert watched.status == plain.status == "success" and watched.steps == plain.steps > 2
    assert adapter_bytes(tmp_path / "watched") == adapter_bytes(tmp_path / "plain")
    steps = [p.step for p in watched.eval_curve.points]  # before training, every 2 steps, and after the last
    expected = sorted({0, *range(2, plain.steps + 1, 2), plain.steps})
    assert steps == expected and plain.eval_curve is None


MULTI_TURN = {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Red."},
                           {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": ""}]}


@pytest.mark.parametrize("rendering", ["legacy_action_boundary", "chat_template"])
def test_the_held_out_conversation_of_a_prompt_is_what_the_student_samples_after(tiny_student, rendering):
    """``rollout_messages`` (the overlap rule's conversation) rendered with the generation cue is the very
    rollout prefix the on-policy preparation builds, in both renderings."""
    from kiln_core.contracts.opd_prompt import kiln_prompt_value
    from kiln_core.on_policy.prepare import prepare_prompts
    from kiln_core.on_policy.render import encode_text, render_for_generation, rollout_messages
    from kiln_core.tokenization import load_student_tokenizer

    student = load_student_tokenizer(str(tiny_student))
    prompts = make_request([MULTI_TURN, chat("Name a color.", system="Be brief.")]).prompts
    prepared = prepare_prompts(prompts, student, rendering=rendering)
    for prompt, kept in zip(prompts, prepared.prompts):
        messages = rollout_messages(kiln_prompt_value(prompt)["messages"], rendering)
        text = render_for_generation(student.chat_template, messages, enable_thinking=False)
        assert encode_text(student.tokenizer, text).tolist() == kept.rollout_prefix.tolist()


def test_a_multi_turn_prompt_is_held_out_as_the_conversation_the_student_answers(held_out_corpus, tiny_student):
    prompts = make_request([MULTI_TURN]).prompts
    # Kiln's default rendering: the first assistant turn is the first action, so the student answers "Name a color."
    with pytest.raises(EvalInputError) as refused:
        HeldOutSlice.admit(watch(held_out_corpus), str(tiny_student), top_k=16, train_prompts=prompts)
    assert (refused.value.code, refused.value.line) == ("eval_train_overlap", 3)
    # chat_template: the student answers after the whole conversation, which no held-out example is
    admitted = HeldOutSlice.admit(watch(held_out_corpus), str(tiny_student), top_k=16, train_prompts=prompts,
                                  prompt_rendering="chat_template")
    assert admitted.tables.num_examples == 3
