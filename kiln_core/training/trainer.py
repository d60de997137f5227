"""The OPD training loop: one candidate sequence per optimizer step, top-K reverse KL, exact resume.

Read ``train_opd`` top to bottom; it runs in the order the work happens:

1. plan: the schedule (file order, ``epochs × examples × samples_per_prompt`` candidates, grouped by
   ``sequences_per_step``), the effective seed and config, and every pre-flight refusal — a bad resume
   basename, a checkpoint that does not match, an adapter already published — before any model loads;
2. setup: the student with a seeded LoRA, the optimizer, the RNG streams; on resume, the checkpoint's
   LoRA weights, optimizer state, RNG streams and loop counters replace the fresh ones;
3. the loop: forward → loss → finite check → backward → optimizer step → finite check → checkpoint
   when due → cancellation check at the step boundary;
4. publish: the PEFT adapter directory, then ``train_receipt.json`` (also written on failure).

Exactness (DESIGN.md decision 8): a step depends only on the LoRA weights, the optimizer state and the
candidate, all of which a checkpoint restores bit for bit, so an interrupted-and-resumed CPU run ends
with the same ``adapter_model.safetensors`` bytes as an uninterrupted one.

Several processes (``torch.distributed``, see ``kiln_core.training.distributed``): with world size W each
step takes ``W × sequences_per_step`` candidates, rank r trains its own contiguous block of them and the
LoRA gradients are summed across ranks (``_train_step_distributed``), so a W-process run is the
single-process run with ``sequences_per_step × W``. Rank 0 alone publishes checkpoints, the adapter and
the receipt. With one process (the default) none of that code runs.
"""

from __future__ import annotations

import contextlib
import math
import random
import resource
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np
import torch
from pydantic import BaseModel
from safetensors.torch import save as save_safetensors

from kiln_core.canonical import sha256_prefixed, strip_sha256_prefix
from kiln_core.contracts.opd_config import (
    ConfigError,
    OpdConfig,
    effective_config,
    effective_samples_per_prompt,
    resolve_learning_rate,
    resolve_top_k,
)
from kiln_core.corpus import CorpusTables
from kiln_core.storage import StagedDirectory, move_aside, remove_tree, resolve
from kiln_core.training import checkpoint as ckpt
from kiln_core.training.distributed import World
from kiln_core.training.loss import compose_step_loss, echo_env_cross_entropy, step_loss
from kiln_core.training.optim import build_optimizer, load_optimizer_state, optimizer_hyperparameters, optimizer_state_tensors
from kiln_core.training.receipt import (
    RECEIPT_FILE,
    TOKEN_COUNT_KEYS,
    RunFacts,
    RunOutcome,
    build_receipt,
    library_versions,
    write_receipt,
)
from kiln_core.training.student import LORA_TARGET_MODULES, Student, load_student, precision_policy, resolve_device, resolve_precision, student_identity

__all__ = ["TrainResult", "SimulatedCrash", "Schedule", "train_opd"]

ADAPTER_DIR = "adapter"
CANCEL_MESSAGE = "training cancelled by user (stop requested at OPD step boundary)"


class SimulatedCrash(RuntimeError):
    """Raised by the ``fail_at_step`` test hook after a step commits."""


class _Stop(Exception):
    """An expected end of training that is not success (nan_loss, cancelled)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


class TrainResult(BaseModel):
    """What ``train_opd`` returns (receipts hold the full record)."""

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


@dataclass(frozen=True)
class Schedule:
    """File-order candidate schedule. Candidate c (0-based over the whole run) is example
    ``(c % candidates_per_epoch) // samples_per_prompt``: each example repeated consecutively. Step s
    takes the next ``sequences_per_step`` candidates of that flat order (a group may span an epoch
    boundary; the last group may be shorter)."""

    examples: int
    samples_per_prompt: int
    epochs: int
    sequences_per_step: int

    @property
    def candidates_per_epoch(self) -> int:
        return self.examples * self.samples_per_prompt

    @property
    def total_candidates(self) -> int:
        return self.epochs * self.candidates_per_epoch

    @property
    def total_steps(self) -> int:
        return -(-self.total_candidates // self.sequences_per_step)

    def candidates_of_step(self, step: int) -> range:
        return range(step * self.sequences_per_step, min((step + 1) * self.sequences_per_step, self.total_candidates))

    def example_of(self, candidate: int) -> int:
        return (candidate % self.candidates_per_epoch) // self.samples_per_prompt

    def cursor_after(self, step: int) -> tuple[int, int]:
        """(epoch_index, cursor_in_epoch) of the next candidate once ``step`` steps are committed."""
        return divmod(min(step * self.sequences_per_step, self.total_candidates), self.candidates_per_epoch)


@dataclass
class _Progress:
    """The loop's typed state; ``loop_state()`` is exactly what a checkpoint stores."""

    global_step: int = 0
    loss_history: list[float] = field(default_factory=list)
    token_counts: dict[str, int] = field(default_factory=lambda: RunOutcome().token_counts)
    grad_norms: list[float] = field(default_factory=list)
    echo_fired: bool = False
    env_ce: dict[str, Any] = field(default_factory=lambda: {"observed_candidates": 0, "sum": 0.0, "last": None})

    def loop_state(self, schedule: Schedule, data_stats: dict[str, int]) -> ckpt.OpdLoopState:
        epoch, cursor = schedule.cursor_after(self.global_step)
        return ckpt.OpdLoopState(
            global_step=self.global_step, epoch_index=epoch, cursor_in_epoch=cursor,
            loss_history=list(self.loss_history), last_loss=self.loss_history[-1] if self.loss_history else None,
            data_stats=data_stats, token_counts=dict(self.token_counts), run_env_ce=dict(self.env_ce),
            lora_grad_norms=list(self.grad_norms), guardrail={"non_finite_loss": "abort", "non_finite_parameters": "abort"},
        )

    def record_candidate(self, counts: dict[str, int], env_ce: float | None) -> None:
        self.token_counts = {key: self.token_counts[key] + counts[key] for key in counts}
        if env_ce is not None:  # the ECHO term fired for this candidate
            self.echo_fired = True
            self.env_ce = {"observed_candidates": self.env_ce["observed_candidates"] + 1,
                           "sum": self.env_ce["sum"] + env_ce, "last": env_ce}

    def commit_step(self, loss: float, grad_norm: float) -> None:
        self.global_step += 1
        self.loss_history.append(loss)
        self.grad_norms.append(grad_norm)

    @classmethod
    def from_loop_state(cls, state: ckpt.OpdLoopState) -> "_Progress":
        return cls(global_step=state.global_step, loss_history=list(state.loss_history),
                   token_counts=dict(state.token_counts), grad_norms=list(state.lora_grad_norms),
                   echo_fired=state.run_env_ce["observed_candidates"] > 0, env_ce=dict(state.run_env_ce))


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
    fail_at_step: int | None = None,
    device: str | None = None,
    precision: str | None = None,
    gradient_checkpointing: bool = False,
    handle_signals: bool = False,
    world: World | None = None,
) -> TrainResult:
    """Train a LoRA student on an admitted corpus and publish the adapter and receipt under ``run_root``.

    Args:
        tables: The admitted corpus (``AdmissionResult.tables`` or a materialization).
        dataset_sha256: ``sha256:<hex>`` of the exact JSONL bytes.
        dataset_path: The dataset path as given (recorded in the receipt).
        student_dir: Local student model directory.
        adapter_name: Adapter name; checkpoints are ``<adapter>-checkpoint-step-<8d>.kiln-checkpoint``.
        config: The validated ``OpdConfig`` (``validate_for_offline_training`` already applied).
        run_root: URI of the run directory ``<root>/runs/<adapter>`` (local path or fsspec URI).
        teacher_identity: The corpus manifest's ``TeacherIdentity``, or None.
        teacher_alias: The request's ``teacher`` (receipt ``teacher_id``).
        resume_checkpoint: Basename of a checkpoint in ``run_root`` to resume from exactly.
        should_cancel: Polled at each step boundary; True stops after publishing a checkpoint.
        on_progress: Called as ``(step, total_steps, loss)`` after each committed step.
        fail_at_step: Test hook: raise ``SimulatedCrash`` right after step N commits.
        device: ``cpu``/``cuda`` (default: CUDA when available).
        precision: ``fp32``/``bf16`` (default: bf16 on CUDA, fp32 on CPU).
        gradient_checkpointing: Recompute activations in backward to save memory.
        handle_signals: Turn SIGTERM/SIGINT into a cooperative cancel (main thread only).
        world: This process's rank and world size (default: the initialized ``torch.distributed``
            process group, else one process). Every rank calls ``train_opd`` with the same arguments.

    Returns:
        ``TrainResult``; status ``failed`` (nan_loss) and ``cancelled`` are returned, not raised.

    Raises:
        ConfigError, CheckpointError, ResumeError: rejected input, before any training work.
        Exception: anything unexpected, after a ``failed`` receipt was written.

    Example:
        >>> result = train_opd(tables=admission.tables, dataset_sha256=admission.dataset_sha256,
        ...     dataset_path="corpus.jsonl", student_dir="student", adapter_name="demo",
        ...     config=config, run_root="kiln-data/runs/demo", teacher_identity=None,
        ...     teacher_alias="tiny")  # doctest: +SKIP
        >>> result.status  # doctest: +SKIP
        'success'
    """
    clock = _Clock()
    world = world if world is not None else World.current()
    # ---- 1. plan: every refusal (bad resume name, mismatching checkpoint, published adapter) happens here
    plan = _plan_run(tables=tables, dataset_sha256=dataset_sha256, dataset_path=dataset_path, student_dir=student_dir,
                     adapter_name=adapter_name, config=config, run_root=run_root, teacher_identity=teacher_identity,
                     teacher_alias=teacher_alias, resume_checkpoint=resume_checkpoint, device=device, precision=precision,
                     world=world)
    schedule, loaded, run_dir = plan.schedule, plan.loaded, plan.run_dir
    outcome = RunOutcome(resumed_from=loaded.basename if loaded else None)
    progress = _Progress()

    with _deterministic(plan.device), _stop_signals(handle_signals) as signalled:
        try:
            # ---- 2. setup: fresh seeded student and optimizer; a resume then overwrites every state
            with clock.phase("setup"):
                student = load_student(student_dir, rank=config.lora_rank, alpha=config.lora_alpha, seed=plan.seed,
                                       device=plan.device.type, precision=plan.precision,
                                       gradient_checkpointing=gradient_checkpointing)
                optimizer = build_optimizer(config.optimizer, student.lora_parameters, plan.learning_rate)
                _seed_everything(plan.seed)
                if loaded is not None:
                    student.load_adapter_tensors(loaded.adapter_tensors)
                    load_optimizer_state(optimizer, student.lora_parameters, loaded.optimizer_tensors)
                    ckpt.restore_rng_states(loaded.manifest.rng_states_of_rank(world.rank))
                    progress = _Progress.from_loop_state(loaded.loop_state)
            published = loaded.basename if loaded else None

            def checkpoint_now() -> str:
                nonlocal published
                if published != ckpt.checkpoint_basename(adapter_name, progress.global_step):  # never twice
                    with clock.phase("checkpoint"):
                        published = _write_checkpoint(plan, student, optimizer, progress)
                return published

            # ---- 3. the loop: one optimizer step per group of `sequences_per_step` (× world size) candidates
            step_fn = _train_step if world.size == 1 else _train_step_distributed
            loop_started = time.perf_counter()
            while progress.global_step < schedule.total_steps:
                stop = signalled.is_set() or (should_cancel is not None and should_cancel())
                if world.size > 1:  # every rank stops at the same step boundary when any rank was asked to
                    stop = world.any_rank(stop)
                if stop:
                    if progress.global_step > 0:  # nothing to save before the first step
                        checkpoint_now()
                    raise _Stop("cancelled", CANCEL_MESSAGE)
                loss = step_fn(student, optimizer, tables, plan, progress, clock)
                if on_progress is not None:
                    on_progress(progress.global_step, schedule.total_steps, loss)
                interval = config.checkpoint_interval
                if interval and progress.global_step % interval == 0 and progress.global_step < schedule.total_steps:
                    checkpoint_now()
                if fail_at_step is not None and progress.global_step == fail_at_step:
                    raise SimulatedCrash(f"simulated crash after step {fail_at_step}")
            clock.totals_ms["train_loop"] = (time.perf_counter() - loop_started) * 1e3

            # ---- 4. publish the PEFT adapter (rank 0 only; the receipt follows in _finish)
            with clock.phase("publish"):
                files = world.publish_on_main(lambda: _publish_adapter(student, run_dir))
            outcome.status = "success"
            outcome.adapter_uri = run_dir.child(ADAPTER_DIR).uri
            if files is not None:  # rank 0, the only rank of a single-process run
                outcome.adapter_sha256 = sha256_prefixed(files["adapter_model.safetensors"])
                outcome.adapter_bytes = len(files["adapter_model.safetensors"])
            outcome.lora_delta_norms = _lora_delta_norms(student)
        except _Stop as stop:
            outcome.failure_reason, outcome.failure_message = stop.reason, stop.message
        except BaseException as error:  # write the failed receipt, then let the caller see the error
            outcome.failure_reason = "oom" if isinstance(error, torch.OutOfMemoryError) else "training_error"
            outcome.failure_message = f"{type(error).__name__}: {error}"
            _finish(plan, outcome, progress, clock)
            raise
    receipt_uri = _finish(plan, outcome, progress, clock)
    world.barrier()  # the other ranks return once rank 0's receipt is written
    status = "success" if outcome.status == "success" else "cancelled" if outcome.failure_reason == "cancelled" else "failed"
    return TrainResult(
        status=status, failure_reason=outcome.failure_reason, failure_message=outcome.failure_message,
        adapter=outcome.adapter_uri, receipt=receipt_uri, latest_checkpoint=ckpt.latest_checkpoint(run_dir, adapter_name),
        resumed_from=outcome.resumed_from, final_loss=progress.loss_history[-1] if progress.loss_history else None,
        loss_history=list(progress.loss_history), steps=progress.global_step, total_steps=schedule.total_steps,
        effective_seed=plan.seed, phase_timings_ms=dict(clock.totals_ms), world_size=world.size)


def _publish_adapter(student: Student, run_dir) -> dict[str, bytes]:
    """Write the PEFT adapter directory (``adapter_config.json`` last = committed); returns its files."""
    files = student.peft_adapter_files()
    with StagedDirectory(run_dir.child(ADAPTER_DIR), commit_name="adapter_config.json") as staged:
        staged.write("adapter_model.safetensors", files["adapter_model.safetensors"])
        staged.commit(files["adapter_config.json"])
    return files


def _train_step(student: Student, optimizer: torch.optim.Optimizer, tables: CorpusTables, plan: "_Plan",
                progress: _Progress, clock: _Clock) -> float:
    """One optimizer step over the next group of candidates; returns the step loss (mean over them)."""
    config = plan.config
    candidates = plan.schedule.candidates_of_step(progress.global_step)
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for candidate in candidates:
        with clock.phase("data"):
            batch = tables.example(plan.schedule.example_of(candidate)).to_torch(student.device)
        with clock.phase("forward_backward"):
            loss, env_ce, counts = _sequence_loss(student, batch, plan.loss_fn, config)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise _Stop("nan_loss", f"OPD loss became non-finite at candidate {candidate}")
            with torch.autograd.detect_anomaly() if config.detect_anomaly else contextlib.nullcontext():
                (loss / len(candidates)).backward()  # gradient of the mean of per-sequence losses
            _sync(student.device)
        losses.append(value)
        progress.record_candidate(counts, env_ce)
    return _apply_update(student, optimizer, progress, losses, clock)


def _apply_update(student: Student, optimizer: torch.optim.Optimizer, progress: _Progress, losses: list[float],
                  clock: _Clock) -> float:
    """Optimizer step on the accumulated gradients, finite check, commit; returns the step loss."""
    with clock.phase("optimizer"):
        params = list(student.lora_parameters.values())
        grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        optimizer.step()
        if not math.isfinite(float(torch.nn.utils.get_total_norm(params))):
            raise _Stop("nan_loss", f"OPD LoRA parameters became non-finite after step {progress.global_step + 1}")
    progress.commit_step(sum(losses) / len(losses), grad_norm)
    return progress.loss_history[-1]


# One row per candidate a rank trains in a step: present, loss, ECHO fired, ECHO env CE, token counts.
_STAT_COLUMNS = 4 + len(TOKEN_COUNT_KEYS)


def _train_step_distributed(student: Student, optimizer: torch.optim.Optimizer, tables: CorpusTables, plan: "_Plan",
                            progress: _Progress, clock: _Clock) -> float:
    """One optimizer step of a multi-process run: ``_train_step``'s math over the whole group.

    Rank r trains its contiguous block of ``sequences_per_step`` candidates of the group and
    back-propagates ``loss / len(group)`` for each; the LoRA gradients are then summed across ranks,
    so every rank holds the gradient of the group's mean loss and applies the same optimizer step to
    its replica. Per-candidate losses, token counts and ECHO values are gathered first, so every rank
    checks and records them in candidate order, exactly as one process would (a non-finite loss
    stops every rank at the same candidate, before any update).
    """
    world, config = plan.world, plan.config
    group = plan.schedule.candidates_of_step(progress.global_step)
    per_rank = config.sequences_per_step
    optimizer.zero_grad(set_to_none=True)
    rows = torch.zeros(per_rank, _STAT_COLUMNS, dtype=torch.float64)
    for slot, candidate in enumerate(world.shard(group, per_rank)):
        with clock.phase("data"):
            batch = tables.example(plan.schedule.example_of(candidate)).to_torch(student.device)
        with clock.phase("forward_backward"):
            loss, env_ce, counts = _sequence_loss(student, batch, plan.loss_fn, config)
            value = float(loss.detach())
            if math.isfinite(value):  # a non-finite loss is reported below, on every rank alike
                with torch.autograd.detect_anomaly() if config.detect_anomaly else contextlib.nullcontext():
                    (loss / len(group)).backward()  # gradient of the mean of the group's per-sequence losses
            _sync(student.device)
        rows[slot] = torch.tensor([1.0, value, 0.0 if env_ce is None else 1.0, env_ce or 0.0,
                                   *(counts[key] for key in TOKEN_COUNT_KEYS)], dtype=torch.float64)
    with clock.phase("all_reduce"):
        gathered = world.all_gather_rows(rows)  # [W, sequences_per_step, columns], rank-major = candidate order
    losses = []
    for offset, candidate in enumerate(group):
        row = gathered[offset // per_rank, offset % per_rank].tolist()
        value = row[1]
        if not math.isfinite(value):
            raise _Stop("nan_loss", f"OPD loss became non-finite at candidate {candidate}")
        losses.append(value)
        progress.record_candidate({key: int(count) for key, count in zip(TOKEN_COUNT_KEYS, row[4:])},
                                  row[3] if row[2] else None)
    with clock.phase("all_reduce"):
        world.all_reduce_gradients_(list(student.lora_parameters.values()))
    return _apply_update(student, optimizer, progress, losses, clock)


# ---------------------------------------------------------------------------------------------
# Plan: everything decided before the model loads


@dataclass(frozen=True)
class _Plan:
    """The resolved run: schedule, seed, identities, and the checkpoint being resumed (if any)."""

    run_dir: Any
    adapter_name: str
    config: OpdConfig
    schedule: Schedule
    seed: int
    top_k: int
    learning_rate: float
    effective_config: dict[str, Any]
    device: torch.device
    precision: str
    precision_policy: dict[str, Any]
    auxiliary_state: dict[str, Any]
    data: ckpt.DataBinding
    data_stats: dict[str, int]
    loaded: ckpt.LoadedCheckpoint | None
    facts: RunFacts
    world: World = field(default_factory=World)

    @property
    def loss_fn(self) -> Callable:
        return step_loss(self.config.loss)


def _plan_run(*, tables, dataset_sha256, dataset_path, student_dir, adapter_name, config, run_root, teacher_identity,
              teacher_alias, resume_checkpoint, device, precision, world: World) -> _Plan:
    """Resolve the run and apply every refusal before any model loads (cheapest checks first)."""
    run_dir = resolve(run_root)
    basename = ckpt.check_resume_basename(resume_checkpoint, run_dir, adapter_name) if resume_checkpoint else None
    top_k = resolve_top_k(config.top_k)
    if tables.num_examples == 0 or tables.top_k != top_k:
        raise ConfigError(f"corpus has {tables.num_examples} examples at top_k {tables.top_k}; the config resolves "
                          f"top_k to {top_k}", "config.top_k")
    schedule = Schedule(tables.num_examples, effective_samples_per_prompt(config), config.epochs,
                        config.sequences_per_step * world.size)  # candidates per optimizer step, all ranks together
    dev = resolve_device(device)
    prec = resolve_precision(dev, precision)
    policy = precision_policy(dev, prec)
    lr = resolve_learning_rate(config)
    versions = library_versions()
    identity = student_identity(student_dir)
    teacher = teacher_identity.as_ordered_dict() if teacher_identity is not None else None
    teacher_rev = teacher_identity.identity_revision() if teacher_identity is not None else None
    aux = {  # a resume must match all of it (model, tokenizer, teacher, runtime)
        "loop_state_type": ckpt.LOOP_STATE_TYPE, **identity,
        "backend_runtime": {k: versions[k] for k in ("torch", "transformers", "peft")},
        "kiln_train_version": f"kiln-flows/{versions['kiln-flows']}",
        "lora_target_modules": list(LORA_TARGET_MODULES),
        "teacher_identity": teacher, "teacher_identity_revision": teacher_rev,
        "training_precision_policy": prec,
        "use_chat_template_rollout_prefixes": config.rollout_prompt_rendering == "chat_template",
    }
    data = ckpt.DataBinding(source_kind=ckpt.DATA_SOURCE_KIND, content_sha256=strip_sha256_prefix(dataset_sha256),
                            item_count=schedule.candidates_per_epoch)
    data_stats = _data_stats(tables)
    loaded = None
    if basename is not None:
        loaded = ckpt.load_checkpoint(run_dir, basename)
        seed = ckpt.validate_resume(loaded, ckpt.ResumeExpectation(
            adapter_name=adapter_name, data=data, requested_seed=config.seed,
            effective_config_for_seed=lambda s: effective_config(config, s, top_k), precision_policy=policy,
            total_steps=schedule.total_steps, data_order=list(range(schedule.candidates_per_epoch)),
            optimizer_kind=config.optimizer.kind, optimizer_hyperparameters=optimizer_hyperparameters(config.optimizer, lr),
            learning_rate=lr, cuda_streams=_cuda_streams(), auxiliary_state=aux, data_stats=data_stats,
            expected_cursor=schedule.cursor_after, world_size=world.size))
    else:  # Kiln draws the seed once when the request leaves it null; it is recorded everywhere (rank 0's)
        seed = config.seed if config.seed is not None else world.broadcast_int(secrets.randbits(63))
    _preflight_outputs(run_dir, adapter_name, config.checkpoint_interval,
                       loaded.manifest.progress.global_step if loaded else 0, schedule.total_steps,
                       may_change=world.is_main)
    eff = effective_config(config, seed, top_k)
    facts = RunFacts(
        adapter_name=adapter_name, student_dir=str(student_dir), student_identity=identity, dataset_path=dataset_path,
        dataset_sha256=dataset_sha256, effective_config=eff, seed=seed, learning_rate=lr, top_k=top_k,
        samples_per_prompt=schedule.samples_per_prompt, teacher_alias=teacher_alias, teacher_identity=teacher,
        teacher_identity_revision=teacher_rev, examples_read=tables.num_examples,
        candidates_per_epoch=schedule.candidates_per_epoch, total_steps=schedule.total_steps, device=dev.type,
        precision_policy=policy, library_versions=versions)
    return _Plan(run_dir=run_dir, adapter_name=adapter_name, config=config, schedule=schedule, seed=seed, top_k=top_k,
                 learning_rate=lr, effective_config=eff, device=dev, precision=prec, precision_policy=policy,
                 auxiliary_state=aux, data=data, data_stats=data_stats, loaded=loaded, facts=facts, world=world)


def _write_checkpoint(plan: _Plan, student: Student, optimizer: torch.optim.Optimizer, progress: _Progress) -> str:
    """Publish the state after ``progress.global_step`` committed steps; returns the basename.

    In a multi-process run every rank calls this: their RNG streams are gathered, rank 0 writes the
    checkpoint and the others wait until it is committed.
    """
    world = plan.world
    if world.size == 1:
        return _write_checkpoint_files(plan, student, optimizer, progress, ckpt.capture_rng_states(plan.seed), None)
    rng = ckpt.capture_rng_states(plan.seed)
    payloads = world.gather_bytes(rng.model_dump_json(by_alias=True).encode("utf-8"))
    record = None
    if world.is_main:
        record = ckpt.DistributedRecord(world_size=world.size, backend=world.backend or "", strategy="ddp",
                                        rank_rng_states=[ckpt.RngStates.model_validate_json(p) for p in payloads])
    world.publish_on_main(lambda: _write_checkpoint_files(plan, student, optimizer, progress, rng, record))
    return ckpt.checkpoint_basename(plan.adapter_name, progress.global_step)


def _write_checkpoint_files(plan: _Plan, student: Student, optimizer: torch.optim.Optimizer, progress: _Progress,
                            rng_states: ckpt.RngStates, distributed: ckpt.DistributedRecord | None) -> str:
    epoch, cursor = plan.schedule.cursor_after(progress.global_step)
    stateful = plan.config.optimizer.kind != "sgd"
    return ckpt.write_checkpoint(
        plan.run_dir, adapter_name=plan.adapter_name, effective_config=plan.effective_config,
        precision_policy=plan.precision_policy,
        progress=ckpt.Progress(global_step=progress.global_step, total_steps=plan.schedule.total_steps, epoch_index=epoch,
                               cursor_in_epoch=cursor, data_order=list(range(plan.schedule.candidates_per_epoch))),
        data=plan.data, rng_states=rng_states, optimizer_kind=plan.config.optimizer.kind,
        optimizer_hyperparameters=optimizer_hyperparameters(plan.config.optimizer, plan.learning_rate),
        learning_rate=plan.learning_rate, auxiliary_state=plan.auxiliary_state,
        adapter_bytes=save_safetensors(student.adapter_tensors()),
        optimizer_bytes=save_safetensors(optimizer_state_tensors(optimizer, student.lora_parameters)) if stateful else None,
        loop_state=progress.loop_state(plan.schedule, plan.data_stats), distributed=distributed)


# ---------------------------------------------------------------------------------------------
# The step's math


def _sequence_loss(student: Student, batch: dict[str, torch.Tensor], loss_fn: Callable, config: OpdConfig):
    """Loss of one candidate: mean top-K KL over its action targets (+ λ·ECHO env CE when it fires).

    Returns ``(loss, env_ce, token_counts)``; ``env_ce`` is a float only when the ECHO term fired.
    """
    ids = batch["input_ids"]  # [L]
    hidden = student.hidden_states(ids)  # [L, H], post final norm
    rows = batch["action_positions"] - 1  # target q is scored from row q-1
    kl = loss_fn(hidden.index_select(0, rows), student.head_weight, batch["teacher_ids"], batch["teacher_logprobs"],
                 head_bias=student.head_bias, target_ids=ids.index_select(0, batch["action_positions"]))
    env_positions = batch["env_positions"]  # [E]
    observed = int(env_positions.shape[0])  # |O|, counted before the warning filter
    echo = config.echo
    keep = env_positions
    if echo is not None and echo.warning_filter and echo.env_mask_mode == "env_only":
        keep = env_positions[~batch["env_in_warning_prefix"]]  # O'
    env_ce, lam = None, 0.0
    if echo is not None and echo.lambda_ != 0.0 and observed > 0:
        lam = echo.lambda_
        env_ce = echo_env_cross_entropy(hidden.index_select(0, keep - 1), student.head_weight, ids.index_select(0, keep),
                                        observed, head_bias=student.head_bias)
    loss, fired = compose_step_loss(kl, env_ce, lam, observed)
    kept = int(keep.shape[0])
    counts = {
        "action_tokens": int(rows.shape[0]), "env_tokens": observed,
        "env_tokens_before_warning_filter": observed, "env_tokens_after_warning_filter": kept,
        "warning_tokens_filtered": observed - kept,
        "context_tokens": int(ids.shape[0]) - int(rows.shape[0]) - observed,
    }
    return loss, (float(env_ce.detach()) if fired else None), counts


# ---------------------------------------------------------------------------------------------
# Small helpers kept out of the loop's way


class _Clock:
    """Accumulates wall time per phase (data, forward_backward, optimizer, checkpoint, ...)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.totals_ms: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals_ms[name] = self.totals_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # make the phase timings honest on an asynchronous device
        torch.cuda.synchronize(device)


def _cuda_streams() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # also initializes CUDA, so its generator states are captured


def _data_stats(tables: CorpusTables) -> dict[str, int]:
    """Prepared-row counters, bound into checkpoints so a resume over a different corpus is refused."""
    return {
        "examples": tables.num_examples,
        "input_tokens": int(tables.input_ids.shape[0]),
        "action_tokens": int(tables.action_positions.shape[0]),
        "env_tokens": int(tables.env_positions.shape[0]),
        "top_k": tables.top_k,
    }


def _preflight_outputs(run_dir, adapter_name: str, interval: int | None, start: int, total: int,
                       *, may_change: bool = True) -> None:
    """Settle the run directory before any work.

    * A published adapter with a successful receipt is a finished run: refuse (new adapter name).
    * A published adapter *without* one is a publication cut short between the adapter commit and the
      receipt (a crash, a storage outage): it is removed and republished by this run, which recomputes
      the same bytes from the newest checkpoint.
    * A fresh run into a directory that already holds checkpoints it would write: refuse.
    * A resume from an *earlier* checkpoint the user chose (the newest one is damaged): the later
      checkpoints it would write again are moved aside as hidden ``.<name>.superseded-<id>``
      directories — never deleted, never overwritten — so the run can publish its own.

    Only one process (rank 0) changes the directory; the others just check.
    """
    adapter = run_dir.child(ADAPTER_DIR)
    if adapter.child("adapter_config.json").exists():
        if _receipt_status(run_dir) == "success":
            raise ConfigError(f"adapter {adapter_name!r} is already published at {adapter.uri}; "
                              "choose a new adapter name", "adapter", code="adapter_exists")
        if may_change:
            remove_tree(adapter)
    if not interval:
        return
    clashes = [name for step, name in ckpt.committed_checkpoints(run_dir, adapter_name)
               if step > start and step % interval == 0 and step < total]
    if clashes and start == 0:
        raise ConfigError(f"run directory {run_dir.uri} already holds checkpoint {clashes[0]} that this run would "
                          "write; resume from the newest checkpoint or use a new adapter name", "resume_checkpoint",
                          code="checkpoint_exists")
    for name in clashes if may_change else ():
        move_aside(run_dir.child(name), f".{name}.superseded-{secrets.token_hex(4)}")


def _receipt_status(run_dir) -> str | None:
    import json

    receipt = run_dir.child(RECEIPT_FILE)
    if not receipt.exists():
        return None
    try:
        return json.loads(receipt.read_bytes()).get("status")
    except (ValueError, AttributeError):
        return None


def _lora_delta_norms(student: Student) -> list[dict[str, Any]]:
    """Frobenius norm of each module's ΔW = scale·B·A, via ‖BA‖² = Σ (BᵀB)∘(AAᵀ) (no [out, in] product)."""
    norms = []
    params = student.lora_parameters
    for name_a, a in params.items():
        if ".lora_A." not in name_a:
            continue
        b = params[name_a.replace(".lora_A.", ".lora_B.")]
        module = name_a.split(".lora_A.")[0]
        scale = student.model.peft_config["default"].lora_alpha / a.shape[0]
        with torch.no_grad():
            squared = ((b.T.double() @ b.double()) * (a.double() @ a.T.double())).sum().clamp_min(0)
        norms.append({"module": module.removeprefix("base_model.model."), "norm": float(scale * squared.sqrt())})
    return norms


def _finish(plan: _Plan, outcome: RunOutcome, progress: _Progress, clock: _Clock) -> str:
    """Fill the outcome from the loop state and write ``train_receipt.json``; returns its URI."""
    outcome.global_step = progress.global_step
    outcome.loss_history = list(progress.loss_history)
    outcome.token_counts = dict(progress.token_counts)
    outcome.echo_fired = progress.echo_fired
    outcome.final_env_ce = progress.env_ce.get("last")
    outcome.lora_grad_norms = list(progress.grad_norms)
    outcome.phase_timings_ms = dict(clock.totals_ms)
    outcome.wall_clock_ms = (time.perf_counter() - clock.started) * 1e3
    outcome.peak_rss_mib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # Linux: KiB
    outcome.peak_memory_mib = outcome.peak_rss_mib
    if plan.device.type == "cuda":  # on a GPU the number that matters is device memory
        outcome.peak_vram_mib = round(torch.cuda.max_memory_allocated(plan.device) / 2**20, 1)
        outcome.peak_memory_mib = outcome.peak_vram_mib
    world = plan.world
    if world.size == 1:
        return write_receipt(plan.run_dir, build_receipt(plan.facts, outcome))
    if not world.is_main:  # rank 0 writes the run's one receipt
        return plan.run_dir.child(RECEIPT_FILE).uri
    receipt = build_receipt(plan.facts, outcome)
    receipt["distributed"] = {  # our extension; runtime figures above are rank 0's
        "world_size": world.size, "backend": world.backend, "strategy": world.strategy,
        "sequences_per_step_per_rank": plan.config.sequences_per_step,
        "sequences_per_optimizer_step": plan.schedule.sequences_per_step,
    }
    return write_receipt(plan.run_dir, receipt)


@contextlib.contextmanager
def _deterministic(device: torch.device):
    """Deterministic kernels on CPU for the duration of the run (restored afterwards)."""
    previous = torch.are_deterministic_algorithms_enabled()
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@contextlib.contextmanager
def _stop_signals(enabled: bool):
    """SIGTERM/SIGINT → a flag the loop polls at step boundaries (only from the main thread)."""
    flag = threading.Event()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {sig: signal.signal(sig, lambda *_: flag.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
