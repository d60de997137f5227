"""What a flow run's log and header show: one line per rejection or failure, no stage-completion noise,
the adapter as a tag, the typed run name kept.

Prefect logs every task's end as "Finished in state Completed()" and every failure with its whole
traceback. For a pipeline run those lines bury the story the stages log themselves (manifest pinned,
corpus admitted, loss every N steps, checkpoints, receipt), and a rejected input's or a failed run's
traceback says nothing its one-line message does not. ``quiet_run_logs`` installs two logging filters in
the flow-run process (a worker's run subprocess, or the CLI's process): completions of our stage tasks
are dropped (failures and retries stay), and a run that ends rejected or failed (``reject_run``,
``fail_run``) is told once: by its final "Finished in state Failed('<status> (<code>) ...')" line, raised
to ERROR so that the UI's "Error and above" filter shows it, with no traceback and no "unexpected
exception" line around it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

QUIET_TASKS = frozenset({"validate", "manifest", "score", "fingerprint", "admit", "materialize", "train", "publish",
                         "prepare"})


class _StageCompletionFilter(logging.Filter):
    """Drops "Finished in state Completed()" (and "Cached") of the stage tasks, and the train task's "Finished in
    state Cancelled(...)" (Prefect logs it at ERROR; the flow says how far training got and ends Cancelled
    itself); everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "task_name", None) not in QUIET_TASKS:
            return True
        message = record.getMessage()
        if message.startswith("Finished in state Cancelled"):
            return False
        return record.levelno > logging.INFO or not message.startswith(("Finished in state Completed",
                                                                         "Finished in state Cached"))


class _EndToldOnce(logging.Filter):
    """A run that ends rejected or failed is told once, by its final state (``reject_run``/``fail_run``).

    Dropped: the failing task's "Task run failed with exception: SpecError(...)" and its "Finished in state
    Failed(...)", and the engine's "exited with unexpected exception" when the flow returned the error (or a
    cancelled run's ``Cancelled`` state, ``cancel_run``) as its state: the engine re-raises it only to set the
    process's exit status. Raised to ERROR: the flow run's own "Finished in state Failed(...)" line, which
    Prefect logs at INFO whatever the state.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rejected_task_runs: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.exceptions import CancelledRun

        from kiln_core.errors import KilnFlowsError, Rejection

        error = record.exc_info[1] if record.exc_info else None
        task_run = str(getattr(record, "task_run_id", "") or "")
        if isinstance(error, Rejection) and record.name.startswith("prefect.task_runs"):
            self.rejected_task_runs.add(task_run)
            return False
        if isinstance(error, (KilnFlowsError, CancelledRun)) and record.name.startswith(("prefect.engine",
                                                                                          "prefect.flow_runs")):
            return not _ENDED_RUNS
        message = record.getMessage()
        if task_run and task_run in self.rejected_task_runs and message.startswith("Finished in state Failed"):
            return False
        if (not task_run and str(getattr(record, "flow_run_id", "") or "") in _ENDED_RUNS
                and message.startswith("Finished in state Failed")):
            record.levelno, record.levelname = logging.ERROR, logging.getLevelName(logging.ERROR)
        return True


_ENDED_RUNS: set[str] = set()
_TOLD_ONCE = _EndToldOnce()


def quiet_run_logs() -> None:
    """Install the filters on Prefect's task-run, flow-run and engine loggers (once per process)."""
    from flows.local_api import hide_rejection_tracebacks

    hide_rejection_tracebacks()
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _StageCompletionFilter) for f in logger.filters):
        logger.addFilter(_StageCompletionFilter())
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if _TOLD_ONCE not in logger.filters:
            # first: the traceback filter above clears the record's exception, which this one reads
            logger.filters.insert(0, _TOLD_ONCE)


def end_line(error: Any) -> str:
    """One line for a run that ends on a kiln-flows error: ``<status> (<code>) <where>: <rule>``, the status
    ``rejected`` for bad input and ``failed`` otherwise; where is the field (``spec.source.corpus``), or the
    file and line.

    Example:
        >>> from kiln_core.errors import Rejection
        >>> end_line(Rejection("invalid_student", "/x is not a directory", field="spec.student"))
        'rejected (invalid_student) spec.student: /x is not a directory'
    """
    where = " ".join(str(part) for part in (error.file, f"line {error.line}" if error.line is not None else None,
                                            error.field) if part)
    return f"{type(error).status} ({error.code}){' ' + where if where else ''}: {error.message}"



def reject_run(error: Any, adapter: str | None) -> Any:
    """The flow's end for a rejected input: a ``Failed`` state whose message is ``end_line`` and whose data
    is the error (``state.result()`` re-raises it), plus a short markdown artifact ``rejected-<adapter>``
    saying what to fix."""
    heading = "Rejected: nothing was trained or published"
    return _end_run(error, adapter, heading, [f" at `{error.field}`" if error.field else ""])


def fail_run(error: Any, adapter: str | None, *, receipt: str | None = None, checkpoint: str | None = None) -> Any:
    """The flow's end for a run that failed (its training ended ``failed``): like ``reject_run``, a ``Failed``
    state whose message is ``end_line`` and whose data is the error, and a ``failed-<adapter>`` artifact of the
    same shape naming the receipt and the newest checkpoint kept. Returning the state rather than raising
    keeps Prefect's traceback and "Engine execution exited with unexpected exception" out of the log."""
    kept = [f"\nReceipt: `{receipt}`\n" if receipt else "",
            f"\nNewest checkpoint (kept; a retry resumes from it): `{checkpoint}`\n" if checkpoint else ""]
    return _end_run(error, adapter, "Failed: nothing was published", ["", *kept])


def cancel_run(message: str) -> Any:
    """The flow's end for a run whose training was cancelled: a ``Cancelled`` state with ``message``, told by
    the run's final line alone (the engine's re-raise of it is not logged as an "unexpected exception")."""
    from prefect.runtime import flow_run
    from prefect.states import Cancelled

    _ENDED_RUNS.add(str(flow_run.get_id()))
    return Cancelled(message=message)


def _end_run(error: Any, adapter: str | None, heading: str, details: list[str]) -> Any:
    from prefect.runtime import flow_run
    from prefect.states import Failed

    line = end_line(error)
    _ENDED_RUNS.add(str(flow_run.get_id()))
    try:
        from prefect.artifacts import create_markdown_artifact

        from tasks.artifacts import artifact_key

        status = type(error).status
        create_markdown_artifact(
            key=artifact_key(status, adapter or "run"),
            markdown=f"### {heading}\n\n**{error.code}**{details[0]}\n\n{error.message}\n{''.join(details[1:])}",
            description=line[:200])
    except Exception as failure:  # noqa: BLE001 - the artifact is a courtesy; the state carries the error
        logging.getLogger("kiln_flows").debug("could not write the %s artifact: %s", heading, failure)
    return Failed(message=line, data=error)


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


def request_adapter(request: Any) -> str | None:
    """A Kiln request's ``name`` (the adapter it publishes), valid or not yet validated; None when it has none."""
    name = request.get("name") if isinstance(request, dict) else getattr(request, "name", None)
    return name if isinstance(name, str) and name.strip() else None


def request_run_name(prefix: str) -> Callable[[], str]:
    """The ``flow_run_name`` of a flow whose ``request`` parameter is a Kiln request: ``<prefix>-<name>``, or
    the name the run was created with when it came from a deployment (``<prefix>-run`` outside a flow run).

    Example:
        >>> request_run_name("merge")()
        'merge-run'
    """
    def name() -> str:
        from prefect.context import FlowRunContext

        context = FlowRunContext.get()
        if context is None or context.flow_run is None:
            return f"{prefix}-run"
        if context.flow_run.deployment_id and context.flow_run.name:
            return context.flow_run.name
        return f"{prefix}-{request_adapter((context.parameters or {}).get('request')) or 'run'}"

    name.__name__ = f"{prefix.replace('-', '_')}_run_name"
    return name


# A deployment's schedule zone (``tz:Europe/Berlin``, deployments/prefect.yaml and ``serve``) says something
# about the deployment, shown on its page; on a run it would push the adapter tag behind the UI's "+1".
DEPLOYMENT_ONLY_TAG = "tz:"


def tag_run(*tags: str) -> None:
    """Add tags to the current flow run, without the deployment-only tags it inherited (best effort: a
    failed API call must not fail the run)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if run_id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            current = [tag for tag in client.read_flow_run(run_id).tags or [] if not tag.startswith(DEPLOYMENT_ONLY_TAG)]
            client.update_flow_run(run_id, tags=current + [tag for tag in tags if tag not in current])
    except Exception as error:  # noqa: BLE001 - tags are cosmetic
        logging.getLogger("kiln_flows").debug("could not tag flow run %s: %s", run_id, error)
