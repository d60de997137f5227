"""``opd_distill``: manifest → admit → materialize → train → (gate) → publish, from one ``PipelineSpec``.

Run it on a schedule or from the UI's Run button (deployments/prefect.yaml), or from the command line
with ``kiln-flows run pipeline.yaml``. The flow is the engine's ``run_pipeline`` with each stage as a
Prefect task (``tasks.stages.PrefectStages``), so it does exactly what ``kiln-flows train`` does: the
same run directory ``<root>/runs/<adapter>/<run key>/`` (derived from the input digests, so a retry —
in the same process, from the UI, or on new infrastructure — resumes from the same checkpoints), the
same ``latest.json``, the same gate (``post_eval`` / ``quality_gate``: only a promoted adapter is
published; the decision is a ``kiln-flows.adapter.*`` event, ``tasks/gate.py``). A spec whose source is
``prompts`` trains on-policy on the same path: a ``prompts`` task checks them (Kiln's submit rules,
before any model loads) in place of admission, and the ``train`` task samples, scores and trains,
storing every rollout so that a retry reuses them. A rejected input fails the run at once (never retried), with
one line as the run's state (``rejected (<code>) spec.<field>: <rule>``, the field as the form names it), the
adapter tag and a short ``rejected-<adapter>`` artifact, never as a crash; a storage or network failure is
retried by the stage's task.
"""


from contextlib import contextmanager
from typing import Any

from prefect import flow

from flows.run_log import cancel_run, fail_run, quiet_run_logs, reject_run, run_name, tag_run
from kiln_core.contracts.pipeline import PipelineSpec, SpecError
from kiln_core.errors import KilnFlowsError, Rejection


def _adapter_of(spec: Any) -> str | None:
    """The adapter name of the flow's parameter, valid or not yet validated (None when there is none)."""
    adapter = spec.get("adapter") if isinstance(spec, dict) else getattr(spec, "adapter", None)
    return adapter if isinstance(adapter, str) and adapter.strip() else None


class RunFailed(KilnFlowsError):
    """Training ended ``failed`` (its receipt says why: ``nan_loss``, ``training_diverged``, …): exit 3."""


def finish_run(result: Any, what: str, detail: str = "", *, adapter: str | None = None) -> Any:
    """End a flow run the way its pipeline ended, after one summary line in the run's log.

    Args:
        result: The ``PipelineResult`` of ``run_pipeline``.
        what: What trained, for the summary line (the adapter, ``distill pump x (examples)``, …).
        detail: More of the story for the summary line (``; sources a=4, b=3``).
        adapter: The adapter's name, for the artifact of a failed run (``failed-<adapter>``); ``what`` when
            not given.

    Returns:
        The run summary (``PipelineResult.summary()``) on success; a ``Cancelled`` state when training was
        cancelled (naming the checkpoint kept); a ``Failed`` state carrying ``RunFailed`` when training ended
        ``failed`` (``fail_run``: its code, reason and receipt in one line, shown once; exit 3 from the CLI).
    """
    from prefect import get_run_logger

    loss = "n/a" if result.final_loss is None else f"{result.final_loss:.4f}"
    get_run_logger().info("summary: %s %s after %d/%s steps, final loss %s; receipt %s%s%s", what, result.status,
                          result.steps, result.total_steps or "?", loss, result.receipt,
                          f"; latest.json {result.latest}" if result.latest else "", detail)
    if result.status == "cancelled":
        return cancel_run(cancelled_line(result))
    if result.status != "success":
        return failed_run(result, adapter or what)
    return result.summary()


def failed_run(result: Any, adapter: str) -> Any:
    """The ``Failed`` state of a run whose training ended ``failed``: ``RunFailed`` with the receipt's reason
    (ours: ``training_diverged`` where Kiln's receipt says ``training_error``), told once (``fail_run``)."""
    error = RunFailed(result.failure_reason or "training_failed",
                      f"{result.failure_message or 'training failed'}; receipt {result.receipt}")
    return fail_run(error, adapter, receipt=result.receipt, checkpoint=result.latest_checkpoint)


def cancelled_line(result: Any) -> str:
    """The final state's message of a cancelled run: where it stopped and the checkpoint a retry resumes from.

    Example:
        >>> from types import SimpleNamespace
        >>> cancelled_line(SimpleNamespace(steps=4, latest_checkpoint="a-checkpoint-step-00000004.kiln-checkpoint"))
        'training cancelled at step 4; checkpoint a-checkpoint-step-00000004.kiln-checkpoint kept (a retry resumes from it)'
    """
    if result.latest_checkpoint is None:
        return f"training cancelled at step {result.steps}; no checkpoint was committed yet (a retry starts over)"
    return f"training cancelled at step {result.steps}; checkpoint {result.latest_checkpoint} kept (a retry resumes from it)"


@contextmanager
def storage_credentials(block_slug: str | None):
    """Pass fsspec options from a Prefect ``Secret`` block to this run's storage calls.

    The block (slug ``secret/<name>``) holds a JSON object of fsspec options per protocol, e.g.
    ``{"s3": {"key": "...", "secret": "...", "client_kwargs": {"endpoint_url": "..."}}}``. The options
    are scoped to this run (``kiln_core.storage.storage_options_scope``, a context variable): fsspec's
    process-wide configuration is never written, so two runs in one worker cannot see each other's
    credentials, and secrets never travel as parameters or reach logs.
    """
    from kiln_core.storage import storage_options_scope

    if not block_slug:
        yield
        return
    import json

    from prefect.blocks.core import Block
    from prefect.blocks.system import Secret

    if "/" not in block_slug:
        raise SpecError(f"invalid pipeline spec: `options.storage_block`: expected `secret/<name>`, got {block_slug!r}",
                        "options.storage_block")
    block = Block.load(block_slug)
    if not isinstance(block, Secret):
        raise SpecError(
            f"invalid pipeline spec: `options.storage_block`: {block_slug} is a {type(block).__name__} block; "
            "a `secret` block holding fsspec options is expected", "options.storage_block")
    options = block.get()
    if isinstance(options, str):
        options = json.loads(options)
    with storage_options_scope(dict(options)):
        yield


# validate_parameters=False: the spec is validated by the `validate` task instead of by Prefect before
# the run starts, so a rule the form cannot check fails the run with one line naming the field
# (`spec.adapter: ...`) rather than Prefect's parameter-validation traceback. The UI form and the
# server's schema check still come from the annotation.
@flow(name="opd-distill", flow_run_name=run_name, log_prints=True, validate_parameters=False)
def opd_distill(spec: PipelineSpec) -> dict[str, Any]:
    """Distill a teacher into a LoRA student from a teacher-scored corpus or on-policy prompts, Kiln-compatibly.

    Args:
        spec: What to train and where: teacher, training data (corpus, examples or prompts), student, storage, adapter, config.

    Returns:
        The run summary (``PipelineResult.summary()``): adapter, receipt and ``latest.json`` URIs, final
        loss and loss history.
    """
    from kiln_core.engine import run_pipeline
    from tasks.stages import PrefectStages
    from tasks.validate import validate_spec

    quiet_run_logs()
    # The adapter tag first, from the raw parameter: a run refused for its input is still found by its tag.
    adapter = _adapter_of(spec)
    if adapter:
        tag_run(f"adapter:{adapter}")
    try:
        spec = validate_spec(spec)
        with storage_credentials(spec.options.storage_block):
            with PrefectStages(spec) as stages:  # closes the Ray session a shard admission opened, if any
                result = run_pipeline(spec, stages)
    except Rejection as error:
        # Bad input, not a crash: one line as the run's state (what the UI and the log show), a short
        # artifact, and the exception kept in the state so `kiln-flows run` still exits 2 with it.
        return reject_run(error, adapter)
    return finish_run(result, spec.adapter, adapter=spec.adapter)
