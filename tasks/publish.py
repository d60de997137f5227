"""Stage 5, ``publish``: ``kiln_core.engine.publish`` (verify, ``latest.json``), plus the run's artifacts."""

from __future__ import annotations

from prefect import task

from kiln_core.engine.refs import PublishRef, TrainRef
from tasks.artifacts import artifact_key, markdown_links, table_rows
from tasks.retry import retry_unless_rejected


def record_artifacts(train: TrainRef, adapter: str, published: PublishRef | None) -> None:
    """Table artifact with the receipt summary, markdown artifact with the output links."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from kiln_core.engine.publish import receipt_summary
    from kiln_core.storage import resolve
    from kiln_core.training.receipt import read_receipt

    receipt = read_receipt(train.receipt_uri)
    create_table_artifact(
        table_rows(receipt_summary(receipt)),
        key=artifact_key("receipt", adapter),
        description=f"train_receipt.json summary for {adapter}",
    )
    links = {"adapter": train.adapter_uri, "receipt": train.receipt_uri, "run directory": train.run_uri}
    if published is not None:
        links["latest.json"] = published.latest_uri
        for uri in published.checkpoints:
            links[uri.rsplit("/", 1)[-1]] = uri
    elif train.latest_checkpoint:
        links["latest checkpoint"] = resolve(train.run_uri).child(train.latest_checkpoint).uri
    create_markdown_artifact(
        markdown_links(f"Outputs of {adapter} ({train.status})", links),
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
