"""Stage 4, ``train``: ``kiln_core.engine.training.train`` as a task, with progress and cancellation.

Retry-from-checkpoint is the engine's: every attempt (a task retry, a flow retry, the UI's Retry
button on new infrastructure) plans the same run directory and resumes from its newest committed
checkpoint. A rejection (a checkpoint that does not match the run) is never retried.

The task is called directly on the flow's main thread so that Ctrl-C and Prefect's cancellation
(SIGTERM from the worker) reach it: training stops at the next step boundary after a checkpoint and
the task returns ``cancelled``. The flow run being set to CANCELLING is polled as well.
"""

from __future__ import annotations

import time
from typing import Callable

from prefect import task

from kiln_core.engine.refs import CorpusRef, ManifestRef, TrainPlan, TrainRef
from tasks.artifacts import ProgressReporter, artifact_key
from tasks.retry import retry_unless_rejected


def _cancel_poller(every_seconds: float) -> Callable[[], bool]:
    """True once the current flow run is CANCELLING (checked at most every ``every_seconds``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import flow_run

    last = [0.0]
    flow_run_id = flow_run.get_id()

    def should_cancel() -> bool:
        if flow_run_id is None or time.monotonic() - last[0] < every_seconds:
            return False
        last[0] = time.monotonic()
        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run_id).state
        except Exception:
            return False  # an API hiccup must not stop training
        return state is not None and state.type == StateType.CANCELLING

    return should_cancel


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
    """Train (or resume training) the run of ``plan`` and return where its outputs are.

    Example:
        ```python
        plan = plan_run(spec, corpus_ref, manifest_ref, "./student")
        train_ref = train_task(plan, corpus_ref, manifest_ref, "./student")
        ```
    """
    from kiln_core.engine.training import train

    reporter = ProgressReporter(key=artifact_key("train-progress", plan.adapter), description=f"training {plan.adapter}",
                                every_seconds=progress_every_seconds)
    result = train(plan, corpus, manifest, student_dir, on_progress=reporter.update,
                   should_cancel=_cancel_poller(cancel_poll_seconds))
    # On-policy progress counts candidates (empty rollouts consume one without a step): a finished run is 100 %.
    done = result.total_steps if corpus.kind == "prompts" and result.status == "success" else result.steps
    reporter.update(done or 0, result.total_steps or result.steps, result.final_loss, force=True)
    return result
