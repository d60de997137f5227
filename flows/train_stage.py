"""``train_stage``: the training stage as its own flow, so it can run on a GPU work pool.

``opd_distill`` runs admission on whatever worker picked it up (CPU is enough) and, when
``options.train_deployment`` names a deployment of this flow, hands the planned run to it
(``tasks.dispatch.dispatch_training``). Storage (the materialization and the run directory) must be
shared with the flow that dispatched it.
"""


from prefect import flow

from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan, TrainRef
from tasks.dispatch import dispatch_training, published_run  # noqa: F401 - the dispatching side, re-exported
from tasks.train import train_task


@flow(name="kiln-train", flow_run_name="train-{plan.adapter}")
def train_stage(
    plan: TrainPlan,
    corpus: CorpusRef,
    manifest: ManifestRef,
    student_dir: str,
    progress_every_seconds: float = 5.0,
    cancel_poll_seconds: float = 2.0,
    retries: int = 2,
) -> TrainRef:
    """Train one planned run to completion (resuming from its newest checkpoint)."""
    from kiln_core.storage import localize_directory

    return train_task.with_options(retries=retries)(
        plan, corpus, manifest, localize_directory(student_dir), progress_every_seconds, cancel_poll_seconds)
