"""The time bound: a run whose measured pace says it cannot finish within the bound is refused early.

``epochs: 1000000000`` is a valid config (Kiln accepts any positive count) and would train for 1.5 million
hours. Nothing about the config alone says how long a step takes, so the run measures itself: after its
first ``MEASURED_STEPS`` optimizer steps in this process, the pace of every step but the first (which pays for
warm-up) times the work left is the projected rest of the run. Above ``max_hours`` the run stops before
anything more is written, with ``training_too_long`` naming the projection; a fresh run leaves nothing behind
(``kiln_core.training.loop``), a resumed one keeps its earlier checkpoints.

A normal run pays two clock reads per step for it. The bound is not part of the run's identity: raising it
(``options.max_training_hours``, ``kiln-flows train --max-training-hours``) and running again resumes the same
run, and a resumed run measures its own pace again.
"""

from __future__ import annotations

import time

from kiln_core.contracts.spec_blocks import DEFAULT_MAX_TRAINING_HOURS
from kiln_core.errors import Rejection
from kiln_core.training.distributed.world import World
from kiln_core.training.plan import Schedule
from kiln_core.training.progress import LoopProgress

__all__ = ["DEFAULT_MAX_TRAINING_HOURS", "MEASURED_STEPS", "TimeBound", "TrainingTooLong"]

MEASURED_STEPS = 3
"""Steps in this process before the projection: the first pays for warm-up, the next ones set the pace."""


class TrainingTooLong(Rejection):
    """A run projected to train longer than its bound (code ``training_too_long``, field ``config.epochs``)."""

    def __init__(self, message: str) -> None:
        super().__init__("training_too_long", message, field="config.epochs")


class TimeBound:
    """Projects a run's remaining time from its measured pace, once, and refuses it above ``max_hours``.

    Args:
        max_hours: The bound; None: no bound (nothing is measured).
        schedule: The run's schedule (its total steps, or total candidates on-policy).
        world: Every rank decides together (one rank too slow stops them all at the same step).
    """

    def __init__(self, max_hours: float | None, schedule: Schedule, world: World) -> None:
        self.max_hours, self.schedule, self.world = max_hours, schedule, world
        self.steps_seen = 0
        self.first: tuple[float, int] | None = None  # (clock, work done) at the end of this process's first step

    def after_step(self, progress: LoopProgress, *, steps_left: bool) -> None:
        """Called at the end of every committed step, before anything else is written.

        Raises:
            TrainingTooLong: at the ``MEASURED_STEPS``-th step of this process, when the rest of the run is
                projected to take longer than ``max_hours``.
        """
        if self.max_hours is None or self.steps_seen >= MEASURED_STEPS:
            return
        self.steps_seen += 1
        done, total = self._work(progress)
        if self.first is None:
            self.first = (time.perf_counter(), done)
            return
        if self.steps_seen < MEASURED_STEPS:
            return
        started, done_then = self.first
        pace = (time.perf_counter() - started) / max(done - done_then, 1)  # seconds per unit of work
        hours = pace * (total - done) / 3600 if steps_left else 0.0
        if not self.world.any_rank(hours > self.max_hours):
            return
        unit = "candidates" if progress.consumed is not None else "steps"
        raise TrainingTooLong(
            f"the run would train {total:,} {unit} ({self.schedule.epochs:,} epochs); at the measured "
            f"{pace:.3g} s per {unit[:-1]} the {total - done:,} left take about {hours:,.0f} hours, above the "
            f"{self.max_hours:g}-hour bound: lower config.epochs, or raise the bound (options.max_training_hours; "
            f"kiln-flows train --max-training-hours)")

    def _work(self, progress: LoopProgress) -> tuple[int, int]:
        """Work done and in all: candidates on-policy (an empty rollout is consumed without a step), else steps."""
        if progress.consumed is not None:
            return progress.consumed, self.schedule.total_candidates
        return progress.global_step, self.schedule.total_steps
