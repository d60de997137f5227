"""Watching a run while it trains: a held-out slice scored every N steps, alarms, a clean stop.

Two pieces, used by both training loops (``train_opd``, ``train_on_policy``):

* ``HeldOutSlice`` — what the caller hands the trainer as ``eval_watch=``: the ``EvalWatch`` settings
  and the admitted held-out corpus (``HeldOutSlice.admit`` applies ``admit_eval_corpus``'s rules:
  the training teacher, the student's vocabulary, no prompt shared with the training data, and with
  ``out_root`` materializes it; ``HeldOutSlice.load`` reads such a materialization back — the engine
  admits once, when it prepares the run, and training loads what the plan's ``held_out`` names). The slice
  is fixed once: at most ``max_examples`` examples spread evenly over the corpus in file order, cut
  to ``max_tokens`` action tokens, so an evaluation costs the same at every step.
* ``HeldOutWatch`` — the loop's side: a baseline evaluation before the first step (or the curve
  restored from the checkpoint on resume), one evaluation every ``every_steps`` steps and one after
  the last, the rules of ``eval_curve`` applied to each, alarms logged (``WARNING`` on this module's
  logger) and kept in the curve, ``on_eval`` called with an ``EvalReport``, and — with
  ``stop_on_divergence`` — a ``StopTraining`` the loop raises after publishing a checkpoint.

Training never sees the evaluation: it runs under ``torch.no_grad()``, in eval mode (the student's
mode is restored after), inside ``torch.random.fork_rng`` (no generator a checkpoint restores moves),
on the same weights the next step trains. A watched run therefore ends with the adapter bytes of the
same run unwatched, and its checkpoints differ only in the extension file's ``eval_curve``.

A rule that fires at the last evaluation (no steps left) is an alarm but does not fail the run: the
training is done and nothing is saved by stopping; promotion is the post-training gate's decision.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kiln_core.contracts.eval_curve import EvalAlarm, EvalCurve, EvalPoint, HeldOutSliceRecord, StopRule
from kiln_core.contracts.eval_watch import EvalWatch
from kiln_core.contracts.opd_config import ConfigError
from kiln_core.contracts.stage_refs import HeldOutRef
from kiln_core.corpus import CorpusTables
from kiln_core.training.distributed.world import World
from kiln_core.training.eval_curve import finite_or_none, firing_rules, new_alarms
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.contracts.training_record import RunOutcome
from kiln_core.training.step import StopTraining
from kiln_core.training.student import Student

__all__ = ["HeldOutSlice", "HeldOutWatch", "EvalReport", "select_examples", "check_watch"]

LOG = logging.getLogger(__name__)
STOP_FAILURE_REASON = "training_error"  # Kiln's failure_reason enum has no value for this; ours is stop_reason


def select_examples(tables: CorpusTables, max_examples: int, max_tokens: int) -> list[int]:
    """The slice: ``min(max_examples, N)`` indices spread evenly over ``N`` examples (``i·N // k``), then
    cut after the last one that keeps the action tokens within ``max_tokens`` (the first always stays).

    Example:
        >>> select_examples(tables, max_examples=4, max_tokens=10_000)  # 10 examples  # doctest: +SKIP
        [0, 2, 5, 7]
    """
    n = tables.num_examples
    k = min(max_examples, n)
    counts = np.diff(tables.action_offsets)
    chosen, tokens = [], 0
    for index in (i * n // k for i in range(k)):
        if chosen and tokens + int(counts[index]) > max_tokens:
            break
        chosen.append(index)
        tokens += int(counts[index])
    return chosen


@dataclass(frozen=True)
class HeldOutSlice:
    """The ``eval_watch=`` keyword of the trainers: settings plus the admitted held-out corpus.

    Attributes:
        watch: The ``EvalWatch`` settings.
        tables: The admitted held-out corpus (``admit_eval_corpus(...).tables``).
        corpus_sha256: ``sha256:`` of its JSONL bytes (``AdmissionResult.dataset_sha256``).
        materialized: Where the admitted tables are committed (``admit(out_root=...)``), else None.
    """

    watch: EvalWatch
    tables: CorpusTables
    corpus_sha256: str
    materialized: str | None = None

    @classmethod
    def admit(cls, watch: EvalWatch, student_dir: str, *, top_k: int, teacher_manifest: str | None = None,
              train_corpus_uri: str | None = None, train_prompts: Sequence[Any] | None = None,
              prompt_rendering: str = "legacy_action_boundary", out_root: str | None = None) -> "HeldOutSlice":
        """Admit ``watch.corpus`` for ``student_dir`` with the held-out rules, before any training work.

        Args:
            watch: The settings; ``watch.corpus`` is the held-out JSONL.
            student_dir: The student being trained.
            top_k: The run's effective top-K (``ResolvedSettings.top_k``): the held-out corpus is admitted at it.
            teacher_manifest: The training teacher's manifest line; another teacher is refused.
            train_corpus_uri: The off-policy training corpus; a shared prompt is refused.
            train_prompts: The on-policy prompts (``OpdPrompt``s or their ``PromptFile``); a shared prompt is
                refused.
            prompt_rendering: The on-policy run's ``rollout_prompt_rendering``.
            out_root: Storage root to materialize the admitted corpus under (content-addressed, reused
                when committed), so training can ``load`` it instead of admitting it again.

        Raises:
            AdmissionError, EvalInputError: ``identity_mismatch``, ``vocabulary_mismatch``,
                ``eval_train_overlap`` or any admission rule (exit 2).

        Example:
            >>> held_out = HeldOutSlice.admit(EvalWatch(corpus="heldout.jsonl", every_steps=25), "student",
            ...     top_k=32, teacher_manifest=manifest, train_corpus_uri="train.jsonl")  # doctest: +SKIP
        """
        from kiln_core.evaluation.corpus import admit_eval_corpus

        admission = admit_eval_corpus(watch.corpus, student_dir, effective_top_k=top_k, teacher_manifest=teacher_manifest,
                                      train_corpus_uri=train_corpus_uri, train_prompts=train_prompts,
                                      prompt_rendering=prompt_rendering, out_root=out_root)
        return cls(watch=watch, tables=admission.tables, corpus_sha256=admission.dataset_sha256,
                   materialized=admission.materialized)

    @classmethod
    def load(cls, watch: EvalWatch, held_out: HeldOutRef) -> "HeldOutSlice":
        """The slice of a corpus admitted when the run was prepared (``TrainPlan.held_out``): its committed
        tables read back (each file verified against ``admission.json``), not admitted again.

        Raises:
            EnvironmentFailure: ``corpus_changed`` when the materialization is not the admitted corpus.
            FileNotFoundError: no committed materialization at ``held_out.uri``.
        """
        from kiln_core.evaluation.corpus import admitted_tables

        return cls(watch=watch, tables=admitted_tables(held_out), corpus_sha256=held_out.corpus_sha256,
                   materialized=held_out.uri)

    def ref(self) -> HeldOutRef:
        """What the plan carries of this slice (``TrainPlan.held_out``); only for a materialized one."""
        if self.materialized is None:
            raise ValueError("a held-out slice admitted without out_root has no materialization to refer to")
        return HeldOutRef(uri=self.materialized, corpus_sha256=self.corpus_sha256, examples=self.tables.num_examples,
                          action_tokens=int(self.tables.action_positions.shape[0]))

    def record(self) -> HeldOutSliceRecord:
        """The slice this run scores (indices and token count), as checkpoints and receipts record it.

        Raises:
            ConfigError: the corpus has no action token to evaluate.
        """
        indices = select_examples(self.tables, self.watch.max_examples, self.watch.max_tokens)
        counts = np.diff(self.tables.action_offsets)
        tokens = int(sum(int(counts[i]) for i in indices))
        if tokens == 0:
            raise ConfigError(f"held-out corpus {self.watch.corpus} has no action token to evaluate", "eval.corpus",
                              code="eval_watch_empty")
        return HeldOutSliceRecord(corpus=self.watch.corpus, corpus_sha256=self.corpus_sha256, example_indices=indices,
                                  tokens=tokens)


@dataclass(frozen=True)
class EvalReport:
    """What ``on_eval`` receives after each evaluation (render ``curve.rows()`` as a table artifact)."""

    point: EvalPoint
    curve: EvalCurve
    """The whole curve so far, this point and its alarms included."""
    alarms: list[EvalAlarm]
    """The alarms raised at this evaluation."""
    stopping: StopRule | None
    """The rule that stops the run here (``stop_on_divergence``), or None."""


def check_watch(held_out: HeldOutSlice | None, world: World) -> None:
    """Refuse, before any work, a watch this run cannot keep: one over several processes (the watch runs
    in one), or a slice without an action token.

    Raises:
        ConfigError: ``eval_watch_distributed``, ``eval_watch_empty``.
    """
    if held_out is None:
        return
    if world.size > 1:
        raise ConfigError(f"held-out evaluation during training (eval.every_steps) runs in a single process; this run "
                          f"has {world.size}: train with one process, or evaluate the adapter afterwards "
                          "(kiln-flows eval)", "eval", code="eval_watch_distributed")
    held_out.record()


class HeldOutWatch:
    """The loop's held-out watch (see the module docstring); ``curve`` is the curve so far.

    Example:
        >>> watch = HeldOutWatch.start(held_out, plan.loaded, outcome, student, progress, clock)  # doctest: +SKIP
        >>> halt = watch.after_step(student, progress, clock, steps_left=True)  # doctest: +SKIP
    """

    def __init__(self, held_out: HeldOutSlice, outcome: RunOutcome,
                 on_eval: Callable[[EvalReport], None] | None = None) -> None:
        self.config, self.tables, self.outcome, self.on_eval = held_out.watch, held_out.tables, outcome, on_eval
        self.curve = EvalCurve(watch=held_out.watch, held_out=held_out.record())

    @classmethod
    def start(cls, held_out: HeldOutSlice, loaded: Any, outcome: RunOutcome, student: Student, progress: LoopProgress,
              clock: Clock, on_eval: Callable[[EvalReport], None] | None = None) -> "HeldOutWatch":
        """Continue the curve of the checkpoint being resumed (``loaded``), or begin one with an evaluation now."""
        watch = cls(held_out, outcome, on_eval)
        saved = loaded.extension.eval_curve if loaded is not None else None
        if saved is not None and saved.held_out == watch.curve.held_out:
            watch._keep(saved.model_copy(update={"watch": watch.config}))
        else:
            if saved is not None:
                LOG.warning("the held-out slice differs from checkpoint %s's (corpus %s, %d examples); the held-out "
                            "curve restarts at step %d", loaded.basename, saved.held_out.corpus_sha256,
                            len(saved.held_out.example_indices), progress.global_step)
            watch._evaluate(student, progress, clock, steps_left=True)
        return watch

    def after_step(self, student: Student, progress: LoopProgress, clock: Clock, *, steps_left: bool) -> StopTraining | None:
        """Evaluate when ``every_steps`` divides the step; returns the stop to raise (after a checkpoint), if any."""
        if progress.global_step % self.config.every_steps:
            return None
        return self._evaluate(student, progress, clock, steps_left=steps_left)

    def finish(self, student: Student, progress: LoopProgress, clock: Clock) -> None:
        """After the last step: one more evaluation unless the curve already ends at this step (never stops)."""
        if not self.curve.points or self.curve.points[-1].step != progress.global_step:
            self._evaluate(student, progress, clock, steps_left=False)

    # -- internals

    def _evaluate(self, student: Student, progress: LoopProgress, clock: Clock, *, steps_left: bool) -> StopTraining | None:
        with clock.phase("eval"):
            metrics = self._score(student)
        step, losses = progress.global_step, progress.loss_history
        since = self.curve.points[-1].step if self.curve.points else step
        recent = losses[since:step]
        point = EvalPoint(step=step, reverse_kl=finite_or_none(metrics.reverse_kl),
                          top1_agreement=finite_or_none(metrics.top1_agreement),
                          teacher_token_nll=finite_or_none(metrics.teacher_token_nll), tokens=metrics.tokens,
                          train_loss=finite_or_none(math.fsum(recent) / len(recent)) if recent else None)
        points = [*self.curve.points, point]
        alarms = new_alarms(points, losses[:step], self.config)
        self._keep(self.curve.model_copy(update={"points": points, "alarms": [*self.curve.alarms, *alarms]}))
        LOG.info("held-out eval at step %d: reverse_kl=%s top1_agreement=%s teacher_token_nll=%s (%d tokens)", step,
                 point.reverse_kl, point.top1_agreement, point.teacher_token_nll, point.tokens)
        for alarm in alarms:
            LOG.warning("held-out watch, step %d [%s]: %s", alarm.step, alarm.rule, alarm.message)
        halt = None
        if self.config.stop_on_divergence and steps_left:
            firing = firing_rules(points, losses[:step], self.config)
            if firing:
                rule, message = firing[0]
                halt = StopTraining(STOP_FAILURE_REASON, f"stopped by the held-out watch at step {step} (rule {rule}, "
                                    f"eval.stop_on_divergence): {message}", stop_reason=rule)
        if self.on_eval is not None:
            self.on_eval(EvalReport(point=point, curve=self.curve, alarms=alarms,
                                    stopping=halt.stop_reason if halt is not None else None))
        return halt

    def _score(self, student: Student):
        from kiln_core.evaluation.metrics import evaluate_examples

        model = student.model
        was_training = model.training
        devices = [student.device.index or 0] if student.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            try:
                return evaluate_examples(student, (self.tables.example(i) for i in self.curve.held_out.example_indices))
            finally:
                model.train(was_training)

    def _keep(self, curve: EvalCurve) -> None:
        self.curve = curve
        self.outcome.eval_curve = curve
