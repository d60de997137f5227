"""Scorers and the <think> split, against Kiln's own unit tests and the rules around them.

Kiln sources: crates/kiln-eval/src/scorers/*.rs (#[test] cases translated below, named after them)
and crates/kiln-eval/src/qwen3.rs · split_thinking.
"""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from kiln_core.contracts.post_eval.answer_parsing import (extract_json_body, extract_last_number, json_pointer_exists,
                                               split_thinking)
from kiln_core.contracts.post_eval.scorers import Scorer, ScorerError, score_completion
from kiln_core.contracts.post_eval.suite import EvalExample

SCORER = TypeAdapter(Scorer)


def ex(target=None, aliases=(), question="q", messages=None):
    return EvalExample.model_validate({"messages": messages or [{"role": "user", "content": question}],
                                       "target": target, "aliases": list(aliases)})


def score(scorer: dict, completion: str, target=None, aliases=(), judge=None, **kw):
    return score_completion(SCORER.validate_python(scorer), ex(target, aliases, **kw), completion, judge)


# ---- exact_match.rs ------------------------------------------------------------------------------


def test_exact_match_kiln_cases():
    assert score({"kind": "exact_match", "case_sensitive": False}, "  paris\n", "Paris").kind == "pass"  # case_insensitive_passes_with_strip
    assert score({"kind": "exact_match"}, "paris", "Paris").kind == "fail"  # case_sensitive_fails_on_case_mismatch
    assert score({"kind": "exact_match", "case_sensitive": False}, "the city of light", "Paris",
                 aliases=["The City of Light"]).kind == "pass"  # aliases_accepted
    assert score({"kind": "exact_match", "case_sensitive": False}, "cafe\u0301", "café").kind == "pass"  # nfc
    with pytest.raises(ScorerError, match="requires `target`"):  # missing_target_is_error
        score({"kind": "exact_match"}, "x", None)


def test_exact_match_defaults_strip_and_respect_no_strip():
    assert score({"kind": "exact_match"}, " 4\n", "4").score == 1.0
    failed = score({"kind": "exact_match", "strip_whitespace": False}, " 4", "4")
    assert (failed.kind, failed.score, failed.detail) == ("fail", 0.0, "expected `4`, got ` 4`")
    # Rust's trim strips Unicode White_Space only: U+001F is not whitespace there.
    assert score({"kind": "exact_match"}, "4\x1f", "4").kind == "fail"
    assert score({"kind": "exact_match"}, "4\u3000", "4").kind == "pass"


# ---- contains.rs ---------------------------------------------------------------------------------


def test_contains_kiln_cases():
    assert score({"kind": "contains", "phrases": ["world", "missing"]}, "hello world").kind == "pass"
    partial = score({"kind": "contains", "phrases": ["hello", "missing"], "mode": "all"}, "hello world")
    assert (partial.kind, partial.score, partial.detail) == ("fail", 0.5, "1/2 matched")
    assert score({"kind": "contains", "phrases": ["unsafe"], "mode": "none"}, "safe text").kind == "pass"
    assert score({"kind": "contains", "phrases": ["unsafe"], "mode": "none"}, "very unsafe").kind == "fail"
    assert score({"kind": "contains", "phrases": ["world"], "case_sensitive": False}, "Hello WORLD").kind == "pass"
    assert score({"kind": "contains", "phrases": []}, "x").kind == "invalid"


def test_contains_partial_score_is_f32_and_ignores_target():
    third = score({"kind": "contains", "phrases": ["a", "b", "c"], "mode": "all"}, "a", target="zzz")
    assert third.score == pytest.approx(1 / 3, rel=1e-7) and third.score != 1 / 3  # f32, as Kiln stores it


# ---- regex_match.rs ------------------------------------------------------------------------------


def test_regex_kiln_cases():
    assert score({"kind": "regex", "pattern": r"answer is \d+"}, "the answer is 42").kind == "pass"
    assert score({"kind": "regex", "pattern": r"answer:\s*(\d+)", "capture_group": 1}, "answer: 42", "42").kind == "pass"
    assert score({"kind": "regex", "pattern": r"answer:\s*(\d+)", "capture_group": 1}, "answer: 42", "43").kind == "fail"
    assert score({"kind": "regex", "pattern": r"answer:\s*\d+", "capture_group": 1}, "answer: 42", "x").kind == "invalid"
    with pytest.raises(ScorerError, match="invalid regex"):
        score({"kind": "regex", "pattern": "("}, "x")


def test_regex_no_match_aliases_and_ascii_only_case_folding():
    assert score({"kind": "regex", "pattern": "z+"}, "abc").detail == "pattern `z+` did not match"
    assert score({"kind": "regex", "pattern": r"is (\w+)", "capture_group": 1}, "is B", "A", aliases=["B"]).kind == "pass"
    insensitive = {"kind": "regex", "pattern": r"is (\w+)", "capture_group": 1, "case_sensitive": False}
    assert score(insensitive, "IS PARIS", "paris").kind == "pass"
    assert score(insensitive, "is ÉTÉ", "été").kind == "fail"  # eq_ignore_ascii_case does not fold É
    assert score({"kind": "regex", "pattern": "(a)|(b)", "capture_group": 2}, "a", "b").kind == "invalid"
    with pytest.raises(ScorerError, match="requires `target`"):
        score({"kind": "regex", "pattern": "(a)", "capture_group": 1}, "a", None)


# ---- numeric.rs ----------------------------------------------------------------------------------


def test_last_number_extracted_kiln_cases():
    assert extract_last_number("the answer is 42") == 42.0
    assert extract_last_number("Final: -3.14") == -3.14
    assert extract_last_number("got 1, then 2, finally 3") == 3.0
    assert extract_last_number("price is $1,234.50") == 1234.50
    assert extract_last_number("no number here") is None
    assert extract_last_number("1.5e3 kg") == 1500.0
    assert extract_last_number("50%") == 50.0
    assert extract_last_number("x-7") == -7.0
    assert extract_last_number("v1.2.3") == 0.3  # "1.2" then ".3": the scan Kiln does, literally


def test_numeric_tolerance_kiln_cases():
    assert score({"kind": "numeric_tolerance", "atol": 1.0}, "answer 41.5", "42").kind == "pass"
    assert score({"kind": "numeric_tolerance", "rtol": 0.01}, "the answer is 1009", "1000").kind == "pass"
    assert score({"kind": "numeric_tolerance", "rtol": 0.01}, "the answer is 1011", "1000").kind == "fail"
    assert score({"kind": "numeric_tolerance"}, "I don't know", "42").kind == "invalid"
    assert score({"kind": "numeric_tolerance", "atol": 1.0, "integer_only": True}, "3.5", "3").kind == "fail"
    assert score({"kind": "numeric_tolerance", "integer_only": True}, "3.0", "3").kind == "pass"
    assert score({"kind": "numeric_tolerance"}, "185", "= 185 units").kind == "pass"  # target keeps 0-9 . - + e E
    for unparseable in ("n/a", "185 apples"):  # "185 apples" keeps "185e": Kiln's filter, literally
        with pytest.raises(ScorerError):
            score({"kind": "numeric_tolerance"}, "1", unparseable)


# ---- json_validity.rs ----------------------------------------------------------------------------


def test_json_validity_kiln_cases():
    assert score({"kind": "json_validity"}, '{"a":1}').kind == "pass"
    assert score({"kind": "json_validity"}, "not json").kind == "invalid"
    assert score({"kind": "json_validity", "require_object": True}, "[1,2]").kind == "fail"
    paths = {"kind": "json_validity", "required_paths": ["/tool_call/name"]}
    assert score(paths, '{"tool_call": {"name": "x"}}').kind == "pass"
    assert score(paths, '{"other": 1}').kind == "fail"
    assert score({"kind": "json_validity", "require_object": True}, '{"a":1,"b":2}', '{"b":2,"a":1}').kind == "pass"
    assert extract_json_body('Here you go:\n```json\n{"a":1}\n```').strip() == '{"a":1}'
    assert extract_json_body('prelude { "msg": "} hi {" } trailer') == '{ "msg": "} hi {" }'


def test_json_validity_compares_like_serde_values():
    assert score({"kind": "json_validity"}, '{"a": 1}', '{"a": 1.0}').kind == "fail"  # 1 != 1.0 in serde_json
    assert score({"kind": "json_validity"}, "[true]", "[1]").kind == "fail"
    assert score({"kind": "json_validity"}, '{"a": NaN}').kind == "invalid"
    assert score({"kind": "json_validity"}, "[1e400]").kind == "invalid"
    assert score({"kind": "json_validity"}, "{}", "{oops").kind == "invalid"
    assert json_pointer_exists({"a": [{"b": 1}]}, "/a/0/b") and not json_pointer_exists({"a": [1]}, "/a/01")
    assert json_pointer_exists({"a/b": {"~": 1}}, "/a~1b/~0") and not json_pointer_exists({"a": 1}, "a")


# ---- multiple_choice.rs --------------------------------------------------------------------------


def test_multiple_choice_kiln_cases():
    mc = {"kind": "multiple_choice"}
    assert score(mc, "Answer: B because...", "B").kind == "pass"
    assert score(mc, "(C) is correct.", "C").kind == "pass"
    assert score(mc, "A. The answer is A.", "A").kind == "pass"
    assert score(mc, "Answer: B", "A").kind == "fail"
    assert score(mc, "I am not sure.", "A").kind == "invalid"
    assert score({"kind": "multiple_choice", "choices": ["AB", "CD"]}, "Answer: AB", "AB").kind == "pass"
    assert score(mc, "Answer: B", "A", aliases=["B"]).kind == "pass"


def test_multiple_choice_marker_wins_over_leading_letter():
    assert score({"kind": "multiple_choice"}, "B seems plausible, but the final answer is D", "D").kind == "pass"
    assert score({"kind": "multiple_choice", "choices": ["X", "Y"]}, "answer: y", " y ").kind == "pass"


# ---- llm_judge.rs --------------------------------------------------------------------------------


def test_llm_judge_without_a_judge_is_invalid():
    out = score({"kind": "llm_judge"}, "Paris", "Paris")
    assert (out.kind, out.score, out.detail) == ("invalid", 0.0, "judge runner unavailable")


def test_llm_judge_kiln_cases_with_a_fake_judge():
    prompts = []

    def judge(reply):
        return lambda adapter, prompt: prompts.append((adapter, prompt)) or reply

    q = {"question": "What is the capital of France?"}
    assert score({"kind": "llm_judge"}, "Paris", "Paris", judge=judge("Score: 1"), **q).kind == "pass"
    assert score({"kind": "llm_judge"}, "Lyon", "Paris", judge=judge("Score: 0.2"), **q).kind == "fail"
    assert score({"kind": "llm_judge"}, "Paris", "Paris", judge=judge("I refuse to answer."), **q).kind == "invalid"
    out = score({"kind": "llm_judge", "template": "Q={question}|T={target}|A={answer}", "judge_adapter": "j"},
                "Paris", "Paris", judge=judge("score: 0.5"), **q)
    assert (out.kind, out.score, out.detail) == ("pass", 0.5, "judge score 0.50")
    assert prompts[-1] == ("j", "Q=What is the capital of France?|T=Paris|A=Paris")
    with pytest.raises(ScorerError, match="capture group"):
        score({"kind": "llm_judge", "score_regex": "score"}, "x", judge=judge("score"))


def test_llm_judge_sees_the_full_text_including_reasoning():
    seen = []
    score({"kind": "llm_judge", "template": "{answer}"}, "<think>hm</think>4", "4",
          judge=lambda adapter, prompt: seen.append(prompt) or "Score: 1")
    assert seen == ["<think>hm</think>4"]


# ---- <think> split and composites ---------------------------------------------------------------


def test_split_thinking_shapes():
    closed = split_thinking("<think>\nreasoning\n</think>\n\nParis")
    assert (closed.reasoning, closed.answer, closed.had_thinking, closed.unclosed) == ("reasoning", "Paris", True, False)
    assert split_thinking("no tags").answer == "no tags"
    assert split_thinking("\n\n Paris").answer == "Paris"  # without a block: leading whitespace trimmed
    assert split_thinking("<think>x</think>\n Paris").answer == " Paris"  # after a block: one newline only
    buried = split_thinking("prose <think>x</think> more")
    assert (buried.had_thinking, buried.answer) == (False, "prose <think>x</think> more")
    unclosed = split_thinking("  <think>\nstill going")
    assert (unclosed.unclosed, unclosed.answer, unclosed.reasoning) == (True, "", "still going")


def test_scorers_grade_the_answer_after_thinking():
    assert score({"kind": "exact_match"}, "<think>2+2=4</think>\n4", "4").kind == "pass"
    unclosed = score({"kind": "exact_match"}, "<think>2+2 is", "4")
    assert (unclosed.kind, unclosed.score, unclosed.unclosed_thinking) == ("invalid", 0.0, True)
    assert score({"kind": "numeric_tolerance"}, "<think>maybe 5</think>4", "4").kind == "pass"


def test_composites_all_and_any():
    all_of = {"kind": "all", "scorers": [{"kind": "json_validity"}, {"kind": "contains", "phrases": ["x"]}]}
    both = score(all_of, '{"x": 1}')
    assert (both.kind, both.score) == ("pass", 1.0)
    half = score(all_of, '{"y": 1}')
    assert (half.kind, half.score) == ("fail", 0.5) and "contains: none of 1 phrases matched" in half.detail
    any_of = {"kind": "any", "scorers": [{"kind": "exact_match"}, {"kind": "contains", "phrases": ["a", "z"],
                                                                    "mode": "all"}]}
    best = score(any_of, "a", "b")
    assert (best.kind, best.score) == ("fail", 0.5)
    assert score({"kind": "any", "scorers": []}, "x").kind == "invalid"
    assert score({"kind": "all", "scorers": []}, "x").kind == "invalid"
    # sub-scorers re-split the reasoning themselves; an unclosed block makes them invalid, not the composite
    assert score({"kind": "all", "scorers": [{"kind": "exact_match"}]}, "<think>4", "4").kind == "fail"
    with pytest.raises(ScorerError):  # a broken sub-scorer breaks the composite
        score({"kind": "any", "scorers": [{"kind": "exact_match"}]}, "x", None)
