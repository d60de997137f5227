"""Off-policy OPD training: an admitted corpus, one candidate sequence per optimizer step, top-K
reverse KL, exact resume.

``train_opd`` plans the run (``plan.plan_off_policy_run``: the schedule, the seed, the identities a checkpoint
binds, and every refusal — a bad resume basename, a checkpoint that does not match, an adapter
already published — before any model loads), then runs the one training loop
(``loop.run_training``) over the corpus (``CorpusCandidates``): the seeded student, restored exactly
on resume or warm-started from ``plan.base_adapter``; forward → loss → finite check → backward →
optimizer step → the end-of-step work (``boundary.StepBoundary``); then the PEFT adapter and
``train_receipt.json``.

Exactness (docs/architecture.md, decision 8): a step depends only on the LoRA weights, the optimizer state and the
candidate, all of which a checkpoint restores bit for bit, so an interrupted-and-resumed CPU run ends
with the same ``adapter_model.safetensors`` bytes as an uninterrupted one.

Several processes (``distributed.world``): with world size W each step takes ``W × sequences_per_step``
candidates, rank r trains its own block and the LoRA gradients are summed across ranks, so a W-process
run is the single-process run with ``sequences_per_step × W``. Rank 0 alone publishes.
"""

from __future__ import annotations

from typing import Callable, Iterator

from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.contracts.stage_refs import TrainPlan
from kiln_core.corpus import CorpusTables
from kiln_core.corpus_set import ShardedCorpus
from kiln_core.training.distributed.world import World
from kiln_core.training.lifecycle import CANCEL_MESSAGE, TrainResult, result_fields
from kiln_core.training.loop import StepGroup, run_training
from kiln_core.training.plan import RunPlan, Schedule, plan_off_policy_run
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.training.step import corpus_examples
from kiln_core.training.watch import EvalReport, HeldOutSlice, check_watch

__all__ = ["TrainResult", "Schedule", "LoopProgress", "Clock", "CorpusCandidates", "train_opd", "CANCEL_MESSAGE"]


def train_opd(
    plan: TrainPlan,
    tables: CorpusTables | ShardedCorpus,
    *,
    dataset_sha256: str,
    dataset_path: str,
    student_dir: str,
    teacher_alias: str,
    teacher_identity: TeacherIdentity | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
    on_step_committed: Callable[[int], None] | None = None,
    handle_signals: bool = False,
    world: World | None = None,
    eval_watch: HeldOutSlice | None = None,
    on_eval: Callable[[EvalReport], None] | None = None,
) -> TrainResult:
    """Train a LoRA student on an admitted corpus and publish the adapter and receipt under ``plan.run_uri``.

    Args:
        plan: The resolved run (``kiln_core.engine.runs.plan_run``): run directory, adapter name, the
            effective config, top-K, learning rate, samples per prompt, base adapter, device options, and
            ``resume`` — a checkpoint basename in ``plan.run_uri`` to resume from exactly, or None (the
            engine turns ``"latest"`` into one before calling).
        tables: The admitted corpus (``AdmissionResult.tables`` or a materialization) at ``plan.settings.top_k``, or a
            set of shards (``kiln_core.corpus_set.ShardedCorpus``: read one shard at a time; checkpoints then
            record the shard and row of the next candidate).
        dataset_sha256: ``sha256:<hex>`` of the exact JSONL bytes (a set: its set digest).
        dataset_path: The dataset path as given (recorded in the receipt).
        student_dir: Local student model directory.
        teacher_alias: The request's ``teacher`` (receipt ``teacher_id``).
        teacher_identity: The corpus manifest's ``TeacherIdentity`` (``ManifestRef.teacher_identity``), or None.
        should_cancel: Polled at each step boundary; True stops after publishing a checkpoint.
        on_progress: Called as ``(step, total_steps, loss)`` after each step's update.
        on_step_committed: Called with the step number once a step and its checkpoint (when one is
            due) are published; whatever it raises ends the run like any other error (a failed
            receipt, the error re-raised) — tests and fault drills use it to stop a run at a step.
        handle_signals: Turn SIGTERM/SIGINT into a cooperative cancel (main thread only).
        world: This process's rank and world size (default: the initialized ``torch.distributed``
            process group, else one process). Every rank calls ``train_opd`` with the same arguments.
        eval_watch: Held-out evaluation during training (``HeldOutSlice``; off by default): a
            baseline, then every ``every_steps`` steps and after the last; alarms in the log and the
            receipt's ``eval_curve``; with ``stop_on_divergence`` a firing rule stops the run (a
            checkpoint, a ``failed`` receipt with ``stop_reason``). Single process only.
        on_eval: Called with an ``EvalReport`` after each held-out evaluation.

    Returns:
        ``TrainResult``; status ``failed`` (nan_loss) and ``cancelled`` are returned, not raised.

    Raises:
        ConfigError, CheckpointError, ResumeError: rejected input, before any training work
            (``eval_watch_distributed``, ``eval_watch_empty``: a watch this run cannot keep).
        Exception: anything unexpected, after a ``failed`` receipt was written.

    Example:
        >>> result = train_opd(plan, admission.tables, dataset_sha256=admission.dataset_sha256,
        ...     dataset_path="corpus.jsonl", student_dir="student", teacher_alias="tiny")  # doctest: +SKIP
        >>> result.status  # doctest: +SKIP
        'success'
    """
    clock = Clock()
    world = world if world is not None else World.current()
    check_watch(eval_watch, world)
    # ---- 1. plan: every refusal (bad resume name, mismatching checkpoint, published adapter) happens here
    run_plan = plan_off_policy_run(plan, tables=tables, dataset_sha256=dataset_sha256, dataset_path=dataset_path,
                                   student_dir=student_dir, teacher_identity=teacher_identity,
                                   teacher_alias=teacher_alias, world=world)
    total = run_plan.schedule.total_steps
    # ---- 2.–4. setup, the loop over the corpus, the adapter and the receipt (``loop.run_training``)
    run = run_training(run_plan, CorpusCandidates(tables, run_plan), student_dir=student_dir, clock=clock,
                       gradient_checkpointing=plan.gradient_checkpointing, handle_signals=handle_signals,
                       should_cancel=should_cancel, on_step_committed=on_step_committed,
                       report=(lambda progress, loss: on_progress(progress.global_step, total, loss)) if on_progress else None,
                       eval_watch=eval_watch, on_eval=on_eval, max_hours=plan.max_training_hours)
    return TrainResult(**result_fields(run_plan, run.outcome, run.progress, clock, run.receipt_uri))


class CorpusCandidates:
    """The off-policy candidate source: the corpus tables in file order (a set of shards: shard order,
    then file order), each example repeated ``samples_per_prompt`` times, ``sequences_per_step`` × world
    size candidates per optimizer step (``plan.Schedule``). The cursor is ``global_step`` itself."""

    stop_before_first_step = True

    def __init__(self, tables: CorpusTables | ShardedCorpus, plan: RunPlan) -> None:
        self.tables, self.plan = tables, plan

    def open(self, student, outcome, clock) -> None:
        return None

    def groups(self, progress: LoopProgress, clock: Clock) -> Iterator[StepGroup]:
        while progress.global_step < self.plan.schedule.total_steps:
            yield corpus_examples(self.tables, self.plan, progress.global_step)

    def steps_left(self, progress: LoopProgress) -> bool:
        return progress.global_step < self.plan.schedule.total_steps

    def close(self, clock: Clock) -> None:
        return None
