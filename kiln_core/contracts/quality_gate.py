"""``QualityGate``: kiln-flows' own second gate, on the distillation metrics of ``kiln-flows eval``.

Kiln's ``post_eval`` grades generated answers against a suite. Distillation also has a cheaper,
denser signal: how closely the student follows the teacher on a held-out teacher-scored corpus
(top-K reverse KL, full-vocabulary top-1 agreement, teacher-token NLL; ``kiln_core.evaluation``).
A spec's ``quality_gate:`` block sets floors and ceilings on those metrics for the new adapter; the
gate stage evaluates the base student and the distilled one on the corpus and decides:

* every threshold met → ``promoted`` (``kept`` when the config's ``auto_load`` is false);
* any threshold missed → ``demoted`` (the run directory is renamed ``<adapter>.failed``, as for
  Kiln's gate).

With ``post_eval`` as well, the stronger outcome of the two wins (Kiln's rule for several gates on
one training job, ``kiln_core.post_eval.gate.aggregate_gate_outcome``). Kiln requests never carry
this block: it is set in a ``PipelineSpec`` only.

Example:
    >>> gate = QualityGate(corpus="heldout.jsonl", min_top1_agreement=0.5)
    >>> gate.thresholds()
    {'min_top1_agreement': 0.5}
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["QualityGate"]


class QualityGate(BaseModel):
    """Thresholds on the new adapter's held-out distillation metrics."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="Quality gate (held-out metrics)")

    corpus: str = Field(
        min_length=1,
        description="Held-out teacher-scored JSONL (path or URI), scored by the training teacher, sharing no "
        "prompt with the training corpus (admitted with the rules of kiln-flows eval).",
    )
    max_reverse_kl: float | None = Field(
        default=None, ge=0.0, description="The distilled student's mean top-K reverse KL must be at most this."
    )
    min_top1_agreement: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="Its full-vocabulary argmax must equal the teacher's first candidate at least this often.",
    )
    max_teacher_token_nll: float | None = Field(
        default=None, ge=0.0, description="Its mean NLL of the corpus tokens must be at most this."
    )
    require_improvement: bool = Field(
        default=False, description="Its reverse KL must also be lower than the base student's on the same corpus."
    )

    @model_validator(mode="after")
    def _something_to_check(self) -> "QualityGate":
        if not self.thresholds() and not self.require_improvement:
            raise ValueError("`quality_gate`: set at least one of max_reverse_kl, min_top1_agreement, "
                             "max_teacher_token_nll or require_improvement")
        for name, value in self.thresholds().items():
            if not math.isfinite(value):
                raise ValueError(f"`quality_gate.{name}`: must be finite")
        return self

    def thresholds(self) -> dict[str, float]:
        """The thresholds that are set, by name."""
        names = ("max_reverse_kl", "min_top1_agreement", "max_teacher_token_nll")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}
