"""From raw completions to one outcome per example, and the suite metrics over those outcomes.

Source: crates/kiln-eval/src/result.rs · ExampleOutcome, AggregatedExampleOutcome,
aggregate_example_outcomes, AggregateMetrics::compute_with_tools_full. One example is one
independent observation: k completions reduce to one record, and accuracy, confidence intervals
and the gate read only the reduced records. Scores are f32 and are summed in f32, as Kiln sums them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kiln_core.post_eval.stats import wilson_interval
from kiln_core.serde_json import rust_debug_str, rust_display_float, to_f32

__all__ = ["CompletionOutcome", "ReducedOutcome", "AggregationError", "aggregate_example_outcomes", "suite_metrics"]

OUTCOME_KINDS = ("pass", "fail", "invalid", "error")


@dataclass
class CompletionOutcome:
    """One generated completion and its grade (Kiln's ``ExampleOutcome``)."""

    example_id: str
    completion_index: int
    kind: str
    score: float
    generation_seed: int | None = None
    completion_text: str = ""
    raw_completion_text: str | None = None
    detail: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float | None = None
    tags: list[str] = field(default_factory=list)
    metadata: Any = None
    reasoning_text: str | None = None
    unclosed_thinking: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.generation_seed is not None:  # decimal string: a u64 does not fit a JS number
            out["generation_seed"] = str(self.generation_seed)
        return out


@dataclass
class ReducedOutcome:
    """One example's statistic after the suite's aggregation (Kiln's ``AggregatedExampleOutcome``)."""

    example_id: str
    kind: str
    score: float
    completion_indices: list[int]
    representative_completion_index: int
    num_pass: int
    num_fail: int
    num_invalid: int
    num_error: int
    tags: list[str] = field(default_factory=list)
    metadata: Any = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class AggregationError(ValueError):
    """Completions that cannot be reduced (Kiln's ``EvalAggregationError``); the run is an error."""


def _check_definition(aggregation: Any) -> int:
    k = aggregation.k
    if k == 0 or k > 128:
        raise AggregationError(f"invalid aggregation definition: {aggregation.label()} requires k in 1..=128")
    if aggregation.kind == "majority_at_k" and k % 2 == 0:
        raise AggregationError(
            f"invalid aggregation definition: {aggregation.label()} requires an odd k so ties are impossible")
    return k


def aggregate_example_outcomes(outcomes: list[CompletionOutcome], aggregation: Any) -> list[ReducedOutcome]:
    """Reduce every example's k completions to one record, in order of first appearance.

    Args:
        outcomes: Raw completions; each example must have exactly the indices ``0..k``.
        aggregation: The suite's ``EvalAggregation``.

    Raises:
        AggregationError: Wrong count or indices, disagreeing tags/metadata, a score outside [0, 1].

    Example:
        >>> from kiln_core.contracts.post_eval.suite import PassAtK
        >>> raw = [CompletionOutcome("x", 0, "fail", 0.0), CompletionOutcome("x", 1, "pass", 1.0)]
        >>> aggregate_example_outcomes(raw, PassAtK(kind="pass_at_k", k=2))[0].kind
        'pass'
    """
    k = _check_definition(aggregation)
    groups: dict[str, list[CompletionOutcome]] = {}
    for outcome in outcomes:
        groups.setdefault(outcome.example_id, []).append(outcome)
    reduced = []
    for example_id, group in groups.items():
        quoted = rust_debug_str(example_id)
        if len(group) != k:
            raise AggregationError(f"example {quoted} has {len(group)} completions; aggregation "
                                   f"{aggregation.label()} requires exactly {k}")
        group = sorted(group, key=lambda outcome: outcome.completion_index)
        indices = [outcome.completion_index for outcome in group]
        if indices != list(range(k)):
            raise AggregationError(f"example {quoted} has completion indices {indices}; expected {list(range(k))}")
        first = group[0]
        if any(outcome.tags != first.tags or outcome.metadata != first.metadata for outcome in group):
            raise AggregationError(f"example {quoted} completions disagree on tags or metadata")
        for outcome in group:
            if not 0.0 <= outcome.score <= 1.0:  # NaN fails too
                raise AggregationError(f"example {quoted} completion {outcome.completion_index} has invalid score "
                                       f"{rust_display_float(outcome.score, single=True)}")
        reduced.append(_reduce(example_id, group, aggregation, k))
    return reduced


def _reduce(example_id: str, group: list[CompletionOutcome], aggregation: Any, k: int) -> ReducedOutcome:
    counts = {kind: sum(outcome.kind == kind for outcome in group) for kind in OUTCOME_KINDS}
    fallback = "fail" if counts["fail"] else "invalid" if counts["invalid"] else "error"
    passing = [outcome for outcome in group if outcome.kind == "pass"]
    if aggregation.kind == "single":
        kind, score, representative = group[0].kind, group[0].score, 0
    elif aggregation.kind == "mean_at_k":
        total = 0.0
        for outcome in group:
            total = to_f32(total + outcome.score)
        score = to_f32(total / k)
        kind = fallback if counts["pass"] + counts["fail"] == 0 else "pass" if score >= 0.5 else "fail"
        representative = min(group, key=lambda o: (abs(to_f32(o.score - score)), o.completion_index)).completion_index
    elif aggregation.kind == "pass_at_k":
        kind, score, representative = ("pass", 1.0, passing[0].completion_index) if passing else (fallback, 0.0, 0)
    else:  # majority_at_k
        if counts["pass"] > k // 2:
            kind, score, representative = "pass", 1.0, passing[0].completion_index
        else:
            first_other = next((o.completion_index for o in group if o.kind != "pass"), 0)
            kind, score, representative = fallback, 0.0, first_other
    return ReducedOutcome(example_id, kind, score, list(range(k)), representative, counts["pass"], counts["fail"],
                          counts["invalid"], counts["error"], list(group[0].tags), group[0].metadata)


def suite_metrics(reduced: list[ReducedOutcome], outcomes: list[CompletionOutcome], weights: dict[str, float],
                  elapsed_secs: float) -> dict[str, Any]:
    """Headline metrics over the reduced examples; tokens and thinking diagnostics over raw completions.

    ``accuracy`` = passing examples / examples (invalid and error count as not passing);
    ``weighted_mean_score`` = Σ score·weight / Σ weight over ``EvalExample.weight``.
    """
    counts = {kind: 0 for kind in OUTCOME_KINDS}
    sum_score = sum_weighted = sum_weights = 0.0
    tag_counts: dict[str, list[int]] = {}
    for outcome in reduced:
        counts[outcome.kind] += 1
        weight = to_f32(weights.get(outcome.example_id, 1.0))
        sum_score = to_f32(sum_score + outcome.score)
        sum_weighted = to_f32(sum_weighted + to_f32(outcome.score * weight))
        sum_weights = to_f32(sum_weights + weight)
        for tag in outcome.tags:
            seen = tag_counts.setdefault(tag, [0, 0])
            seen[0] += 1
            seen[1] += outcome.kind == "pass"
    n = len(reduced)
    interval = wilson_interval(counts["pass"], n)
    return {
        "num_examples": n,
        "num_completions": len(outcomes),
        **{f"num_{kind}": counts[kind] for kind in OUTCOME_KINDS},
        "accuracy": to_f32(counts["pass"] / n) if n else 0.0,
        "accuracy_confidence_interval": {"confidence_level": interval.confidence_level, "lower": interval.lower,
                                         "upper": interval.upper},
        "mean_score": to_f32(sum_score / n) if n else 0.0,
        "weighted_mean_score": to_f32(sum_weighted / sum_weights) if sum_weights > 0 else 0.0,
        "pass_rate_by_tag": {tag: to_f32(p / c) for tag, (c, p) in sorted(tag_counts.items())},
        "total_prompt_tokens": sum(o.prompt_tokens or 0 for o in outcomes),
        "total_completion_tokens": sum(o.completion_tokens or 0 for o in outcomes),
        "num_unclosed_thinking": sum(o.unclosed_thinking for o in outcomes),
        "elapsed_secs": elapsed_secs,
    }
