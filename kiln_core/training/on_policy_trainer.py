"""On-policy OPD training: the student samples, the teacher scores its tokens, top-K reverse KL trains.

``train_on_policy`` plans the run, then runs the one training loop (``loop.run_training``) over the
rollouts (``RolloutCandidates``), in the order of Kiln's on-policy ``opd_train``
(``crates/kiln-train/src/opd.rs`` · ``opd_train_to_with_checkpoint_root_and_runtime``):

1. plan (``on_policy_plan``): prompts prepared, effective top-K and samples per prompt, the identities
   a checkpoint binds, every refusal — before any model loads;
2. setup (``lifecycle.start_student``): the seeded student and optimizer, restored exactly on resume
   or warm-started from ``config.base_adapter``; then the teacher is loaded;
3. the loop, one candidate at a time in Kiln's order (prompt-major, then sample, no shuffle):
   * a prompt without a prompt/assistant split: the candidate is consumed, nothing else;
   * otherwise the candidate's rollout (``kiln_core.on_policy.collect``): read back from the rollout
     store, or sampled by the student with its current LoRA (seed ``seed + global_step + source ·
     1,000,003 + sample · 1,000,033``), scored top-K by the teacher and committed first;
   * an empty rollout (EOS first) is consumed without an update, loss, progress report, checkpoint
     or cancellation check ("student produced 0 new tokens; skipping step");
   * otherwise one optimizer step on it (``step.train_examples``, the same loss as off-policy), then
     the end-of-step work both modes share (``boundary.StepBoundary``): the progress report, a
     held-out evaluation when due, a checkpoint when ``global_step % checkpoint_interval == 0`` and
     candidates remain, ``on_step_committed``, a watch stop, and the cancellation check;
4. finish (``finish``): the PEFT adapter, then ``train_receipt.json`` (also written on failure).

Three counters, kept apart and all restored on resume: ``global_step`` (committed optimizer steps),
the candidate cursor (``epoch_index``/``cursor_in_epoch``, consumed candidates, empty ones included)
and the ``rollout-sampling`` stream position, which is the consumed-candidate count.

Exactness: a candidate's tokens depend only on the LoRA weights, its seed (from the restored
``global_step``) and the prompt; its teacher rows only on the tokens; the step only on those and the
restored optimizer state — so a run interrupted anywhere and resumed from its checkpoint ends with the
same adapter bytes on CPU. Rollouts committed before an interruption are read back, not sampled again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kiln_core.contracts.opd_prompt import OpdPrompt
from kiln_core.contracts.stage_refs import TrainPlan
from kiln_core.on_policy.collect import RolloutCollector, RolloutCounters
from kiln_core.on_policy.sampler import RolloutBackend, SamplingParams, sample_rollout
from kiln_core.on_policy.schedule import candidate_seed, iter_candidates
from kiln_core.on_policy.teacher import TeacherSource
from kiln_core.training.distributed.world import World
from kiln_core.training.lifecycle import TrainResult, result_fields
from kiln_core.training.loop import StepGroup, run_training
from kiln_core.training.on_policy_plan import RolloutPlan, plan_on_policy_run
from kiln_core.training.plan import RunPlan
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.contracts.training_record import RunOutcome
from kiln_core.training.student import Student
from kiln_core.training.watch import EvalReport, HeldOutSlice, check_watch

__all__ = ["OnPolicyProgress", "OnPolicyTrainResult", "RolloutCandidates", "StudentRollouts", "train_on_policy"]

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnPolicyProgress:
    """What ``on_progress`` receives after each committed step (never for a consumed-only candidate).

    Counts of rollout work cover this process (a resumed run starts them at zero); ``step`` and the
    candidate counts cover the whole run.
    """

    step: int
    """Committed optimizer steps."""
    consumed_candidates: int
    """Candidates consumed, empty rollouts and skipped prompts included."""
    total_candidates: int
    loss: float
    """This step's loss."""
    rollouts_sampled: int
    rollouts_reused: int
    """Rollouts read back from the store instead of sampled again."""
    sampled_tokens: int
    teacher_tokens_scored: int
    elapsed_s: float
    """This process's time in the loop so far."""

    @property
    def fraction(self) -> float:
        """Kiln's progress: consumed candidates / total candidates."""
        return self.consumed_candidates / max(self.total_candidates, 1)

    @property
    def rollouts_per_second(self) -> float:
        return self.rollouts_sampled / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def teacher_tokens_per_second(self) -> float:
        return self.teacher_tokens_scored / self.elapsed_s if self.elapsed_s > 0 else 0.0


class OnPolicyTrainResult(TrainResult):
    """``TrainResult`` plus the rollout work (``total_steps`` counts candidates: an upper bound of steps)."""

    consumed_candidates: int
    rollout_run_key: str
    rollout_root: str
    rollouts_sampled: int
    rollouts_reused: int
    sampled_tokens: int
    teacher_tokens_scored: int


class StudentRollouts:
    """The default rollout backend: the student being trained samples with its current LoRA weights,
    under the same autocast as its training forward."""

    def __init__(self, student: Student) -> None:
        self.student = student

    def sample(self, prompt_ids: Sequence[int], *, params: SamplingParams, max_tokens: int,
               eos_token_ids: Sequence[int], seed: int) -> list[int]:
        with self.student.autocast():
            return sample_rollout(self.student.model, prompt_ids, params=params, max_tokens=max_tokens,
                                  eos_token_ids=eos_token_ids, seed=seed)


def train_on_policy(
    plan: TrainPlan,
    prompts: Sequence[OpdPrompt],
    *,
    student_dir: str,
    teacher: TeacherSource,
    rollout_root: str | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_progress: Callable[[OnPolicyProgress], None] | None = None,
    on_step_committed: Callable[[int], None] | None = None,
    rollout_backend: Callable[[Student], RolloutBackend] | None = None,
    handle_signals: bool = False,
    eval_watch: HeldOutSlice | None = None,
    on_eval: Callable[[EvalReport], None] | None = None,
) -> OnPolicyTrainResult:
    """Train a LoRA student on its own rollouts of ``prompts``, scored by ``teacher``; publish under ``plan.run_uri``.

    Args:
        plan: The resolved run (``kiln_core.engine.runs.plan_run``), as in ``train_opd``: run directory,
            adapter name, the validated on-policy config (``kiln_core.on_policy.submit`` checks passed),
            top-K and samples per prompt as those checks resolved them, learning rate, base adapter (the
            first rollouts are the base adapter's; a resume never reloads it), device options, and
            ``resume`` (a checkpoint basename, or None).
        prompts: The request's prompts (``OpdRequest.prompts`` or a prompt file), in order.
        student_dir: Local student model directory.
        teacher: The pinned teacher (``TeacherSource.local`` for a registered local teacher); it loads
            after every refusal, with the effective top-K.
        rollout_root: Where rollouts are stored (default ``<run_uri>/rollouts``).
        should_cancel: Polled after each committed step; True stops after publishing a checkpoint.
        on_progress: Called with an ``OnPolicyProgress`` after each committed step.
        on_step_committed: Called with the step number once a step and its checkpoint (when one is due)
            are published; whatever it raises ends the run like any other error.
        rollout_backend: Builds the sampler from the loaded student (default ``StudentRollouts``; a vLLM
            server: ``kiln_core.on_policy.vllm_rollouts.vllm_rollout_backend``).
        handle_signals: Turn SIGTERM/SIGINT into a cooperative cancel (main thread only).
        eval_watch: Held-out evaluation during training, as in ``train_opd`` (a ``HeldOutSlice``
            admitted with ``train_prompts=prompts``); evaluations follow committed optimizer steps.
        on_eval: Called with an ``EvalReport`` after each held-out evaluation.

    Returns:
        ``OnPolicyTrainResult``; status ``failed`` (nan_loss) and ``cancelled`` are returned, not raised.

    Raises:
        ConfigError, Rejection, CheckpointError, ResumeError: rejected input, before any model loads.
        Exception: anything unexpected, after a ``failed`` receipt was written.

    Example:
        >>> result = train_on_policy(plan, request.prompts, student_dir="student",
        ...     teacher=TeacherSource.local("tiny-teacher", identity, "teacher"))  # doctest: +SKIP
        >>> result.status, result.rollouts_sampled  # doctest: +SKIP
        ('success', 128)
    """
    clock = Clock()
    world = World.current()
    check_watch(eval_watch, world)
    # ---- 1. plan: every refusal (prompts, teacher, resume checkpoint, published adapter) happens here
    run_plan, rollouts = plan_on_policy_run(plan, prompts=prompts, student_dir=student_dir, teacher=teacher,
                                            rollout_root=rollout_root, world=world)
    source = RolloutCandidates(run_plan, rollouts, teacher, plan.adapter, rollout_backend or StudentRollouts)
    total = run_plan.schedule.total_candidates

    def report(progress: LoopProgress, loss: float) -> None:
        counters = source.counters
        on_progress(OnPolicyProgress(
            step=progress.global_step, consumed_candidates=progress.consumed, total_candidates=total, loss=loss,
            rollouts_sampled=counters.sampled, rollouts_reused=counters.reused, sampled_tokens=counters.sampled_tokens,
            teacher_tokens_scored=counters.teacher_tokens_scored, elapsed_s=time.perf_counter() - source.started))

    # ---- 2.–4. setup, the loop over the rollouts, the adapter and the receipt (``loop.run_training``)
    run = run_training(run_plan, source, student_dir=student_dir, clock=clock,
                       gradient_checkpointing=plan.gradient_checkpointing, handle_signals=handle_signals,
                       should_cancel=should_cancel, on_step_committed=on_step_committed,
                       report=report if on_progress is not None else None, eval_watch=eval_watch, on_eval=on_eval,
                       max_hours=plan.max_training_hours)
    counters = source.counters
    return OnPolicyTrainResult(
        **result_fields(run_plan, run.outcome, run.progress, clock, run.receipt_uri),
        consumed_candidates=run.progress.consumed or 0, rollout_run_key=rollouts.run_key,
        rollout_root=rollouts.store.root.uri, rollouts_sampled=counters.sampled, rollouts_reused=counters.reused,
        sampled_tokens=counters.sampled_tokens, teacher_tokens_scored=counters.teacher_tokens_scored)


class RolloutCandidates:
    """The on-policy candidate source: Kiln's candidate order (prompt-major, then sample, no shuffle),
    each candidate's rollout read back from the rollout store or sampled by the student with its current
    LoRA and scored by the teacher. A skipped prompt or an empty rollout is consumed without a step. The
    cursor is ``progress.consumed`` (and the rollout seed uses ``global_step``)."""

    stop_before_first_step = False

    def __init__(self, plan: RunPlan, rollouts: RolloutPlan, teacher: TeacherSource, adapter_name: str,
                 rollout_backend: Callable[[Student], RolloutBackend]) -> None:
        self.plan, self.rollouts, self.teacher, self.adapter_name = plan, rollouts, teacher, adapter_name
        self.rollout_backend = rollout_backend
        self.counters = RolloutCounters()
        self.started = time.perf_counter()
        self.collector: RolloutCollector | None = None
        self.backend = None

    def open(self, student: Student, outcome: RunOutcome, clock: Clock) -> None:
        """Load the teacher and the sampler (after the student, so a refusal costs neither)."""
        with clock.phase("setup"):
            scorer = self.teacher.load(self.plan.settings.top_k)
        self.backend = self.rollout_backend(student)
        outcome.rollout_backend = getattr(self.backend, "receipt_label", "local")
        outcome.teacher_backend = getattr(scorer, "receipt_label", "local")
        rollouts = self.rollouts
        self.collector = RolloutCollector(
            rollouts.store, rollouts.run_key, self.backend, scorer,
            params=rollouts.sampling, max_tokens=rollouts.max_tokens, eos_token_ids=rollouts.eos_token_ids,
            top_k=self.plan.settings.top_k, vocab_size=self.teacher.identity.vocab_size, teacher_id=self.teacher.alias,
            metadata={"teacher_content_revision": self.plan.facts.teacher_content_revision,
                      "adapter_name": self.adapter_name, "rollout_backend": outcome.rollout_backend})
        self.counters = self.collector.counters

    def groups(self, progress: LoopProgress, clock: Clock) -> Iterator[StepGroup]:
        schedule, prepared = self.plan.schedule, self.rollouts.prepared
        self.started = time.perf_counter()
        epoch, cursor = progress.position(schedule)
        for candidate in iter_candidates(prepared, schedule.samples_per_prompt, schedule.epochs,
                                         start_epoch=epoch, start_cursor=cursor):
            rollout = None
            if not candidate.skipped:
                seed = candidate_seed(self.plan.seed, progress.global_step, candidate.source_index,
                                      candidate.sample_index)
                with clock.phase("rollout"):
                    rollout = self.collector.rollout(candidate, prepared.prompts[candidate.prepared_index],
                                                     global_step=progress.global_step, seed=seed)
            progress.consumed = candidate.consumed_after(schedule.candidates_per_epoch)
            if rollout is None or rollout.empty:
                if rollout is not None:
                    LOG.warning("prompt %d sample %d: student produced 0 new tokens; skipping step",
                                candidate.source_index, candidate.sample_index)
                continue  # consumed without an update
            yield [(candidate.cursor + 1, rollout.training_example)]

    def steps_left(self, progress: LoopProgress) -> bool:
        return progress.consumed < self.plan.schedule.total_candidates

    def close(self, clock: Clock) -> None:
        clock.totals_ms["rollout_sampling"] = self.counters.sampling_s * 1e3
        clock.totals_ms["teacher_scoring"] = self.counters.scoring_s * 1e3
        if self.backend is not None:
            getattr(self.backend, "close", lambda: None)()  # e.g. unload the LoRA a vLLM server holds
