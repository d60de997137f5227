"""The paired promotion gate: validity checks, every row of the decision ladder, verdicts, aggregation.

Kiln source: crates/kiln-server/src/eval/worker.rs; its #[test]s (paired_policy_*,
paired_promotion_flips_use_reduced_examples_not_completion_zero, gate_* and
independent_gate_outcomes_retain_the_strongest_failure) are translated here on synthetic runs.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest

from kiln_core.post_eval.gate import (GATE_OUTCOMES, PairedEvidenceError, PostEvalGate, PostEvalGateEvidence, SuiteRun,
                                      aggregate_gate_outcome, decision_verdict, evaluate_paired_promotion,
                                      gate_outcome_priority, merge_gate_evidence, paired_aggregate_flips)
from kiln_core.post_eval.reduce import ReducedOutcome
from kiln_core.post_eval.stats import sign_test_p_value, wilson_interval
from kiln_core.contracts.post_eval.suite import MajorityAtK, Single


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def reduced(example_id: str, passed: bool, score: float | None = None) -> ReducedOutcome:
    kind = "pass" if passed else "fail"
    return ReducedOutcome(example_id, kind, score if score is not None else float(passed), [0], 0, int(passed),
                          int(not passed), 0, 0)


def run(adapter: str | None, examples: int, passes: int, **changes) -> SuiteRun:
    """Kiln's synthetic_gate_run_with_passes: the first ``passes`` examples pass."""
    base = SuiteRun("gate-suite", adapter, Single(), [reduced(f"e{i}", i < passes) for i in range(examples)],
                    "sha256:gate-suite", "sha256:gate-generation", 17)
    return dataclasses.replace(base, **changes)


def gate(min_accuracy: float, **kw) -> PostEvalGate:
    return PostEvalGate(min_accuracy=min_accuracy, adapter_name="candidate", **kw)


def decide(baseline: SuiteRun, candidate: SuiteRun, min_accuracy: float, **kw):
    return evaluate_paired_promotion("eval", gate(min_accuracy, **kw), baseline, candidate)


# ---- Kiln's paired_policy_* ----------------------------------------------------------------------


def test_paired_policy_requires_significant_improvement_not_a_tied_point_pass():
    result = decide(run(None, 40, 40), run("candidate", 40, 40), 0.9)
    assert result.decision == "inconclusive"
    assert (result.evidence.improved, result.evidence.regressed) == (0, 0)
    assert result.evidence.exact_sign_test_p_value == 1.0
    assert result.evidence.candidate_accuracy_lower_bound >= 0.9
    assert result.reason == "no significant paired improvement (improved 0, regressed 0, exact two-sided p=1.000000)"


def test_paired_policy_rejects_significant_regression():
    result = decide(run(None, 40, 40), run("candidate", 40, 0), 0.0)
    assert result.decision == "regression"
    assert (result.evidence.improved, result.evidence.regressed) == (0, 40)
    assert result.evidence.exact_sign_test_p_value < 0.05


def test_paired_policy_does_not_promote_when_only_point_accuracy_clears_floor():
    result = decide(run(None, 40, 0), run("candidate", 40, 38), 0.9)
    assert result.evidence.candidate_accuracy == f32(0.95)  # Kiln compares f32 with 0.95f32
    assert result.evidence.candidate_accuracy_lower_bound < 0.9 <= result.evidence.candidate_accuracy_upper_bound
    assert result.decision == "inconclusive"
    assert result.reason == "candidate 95% Wilson lower bound 0.835 does not reach accuracy floor 0.900"


def test_paired_policy_uses_confidence_bound_for_relative_recovery():
    result = decide(run(None, 40, 40), run("candidate", 40, 40), 0.0, relative_recovery=0.9)
    assert result.decision == "pass"
    assert result.evidence.relative_recovery_lower_bound >= 0.9
    assert result.evidence.exact_sign_test_p_value == 1.0


def test_paired_promotion_flips_use_reduced_examples_not_completion_zero():
    majority = MajorityAtK(kind="majority_at_k", k=3)
    baseline = run("base", 1, 0, aggregation=majority)
    candidate = run("candidate", 1, 1, aggregation=majority)
    summary = paired_aggregate_flips(baseline, candidate)
    assert (summary.paired_examples, summary.improved, summary.regressed, summary.tied, summary.baseline_pass,
            summary.candidate_pass) == (1, 1, 0, 0, 0, 1)


# ---- the ladder, row by row ----------------------------------------------------------------------


def test_row1_too_few_pairs_is_inconclusive_even_when_everything_improves():
    result = decide(run(None, 19, 0), run("candidate", 19, 19), 0.5)
    assert (result.decision, result.reason) == ("inconclusive", "only 19 paired examples; policy requires at least 20")
    assert (result.evidence.paired_examples, result.evidence.minimum_paired_examples) == (19, 20)


def test_row2_regression_wins_over_a_conclusive_floor_failure():
    result = decide(run(None, 40, 40), run("candidate", 40, 0), 0.9)
    assert result.decision == "regression"
    assert result.reason.startswith("candidate is significantly worse (improved 0, regressed 40, exact two-sided p=")


def test_row2_needs_significance():
    result = decide(run(None, 20, 12), run("candidate", 20, 9), 0.0)  # regressed 3 > improved 0, p = 0.25
    assert (result.evidence.improved, result.evidence.regressed) == (0, 3)
    assert result.decision == "inconclusive"


def test_row3_upper_bound_below_floor_demotes():
    result = decide(run(None, 40, 0), run("candidate", 40, 0), 0.9)
    assert result.decision == "demoted"
    assert result.reason == "candidate 95% Wilson upper bound 0.088 is below accuracy floor 0.900"
    assert result.evidence.candidate_accuracy_upper_bound < 0.9


def test_row4_lower_bound_below_floor_is_inconclusive_but_upper_above():
    result = decide(run(None, 20, 0), run("candidate", 20, 20), 0.9)  # 20/20 lower bound 0.839
    assert result.decision == "inconclusive" and "0.839" in result.reason


def test_rows5_and_6_gain_bounds():
    full, half = run(None, 40, 40), run(None, 40, 20)
    assert decide(full, run("candidate", 40, 40), 0.0, relative_recovery=0.95).decision == "inconclusive"
    assert decide(half, run("candidate", 40, 40), 0.0, relative_recovery=0.9, absolute_gain=0.5).decision == "inconclusive"
    both = decide(half, run("candidate", 40, 40), 0.0, relative_recovery=0.9, absolute_gain=0.1)
    assert both.decision == "pass" and both.reason == "all paired confidence requirements passed"
    cand_lower, base_upper = wilson_interval(40, 40).lower, wilson_interval(20, 40).upper
    assert both.evidence.absolute_gain_lower_bound == pytest.approx(cand_lower - base_upper, abs=1e-6)
    assert both.evidence.relative_recovery_lower_bound == pytest.approx(cand_lower / base_upper, abs=1e-6)
    only_gain = decide(half, run("candidate", 40, 40), 0.0, absolute_gain=0.5)
    assert only_gain.decision == "inconclusive" and only_gain.reason.startswith("absolute-gain lower bound +0.")
    assert decide(half, run("candidate", 40, 40), 0.0, absolute_gain=0.1).decision == "pass"
    # A Wilson upper bound is positive whenever n > 0, so the ratio is always defined here.
    zero_base = decide(run(None, 40, 0), run("candidate", 40, 40), 0.0, relative_recovery=0.9)
    assert zero_base.evidence.relative_recovery_lower_bound == pytest.approx(
        cand_lower / wilson_interval(0, 40).upper, rel=1e-6)


def test_row7_significant_improvement_with_floor_passes():
    result = decide(run(None, 40, 0), run("candidate", 40, 40), 0.9)
    assert (result.decision, result.reason) == ("pass", "exact paired improvement and accuracy confidence floor passed")
    assert result.evidence.exact_sign_test_p_value == pytest.approx(sign_test_p_value(40, 0))


def test_row8_improvement_without_significance_is_inconclusive():
    result = decide(run(None, 20, 17), run("candidate", 20, 20), 0.5)  # improved 3, p = 0.25
    assert result.decision == "inconclusive" and result.reason.startswith("no significant paired improvement")


def test_flips_compare_scores_not_kinds():
    baseline = run(None, 20, 0, reduced=[reduced(f"e{i}", False, 0.25) for i in range(20)])
    candidate = run("candidate", 20, 0, reduced=[reduced(f"e{i}", False, 0.5) for i in range(20)])
    result = decide(baseline, candidate, 0.0)
    assert (result.evidence.improved, result.evidence.candidate_accuracy) == (20, 0.0)
    assert result.decision == "pass"  # floor 0 and a significant partial-credit gain


# ---- validity checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    ({"suite_name": "other"}, 'suite-name mismatch: baseline "gate-suite" vs candidate "other"'),
    ({"suite_hash": "sha256:x"}, "suite-hash mismatch: baseline sha256:gate-suite vs candidate sha256:x"),
    ({"effective_generation_hash": "sha256:y"}, "generation-hash mismatch"),
    ({"aggregation": MajorityAtK(kind="majority_at_k", k=3)}, "aggregation mismatch: baseline single vs candidate majority@3"),
    ({"reduced": [reduced("e0", True)]}, "example-count mismatch: baseline 40 vs candidate 1"),
    ({"reduced": [reduced("e0", True)] * 40}, 'candidate contains duplicate example "e0"'),
    ({"reduced": [reduced(f"x{i}", True) for i in range(40)]}, 'candidate is missing example "e0"'),
    ({"reduced": [reduced("e0", True, float("nan"))] + [reduced(f"e{i}", True) for i in range(1, 40)]},
     'candidate example "e0" has non-finite score'),
])
def test_invalid_pairings_raise(changes, message):
    with pytest.raises(PairedEvidenceError) as caught:
        decide(run(None, 40, 40), run("candidate", 40, 40, **changes), 0.5)
    assert str(caught.value).startswith(message)


def test_empty_and_duplicate_baselines_raise():
    with pytest.raises(PairedEvidenceError, match="zero independent examples"):
        decide(run(None, 0, 0), run("candidate", 0, 0), 0.5)
    with pytest.raises(PairedEvidenceError, match='baseline contains duplicate example "e0"'):
        decide(run(None, 2, 0, reduced=[reduced("e0", False)] * 2),
               run("candidate", 2, 0, reduced=[reduced("e0", False), reduced("e1", False)]), 0.5)


# ---- evidence and verdicts -------------------------------------------------------------------------


def test_evidence_carries_kiln_field_names_in_order():
    evidence = decide(run(None, 40, 0), run("candidate", 40, 40), 0.9).evidence
    assert list(PostEvalGateEvidence.model_fields) == [
        "policy_version", "suite_policy", "eval_job_id", "suite_name", "suite_hash", "effective_generation_hash",
        "baseline_adapter", "candidate_adapter", "aggregation", "minimum_paired_examples", "paired_examples",
        "improved", "regressed", "tied", "exact_sign_test_p_value", "exact_sign_test_alpha", "baseline_accuracy",
        "baseline_accuracy_lower_bound", "baseline_accuracy_upper_bound", "candidate_accuracy",
        "candidate_accuracy_lower_bound", "candidate_accuracy_upper_bound", "accuracy_confidence_level",
        "minimum_accuracy", "required_relative_recovery", "relative_recovery_lower_bound", "required_absolute_gain",
        "absolute_gain_lower_bound", "outcome"]
    assert (evidence.policy_version, evidence.suite_policy, evidence.exact_sign_test_alpha) == (
        "paired_wilson_v1", "single_versioned_suite", 0.05)
    assert (evidence.baseline_adapter, evidence.candidate_adapter, evidence.aggregation) == (None, "candidate", "single")
    assert evidence.minimum_accuracy != 0.9 and abs(evidence.minimum_accuracy - 0.9) < 1e-7  # the f32 floor


def test_verdicts_and_outcomes():
    passing = decide(run(None, 40, 0), run("candidate", 40, 40), 0.9)
    outcome, verdict = decision_verdict(passing, gate(0.9, auto_load_on_pass=True))
    assert outcome == "promoted"
    assert verdict == ("PASSED: exact paired improvement and accuracy confidence floor passed; accuracy 1.000, 95% lower "
                       "bound 0.912 >= 0.900; adapter `candidate` promoted to active")
    outcome, verdict = decision_verdict(passing, gate(0.9, auto_load_on_pass=False))
    assert outcome == "kept" and verdict.endswith("adapter `candidate` kept (auto_load not requested)")
    outcome, verdict = decision_verdict(decide(run("prev", 40, 40), run("candidate", 40, 0), 0.0), gate(0.0))
    assert outcome == "regression" and verdict.startswith("REGRESSION: `candidate` vs `prev`: candidate is significantly")
    assert verdict.endswith(" — NOT promoted")
    outcome, verdict = decision_verdict(decide(run(None, 19, 0), run("candidate", 19, 19), 0.5), gate(0.5))
    assert (outcome, verdict) == ("inconclusive", "INCONCLUSIVE: `candidate`: only 19 paired examples; policy requires "
                                                  "at least 20; adapter left on disk, NOT promoted")
    outcome, verdict = decision_verdict(decide(run(None, 40, 0), run("candidate", 40, 0), 0.9), gate(0.9))
    assert outcome == "demoted" and verdict.startswith("FAILED: candidate 95% Wilson upper bound 0.088 is below")
    assert verdict.endswith("accuracy 0.000, 95% upper bound 0.088 < 0.900; adapter `candidate` NOT promoted")


def test_independent_gate_outcomes_retain_the_strongest_failure():
    assert aggregate_gate_outcome("regression", "kept", "v")[0] == "regression"
    assert aggregate_gate_outcome("kept", "inconclusive", "v")[0] == "inconclusive"
    assert aggregate_gate_outcome("inconclusive", "demoted", "v")[0] == "demoted"
    assert aggregate_gate_outcome("regression", "error", "v")[0] == "error"
    assert aggregate_gate_outcome("kept", "promoted", "v")[0] == "promoted"
    assert aggregate_gate_outcome(None, "kept", "v") == ("kept", "v")
    assert aggregate_gate_outcome("demoted", "regression", "REGRESSION: x") == (
        "demoted", "DEMOTED retained across independent gate evidence; latest result: REGRESSION: x")
    assert aggregate_gate_outcome("archived-weird", "error", "v")[0] == "archived-weird"  # unknown ranks 7
    assert [gate_outcome_priority(o) for o in GATE_OUTCOMES] == [3, 2, 5, 5, 4, 6]


def test_evidence_entries_are_keyed_by_eval_job_id():
    first, second = {"eval_job_id": "a", "outcome": "kept"}, {"eval_job_id": "b", "outcome": "error"}
    merged = merge_gate_evidence([first, second], {"eval_job_id": "a", "outcome": "regression"})
    assert merged == [{"eval_job_id": "a", "outcome": "regression"}, second]
    assert merge_gate_evidence(merged, {"eval_job_id": "c"})[-1] == {"eval_job_id": "c"}
    assert first == {"eval_job_id": "a", "outcome": "kept"}  # inputs untouched
