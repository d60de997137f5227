"""After training: evaluate the new adapter on its ``post_eval`` suite and, with a gate, decide its fate.

Source: crates/kiln-server/src/training_queue.rs · enqueue_post_training_eval (which runs exist),
crates/kiln-server/src/eval/worker.rs · apply_post_eval_gate (outcomes and verdicts).

* **Gated** (``min_accuracy`` set): one comparison over two arms with the same suite, generation
  override and seeds — the baseline (the previously active adapter, or the base model when none is
  active or it has the candidate's name) and the candidate. The decision becomes ``promoted`` (pass and
  ``auto_load_on_pass``), ``kept`` (pass otherwise), ``regression``, ``demoted`` or ``inconclusive``;
  an eval that does not complete or evidence that cannot be paired is ``error``.
* **Ungated**: the candidate alone, for information; no outcome.
* ``include_baseline`` adds a base-model run for display; it reuses the gate's baseline arm when
  that arm already is the base model (same suite, seeds and decoding, so the same result).

``apply_gate_outcome`` (``fate.py``) then acts on the outcome.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from kiln_core.contracts.post_eval.config import PostEvalConfig
from kiln_core.post_eval.gate import (PairedEvidenceError, PostEvalGate, PostEvalGateEvidence, SuiteRun,
                                      decision_verdict, evaluate_paired_promotion)
from kiln_core.post_eval.reduce import AggregationError
from kiln_core.contracts.post_eval.scorers import JudgeRunner
from kiln_core.post_eval.identity import effective_generation_sha256, suite_sha256
from kiln_core.contracts.post_eval.suite import EvalSuite

__all__ = ["PostEvalResult", "run_post_eval"]


@dataclass
class PostEvalResult:
    """Everything one post-training evaluation produced.

    Attributes:
        gated: Whether a ``min_accuracy`` gate ran.
        outcome: ``promoted | kept | regression | demoted | inconclusive | error``; None when ungated.
        verdict: Kiln's prose verdict (completed by ``apply_gate_outcome`` for ``demoted``).
        evidence: The paired statistics, when they could be computed.
        candidate, baseline, base_model: The runs (``baseline`` only when gated).
        error: Why the eval did not complete, for ``error`` outcomes.
    """

    suite: str
    data_scope: str
    min_accuracy: float | None
    gated: bool
    eval_job_id: str
    effective_seed: int
    outcome: str | None = None
    verdict: str | None = None
    evidence: PostEvalGateEvidence | None = None
    decision_reason: str | None = None
    candidate: SuiteRun | None = None
    baseline: SuiteRun | None = None
    base_model: SuiteRun | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        runs = {name: run.to_json() for name, run in
                (("candidate", self.candidate), ("baseline", self.baseline), ("base_model", self.base_model)) if run}
        return {"suite": self.suite, "data_scope": self.data_scope, "min_accuracy": self.min_accuracy,
                "gated": self.gated, "eval_job_id": self.eval_job_id, "effective_seed": str(self.effective_seed),
                "gate_outcome": self.outcome, "post_eval_verdict": self.verdict,
                "evidence": self.evidence.model_dump() if self.evidence else None, "error": self.error,
                "warnings": list(self.warnings), "runs": runs}


def _eval_job_id(*parts: Any) -> str:
    # Stable across retries of the same evaluation, so a repeated gate replaces its evidence entry.
    return "post-eval-" + hashlib.sha256("\0".join(str(part) for part in parts).encode()).hexdigest()[:16]


def _unenforced_budgets(suite: EvalSuite, config: PostEvalConfig) -> list[str]:
    params = [suite.generation, config.generation, *(example.generation for example in suite.examples)]
    if any(p is not None and isinstance(p.budget(name), int)
           for p in params for name in ("thinking_budget_tokens", "thinking_budget_ms")):
        return ["thinking budgets are recorded in the generation hash but not enforced by kiln-flows' runner"]
    return []


def run_post_eval(config: PostEvalConfig, suite: EvalSuite, *, student_dir: str, candidate_adapter: str,
                  candidate_name: str, baseline_adapter: str | None = None, baseline_name: str | None = None,
                  auto_load_on_pass: bool = True, seed: int | None = None, device: str | None = None,
                  judge: JudgeRunner | None = None, time_limit_s: float | None = None) -> PostEvalResult:
    """Evaluate a freshly trained adapter as Kiln's post-training eval does.

    Args:
        config: The request's ``post_eval`` (validated at submit time).
        suite: The suite ``config.suite`` names (``SuiteRegistry.load``).
        student_dir: Local base student directory.
        candidate_adapter: The new PEFT adapter directory (path or fsspec URI).
        candidate_name: The new adapter's name.
        baseline_adapter: The previously active adapter's directory, or None for the base model.
        baseline_name: Its name (shown in evidence and verdicts). A baseline with the candidate's name is
            replaced by the base model, as Kiln does.
        auto_load_on_pass: Kiln's ``auto_load`` (and no quarantine): a pass is ``promoted``, else ``kept``.
        seed: The job's seed; None falls back to ``post_eval.generation.seed``, the suite's, then random.
        device: ``cpu``/``cuda`` (default: CUDA when available).
        judge: Judge runner for ``llm_judge`` scorers; None grades them ``invalid``.
        time_limit_s: Stop and report ``error`` when the whole evaluation exceeds this many seconds.

    Returns:
        ``PostEvalResult``; ``error`` outcomes are returned, not raised.

    Example:
        >>> result = run_post_eval(config, registry.load(config.suite), student_dir="student",
        ...                        candidate_adapter="kiln-data/runs/demo/adapter", candidate_name="demo",
        ...                        seed=7)  # doctest: +SKIP
        >>> result.outcome, result.evidence.candidate_accuracy  # doctest: +SKIP
        ('promoted', 0.95)
    """
    from kiln_core.post_eval.runner import PostEvalTimeout, load_arm, resolve_effective_seed, run_suite

    if baseline_name == candidate_name:
        baseline_adapter = baseline_name = None
    effective_seed = resolve_effective_seed(seed, config, suite)
    deadline = time.monotonic() + time_limit_s if time_limit_s is not None else None
    job_id = _eval_job_id(suite_sha256(suite), effective_generation_sha256(suite, config.generation, effective_seed),
                          baseline_name, candidate_name)
    result = PostEvalResult(config.suite, config.data_scope, config.min_accuracy_f32, config.gated, job_id,
                            effective_seed, warnings=_unenforced_budgets(suite, config))

    def run(adapter_dir: str | None, label: str | None) -> SuiteRun:
        arm = load_arm(student_dir, adapter_dir, device=device)
        try:
            return run_suite(suite, arm, adapter_label=label, override=config.generation,
                             effective_seed=effective_seed, judge=judge, deadline=deadline)
        finally:
            del arm

    try:
        if config.gated:
            result.baseline = run(baseline_adapter, baseline_name)
        result.candidate = run(candidate_adapter, candidate_name)
        if config.include_baseline:
            reuse = config.gated and baseline_adapter is None
            result.base_model = result.baseline if reuse else run(None, None)
    except (PostEvalTimeout, AggregationError) as error:
        result.error = str(error)
        if config.gated:
            result.outcome = "error"
            result.verdict = (f"post-eval did not complete (state: Failed) — adapter `{candidate_name}` left on disk, "
                              "NOT promoted")
        return result
    if not config.gated:
        return result
    gate = PostEvalGate(min_accuracy=config.min_accuracy_f32, adapter_name=candidate_name,
                        auto_load_on_pass=auto_load_on_pass)
    try:
        decision = evaluate_paired_promotion(job_id, gate, result.baseline, result.candidate)
    except PairedEvidenceError as error:
        result.outcome, result.error = "error", str(error)
        result.verdict = f"post-eval paired evidence is invalid: {error} — NOT promoted"
        return result
    result.evidence, result.decision_reason = decision.evidence, decision.reason
    result.outcome, result.verdict = decision_verdict(decision, gate)
    return result
