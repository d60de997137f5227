"""The one training loop: optimizer steps over a candidate source, from a plan to a receipt.

Both training modes run ``run_training``; they differ only in their ``CandidateSource``:

* off-policy (``trainer.CorpusCandidates``): the admitted corpus tables in file order, the next
  ``sequences_per_step`` × world size candidates per step;
* on-policy (``on_policy_trainer.RolloutCandidates``): one candidate at a time, its rollout read back
  from the rollout store or sampled and scored, an empty rollout consumed without a step.

A source's cursor lives in the loop's ``LoopProgress`` (``global_step``, and ``consumed`` for
on-policy), which every checkpoint stores and a resume restores, so a source picks up exactly where
the checkpoint left it.

Read ``run_training`` top to bottom; it runs in the order the work happens:

1. setup (``lifecycle.start_student``): the student with a seeded LoRA, the optimizer, the RNG
   streams — restored exactly on resume, or warm-started from the plan's base adapter — then the
   held-out watch's baseline, then the source's own setup (``open``: e.g. the teacher);
2. the loop: the source's next group → one optimizer step (``step.train_examples``, or
   ``step.train_step_distributed`` with several processes) → the end-of-step work
   (``boundary.StepBoundary``: progress, watch, checkpoint, ``on_step_committed``, stops);
3. finish: the watch's last point, the PEFT adapter (``finish.publish_final_adapter``), then
   ``train_receipt.json`` (``finish.finish_run``; also written on failure).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol, Sequence

from kiln_core.corpus import TrainingExample
from kiln_core.training.boundary import StepBoundary
from kiln_core.training.finish import finish_run, publish_final_adapter
from kiln_core.training.lifecycle import (
    CheckpointPublisher,
    deterministic,
    new_progress,
    outcome_recorded,
    start_student,
    stop_signals,
)
from kiln_core.training.plan import RunPlan
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.contracts.training_record import RunOutcome
from kiln_core.storage import remove_tree
from kiln_core.training.step import train_examples, train_step_distributed
from kiln_core.training.student import Student
from kiln_core.training.time_bound import TimeBound, TrainingTooLong
from kiln_core.training.watch import EvalReport, HeldOutSlice, HeldOutWatch

__all__ = ["CandidateSource", "StepGroup", "TrainingRun", "run_training"]

StepGroup = Sequence[tuple[int, Callable[[], TrainingExample]]]
"""One optimizer step's candidates: ``(label, load)`` pairs; ``label`` names the candidate in a
non-finite-loss message, ``load`` reads its ``TrainingExample``."""


class CandidateSource(Protocol):
    """Where a run's optimizer steps come from; its cursor is the loop's ``LoopProgress``."""

    stop_before_first_step: bool
    """Whether a stop requested before the first step ends the run at once (Kiln's offline loop checks at
    the top of every iteration; its on-policy loop only after committed steps)."""

    def open(self, student: Student, outcome: RunOutcome, clock: Clock) -> None:
        """Setup that needs the loaded student (the on-policy teacher and sampler); after every refusal."""

    def groups(self, progress: LoopProgress, clock: Clock) -> Iterator[StepGroup]:
        """The remaining steps' groups, from the cursor in ``progress``; read lazily, one step at a time
        (a group is trained and committed before the next is asked for)."""

    def steps_left(self, progress: LoopProgress) -> bool:
        """Whether the run has more to train after the step just committed."""

    def close(self, clock: Clock) -> None:
        """Release what ``open`` took (always called once ``open`` ran); record the source's timings."""


class TrainingRun:
    """How a run ended: the outcome, the counters and the receipt, for the entry point's result."""

    def __init__(self, plan: RunPlan, outcome: RunOutcome, progress: LoopProgress, clock: Clock, receipt_uri: str):
        self.plan, self.outcome, self.progress, self.clock, self.receipt_uri = plan, outcome, progress, clock, receipt_uri


def run_training(plan: RunPlan, source: CandidateSource, *, student_dir: str, clock: Clock,
                 gradient_checkpointing: bool = False, handle_signals: bool = False,
                 should_cancel: Callable[[], bool] | None = None,
                 on_step_committed: Callable[[int], None] | None = None,
                 report: Callable[[LoopProgress, float], None] | None = None,
                 eval_watch: HeldOutSlice | None = None,
                 on_eval: Callable[[EvalReport], None] | None = None,
                 max_hours: float | None = None) -> TrainingRun:
    """Train the planned run over ``source`` and publish the adapter and receipt.

    Args:
        plan: The resolved run (``plan.plan_off_policy_run`` / ``on_policy_plan.plan_on_policy_run``): every
            refusal already made.
        source: The run's candidates.
        student_dir: Local student model directory.
        clock: Phase timings (started by the caller, so planning counts).
        gradient_checkpointing: Recompute activations in backward to save memory.
        handle_signals: Turn SIGTERM/SIGINT into a cooperative stop (main thread only).
        should_cancel: Polled at each step boundary; True stops after publishing a checkpoint.
        on_step_committed: Called with the step number once a step and its checkpoint (when one is due)
            are published; whatever it raises ends the run like any other error.
        report: Called as ``(progress, loss)`` after each committed step.
        eval_watch: Held-out evaluation during training, or None.
        on_eval: Called with an ``EvalReport`` after each held-out evaluation.
        max_hours: The time bound (``time_bound.TimeBound``); None: none.

    Returns:
        ``TrainingRun``; a cancelled, non-finite or watch-stopped run is returned, not raised.

    Raises:
        TrainingTooLong: ``training_too_long`` — projected past ``max_hours`` after its first steps (no receipt;
            a fresh run's directory is removed, a resumed one keeps its earlier checkpoints).
        Exception: anything unexpected, after a ``failed`` receipt was written.
    """
    outcome = RunOutcome(resumed_from=plan.loaded.basename if plan.loaded else None)
    progress = new_progress(plan)
    step = train_examples if plan.world.size == 1 else train_step_distributed

    try:
        _train(plan, source, outcome, progress, clock, student_dir=student_dir, step=step,
               gradient_checkpointing=gradient_checkpointing, handle_signals=handle_signals,
               should_cancel=should_cancel, on_step_committed=on_step_committed, report=report,
               eval_watch=eval_watch, on_eval=on_eval, max_hours=max_hours)
    except TrainingTooLong:
        if plan.loaded is None and plan.world.is_main:
            remove_tree(plan.run_dir)  # a fresh run refused after its first steps: nothing of it stays
        raise
    receipt_uri = finish_run(plan, outcome, progress, clock)
    plan.world.barrier()  # the other ranks return once rank 0's receipt is written
    return TrainingRun(plan, outcome, progress, clock, receipt_uri)


def _train(plan: RunPlan, source: CandidateSource, outcome: RunOutcome, progress: LoopProgress, clock: Clock, *,
           student_dir: str, step, gradient_checkpointing: bool, handle_signals: bool,
           should_cancel: Callable[[], bool] | None, on_step_committed: Callable[[int], None] | None,
           report: Callable[[LoopProgress, float], None] | None, eval_watch: HeldOutSlice | None,
           on_eval: Callable[[EvalReport], None] | None, max_hours: float | None) -> None:
    """Setup, the loop and the final adapter (``run_training``'s steps 1-3), with the outcome recorded."""
    with (deterministic(plan.device), stop_signals(handle_signals) as signalled,
          outcome_recorded(plan, outcome, progress, clock)):
        # ---- 1. setup: fresh seeded student and optimizer; a resume then overwrites every state
        student, optimizer = start_student(plan, student_dir, progress, gradient_checkpointing=gradient_checkpointing,
                                           clock=clock)
        outcome.sharding = student.sharding
        watch = None
        if eval_watch is not None:  # a baseline evaluation now, or the curve of the checkpoint resumed
            watch = HeldOutWatch.start(eval_watch, plan.loaded, outcome, student, progress, clock, on_eval)
        checkpoints = CheckpointPublisher(plan, student, optimizer, progress, clock,
                                          eval_curve=(lambda: watch.curve) if watch is not None else None)
        boundary = StepBoundary(checkpoints, progress, clock, plan.world, plan.settings.config.checkpoint_interval,
                                signalled, should_cancel=should_cancel, on_step_committed=on_step_committed, watch=watch,
                                time_bound=TimeBound(max_hours, plan.schedule, plan.world))
        source.open(student, outcome, clock)
        try:
            # ---- 2. the loop: one optimizer step per group the source gives
            loop_started = time.perf_counter()
            if source.stop_before_first_step:
                boundary.before_first_step()
            for group in source.groups(progress, clock):
                loss = step(student, optimizer, group, plan, progress, clock)
                boundary.after_step(student, steps_left=source.steps_left(progress),
                                    report=(lambda: report(progress, loss)) if report is not None else None)
            if watch is not None:
                watch.finish(student, progress, clock)
            clock.totals_ms["train_loop"] = (time.perf_counter() - loop_started) * 1e3
        finally:
            source.close(clock)

        # ---- 3. publish the PEFT adapter (rank 0 only; the receipt follows in finish_run)
        publish_final_adapter(plan, outcome, student, clock, progress)
