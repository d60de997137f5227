"""``train_stage``: the training stage as its own flow, so it can run on a GPU work pool.

``opd_distill`` runs admission on whatever worker picked it up (CPU is enough) and, when
``options.train_deployment`` names a deployment of this flow, hands training to it with
``run_deployment``. The idempotency key is derived from the parent run and the input digests, so a
retry of the parent never starts a second GPU run while one is running or has finished; only a child
that ended failed or crashed is followed by a new one — which resumes from the newest checkpoint.
"""


import time
from typing import Any

from prefect import flow

from tasks.refs import CorpusRef, ManifestRef, TrainRef
from tasks.train import train_task


@flow(name="kiln-train", flow_run_name="train-{adapter}")
def train_stage(
    corpus: CorpusRef,
    manifest: ManifestRef,
    student_dir: str,
    adapter: str,
    config: dict[str, Any],
    run_uri: str,
    progress_every_seconds: float = 5.0,
    cancel_poll_seconds: float = 2.0,
    retries: int = 2,
    distributed: dict[str, Any] | None = None,
) -> TrainRef:
    """Train one run directory to completion (resuming from its newest checkpoint).

    Storage (the materialization and ``run_uri``) must be shared with the flow that dispatched this one.
    """
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.storage import localize_directory

    return train_task.with_options(retries=retries)(
        corpus, manifest, localize_directory(student_dir), adapter, OpdConfig.model_validate(config), run_uri,
        progress_every_seconds, cancel_poll_seconds, distributed,
    )


def dispatch_training(
    deployment: str,
    *,
    parent_run_id: str,
    run_key: str,
    parameters: dict[str, Any],
    max_children: int = 5,
    poll_seconds: float = 5.0,
) -> TrainRef:
    """Run ``train_stage`` as a deployment and wait for it; raise if it does not complete.

    Args:
        deployment: ``"kiln-train/<deployment name>"``.
        parent_run_id: The calling flow run's id (part of the idempotency key).
        run_key: The run directory's input digest (part of the idempotency key).
        parameters: ``train_stage`` parameters (JSON-able).
        max_children: Most children started by one parent attempt after failed predecessors.
        poll_seconds: How often the child's state is read.
    """
    from prefect import get_client
    from prefect.deployments import run_deployment

    for attempt in range(max_children):
        key = f"{parent_run_id}:train:{run_key}:{attempt}"
        child = run_deployment(deployment, parameters=parameters, idempotency_key=key, timeout=0, as_subflow=True)
        state = child.state
        if state is not None and state.is_final() and not state.is_completed():
            continue  # an earlier attempt's child failed: a new one resumes from the checkpoint
        with get_client(sync_client=True) as client:
            while not (state is not None and state.is_final()):
                time.sleep(poll_seconds)
                state = client.read_flow_run(child.id).state
        if state.is_completed():
            return _published_run(parameters["run_uri"], parameters["adapter"])
        raise RuntimeError(f"training deployment run {child.name} ended {state.type.value}: {state.message}")
    raise RuntimeError(f"{max_children} training runs of {deployment} failed for run key {run_key}")


def _published_run(run_uri: str, adapter: str) -> TrainRef:
    """The finished run as shared storage shows it (the child's Prefect result may live elsewhere)."""
    from kiln_core.storage import resolve
    from tasks.train import finished_run

    ref = finished_run(resolve(run_uri), adapter)
    if ref is None:
        raise RuntimeError(f"the training deployment completed but {run_uri} holds no successful receipt and adapter")
    return ref
