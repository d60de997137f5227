"""The OPD training loop: one candidate sequence per optimizer step, top-K reverse KL, exact resume.

Read ``train_opd`` top to bottom; it runs in the order the work happens:

1. plan (``plan.plan_run``): the schedule, the seed, the identities a checkpoint binds, and every
   refusal — a bad resume basename, a checkpoint that does not match, an adapter already published —
   before any model loads;
2. setup (``lifecycle.start_student``): the student with a seeded LoRA, the optimizer, the RNG
   streams; on resume, the checkpoint's LoRA weights, optimizer state, generator states and loop
   counters replace the fresh ones; on a fresh warm-started run (``config.base_adapter``), the base
   adapter's LoRA weights do;
3. the loop (``step``): forward → loss → finite check → backward → optimizer step → finite check →
   held-out evaluation when due (``watch``, only with ``eval_watch``) → checkpoint when due →
   ``on_step_committed`` → a watch stop, or the cancellation check at the step boundary;
4. finish (``finish``): the PEFT adapter directory, then ``train_receipt.json`` (also written on failure).

Exactness (DESIGN.md decision 8): a step depends only on the LoRA weights, the optimizer state and the
candidate, all of which a checkpoint restores bit for bit, so an interrupted-and-resumed CPU run ends
with the same ``adapter_model.safetensors`` bytes as an uninterrupted one.

Several processes (``distributed.world``): with world size W each step takes ``W × sequences_per_step``
candidates, rank r trains its own block and the LoRA gradients are summed across ranks, so a W-process
run is the single-process run with ``sequences_per_step × W``. Rank 0 alone publishes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.corpus import CorpusTables
from kiln_core.training.base_adapter import BaseAdapter
from kiln_core.training.distributed.world import World
from kiln_core.training.finish import finish_run, publish_final_adapter
from kiln_core.training.lifecycle import (
    CANCEL_MESSAGE,
    CheckpointPublisher,
    TrainResult,
    deterministic,
    new_progress,
    outcome_recorded,
    result_fields,
    start_student,
    stop_signals,
)
from kiln_core.training.plan import Schedule, plan_run
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.training.receipt import RunOutcome
from kiln_core.training.step import StopTraining, train_step, train_step_distributed
from kiln_core.training.watch import EvalReport, HeldOutSlice, HeldOutWatch, check_watch

__all__ = ["TrainResult", "Schedule", "LoopProgress", "Clock", "train_opd", "CANCEL_MESSAGE"]


def train_opd(
    *,
    tables: CorpusTables,
    dataset_sha256: str,
    dataset_path: str,
    student_dir: str,
    adapter_name: str,
    config: OpdConfig,
    run_root: str,
    teacher_identity: Any | None,
    teacher_alias: str,
    resume_checkpoint: str | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
    on_step_committed: Callable[[int], None] | None = None,
    device: str | None = None,
    precision: str | None = None,
    gradient_checkpointing: bool = False,
    handle_signals: bool = False,
    world: World | None = None,
    eval_watch: HeldOutSlice | None = None,
    on_eval: Callable[[EvalReport], None] | None = None,
    base_adapter: BaseAdapter | None = None,
) -> TrainResult:
    """Train a LoRA student on an admitted corpus and publish the adapter and receipt under ``run_root``.

    Args:
        tables: The admitted corpus (``AdmissionResult.tables`` or a materialization).
        dataset_sha256: ``sha256:<hex>`` of the exact JSONL bytes.
        dataset_path: The dataset path as given (recorded in the receipt).
        student_dir: Local student model directory.
        adapter_name: Adapter name; checkpoints are ``<adapter>-checkpoint-step-<8d>.kiln-checkpoint``.
        config: The validated ``OpdConfig`` (``kiln_core.contracts.opd_submit.validate_for_offline_training`` already applied).
        run_root: URI of the run directory ``<root>/runs/<adapter>`` (local path or fsspec URI).
        teacher_identity: The corpus manifest's ``TeacherIdentity``, or None.
        teacher_alias: The request's ``teacher`` (receipt ``teacher_id``).
        resume_checkpoint: Basename of a checkpoint in ``run_root`` to resume from exactly.
        should_cancel: Polled at each step boundary; True stops after publishing a checkpoint.
        on_progress: Called as ``(step, total_steps, loss)`` after each step's update.
        on_step_committed: Called with the step number once a step and its checkpoint (when one is
            due) are published; whatever it raises ends the run like any other error (a failed
            receipt, the error re-raised) — tests and fault drills use it to stop a run at a step.
        device: ``cpu``/``cuda`` (default: CUDA when available).
        precision: ``fp32``/``bf16`` (default: bf16 on CUDA, fp32 on CPU).
        gradient_checkpointing: Recompute activations in backward to save memory.
        handle_signals: Turn SIGTERM/SIGINT into a cooperative cancel (main thread only).
        world: This process's rank and world size (default: the initialized ``torch.distributed``
            process group, else one process). Every rank calls ``train_opd`` with the same arguments.
        eval_watch: Held-out evaluation during training (``HeldOutSlice.admit``; off by default): a
            baseline, then every ``every_steps`` steps and after the last; alarms in the log and the
            receipt's ``eval_curve``; with ``stop_on_divergence`` a firing rule stops the run (a
            checkpoint, a ``failed`` receipt with ``stop_reason``). Single process only.
        on_eval: Called with an ``EvalReport`` after each held-out evaluation.
        base_adapter: ``config.base_adapter`` resolved (``kiln_core.engine.base_adapter.resolve_base_adapter``);
            a fresh run starts from its LoRA weights with a fresh optimizer. Without it, a
            ``config.base_adapter`` that is an adapter directory is read from there.

    Returns:
        ``TrainResult``; status ``failed`` (nan_loss) and ``cancelled`` are returned, not raised.

    Raises:
        ConfigError, CheckpointError, ResumeError: rejected input, before any training work
            (``eval_watch_distributed``, ``eval_watch_empty``: a watch this run cannot keep).
        Exception: anything unexpected, after a ``failed`` receipt was written.

    Example:
        >>> result = train_opd(tables=admission.tables, dataset_sha256=admission.dataset_sha256,
        ...     dataset_path="corpus.jsonl", student_dir="student", adapter_name="demo",
        ...     config=config, run_root="kiln-data/runs/demo", teacher_identity=None,
        ...     teacher_alias="tiny")  # doctest: +SKIP
        >>> result.status  # doctest: +SKIP
        'success'
    """
    clock = Clock()
    world = world if world is not None else World.current()
    check_watch(eval_watch, world)
    # ---- 1. plan: every refusal (bad resume name, mismatching checkpoint, published adapter) happens here
    plan = plan_run(tables=tables, dataset_sha256=dataset_sha256, dataset_path=dataset_path, student_dir=student_dir,
                    adapter_name=adapter_name, config=config, run_root=run_root, teacher_identity=teacher_identity,
                    teacher_alias=teacher_alias, resume_checkpoint=resume_checkpoint, device=device,
                    precision=precision, gradient_checkpointing=gradient_checkpointing, world=world,
                    base_adapter=base_adapter)
    schedule, loaded = plan.schedule, plan.loaded
    outcome = RunOutcome(resumed_from=loaded.basename if loaded else None)
    progress = new_progress(plan)

    with (deterministic(plan.device), stop_signals(handle_signals) as signalled,
          outcome_recorded(plan, outcome, progress, clock)):
        # ---- 2. setup: fresh seeded student and optimizer; a resume then overwrites every state
        student, optimizer = start_student(plan, student_dir, progress, gradient_checkpointing=gradient_checkpointing,
                                           clock=clock)
        watch = None
        if eval_watch is not None:  # a baseline evaluation now, or the curve of the checkpoint resumed
            watch = HeldOutWatch.start(eval_watch, loaded, outcome, student, progress, clock, on_eval)
        checkpoints = CheckpointPublisher(plan, student, optimizer, progress, clock,
                                          eval_curve=(lambda: watch.curve) if watch is not None else None)

        # ---- 3. the loop: one optimizer step per group of `sequences_per_step` (× world size) candidates
        step_fn = train_step if world.size == 1 else train_step_distributed
        loop_started = time.perf_counter()
        while progress.global_step < schedule.total_steps:
            stop = signalled.is_set() or (should_cancel is not None and should_cancel())
            if world.size > 1:  # every rank stops at the same step boundary when any rank was asked to
                stop = world.any_rank(stop)
            if stop:
                if progress.global_step > 0:  # nothing to save before the first step
                    checkpoints.publish()
                raise StopTraining("cancelled", CANCEL_MESSAGE)
            loss = step_fn(student, optimizer, tables, plan, progress, clock)
            if on_progress is not None:
                on_progress(progress.global_step, schedule.total_steps, loss)
            steps_left = progress.global_step < schedule.total_steps
            halt = watch.after_step(student, progress, clock, steps_left=steps_left) if watch is not None else None
            interval = config.checkpoint_interval
            if interval and progress.global_step % interval == 0 and steps_left:
                checkpoints.publish()
            if on_step_committed is not None:
                on_step_committed(progress.global_step)
            if halt is not None:  # the held-out watch stops the run: its state is saved first
                checkpoints.publish()
                raise halt
        if watch is not None:
            watch.finish(student, progress, clock)
        clock.totals_ms["train_loop"] = (time.perf_counter() - loop_started) * 1e3

        # ---- 4. publish the PEFT adapter (rank 0 only; the receipt follows in finish_run)
        publish_final_adapter(plan, outcome, student, clock, progress)
    receipt_uri = finish_run(plan, outcome, progress, clock)
    world.barrier()  # the other ranks return once rank 0's receipt is written
    return TrainResult(**result_fields(plan, outcome, progress, clock, receipt_uri))
