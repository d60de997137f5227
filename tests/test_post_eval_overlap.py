"""Held-out overlap between a suite and the training corpus (Kiln's contamination index).

Kiln sources: crates/kiln-eval/src/data_identity.rs and crates/kiln-server/src/api/training.rs ·
check_prompt_variants, check_sft_contamination, contamination_error. The identity reference below
hashes JSON text written out by hand, independently of kiln_core's encoder.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from kiln_core.post_eval import PostEvalRejection, check_training_overlap, conversation_from_opd_example, load_suite
from kiln_core.contracts.post_eval.config import PostEvalConfig
from kiln_core.post_eval.overlap import EvalContaminationIndex, TrainingConversation, example_identity

HELD_OUT = PostEvalConfig(suite="math-held-out")
KILN_MESSAGE = ('post_eval suite "math-held-out" is declared held-out but overlaps admitted training data via {}; '
                'use a disjoint suite or explicitly set post_eval.data_scope to "train-set-eval" for a non-gating '
                "diagnostic")


def make_suite(*examples):
    return load_suite(json.dumps({"name": "math-held-out", "default_scorer": {"kind": "exact_match"},
                                  "examples": list(examples)}))


def user(text):
    return {"role": "user", "content": text}


def opd(messages, response):
    return {"messages": messages, "teacher_response": response, "teacher_tokens": []}


def overlap_of(suite, *rows) -> str | None:
    try:
        check_training_overlap(HELD_OUT, suite, (conversation_from_opd_example(row) for row in rows))
    except PostEvalRejection as error:
        assert error.code == "post_eval_overlap" and error.field == "post_eval.data_scope"
        return error.message
    return None


def test_identity_is_sha256_of_sorted_compact_json():
    content, normalized = example_identity([user("What is  2+2?\n")], "Four")
    exact_text = '{"messages":[{"content":"What is  2+2?\\n","role":"user"}],"target":"Four"}'
    normal_text = '{"messages":[{"content":"what is 2+2?","role":"user"}],"target":"four"}'
    assert content == "sha256:" + hashlib.sha256(exact_text.encode()).hexdigest()
    assert normalized == "sha256:" + hashlib.sha256(normal_text.encode()).hexdigest()
    assert example_identity([user("x")], None)[0] == "sha256:" + hashlib.sha256(
        b'{"messages":[{"content":"x","role":"user"}],"target":null}').hexdigest()


def test_exact_overlap_is_rejected_with_kiln_message():
    suite = make_suite({"messages": [user("What is 2+2?")], "target": "4"})
    assert overlap_of(suite, opd([user("What is 2+2?")], "4")) == KILN_MESSAGE.format("exact prompt/target")


def test_normalized_overlap_folds_case_and_whitespace():
    suite = make_suite({"messages": [user("What is 2+2?")], "target": "Four"})
    assert overlap_of(suite, opd([user("  what IS\t2+2? ")], "four")) == KILN_MESSAGE.format("normalized prompt/target")


def test_disjoint_data_passes_and_train_set_eval_skips():
    suite = make_suite({"messages": [user("What is 2+2?")], "target": "4"})
    assert overlap_of(suite, opd([user("What is 2+3?")], "5"), opd([user("What is 2+2?")], "5")) is None
    diagnostic = PostEvalConfig(suite="math-held-out", data_scope="train-set-eval")
    check_training_overlap(diagnostic, suite, [conversation_from_opd_example(opd([user("What is 2+2?")], "4"))])
    check_training_overlap(None, suite, [conversation_from_opd_example(opd([user("What is 2+2?")], "4"))])


def test_prompt_variants_without_system_and_trailing_tool_messages():
    suite = make_suite({"messages": [user("look it up")], "target": "done"})
    system = {"role": "system", "content": "You are terse."}
    tool = {"role": "tool", "content": "result", "tool_call_id": "c1"}
    assert overlap_of(suite, opd([system, user("look it up")], "done")) == KILN_MESSAGE.format("exact prompt/target")
    assert overlap_of(suite, opd([system, user("look it up"), tool, tool], "done")) == KILN_MESSAGE.format(
        "exact prompt/target")
    assert overlap_of(suite, opd([tool, user("look it up")], "done")) is None  # only trailing tool turns are dropped


def test_every_assistant_turn_of_the_conversation_is_checked():
    suite = make_suite({"messages": [user("hi")], "target": "hello"})
    earlier = [user("hi"), {"role": "assistant", "content": "hello"}, user("and now?")]
    assert overlap_of(suite, opd(earlier, "something else")) == KILN_MESSAGE.format("exact prompt/target")


def test_structured_content_is_compared_as_its_text():
    suite = make_suite({"messages": [user("ab")], "target": "c"})
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert overlap_of(suite, opd([parts], "c")) == KILN_MESSAGE.format("exact prompt/target")


def test_source_provenance_groups_and_sessions():
    row = {"row_number": 3, "content_sha256": "sha256:" + "a" * 64, "normalized_sha256": "sha256:" + "b" * 64,
           "group_id": "g-1", "session_id": "s-9"}
    provenance = {"kiln_dataset_provenance": {"dataset": "d", "source_split": "holdout", "row": row}}
    suite = make_suite({"messages": [user("q")], "target": "a", "metadata": provenance})
    index = EvalContaminationIndex(suite)
    assert index.has_sources
    assert overlap_of(suite, dict(opd([user("other")], "x"), metadata={"group_id": " g-1 "})) == KILN_MESSAGE.format(
        "source group")
    assert overlap_of(suite, dict(opd([user("other")], "x"), session_id="s-9")) == KILN_MESSAGE.format("source session")
    assert index.check_source_row({"content_sha256": row["content_sha256"], "normalized_sha256": "x"}) == "source_row"
    assert index.check_source_row({"content_sha256": "y", "normalized_sha256": row["normalized_sha256"]}) == \
        "normalized_source_row"
    # provenance that does not parse as Kiln's DatasetExampleProvenance is ignored (serde's .ok())
    bad = {"kiln_dataset_provenance": {"dataset": "d", "source_split": "holdout", "row": row, "extra": 1}}
    assert not EvalContaminationIndex(make_suite({"messages": [user("q")], "target": "a", "metadata": bad})).has_sources


def test_example_check_comes_before_source_checks():
    row = {"row_number": 1, "content_sha256": "sha256:c", "normalized_sha256": "sha256:n", "group_id": "g"}
    suite = make_suite({"messages": [user("q")], "target": "a",
                        "metadata": {"kiln_dataset_provenance": {"dataset": "d", "source_split": "train", "row": row}}})
    hit = dict(opd([user("q")], "a"), group_id="g")
    assert overlap_of(suite, hit) == KILN_MESSAGE.format("exact prompt/target")


def test_training_conversation_can_be_given_directly():
    suite = make_suite({"messages": [user("q")], "target": "a"})
    with pytest.raises(PostEvalRejection):
        check_training_overlap(HELD_OUT, suite, [TrainingConversation([user("q"), {"role": "assistant", "content": "a"}])])
