"""The paired promotion gate (``paired_wilson_v1``): evidence, decision ladder and outcomes.

Source: crates/kiln-server/src/eval/worker.rs · paired_aggregate_flips, evaluate_paired_promotion,
apply_post_eval_gate, gate_outcome_priority, aggregate_gate_outcome, and the policy constants;
crates/kiln-server/src/eval/queue.rs · PostEvalGate; PostEvalGateEvidence's field names as the
worker fills them. Decision ladder (first match wins; F = min_accuracy):

1. fewer than 20 paired examples              → inconclusive
2. regressed > improved and p < 0.05          → regression
3. candidate Wilson upper bound < F           → demoted
4. candidate Wilson lower bound < F           → inconclusive
5. relative_recovery set: pass iff its bound (and absolute_gain's, if set) reaches the requirement
6. only absolute_gain set: pass iff its bound reaches the requirement
7. improved > regressed and p < 0.05          → pass
8. otherwise                                  → inconclusive

Point accuracy alone never promotes. All comparisons use Kiln's f32 values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln_core.contracts.outcomes import PostEvalGateEvidence  # the receipt's record; re-exported here
from kiln_core.post_eval.reduce import ReducedOutcome
from kiln_core.post_eval.stats import sign_test_p_value, wilson_interval
from kiln_core.serde_json import rust_debug_str, to_f32

__all__ = ["POLICY_VERSION", "SUITE_POLICY", "MINIMUM_PAIRED_EXAMPLES", "EXACT_SIGN_TEST_ALPHA", "GATE_OUTCOMES",
           "SuiteRun", "PostEvalGate", "PairedSummary", "PairedEvidenceError", "paired_aggregate_flips",
           "PostEvalGateEvidence", "StatisticalDecision", "evaluate_paired_promotion", "decision_verdict",
           "gate_outcome_priority", "aggregate_gate_outcome", "merge_gate_evidence"]

# Fixed server policy, not request knobs.
POLICY_VERSION = "paired_wilson_v1"
SUITE_POLICY = "single_versioned_suite"
MINIMUM_PAIRED_EXAMPLES = 20
EXACT_SIGN_TEST_ALPHA = 0.05
GATE_OUTCOMES = ("promoted", "kept", "regression", "demoted", "inconclusive", "error")


@dataclass
class SuiteRun:
    """One arm's result: a suite run against one adapter (``None`` = base model); Kiln's ``SuiteResult``."""

    suite_name: str
    adapter: str | None
    aggregation: Any
    reduced: list[ReducedOutcome]
    suite_hash: str
    effective_generation_hash: str
    effective_seed: int
    outcomes: list[Any] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_json(self, *, with_outcomes: bool = False) -> dict[str, Any]:
        out = {"suite_name": self.suite_name, "adapter": self.adapter, "aggregation": self.aggregation.label(),
               "suite_hash": self.suite_hash, "effective_generation_hash": self.effective_generation_hash,
               "effective_seed": str(self.effective_seed), "metrics": self.metrics}
        if with_outcomes:
            out["aggregated_outcomes"] = [outcome.to_json() for outcome in self.reduced]
            out["outcomes"] = [outcome.to_json() for outcome in self.outcomes]
        return out


@dataclass(frozen=True)
class PostEvalGate:
    """The gate attached to the compare job (queue.rs · PostEvalGate)."""

    min_accuracy: float
    adapter_name: str
    auto_load_on_pass: bool = True
    relative_recovery: float | None = None
    absolute_gain: float | None = None
    training_job_id: str | None = None


@dataclass(frozen=True)
class PairedSummary:
    paired_examples: int
    improved: int
    regressed: int
    tied: int
    baseline_pass: int
    candidate_pass: int


class PairedEvidenceError(ValueError):
    """The two arms cannot be paired; the gate outcome is ``error``."""


def paired_aggregate_flips(baseline: SuiteRun, candidate: SuiteRun) -> PairedSummary:
    """Pair reduced examples by id and count score flips (not pass/fail flips) and passes.

    Raises:
        PairedEvidenceError: Different suite, hashes or aggregation; unequal or zero counts; a
            non-finite score; a duplicate id; a baseline example missing from the candidate.
    """
    checks = [
        (baseline.suite_name != candidate.suite_name, "suite-name mismatch: baseline "
         f"{rust_debug_str(baseline.suite_name)} vs candidate {rust_debug_str(candidate.suite_name)}"),
        (baseline.suite_hash != candidate.suite_hash,
         f"suite-hash mismatch: baseline {baseline.suite_hash} vs candidate {candidate.suite_hash}"),
        (baseline.effective_generation_hash != candidate.effective_generation_hash, "generation-hash mismatch: "
         f"baseline {baseline.effective_generation_hash} vs candidate {candidate.effective_generation_hash}"),
        (baseline.aggregation != candidate.aggregation, "aggregation mismatch: baseline "
         f"{baseline.aggregation.label()} vs candidate {candidate.aggregation.label()}"),
        (len(baseline.reduced) != len(candidate.reduced),
         f"example-count mismatch: baseline {len(baseline.reduced)} vs candidate {len(candidate.reduced)}"),
        (not baseline.reduced, "paired suite produced zero independent examples"),
    ]
    for failed, message in checks:
        if failed:
            raise PairedEvidenceError(message)
    by_id: dict[str, ReducedOutcome] = {}
    for outcome in candidate.reduced:
        if outcome.score != outcome.score or abs(outcome.score) == float("inf"):
            raise PairedEvidenceError(f"candidate example {rust_debug_str(outcome.example_id)} has non-finite score")
        if outcome.example_id in by_id:
            raise PairedEvidenceError(f"candidate contains duplicate example {rust_debug_str(outcome.example_id)}")
        by_id[outcome.example_id] = outcome
    seen: set[str] = set()
    improved = regressed = baseline_pass = candidate_pass = 0
    for base in baseline.reduced:
        quoted = rust_debug_str(base.example_id)
        if base.score != base.score or abs(base.score) == float("inf"):
            raise PairedEvidenceError(f"baseline example {quoted} has non-finite score")
        if base.example_id in seen:
            raise PairedEvidenceError(f"baseline contains duplicate example {quoted}")
        seen.add(base.example_id)
        cand = by_id.get(base.example_id)
        if cand is None:
            raise PairedEvidenceError(f"candidate is missing example {quoted}")
        improved += cand.score > base.score
        regressed += cand.score < base.score
        baseline_pass += base.kind == "pass"
        candidate_pass += cand.kind == "pass"
    n = len(baseline.reduced)
    return PairedSummary(n, improved, regressed, n - improved - regressed, baseline_pass, candidate_pass)


@dataclass(frozen=True)
class StatisticalDecision:
    decision: str  # pass | regression | demoted | inconclusive
    evidence: PostEvalGateEvidence
    reason: str


def evaluate_paired_promotion(eval_job_id: str, gate: PostEvalGate, baseline: SuiteRun,
                              candidate: SuiteRun) -> StatisticalDecision:
    """Run the decision ladder on paired evidence.

    Raises:
        PairedEvidenceError: The arms cannot be paired (outcome ``error``).

    Example:
        See ``tests/test_post_eval_gate.py`` for Kiln's ``paired_policy_*`` cases.
    """
    paired = paired_aggregate_flips(baseline, candidate)
    n = paired.paired_examples
    p_value = sign_test_p_value(paired.improved, paired.regressed)
    base_ci, cand_ci = wilson_interval(paired.baseline_pass, n), wilson_interval(paired.candidate_pass, n)
    floor = to_f32(gate.min_accuracy)
    relative = None if gate.relative_recovery is None else (
        to_f32(cand_ci.lower / base_ci.upper) if base_ci.upper > 0.0 else 1.0)
    absolute = None if gate.absolute_gain is None else to_f32(cand_ci.lower - base_ci.upper)
    counts = f"improved {paired.improved}, regressed {paired.regressed}, exact two-sided p={p_value:.6f}"
    passed_all = ("pass", "all paired confidence requirements passed")

    def gain_rule() -> tuple[str, str]:
        required = to_f32(gate.absolute_gain)
        if absolute < required:
            return "inconclusive", f"absolute-gain lower bound {absolute:+.3f} does not reach {required:+.3f}"
        return passed_all

    if n < MINIMUM_PAIRED_EXAMPLES:
        decision = ("inconclusive", f"only {n} paired examples; policy requires at least {MINIMUM_PAIRED_EXAMPLES}")
    elif paired.regressed > paired.improved and p_value < EXACT_SIGN_TEST_ALPHA:
        decision = ("regression", f"candidate is significantly worse ({counts})")
    elif cand_ci.upper < floor:
        decision = ("demoted", f"candidate 95% Wilson upper bound {cand_ci.upper:.3f} is below accuracy floor {floor:.3f}")
    elif cand_ci.lower < floor:
        decision = ("inconclusive",
                    f"candidate 95% Wilson lower bound {cand_ci.lower:.3f} does not reach accuracy floor {floor:.3f}")
    elif relative is not None:
        required = to_f32(gate.relative_recovery)
        if relative < required:
            decision = ("inconclusive", f"relative-recovery lower bound {relative:.3f} does not reach {required:.3f}")
        else:
            decision = gain_rule() if absolute is not None else passed_all
    elif absolute is not None:
        decision = gain_rule()
    elif paired.improved > paired.regressed and p_value < EXACT_SIGN_TEST_ALPHA:
        decision = ("pass", "exact paired improvement and accuracy confidence floor passed")
    else:
        decision = ("inconclusive", f"no significant paired improvement ({counts})")

    evidence = PostEvalGateEvidence(
        policy_version=POLICY_VERSION, suite_policy=SUITE_POLICY, eval_job_id=eval_job_id,
        suite_name=candidate.suite_name, suite_hash=candidate.suite_hash,
        effective_generation_hash=candidate.effective_generation_hash, baseline_adapter=baseline.adapter,
        candidate_adapter=gate.adapter_name, aggregation=candidate.aggregation.label(),
        minimum_paired_examples=MINIMUM_PAIRED_EXAMPLES, paired_examples=n, improved=paired.improved,
        regressed=paired.regressed, tied=paired.tied, exact_sign_test_p_value=p_value,
        exact_sign_test_alpha=EXACT_SIGN_TEST_ALPHA, baseline_accuracy=to_f32(paired.baseline_pass / n),
        baseline_accuracy_lower_bound=base_ci.lower, baseline_accuracy_upper_bound=base_ci.upper,
        candidate_accuracy=to_f32(paired.candidate_pass / n), candidate_accuracy_lower_bound=cand_ci.lower,
        candidate_accuracy_upper_bound=cand_ci.upper, accuracy_confidence_level=cand_ci.confidence_level,
        minimum_accuracy=floor, required_relative_recovery=_f32_or_none(gate.relative_recovery),
        relative_recovery_lower_bound=relative, required_absolute_gain=_f32_or_none(gate.absolute_gain),
        absolute_gain_lower_bound=absolute)
    return StatisticalDecision(decision[0], evidence, decision[1])


def _f32_or_none(value: float | None) -> float | None:
    return None if value is None else to_f32(value)


def decision_verdict(result: StatisticalDecision, gate: PostEvalGate) -> tuple[str, str]:
    """The intended outcome and Kiln's prose verdict, before the adapter's fate is applied.

    ``pass`` becomes ``promoted`` when ``auto_load_on_pass`` (kiln-flows: move ``latest.json``), else
    ``kept``. ``demoted``'s verdict is completed by ``apply_gate_outcome`` once the rename happened.
    """
    evidence, name = result.evidence, gate.adapter_name
    accuracy, floor = evidence.candidate_accuracy, evidence.minimum_accuracy
    if result.decision == "regression":
        return "regression", (f"REGRESSION: `{name}` vs `{evidence.baseline_adapter or 'base'}`: {result.reason} "
                              "— NOT promoted")
    if result.decision == "inconclusive":
        return "inconclusive", f"INCONCLUSIVE: `{name}`: {result.reason}; adapter left on disk, NOT promoted"
    if result.decision == "pass":
        head = (f"PASSED: {result.reason}; accuracy {accuracy:.3f}, 95% lower bound "
                f"{evidence.candidate_accuracy_lower_bound:.3f} >= {floor:.3f}; adapter `{name}`")
        if gate.auto_load_on_pass:
            return "promoted", f"{head} promoted to active"
        return "kept", f"{head} kept (auto_load not requested)"
    return "demoted", (f"FAILED: {result.reason}; accuracy {accuracy:.3f}, 95% upper bound "
                       f"{evidence.candidate_accuracy_upper_bound:.3f} < {floor:.3f}; adapter `{name}` NOT promoted")


def gate_outcome_priority(outcome: str) -> int:
    """error 6 > demoted/regression 5 > inconclusive 4 > promoted 3 > kept 2; unknown values 7."""
    return {"error": 6, "demoted": 5, "regression": 5, "inconclusive": 4, "promoted": 3, "kept": 2}.get(outcome, 7)


def aggregate_gate_outcome(existing: str | None, new: str, verdict: str) -> tuple[str, str]:
    """Several gates on one training run: keep the stronger outcome, say so in the verdict.

    Example:
        >>> aggregate_gate_outcome("regression", "kept", "PASSED: ...")
        ('regression', 'REGRESSION retained across independent gate evidence; latest result: PASSED: ...')
    """
    if existing is not None and gate_outcome_priority(existing) >= gate_outcome_priority(new):
        if existing == new:
            return existing, verdict
        return existing, f"{existing.upper()} retained across independent gate evidence; latest result: {verdict}"
    return new, verdict


def merge_gate_evidence(entries: list[dict[str, Any]], evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """Evidence entries are keyed by ``eval_job_id``; a repeat replaces the earlier entry in place."""
    merged = [dict(entry) for entry in entries]
    for index, entry in enumerate(merged):
        if entry.get("eval_job_id") == evidence.get("eval_job_id"):
            merged[index] = evidence
            return merged
    return merged + [evidence]
