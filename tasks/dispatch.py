"""Training on another work pool: run the ``kiln-train`` deployment once per run, and wait for it.

The idempotency key is derived from the parent run and the run key, so a retry of the parent never
starts a second training run while one is running or has finished; only a child that ended failed or
crashed is followed by a new one — which resumes from the newest checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

from kiln_core.contracts.stage_refs import TrainRef
from kiln_core.errors import EnvironmentFailure


class TrainingDeploymentFailed(EnvironmentFailure):
    """The training deployment's run did not complete (code ``training_deployment_failed``)."""


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
            return published_run(parameters["plan"]["run_uri"], parameters["plan"]["adapter"])
        raise TrainingDeploymentFailed("training_deployment_failed",
                                       f"training deployment run {child.name} ended {state.type.value}: {state.message}")
    raise TrainingDeploymentFailed("training_deployment_failed",
                                   f"{max_children} training runs of {deployment} failed for run key {run_key}")


def published_run(run_uri: str, adapter: str) -> TrainRef:
    """The finished run as shared storage shows it (the child's Prefect result may live elsewhere)."""
    from kiln_core.engine.runs import finished_run
    from kiln_core.storage import resolve

    ref = finished_run(resolve(run_uri), adapter)
    if ref is None:
        raise TrainingDeploymentFailed("training_deployment_failed", f"the training deployment completed but "
                                       f"{run_uri} holds no successful receipt and adapter")
    return ref
