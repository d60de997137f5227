"""What a flow run's log and header show: one line per rejection, no stage-completion noise, the
adapter as a tag, the typed run name kept.

Prefect logs every task's end as "Finished in state Completed()" and every failure with its whole
traceback. For a pipeline run those lines bury the story the stages log themselves (manifest pinned,
corpus admitted, loss every N steps, checkpoints, receipt), and a rejected input's traceback says
nothing its one-line message does not. ``quiet_run_logs`` installs two logging filters in the
flow-run process (a worker's run subprocess, or the CLI's process): completions of our stage tasks
are dropped (failures and retries stay), and a ``Rejection`` keeps its message without traceback.
"""

from __future__ import annotations

import logging
from typing import Any

QUIET_TASKS = frozenset({"validate", "manifest", "score", "fingerprint", "admit", "materialize", "train", "publish"})


class _StageCompletionFilter(logging.Filter):
    """Drops "Finished in state Completed()" (and "Cached") of the stage tasks; everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or getattr(record, "task_name", None) not in QUIET_TASKS:
            return True
        message = record.getMessage()
        return not message.startswith(("Finished in state Completed", "Finished in state Cached"))


def quiet_run_logs() -> None:
    """Install the filters on Prefect's task-run and flow-run loggers (once per process)."""
    from flows.local_api import hide_rejection_tracebacks

    hide_rejection_tracebacks()
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _StageCompletionFilter) for f in logger.filters):
        logger.addFilter(_StageCompletionFilter())


def run_name() -> str:
    """The flow run's name: the one it was created with when it came from a deployment (what a person
    typed in the UI's Run Name field, or the scheduler's), else ``opd-<adapter>``."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return "opd-run"
    if context.flow_run.deployment_id and context.flow_run.name:
        return context.flow_run.name
    spec: Any = (context.parameters or {}).get("spec")
    adapter = spec.get("adapter") if isinstance(spec, dict) else getattr(spec, "adapter", None)
    return f"opd-{adapter or 'run'}"


def tag_run(*tags: str) -> None:
    """Add tags to the current flow run (best effort: a failed API call must not fail the run)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if run_id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            current = list(client.read_flow_run(run_id).tags or [])
            client.update_flow_run(run_id, tags=current + [tag for tag in tags if tag not in current])
    except Exception as error:  # noqa: BLE001 - tags are cosmetic
        logging.getLogger("kiln_flows").debug("could not tag flow run %s: %s", run_id, error)
