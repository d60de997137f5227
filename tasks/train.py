"""Stage 4, ``train``: ``kiln_core.engine.training.train`` as a task, with progress and cancellation.

Retry-from-checkpoint is the engine's: every attempt (a task retry, a flow retry, the UI's Retry
button on new infrastructure) plans the same run directory and resumes from its newest committed
checkpoint. A rejection (a checkpoint that does not match the run) is never retried.

The task is called directly on the flow's main thread so that Ctrl-C and Prefect's cancellation
reach it. Ctrl-C, and a SIGTERM outside a worker's run (``kiln-flows run``, a container stop), stop
training at the next step boundary after a checkpoint, and the task returns ``cancelled``.

A cancel from the UI reaches a run a worker (or ``kiln-flows serve``) started in two ways. The flow run
being set to ``Cancelling`` is polled every ``cancel_poll_seconds``: training then stops the same way.
And the worker tells the run that a cancel is coming, waits up to a second for the acknowledgement
that only Prefect's own SIGTERM handler gives, and sends SIGTERM. So in such a run SIGTERM is left to
Prefect (``worker_owns_sigterm``): it stops training at once, the receipt says ``cancelled`` and names
the checkpoint kept, the run ends Cancelled, and a retry resumes from the newest committed checkpoint.
Taking SIGTERM over there made the acknowledgement fail; the unannounced SIGTERM that followed a second
later then ended a run whose training the poll had already stopped as Crashed.

Prefect's termination signal is an exception; left to propagate out of the task, it ends the task
Crashed ("Crash detected!", an orange task run) although nothing crashed. When the flow run is being
cancelled, the task ends ``Cancelled`` instead (never Completed: a Retry of the flow run would then take
the cancelled result from the cache instead of resuming), and the flow ends the run Cancelled in words.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from prefect import task

from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan, TrainRef
from tasks.artifacts import ProgressReporter, artifact_key
from tasks.retry import retry_unless_rejected


def worker_owns_sigterm() -> bool:
    """True in a flow run a Prefect worker or runner started: they put its id in the environment."""
    return bool(os.environ.get("PREFECT__FLOW_RUN_ID"))


def _flow_run_cancelling() -> bool:
    """True when the current flow run is being cancelled (or was); False outside a run or when the API
    cannot say."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import flow_run

    flow_run_id = flow_run.get_id()
    if flow_run_id is None:
        return False
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception:
        return False  # an API hiccup must not stop training
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)


def _cancel_poller(every_seconds: float) -> Callable[[], bool]:
    """True once the current flow run is CANCELLING (checked at most every ``every_seconds``)."""
    last = [0.0]

    def should_cancel() -> bool:
        if time.monotonic() - last[0] < every_seconds:
            return False
        last[0] = time.monotonic()
        return _flow_run_cancelling()

    return should_cancel


def cancelled_by_prefect(error: BaseException) -> bool:
    """Whether ``error`` is Prefect's termination signal of a cancel (the flow run is Cancelling), rather
    than a SIGTERM from elsewhere (a container stop), which Prefect itself records as a crash."""
    from prefect.exceptions import TerminationSignal

    return isinstance(error, TerminationSignal) and _flow_run_cancelling()


class TrainingLog:
    """The run log's view of training: a line every ``every`` steps (and the first and last) with the
    step, loss, throughput and ETA, and a checkpoint line at most as often (the newest checkpoint, with
    how many were committed since the previous line).

    Throughput is in action tokens per second, estimated from the corpus' mean action tokens per
    example (the trainer reports steps, not tokens); the receipt has the exact counts.
    """

    def __init__(self, plan: TrainPlan, corpus: CorpusRef, logger, *, every: int | None = None) -> None:
        self.logger, self.adapter = logger, plan.adapter
        config = plan.settings.config
        self.interval = config.checkpoint_interval
        self.tokens_per_step = corpus.action_tokens / max(1, corpus.examples) * config.sequences_per_step
        self.every = every
        self._started = time.monotonic()
        self._first_step: int | None = None
        self.total: int | None = None
        self._last_checkpoint_line: int | None = None
        self._checkpoints_unlogged = 0

    def progress(self, step: int, total: int, loss: float) -> None:
        self.total = total
        if self._first_step is None:
            # The clock starts at the first step this process trains (a resumed run starts late; model
            # loading is not training), so the first line has no rate yet.
            self._first_step, self._started = step, time.monotonic()
            self.logger.info("train step %d/%d: loss %.4f", step, total, loss)
            return
        every = self.every or max(1, total // 10)
        if step != total and step % every:
            return
        elapsed = max(time.monotonic() - self._started, 1e-9)
        done = step - self._first_step
        eta = elapsed / done * (total - step)
        self.logger.info("train step %d/%d: loss %.4f, ~%.0f action tok/s, ETA %s", step, total, loss,
                         done * self.tokens_per_step / elapsed, _duration(eta))

    def step_committed(self, step: int) -> None:
        # The trainer commits a periodic checkpoint at every interval step before the last one; the
        # last step's state is the adapter itself.
        if not (self.interval and step % self.interval == 0 and (self.total is None or step < self.total)):
            return
        # Throttled like the step lines: a checkpoint every 4 steps of a 400-step run is 99 checkpoints,
        # and one line per step line (the newest, with the count since the last line) says as much.
        self._checkpoints_unlogged += 1
        every = self.every or max(1, (self.total or 0) // 10)
        if self._last_checkpoint_line is not None and step - self._last_checkpoint_line < every:
            return
        since = (f" ({self._checkpoints_unlogged} since step {self._last_checkpoint_line})"
                 if self._checkpoints_unlogged > 1 else "")
        self.logger.info("checkpoint published: %s-checkpoint-step-%08d.kiln-checkpoint%s", self.adapter, step, since)
        self._last_checkpoint_line, self._checkpoints_unlogged = step, 0


def _run_logger():
    """The task run's logger, or a plain one when the task's function is called outside a run
    (``train_task.fn(...)`` in tests and drills)."""
    import logging

    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("kiln_flows.train")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


@task(name="train", task_run_name="train-{plan.adapter}", retries=2, retry_delay_seconds=[2, 10],
      retry_condition_fn=retry_unless_rejected)
def train_task(
    plan: TrainPlan,
    corpus: CorpusRef,
    manifest: ManifestRef,
    student_dir: str,
    progress_every_seconds: float = 5.0,
    cancel_poll_seconds: float = 2.0,
) -> TrainRef:
    """Train (or resume training) the run of ``plan`` and return where its outputs are; a ``Cancelled``
    state when the flow run's cancellation stopped it (``PrefectStages.train`` reads the run back).

    Example:
        ```python
        plan = plan_run(spec, settings, corpus_ref, manifest_ref, "./student")
        train_ref = train_task(plan, corpus_ref, manifest_ref, "./student")
        ```
    """
    from kiln_core.engine.training import train

    log = TrainingLog(plan, corpus, _run_logger())
    reporter = ProgressReporter(key=artifact_key("train-progress", plan.adapter), description=f"training {plan.adapter}",
                                every_seconds=progress_every_seconds)

    def on_progress(step: int, total: int, loss: float, rollout=None) -> None:
        reporter.update(step, total, loss, rollout=rollout)
        log.progress(step, total, loss)

    try:
        result = train(plan, corpus, manifest, student_dir, on_progress=on_progress,
                       should_cancel=_cancel_poller(cancel_poll_seconds), on_step_committed=log.step_committed,
                       stop_on_sigterm=not worker_owns_sigterm())
    except BaseException as error:
        if not cancelled_by_prefect(error):
            raise
        # Training recorded the cancel (receipt `cancelled`, the checkpoint kept); the flow reads it back.
        from prefect.states import Cancelled

        return Cancelled(message="training stopped by the flow run's cancellation")
    # On-policy progress counts candidates (empty rollouts consume one without a step): a finished run is 100 %.
    done = result.total_steps if corpus.kind == "prompts" and result.status == "success" else result.steps
    reporter.update(done or 0, result.total_steps or result.steps, result.final_loss, force=True)
    return result
