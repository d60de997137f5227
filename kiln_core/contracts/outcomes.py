"""The typed outcome blocks a run's receipt records beside Kiln's fields: the publish guard's verdict and the
gates' evidence.

Each is produced by one owner and written into ``train_receipt.json`` by the one composer
(``kiln_core.training.receipt.compose_receipt``): the publish guard's block by the trainer
(``kiln_core.training.publish_guard``), the gate's decision by the gate stage (``kiln_core.engine.gate``:
Kiln's ``post_eval`` and our ``quality_gate``). Field names are the ones receipts already on storage carry,
so those receipts read back into these models unchanged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

__all__ = ["GuardCheckRecord", "PublishGuardRecord", "EvalMetricsRecord", "QualityGateRecord",
           "PostEvalGateEvidence", "PostEvalRecord", "GateDecision"]


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _omit_none(value: object) -> bool:
    return value is None


class GuardCheckRecord(_Block):
    """One publish-guard rule: what was measured against which threshold (non-finite values written as text)."""

    rule: str
    passed: bool
    measured: dict[str, float | int | str | None]
    threshold: dict[str, float]
    message: str


class PublishGuardRecord(_Block):
    """The receipt's ``publish_guard``: whether the guard ran, its verdict and each rule's measurement."""

    enabled: bool
    verdict: Literal["passed", "tripped", "off"]
    rules: list[str] = Field(default_factory=list)
    """The rules that tripped."""
    checks: list[GuardCheckRecord] = Field(default_factory=list)
    code: str | None = Field(default=None, exclude_if=_omit_none)
    """``training_diverged`` when the guard tripped."""


class EvalMetricsRecord(_Block):
    """Held-out distillation metrics: means over ``tokens`` action tokens of ``examples`` examples
    (``kiln_core.evaluation.metrics.EvalMetrics``)."""

    reverse_kl: float
    top1_agreement: float
    teacher_token_nll: float
    tokens: int
    examples: int


class QualityGateRecord(_Block):
    """The receipt's ``quality_gate`` (ours): the thresholds, the base and distilled student's metrics, the
    outcome."""

    corpus: str
    corpus_sha256: str
    thresholds: dict[str, float]
    require_improvement: bool
    base: EvalMetricsRecord
    distilled: EvalMetricsRecord
    failures: list[str]
    outcome: str
    verdict: str


class PostEvalGateEvidence(_Block):
    """The statistics one gate decided on, with Kiln's field names (training job ``post_eval_gate_evidence[]``;
    crates/kiln-server/src/eval/queue.rs · PostEvalGate, as the eval worker fills it)."""

    policy_version: str
    suite_policy: str
    eval_job_id: str
    suite_name: str
    suite_hash: str
    effective_generation_hash: str
    baseline_adapter: str | None
    candidate_adapter: str
    aggregation: str
    minimum_paired_examples: int
    paired_examples: int
    improved: int
    regressed: int
    tied: int
    exact_sign_test_p_value: float
    exact_sign_test_alpha: float
    baseline_accuracy: float
    baseline_accuracy_lower_bound: float
    baseline_accuracy_upper_bound: float
    candidate_accuracy: float
    candidate_accuracy_lower_bound: float
    candidate_accuracy_upper_bound: float
    accuracy_confidence_level: float
    minimum_accuracy: float
    required_relative_recovery: float | None = None
    relative_recovery_lower_bound: float | None = None
    required_absolute_gain: float | None = None
    absolute_gain_lower_bound: float | None = None
    outcome: str = ""
    """Stamped when the outcome is final (``kiln_core.engine.fate.apply_gate_outcome``)."""


class PostEvalRecord(_Block):
    """The receipt's ``post_eval`` (ours; Kiln keeps these on the training job): the post-training eval, its
    gate's outcome and evidence (``kiln_core.engine.fate.post_eval_receipt_block``)."""

    suite: str
    data_scope: str
    min_accuracy: float | None
    gated: bool
    eval_job_id: str
    effective_seed: str
    suite_hash: str | None
    gate_outcome: str | None
    post_eval_verdict: str | None
    post_eval_gate_evidence: list[PostEvalGateEvidence] = Field(default_factory=list)
    metrics: dict[str, dict[str, JsonValue]] = Field(default_factory=dict)
    """Each arm's suite metrics as Kiln's eval job reports them (``candidate``, ``baseline``, ``base_model``)."""
    adapter_location: str | None = None
    latest: str | None = None
    error: str | None = None
    warnings: list[str] = Field(default_factory=list)


class GateDecision(_Block):
    """What the gate stage decided about a trained adapter, as the receipt records it: the stronger outcome of
    ``post_eval`` and ``quality_gate`` and each one's evidence."""

    outcome: str | None
    """``promoted | kept | regression | demoted | inconclusive | error``; None when nothing gated (an
    informational ``post_eval`` without ``min_accuracy``)."""
    verdict: str | None
    post_eval: PostEvalRecord | None = None
    quality_gate: QualityGateRecord | None = None
