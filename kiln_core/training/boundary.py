"""The end of an optimizer step, the same in both training modes.

Once a step is committed (``step.train_examples`` / ``step.train_step_distributed``) the loop hands
over to ``StepBoundary.after_step``, which does, in this order:

1. the progress report (the caller's ``report``: its shape differs per mode, its place does not), then the
   time bound (``time_bound``: after the first few steps, a run projected past its bound is refused);
2. a held-out evaluation when due (``watch``, only when the run is watched);
3. a checkpoint when ``global_step % checkpoint_interval == 0`` and steps remain;
4. ``on_step_committed`` (tests and fault drills stop a run there);
5. a watch stop: the state is checkpointed, then the run ends with the watch's reason;
6. cancellation (Ctrl-C, SIGTERM, ``should_cancel``) when steps remain: the state is checkpointed, then
   the run ends ``cancelled``. With several processes every rank stops at the same boundary when any
   rank was asked to.

The off-policy loop also checks before its first step, as Kiln's offline loop checks at the top of
every iteration (``before_first_step``: the run ends at once, nothing new to save); Kiln's on-policy
loop checks only after committed steps, so ``train_on_policy`` does not call it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from kiln_core.training.distributed.world import World
from kiln_core.training.lifecycle import CheckpointPublisher, cancel_message
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.training.step import StopTraining
from kiln_core.training.student import Student
from kiln_core.training.time_bound import TimeBound
from kiln_core.training.watch import HeldOutWatch

__all__ = ["StepBoundary"]


@dataclass
class StepBoundary:
    """What happens between two optimizer steps; one instance per run.

    Attributes:
        checkpoints: Publishes the state at the current step (never twice for one step).
        progress: The loop's counters (``global_step``).
        clock: Phase timings.
        world: This process's rank and world size.
        checkpoint_interval: ``config.checkpoint_interval`` (None or 0: no periodic checkpoints).
        signalled: Set by SIGTERM/SIGINT (``lifecycle.stop_signals``).
        should_cancel: Polled at each boundary; True stops the run.
        on_step_committed: Called with the step number once the step (and its checkpoint) is published.
        watch: The held-out watch of a watched run, or None.
        time_bound: Refuses a run whose measured pace projects past its bound (``time_bound.TimeBound``), or None.
    """

    checkpoints: CheckpointPublisher
    progress: LoopProgress
    clock: Clock
    world: World
    checkpoint_interval: int | None
    signalled: threading.Event
    should_cancel: Callable[[], bool] | None = None
    on_step_committed: Callable[[int], None] | None = None
    watch: HeldOutWatch | None = None
    time_bound: TimeBound | None = None

    def stop_requested(self) -> bool:
        """True when this process (or, with several, any rank) was asked to stop."""
        stop = self.signalled.is_set() or (self.should_cancel is not None and self.should_cancel())
        if self.world.size > 1:  # every rank takes part, so every rank stops at the same boundary
            stop = self.world.any_rank(stop)
        return stop

    def before_first_step(self) -> None:
        """End the run now when a stop was requested before it trained anything in this process.

        Raises:
            StopTraining: ``cancelled``.
        """
        if self.stop_requested():
            raise StopTraining("cancelled", cancel_message(self.checkpoints.published))

    def after_step(self, student: Student, *, steps_left: bool, report: Callable[[], None] | None = None) -> None:
        """The end-of-step work after ``progress.global_step`` committed steps, in the module's order.

        Args:
            student: The student being trained (the watch evaluates it).
            steps_left: Whether the run has more to train (no periodic checkpoint or cancellation after
                the last step: the final adapter follows).
            report: The caller's progress report, called first.

        Raises:
            StopTraining: a watch stop (its reason) or ``cancelled``, after the state was checkpointed.
        """
        if report is not None:
            report()
        if self.time_bound is not None:  # before anything more is written: a refused run keeps nothing new
            self.time_bound.after_step(self.progress, steps_left=steps_left)
        step = self.progress.global_step
        halt = self.watch.after_step(student, self.progress, self.clock, steps_left=steps_left) if self.watch else None
        if self.checkpoint_interval and step % self.checkpoint_interval == 0 and steps_left:
            self.checkpoints.publish()
        if self.on_step_committed is not None:
            self.on_step_committed(step)
        if halt is not None:  # the held-out watch stops the run: its state is saved first
            self.checkpoints.publish()
            raise halt
        if steps_left and self.stop_requested():
            raise StopTraining("cancelled", cancel_message(self.checkpoints.publish()))
