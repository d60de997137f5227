"""Seeds, the exact sign test, the Wilson interval and the reducers, each against a naive reference.

The references below share no code or formula with kiln_core: the sign test sums exact binomial
terms with ``fractions.Fraction``; the Wilson bounds come from bisecting the score-test inequality
|p̂ − p| ≤ z·√(p(1−p)/n); the reducers are written from their one-line definitions. Kiln's #[test]
cases (crates/kiln-eval/src/result.rs) are translated at the end.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from fractions import Fraction
from math import comb

import pytest

from kiln_core.post_eval.reduce import (AggregationError, CompletionOutcome, aggregate_example_outcomes,
                                        suite_metrics)
from kiln_core.post_eval.stats import derive_eval_completion_seed, sign_test_p_value, wilson_interval
from kiln_core.contracts.post_eval.suite import MajorityAtK, MeanAtK, PassAtK, Single

Z95 = 1.959963984540054


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# ---- seeds ---------------------------------------------------------------------------------------


def test_seed_golden_and_layout():
    assert derive_eval_completion_seed(42, "example-7", 3) == 1961911680962343893  # Kiln's pinned v1 golden
    assert derive_eval_completion_seed(42, "example-7", 3) != derive_eval_completion_seed(42, "example-7", 4)
    assert derive_eval_completion_seed(42, "example-7", 3) != derive_eval_completion_seed(43, "example-7", 3)
    ident = "é-1".encode()
    message = b"kiln.eval-seed.v1\x00" + struct.pack("<Q", 2**64 - 1) + struct.pack("<Q", len(ident)) + ident \
        + struct.pack("<Q", 0)
    assert derive_eval_completion_seed(2**64 - 1, "é-1", 0) == struct.unpack("<Q", hashlib.sha256(message).digest()[:8])[0]


# ---- sign test -----------------------------------------------------------------------------------


def exact_two_sided(improved: int, regressed: int) -> Fraction:
    m = improved + regressed
    if m == 0:
        return Fraction(1)
    k = min(improved, regressed)
    tail = sum((Fraction(comb(m, i), 2**m) for i in range(k + 1)), Fraction(0))
    return min(Fraction(1), 2 * tail)


def test_sign_test_matches_exact_fractions_exhaustively():
    for improved, regressed in itertools.product(range(41), repeat=2):
        expected = float(exact_two_sided(improved, regressed))
        assert sign_test_p_value(improved, regressed) == pytest.approx(expected, rel=1e-12, abs=1e-300), (improved, regressed)


def test_sign_test_large_suites_do_not_underflow():
    for improved, regressed in [(900, 700), (1000, 0), (1200, 1000)]:
        p = sign_test_p_value(improved, regressed)
        assert 0.0 < p <= 1.0
        assert p == pytest.approx(float(exact_two_sided(improved, regressed)), rel=1e-9)


def test_sign_test_kiln_cases():  # sign_test_matches_known_exact_values
    assert abs(sign_test_p_value(9, 2) - 134 / 2048) < 1e-12
    assert sign_test_p_value(9, 2) >= 0.05
    assert abs(sign_test_p_value(15, 3) - 2 * 988 / 262144) < 1e-12
    assert sign_test_p_value(15, 3) < 0.05
    assert sign_test_p_value(0, 0) == 1.0
    assert sign_test_p_value(9, 2) == sign_test_p_value(2, 9)
    assert sign_test_p_value(5, 5) == 1.0


# ---- Wilson --------------------------------------------------------------------------------------


def wilson_by_bisection(x: int, n: int) -> tuple[float, float]:
    """Endpoints of {p : (p̂ − p)² ≤ z² p (1 − p) / n}, found by bisection (no closed form)."""
    phat = x / n

    def inside(p: float) -> bool:
        return (phat - p) ** 2 <= Z95 * Z95 * p * (1 - p) / n

    def edge(lo: float, hi: float) -> float:  # lo inside, hi outside (or the other way round)
        want = inside(lo)
        for _ in range(60):  # 2^-60: far below f32 resolution
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if inside(mid) == want else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if inside(0.0) else edge(phat, 0.0)
    upper = 1.0 if inside(1.0) else edge(phat, 1.0)
    return lower, upper


def test_wilson_check_values():
    assert round(wilson_interval(20, 20).lower, 4) == 0.8389
    interval = wilson_interval(38, 40)
    assert (round(interval.lower, 4), round(interval.upper, 4)) == (0.8350, 0.9862)
    assert interval.confidence_level == f32(0.95)
    assert (wilson_interval(0, 0).lower, wilson_interval(0, 0).upper) == (0.0, 0.0)


@pytest.mark.parametrize("n", [1, 2, 5, 19, 20, 40, 97, 500])
def test_wilson_matches_bisection_reference(n):
    for x in range(n + 1):
        interval = wilson_interval(x, n)
        lower, upper = wilson_by_bisection(x, n)
        assert interval.lower == pytest.approx(lower, abs=2e-7), (x, n)  # f32 rounding of the bound
        assert interval.upper == pytest.approx(upper, abs=2e-7), (x, n)
        assert interval.lower == f32(interval.lower) and interval.upper == f32(interval.upper)
        # Kiln clamps only to [0, 1]: at x = 0 round-off leaves a lower bound of ~1e-19, not 0.
        assert 0.0 <= interval.lower <= x / n + 1e-12 and x / n <= interval.upper <= 1.0


# ---- reducers ------------------------------------------------------------------------------------


def outcome(example_id, index, kind, score, **kw):
    return CompletionOutcome(example_id, index, kind, score, **kw)


def naive_reduce(kinds: list[str], scores: list[float], how: str) -> tuple[str, float]:
    passes, k = kinds.count("pass"), len(kinds)
    fallback = "fail" if "fail" in kinds else "invalid" if "invalid" in kinds else "error"
    if how == "single":
        return kinds[0], scores[0]
    if how == "mean":
        mean = sum(Fraction(s) for s in scores) / k
        if passes + kinds.count("fail") == 0:
            return fallback, float(mean)
        return ("pass" if mean >= Fraction(1, 2) else "fail"), float(mean)
    if how == "pass":
        return ("pass", 1.0) if passes else (fallback, 0.0)
    return ("pass", 1.0) if 2 * passes > k else (fallback, 0.0)


AGGREGATIONS = {"single": lambda k: Single(), "mean": lambda k: MeanAtK(kind="mean_at_k", k=k),
                "pass": lambda k: PassAtK(kind="pass_at_k", k=k), "majority": lambda k: MajorityAtK(kind="majority_at_k", k=k)}


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_reducers_match_their_definitions_over_every_kind_pattern(k):
    kinds_cycle = ["pass", "fail", "invalid", "error"]
    score_of = {"pass": 1.0, "fail": 0.25, "invalid": 0.0, "error": 0.0}
    for kinds in itertools.product(kinds_cycle, repeat=k):
        scores = [score_of[kind] for kind in kinds]
        raw = [outcome("x", i, kind, s) for i, (kind, s) in enumerate(zip(kinds, scores))]
        for how, make in AGGREGATIONS.items():
            if (how == "single" and k != 1) or (how == "majority" and k % 2 == 0):
                continue
            reduced = aggregate_example_outcomes(list(reversed(raw)), make(k))[0]  # order of completions is free
            kind, score = naive_reduce(list(kinds), scores, how)
            assert (reduced.kind, reduced.score) == (kind, pytest.approx(score, abs=1e-7)), (kinds, how)
            assert (reduced.num_pass, reduced.num_fail, reduced.num_invalid, reduced.num_error) == tuple(
                kinds.count(name) for name in kinds_cycle)


def test_single_keeps_partial_credit_of_a_failing_completion():
    reduced = aggregate_example_outcomes([outcome("x", 0, "fail", 0.5)], Single())[0]
    assert (reduced.kind, reduced.score) == ("fail", 0.5)


def test_aggregation_known_answers_cover_all_reducers():  # Kiln's aggregation_known_answers_cover_all_reducers
    raw = [outcome("x", 0, "pass", 1.0), outcome("x", 1, "fail", 0.0), outcome("x", 2, "pass", 0.8)]
    mean = aggregate_example_outcomes(raw, MeanAtK(kind="mean_at_k", k=3))[0]
    assert abs(mean.score - 0.6) < 1e-6 and mean.kind == "pass" and mean.representative_completion_index == 2
    passed = aggregate_example_outcomes(raw, PassAtK(kind="pass_at_k", k=3))[0]
    assert (passed.score, passed.kind, passed.representative_completion_index) == (1.0, "pass", 0)
    majority = aggregate_example_outcomes(raw, MajorityAtK(kind="majority_at_k", k=3))[0]
    assert (majority.score, majority.kind, majority.num_pass, majority.num_fail) == (1.0, "pass", 2, 1)


def test_aggregation_truth_table_matches_definitions():  # Kiln's aggregation_truth_table_matches_definitions
    for k in range(1, 10):
        for mask in range(1 << k):
            passes = bin(mask).count("1")
            raw = [outcome("x", i, "pass" if mask >> i & 1 else "fail", 1.0 if mask >> i & 1 else 0.0) for i in range(k)]
            mean = aggregate_example_outcomes(raw, MeanAtK(kind="mean_at_k", k=k))[0]
            assert abs(mean.score - passes / k) < 1e-6 and (mean.kind == "pass") == (passes * 2 >= k)
            assert (aggregate_example_outcomes(raw, PassAtK(kind="pass_at_k", k=k))[0].kind == "pass") == (passes > 0)
            if k % 2:
                majority = aggregate_example_outcomes(raw, MajorityAtK(kind="majority_at_k", k=k))[0]
                assert (majority.kind == "pass") == (passes > k // 2)


def test_aggregation_rejects_incomplete_duplicate_and_nonfinite_groups():
    with pytest.raises(AggregationError, match="requires k in 1..=128"):
        aggregate_example_outcomes([], PassAtK.model_construct(kind="pass_at_k", k=0))
    with pytest.raises(AggregationError, match="odd k"):
        aggregate_example_outcomes([], MajorityAtK.model_construct(kind="majority_at_k", k=2))
    with pytest.raises(AggregationError, match='example "x" has 1 completions; aggregation pass@2 requires exactly 2'):
        aggregate_example_outcomes([outcome("x", 0, "pass", 1.0)], PassAtK(kind="pass_at_k", k=2))
    with pytest.raises(AggregationError, match=r"completion indices \[0, 0\]; expected \[0, 1\]"):
        aggregate_example_outcomes([outcome("x", 0, "pass", 1.0), outcome("x", 0, "fail", 0.0)],
                                   PassAtK(kind="pass_at_k", k=2))
    for bad in (math.nan, 1.5, -0.1):
        with pytest.raises(AggregationError, match="invalid score"):
            aggregate_example_outcomes([outcome("x", 0, "pass", bad)], Single())
    with pytest.raises(AggregationError, match="disagree on tags or metadata"):
        aggregate_example_outcomes([outcome("x", 0, "pass", 1.0, tags=["a"]), outcome("x", 1, "pass", 1.0)],
                                   PassAtK(kind="pass_at_k", k=2))


def test_metrics_use_reduced_examples_and_weights():  # Kiln's aggregate_basic_counts_pass_and_score (+ tags)
    raw = [outcome("a", 0, "pass", 1.0, prompt_tokens=10, completion_tokens=20, tags=["easy"]),
           outcome("b", 0, "fail", 0.0, prompt_tokens=10, completion_tokens=20, tags=["easy"]),
           outcome("c", 0, "invalid", 0.0, prompt_tokens=10, completion_tokens=20)]
    reduced = aggregate_example_outcomes(raw, Single())
    metrics = suite_metrics(reduced, raw, {"a": 2.0, "b": 1.0, "c": 1.0}, 1.5)
    assert (metrics["num_examples"], metrics["num_completions"], metrics["num_pass"], metrics["num_fail"],
            metrics["num_invalid"]) == (3, 3, 1, 1, 1)
    assert metrics["accuracy"] == pytest.approx(1 / 3, abs=1e-6)
    interval = metrics["accuracy_confidence_interval"]
    assert interval["lower"] < metrics["accuracy"] < interval["upper"] and interval["confidence_level"] == f32(0.95)
    assert metrics["weighted_mean_score"] == pytest.approx(0.5)
    assert metrics["total_completion_tokens"] == 60 and metrics["pass_rate_by_tag"] == {"easy": 0.5}
    k2 = [outcome("a", 0, "pass", 1.0), outcome("a", 1, "fail", 0.0), outcome("b", 0, "fail", 0.0),
          outcome("b", 1, "fail", 0.0)]
    pass2 = suite_metrics(aggregate_example_outcomes(k2, PassAtK(kind="pass_at_k", k=2)), k2, {}, 0.0)
    assert (pass2["num_examples"], pass2["num_completions"], pass2["accuracy"]) == (2, 4, 0.5)
