"""The held-out curve of a watched run: ``eval_curve`` in the receipt and in the checkpoint extension.

``EvalCurve`` is one record, written in two places: the checkpoint's extension file
(``kiln_flows_state.json`` → ``eval_curve``), so a resumed run continues the same curve, and the
receipt (``train_receipt.json`` → ``eval_curve``, ours; Kiln's fields are untouched). The rules that
read it (``diverged``, ``stalled``, ``flat``) are ``kiln_core.training.eval_curve``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.contracts.eval_watch import EvalWatch

__all__ = ["EVAL_CURVE_FORMAT", "StopRule", "EvalPoint", "EvalAlarm", "HeldOutSliceRecord", "EvalCurve"]

EVAL_CURVE_FORMAT = "kiln-flows.eval-curve.v1"
StopRule = Literal["diverged", "stalled", "flat"]


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class EvalPoint(_Record):
    """One held-out evaluation, after ``step`` committed optimizer steps (0 = before training)."""

    step: int = Field(ge=0)
    reverse_kl: float | None
    """Mean top-K reverse KL over the slice's action tokens; null when it is not finite."""
    top1_agreement: float | None
    teacher_token_nll: float | None
    tokens: int = Field(ge=0)
    train_loss: float | None = None
    """Mean training loss of the steps since the previous evaluation (null at the first one)."""


class EvalAlarm(_Record):
    """A rule that started firing at ``step``; ``message`` names the rule and its numbers."""

    step: int = Field(ge=0)
    rule: StopRule
    message: str


class HeldOutSliceRecord(_Record):
    """Which held-out examples the watch scores: a resumed run continues a curve only on the same slice."""

    corpus: str
    """The held-out corpus as given."""
    corpus_sha256: str
    """``sha256:`` of its JSONL bytes."""
    example_indices: list[int]
    """0-based admitted examples, in the order scored."""
    tokens: int = Field(ge=1)
    """Action tokens in the slice."""


class EvalCurve(_Record):
    """The held-out curve of a run: the watch's settings, the slice, every evaluation, every alarm."""

    format: Literal["kiln-flows.eval-curve.v1"] = EVAL_CURVE_FORMAT
    watch: EvalWatch
    held_out: HeldOutSliceRecord
    points: list[EvalPoint] = Field(default_factory=list)
    alarms: list[EvalAlarm] = Field(default_factory=list)

    def rows(self) -> list[dict[str, float | int | str | None]]:
        """One row per evaluation, with the alarms raised there: what a table artifact shows.

        Example:
            >>> curve.rows()[0]  # doctest: +SKIP
            {'step': 0, 'reverse_kl': 1.93, 'top1_agreement': 0.05, 'teacher_token_nll': 5.1, 'train_loss': None, 'alarms': ''}
        """
        raised: dict[int, list[str]] = {}
        for alarm in self.alarms:
            raised.setdefault(alarm.step, []).append(alarm.rule)
        return [{"step": p.step, "reverse_kl": p.reverse_kl, "top1_agreement": p.top1_agreement,
                 "teacher_token_nll": p.teacher_token_nll, "train_loss": p.train_loss,
                 "alarms": ", ".join(raised.get(p.step, []))} for p in self.points]
