"""What both training loops share around the loop itself: starting from a plan, publishing
checkpoints, deterministic kernels, stop signals, and the result they return.

``train_opd`` (an admitted corpus) and ``train_on_policy`` (prompts and their rollouts) differ only
inside the loop; everything before the first step and after the last is here, once:

* ``start_student`` — the seeded student and optimizer; on resume the checkpoint's LoRA weights,
  optimizer state, generator states and loop counters replace the fresh ones;
* ``outcome_recorded`` — how the loop ended: an expected stop, or an error after its failed receipt;
* ``CheckpointPublisher`` — publishes the state at the current step (never twice for one step);
* ``deterministic`` / ``stop_signals`` — deterministic CPU kernels, SIGTERM/SIGINT as a cooperative stop;
* ``TrainResult`` — what a run returns (receipts hold the full record).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Literal

import numpy as np
import torch
from pydantic import BaseModel
from safetensors.torch import save as save_safetensors

from kiln_core.contracts.checkpoint import KilnFlowsState, RankRngState
from kiln_core.contracts.eval_curve import EvalCurve
from kiln_core.training import checkpoint as ckpt
from kiln_core.training.base_adapter import BaseAdapterError, load_base_adapter
from kiln_core.training.finish import finish_run
from kiln_core.training.interrupt import stop_requests
from kiln_core.training.optim import build_optimizer, load_optimizer_state, optimizer_state_tensors
from kiln_core.training.plan import RunPlan
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.contracts.training_record import RunOutcome
from kiln_core.training.step import StopTraining
from kiln_core.training.student import Student, load_student
from kiln_core.training.time_bound import TrainingTooLong

__all__ = ["CANCEL_MESSAGE", "cancel_message", "TrainResult", "CheckpointPublisher", "new_progress", "start_student", "outcome_recorded",
           "write_checkpoint", "run_status", "result_fields", "deterministic", "stop_signals"]

CANCEL_MESSAGE = "training cancelled by user (stop requested at OPD step boundary)"


def cancel_message(checkpoint: str | None, how: str = CANCEL_MESSAGE) -> str:
    """A cancelled receipt's ``failure_message``: how the run stopped, then the checkpoint a retry resumes from.

    Example:
        >>> cancel_message("a-checkpoint-step-00000004.kiln-checkpoint")
        'training cancelled by user (stop requested at OPD step boundary); checkpoint a-checkpoint-step-00000004.kiln-checkpoint kept (a retry resumes from it)'
    """
    if checkpoint is None:
        return f"{how}; no checkpoint was committed yet (a retry starts over)"
    return f"{how}; checkpoint {checkpoint} kept (a retry resumes from it)"


class TrainResult(BaseModel):
    """What a training run returns (receipts hold the full record)."""

    status: Literal["success", "failed", "cancelled"]
    failure_reason: str | None = None
    failure_message: str | None = None
    adapter: str | None = None
    receipt: str
    latest_checkpoint: str | None = None
    resumed_from: str | None = None
    final_loss: float | None = None
    loss_history: list[float]
    steps: int
    total_steps: int
    effective_seed: int
    phase_timings_ms: dict[str, float]
    world_size: int = 1
    stop_reason: str | None = None
    """The held-out watch rule that stopped the run (``diverged``, ``stalled``, ``flat``), or None."""
    eval_curve: EvalCurve | None = None
    """The held-out curve of a watched run (points and alarms), or None."""


def new_progress(plan: RunPlan) -> LoopProgress:
    """Progress before the first step; on-policy runs count consumed candidates apart from steps."""
    return LoopProgress(consumed=0 if plan.contract.on_policy else None)


def start_student(plan: RunPlan, student_dir: str, progress: LoopProgress, *, gradient_checkpointing: bool,
                  clock: Clock) -> tuple[Student, torch.optim.Optimizer]:
    """Load the student with its seeded LoRA (its base weights sharded under ``strategy: fsdp``) and build
    the optimizer; on resume, restore every state
    (``progress`` takes the checkpoint's loop counters in place); on a fresh warm-started run, copy the
    base adapter's LoRA weights in (weights only: the optimizer state and RNG streams start fresh, as
    Kiln's warm start does). A resumed run never reloads the base adapter: the checkpoint holds the LoRA.

    Raises:
        ResumeError: the checkpoint's tensors do not fit this student.
        BaseAdapterError: ``base_adapter_mismatch`` — the base adapter's tensors do not fit this student.
    """
    settings = plan.settings
    config = settings.config
    with clock.phase("setup"):
        student = load_student(student_dir, rank=config.lora_rank, alpha=config.lora_alpha, seed=plan.seed,
                               device=plan.device.type, precision=plan.precision,
                               gradient_checkpointing=gradient_checkpointing, targets=settings.lora_targets)
        if plan.world.strategy == "fsdp" and plan.world.size > 1:
            # Shard the frozen base weights across the ranks; the LoRA parameters stay plain replicated
            # tensors, so everything below (resume, warm start, optimizer) is the same as under ddp.
            from kiln_core.training.distributed.fsdp import shard_student

            student.sharding = shard_student(student, plan.world).receipt_fields()
        if config.pack_sequences:
            student.check_packing()
        optimizer = build_optimizer(config.optimizer, student.lora_parameters, settings.learning_rate)
        _seed_everything(plan.seed)
        loaded = plan.loaded
        if loaded is not None:
            student.load_adapter_tensors(loaded.adapter_tensors)
            load_optimizer_state(optimizer, student.checkpoint_keys(), loaded.optimizer_tensors,
                                 loaded.loop_state.global_step)
            ckpt.restore_rng_state(loaded.extension.rank_rng[plan.world.rank])
            progress.restore(loaded.loop_state, plan.schedule.candidates_per_epoch)
        elif plan.base_adapter is not None:  # a warm start: the base adapter's weights, everything else fresh
            load_base_adapter(student, plan.base_adapter)
    return student, optimizer


@contextlib.contextmanager
def outcome_recorded(plan: RunPlan, outcome: RunOutcome, progress: LoopProgress, clock: Clock):
    """How the loop ended, into ``outcome``: a ``StopTraining`` (cancel, non-finite loss) is an expected
    end and is not raised further; ``TrainingTooLong`` (the time bound) propagates with no receipt; any other
    error writes the failed receipt, then propagates."""
    try:
        yield
    except StopTraining as stop:
        outcome.failure_reason, outcome.failure_message = stop.reason, stop.message
        outcome.stop_reason = stop.stop_reason
    except TrainingTooLong:
        raise  # refused, not failed: no receipt (the loop removes a fresh run's directory)
    except BaseException as error:
        outcome.failure_reason = _failure_reason(error)
        outcome.failure_message = f"{type(error).__name__}: {error}"
        if outcome.failure_reason == "cancelled":  # stopped at once: say by what, and what a retry resumes from
            how = f"training cancelled after step {progress.global_step} by {type(error).__name__}" + (
                f" ({error})" if str(error) else "")
            outcome.failure_message = cancel_message(ckpt.latest_checkpoint(plan.run_dir, plan.adapter_name), how)
        finish_run(plan, outcome, progress, clock)
        raise


def _failure_reason(error: BaseException) -> str:
    """The receipt's ``failure_reason`` of an unexpected end (Kiln's ``train_receipt.rs`` classifier)."""
    if isinstance(error, torch.OutOfMemoryError):
        return "oom"
    if isinstance(error, BaseAdapterError):
        return "base_adapter_missing" if error.code == "base_adapter_missing" else "shape_mismatch"
    if not isinstance(error, Exception):  # a second Ctrl-C, or a termination signal raised as an exception
        return "cancelled"                # (Prefect's, in a worker's run): someone stopped the run, it did not fail
    return "training_error"


class CheckpointPublisher:
    """Publishes the run's state after ``progress.global_step`` committed steps, once per step.

    ``eval_curve`` gives the held-out curve so far of a watched run (kept in the extension file).

    Example:
        >>> checkpoints = CheckpointPublisher(plan, student, optimizer, progress, clock)  # doctest: +SKIP
        >>> checkpoints.publish()  # doctest: +SKIP
        'demo-checkpoint-step-00000025.kiln-checkpoint'
    """

    def __init__(self, plan: RunPlan, student: Student, optimizer: torch.optim.Optimizer, progress: LoopProgress,
                 clock: Clock, eval_curve: Callable[[], EvalCurve | None] | None = None) -> None:
        self.plan, self.student, self.optimizer, self.progress, self.clock = plan, student, optimizer, progress, clock
        self.eval_curve = eval_curve
        self.published = plan.loaded.basename if plan.loaded else None

    def publish(self) -> str:
        """The basename of the checkpoint at the current step, written unless it already was."""
        if self.published != ckpt.checkpoint_basename(self.plan.adapter_name, self.progress.global_step):
            with self.clock.phase("checkpoint"):
                curve = self.eval_curve() if self.eval_curve is not None else None
                self.published = write_checkpoint(self.plan, self.student, self.optimizer, self.progress, eval_curve=curve)
        return self.published


def write_checkpoint(plan: RunPlan, student: Student, optimizer: torch.optim.Optimizer, progress: LoopProgress, *,
                     eval_curve: EvalCurve | None = None) -> str:
    """Publish the state after ``progress.global_step`` committed steps; returns the basename.

    Every rank calls this: their generator states are gathered, rank 0 writes the checkpoint and the
    others wait until it is committed.
    """
    world, contract = plan.world, plan.contract
    states = world.gather_bytes(ckpt.capture_rng_state().model_dump_json().encode("utf-8"))

    def write() -> str:
        from kiln_core import __version__

        extension = KilnFlowsState(
            kiln_flows_version=__version__, world_size=world.size, backend=world.backend, strategy=world.strategy,
            sequences_per_step=contract.sequences_per_step, optimizer_steps_total=contract.optimizer_steps_total,
            loss=contract.loss, rank_rng=[RankRngState.model_validate_json(state) for state in states],
            eval_curve=eval_curve, data_cursor=plan.data_cursor(progress.global_step), lr_schedule=contract.lr_schedule,
            pack_sequences=contract.pack_sequences, lora_targets=contract.lora_targets)
        keys = student.checkpoint_keys()
        optimizer_bytes = save_safetensors(optimizer_state_tensors(optimizer, keys)) if contract.stateful_optimizer else None
        loop_state = progress.loop_state(plan.schedule, contract.examples_read, contract.examples_filtered)
        return ckpt.write_checkpoint(plan.run_dir, contract, loop_state,
                                     adapter_bytes=save_safetensors(student.adapter_tensors()),
                                     optimizer_bytes=optimizer_bytes, extension=extension)

    world.publish_on_main(write)
    return ckpt.checkpoint_basename(plan.adapter_name, progress.global_step)


def run_status(outcome: RunOutcome) -> Literal["success", "failed", "cancelled"]:
    """``TrainResult.status``: a cancelled run is ``failed`` + ``cancelled`` in the receipt, as in Kiln."""
    if outcome.status == "success":
        return "success"
    return "cancelled" if outcome.failure_reason == "cancelled" else "failed"


def result_fields(plan: RunPlan, outcome: RunOutcome, progress: LoopProgress, clock: Clock,
                  receipt_uri: str) -> dict[str, Any]:
    """``TrainResult``'s fields once the receipt is written."""
    return dict(
        status=run_status(outcome), failure_reason=outcome.failure_reason, failure_message=outcome.failure_message,
        adapter=outcome.adapter_uri, receipt=receipt_uri,
        latest_checkpoint=ckpt.latest_checkpoint(plan.run_dir, plan.adapter_name), resumed_from=outcome.resumed_from,
        final_loss=progress.loss_history[-1] if progress.loss_history else None, loss_history=list(progress.loss_history),
        steps=progress.global_step, total_steps=plan.schedule.total_steps, effective_seed=plan.seed,
        phase_timings_ms=dict(clock.totals_ms), world_size=plan.world.size, stop_reason=outcome.stop_reason,
        eval_curve=outcome.eval_curve)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # also initializes CUDA, so its generator states are captured


@contextlib.contextmanager
def deterministic(device: torch.device):
    """Deterministic kernels on CPU for the duration of the run (restored afterwards)."""
    previous = torch.are_deterministic_algorithms_enabled()
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@contextlib.contextmanager
def stop_signals(enabled: bool):
    """SIGTERM/SIGINT → a flag the loop polls at step boundaries (only from the main thread); a second
    Ctrl-C stops at once. The same handler as the engine's (``kiln_core.training.interrupt``)."""
    with stop_requests(enabled) as stop:
        yield stop
