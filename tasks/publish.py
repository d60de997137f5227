"""Stage 5, ``publish``: ``kiln_core.engine.publish`` (verify, ``latest.json``), plus the run's artifacts."""

from __future__ import annotations

from prefect import task

from kiln_core.contracts.stage_refs import PublishRef, TrainRef
from tasks.artifacts import artifact_key, loss_curve_markdown, outputs_markdown, receipt_rows
from tasks.retry import retry_unless_rejected


def record_artifacts(train: TrainRef, adapter: str, published: PublishRef | None) -> None:
    """The run's three artifacts: the loss curve (a chart), the compact receipt table, the outputs list."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from kiln_core.storage import resolve
    from kiln_core.training.receipt import read_receipt

    receipt = read_receipt(train.receipt_uri)
    create_markdown_artifact(
        loss_curve_markdown(adapter, list(receipt.loss_history)),
        key=artifact_key("loss-curve", adapter),
        description=f"training loss of {adapter} per optimizer step",
    )
    create_table_artifact(
        receipt_rows(receipt, train.failure_reason),
        key=artifact_key("receipt", adapter),
        description=f"train_receipt.json of {adapter}, the numbers to check first",
    )
    if published is not None:
        checkpoints = list(published.checkpoints)
    elif train.latest_checkpoint:
        checkpoints = [resolve(train.run_uri).child(train.latest_checkpoint).uri]
    else:
        checkpoints = []
    create_markdown_artifact(
        outputs_markdown(adapter, train.status, adapter_uri=train.adapter_uri, receipt_uri=train.receipt_uri,
                         latest_uri=published.latest_uri if published else None, checkpoints=checkpoints,
                         run_uri=train.run_uri),
        key=artifact_key("outputs", adapter),
        description=f"where {adapter}'s adapter, receipt and checkpoints are",
    )


@task(name="publish", task_run_name="publish-{adapter}", retries=2, retry_delay_seconds=[2, 10],
      retry_condition_fn=retry_unless_rejected)
def publish_task(train: TrainRef, storage_root: str, adapter: str) -> PublishRef:
    """Verify and publish a successful training run, with artifacts.

    Example:
        ```python
        published = publish_task(train_ref, "./kiln-data", "demo")
        print(published.latest_uri)
        ```
    """
    from kiln_core.engine.publish import publish

    published = publish(train, storage_root, adapter)
    record_artifacts(train, adapter, published)
    return published
