"""The rules that read the held-out curve of a watched run (issue 14 item 4).

The curve itself (``EvalCurve``, written in the receipt and the checkpoint extension) is a wire
format: ``kiln_core.contracts.eval_curve``. The rules are pure functions of the curve's points and the run's training-loss history (both restored
on resume), so a resumed run fires exactly the alarms an uninterrupted one does. With
``p`` = ``patience``, ``m`` = ``min_improvement``, ``KL_i`` the held-out reverse KL of evaluation i:

* **diverged** — ``KL`` is not finite at the latest evaluation, or it rose at each of the last ``p``
  evaluations: ``KL_i > KL_{i-1} · (1 + m)`` for the last ``p`` pairs (a non-finite ``KL_i`` counts as a
  rise);
* **stalled** — ``p`` evaluations in a row did not improve on the best so far: an evaluation improves
  when ``KL_i < best · (1 − m)`` (the first finite one always does; only an improvement moves ``best``);
* **flat** — the training loss stopped moving: with ``W`` = ``flat_window`` and at least ``2W``
  committed steps, the mean loss of the last ``W`` steps is within ``flat_tolerance`` (relative) of
  the mean of the ``W`` steps before them: ``|mean(L[n−W:n]) − mean(L[n−2W:n−W])| ≤ flat_tolerance ·
  |mean(L[n−2W:n−W])|``. Means over windows, not single steps, because one step's loss depends on its
  example; a ``W`` that is a multiple of the examples per epoch compares the same examples. It fires
  on a student that collapsed (the issue's run: the same loss at every step) and on one that does not
  learn at all; a run that has converged also plateaus, and is reported as flat too.

A rule *fires* at an evaluation when its condition holds there; it raises an *alarm* (a warning in the
log and the receipt) when it fires and did not fire, with the same name, at the previous evaluation.
"""

from __future__ import annotations

import math
from typing import Sequence

from kiln_core.contracts.eval_curve import EvalAlarm, EvalPoint, StopRule
from kiln_core.contracts.eval_watch import EvalWatch

__all__ = ["firing_rules", "new_alarms", "finite_or_none"]


def finite_or_none(value: float) -> float | None:
    """JSON cannot hold NaN or infinities (checkpoints and receipts refuse them): those become null."""
    return float(value) if math.isfinite(value) else None


def _kl_rule(points: Sequence[EvalPoint], watch: EvalWatch) -> tuple[StopRule, str] | None:
    if not points:
        return None
    latest, p, m = points[-1], watch.patience, watch.min_improvement
    if latest.reverse_kl is None:
        return "diverged", f"held-out reverse KL is not finite at step {latest.step}"
    recent = points[-(p + 1):]
    if len(recent) == p + 1 and all(_rose(a.reverse_kl, b.reverse_kl, m) for a, b in zip(recent, recent[1:])):
        trail = " → ".join(_show(q.reverse_kl) for q in recent)
        return "diverged", (f"held-out reverse KL rose at each of the last {p} evaluations: {trail} (steps "
                            f"{recent[0].step}–{latest.step}; eval.patience={p}, eval.min_improvement={m})")
    best, best_step, since = None, None, 0
    for point in points:
        kl = point.reverse_kl
        if kl is not None and (best is None or kl < best * (1.0 - m)):
            best, best_step, since = kl, point.step, 0
        else:
            since += 1
    if since >= p:
        where = f"its best {_show(best)} at step {best_step}" if best is not None else "a finite value"
        return "stalled", (f"held-out reverse KL has not improved on {where} for {since} evaluations (latest "
                           f"{_show(latest.reverse_kl)} at step {latest.step}; eval.patience={p}, "
                           f"eval.min_improvement={m})")
    return None


def _rose(before: float | None, after: float | None, m: float) -> bool:
    if after is None:
        return True
    return before is not None and after > before * (1.0 + m)


def _flat_rule(losses: Sequence[float], watch: EvalWatch) -> tuple[StopRule, str] | None:
    window, n = watch.flat_window, len(losses)
    if window is None or n < 2 * window:
        return None
    before = math.fsum(losses[n - 2 * window : n - window]) / window
    last = math.fsum(losses[n - window :]) / window
    change = abs(last - before)
    if change > watch.flat_tolerance * abs(before):
        return None
    relative = change / abs(before) if before else 0.0
    return "flat", (f"training loss is flat: mean {_show(last)} over steps {n - window + 1}–{n} against {_show(before)} "
                    f"over steps {n - 2 * window + 1}–{n - window}, a relative change of {relative:.3%} ≤ "
                    f"eval.flat_tolerance={watch.flat_tolerance} (eval.flat_window={window})")


def _show(value: float | None) -> str:
    return "non-finite" if value is None else f"{value:.6g}"


def firing_rules(points: Sequence[EvalPoint], losses: Sequence[float], watch: EvalWatch) -> list[tuple[StopRule, str]]:
    """The rules that fire after the last of ``points`` (held-out first, then ``flat``), with their messages.

    ``losses`` is the run's training-loss history up to that evaluation's step.

    Example:
        >>> firing_rules(curve.points, loss_history[:curve.points[-1].step], watch)  # doctest: +SKIP
        [('stalled', 'held-out reverse KL has not improved on its best 0.41 at step 20 for 3 evaluations ...')]
    """
    return [rule for rule in (_kl_rule(points, watch), _flat_rule(losses, watch)) if rule is not None]


def new_alarms(points: Sequence[EvalPoint], losses: Sequence[float], watch: EvalWatch) -> list[EvalAlarm]:
    """Alarms raised at the last of ``points``: rules firing there that did not fire, under the same name,
    at the evaluation before it (``losses`` as in ``firing_rules``)."""
    if not points:
        return []
    before: set[str] = set()
    if len(points) > 1:
        before = {rule for rule, _ in firing_rules(points[:-1], losses[: points[-2].step], watch)}
    step = points[-1].step
    return [EvalAlarm(step=step, rule=rule, message=message)
            for rule, message in firing_rules(points, losses, watch) if rule not in before]
