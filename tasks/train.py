"""Stage 4, ``train``: train the LoRA student, resuming from the newest committed checkpoint.

Retry-from-checkpoint is ours, not Prefect's: every attempt (a task retry, a flow retry, the UI's
Retry button on new infrastructure) lists the run directory — derived from input digests, so every
attempt finds the same one — and resumes exactly from the newest committed ``.kiln-checkpoint``.
Deterministic failures (rejected input, a checkpoint that does not match the run) are not retried.

The task is called directly on the flow's main thread so that cancellation (SIGTERM from the worker)
reaches it; the trainer turns SIGTERM into a cooperative stop at the next step boundary, publishes a
checkpoint, and the task reports ``cancelled``.

With ``distributed.nproc > 1`` (``PipelineSpec.distributed``) the task launches ``torchrun`` as a
subprocess (``kiln_core.training.distributed.launcher.launch``): the ranks read the corpus materialization and
write into the same run directory, rank 0 publishes, and the task returns rank 0's result. A Prefect
cancellation or SIGTERM is passed on to every rank (cooperative stop + checkpoint); a crashed rank
fails the attempt, and the retry resumes from the newest checkpoint with the same number of ranks.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

from prefect import task

from tasks.artifacts import ProgressReporter, artifact_key
from tasks.refs import CorpusRef, ManifestRef, TrainRef


def run_key(corpus: CorpusRef, manifest: ManifestRef, student_weights_sha256: str, config_json: dict[str, Any]) -> str:
    """A short digest of everything that decides what a training run produces."""
    from kiln_core.canonical import canonical_json_bytes

    payload = {
        "dataset_sha256": corpus.dataset_sha256,
        "effective_top_k": corpus.effective_top_k,
        "teacher_identity_revision": manifest.identity_revision,
        "student_weights_sha256": student_weights_sha256,
        "config": config_json,
    }
    return hashlib.sha256(canonical_json_bytes(payload)).hexdigest()[:16]


def _no_retry_for_rejections(task, task_run, state) -> bool:
    """Retry crashes and I/O failures; never a rejected input (it would fail the same way again)."""
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.errors import AdmissionError
    from kiln_core.training.checkpoint import CheckpointError

    try:
        state.result()
    except (ConfigError, AdmissionError, CheckpointError):
        return False
    except Exception:
        return True
    return False


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


@task(name="train", task_run_name="train-{adapter}", retries=2, retry_delay_seconds=[2, 10],
      retry_condition_fn=_no_retry_for_rejections)
def train_task(
    corpus: CorpusRef,
    manifest: ManifestRef,
    student_dir: str,
    adapter: str,
    config: Any,
    run_uri: str,
    progress_every_seconds: float = 5.0,
    cancel_poll_seconds: float = 2.0,
    distributed: Any = None,
) -> TrainRef:
    """Train (or resume training) the adapter in ``run_uri`` and return where its outputs are.

    ``distributed``: ``PipelineSpec.distributed`` (or its dict); ``nproc > 1`` trains under torchrun.

    Example:
        ```python
        train_ref = train_task(corpus_ref, manifest_ref, "./student", "demo", spec.config,
                               "./kiln-data/runs/demo/3f2a9c0d1e2b4a5c")
        ```
    """
    from kiln_core.contracts.identity import parse_manifest_line
    from kiln_core.materialize import read_materialization
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import latest_checkpoint
    from kiln_core.training.trainer import train_opd

    run = resolve(run_uri)
    finished = finished_run(run, adapter)
    if finished is not None:
        return finished
    resume = latest_checkpoint(run, adapter)
    reporter = ProgressReporter(
        key=artifact_key("train-progress", adapter),
        description=f"training {adapter}" + (f" (resuming from {resume})" if resume else ""),
        every_seconds=progress_every_seconds,
    )
    options = _distributed_options(distributed)
    if options["nproc"] > 1:
        from kiln_core.training.checkpoint import check_world_size, load_checkpoint
        from kiln_core.training.distributed.launcher import DistributedJob, launch
        from kiln_core.training.distributed.world import check_strategy

        check_strategy(options["strategy"])
        if resume is not None:  # a retry with another number of ranks is a rejection, before any launch
            check_world_size(load_checkpoint(run, resume), options["nproc"])
        job = DistributedJob(
            materialization=corpus.uri, dataset_sha256=corpus.dataset_sha256, dataset_path=corpus.source_uri,
            student_dir=student_dir, adapter_name=adapter, config=config.model_dump(mode="json", by_alias=True),
            run_root=run.uri, manifest_line=manifest.manifest_line, teacher_alias=manifest.teacher,
            resume_checkpoint=resume, backend=options["backend"])
        result = launch(job, options["nproc"], on_progress=lambda step, total, loss: reporter.update(step, total, loss),
                        should_cancel=_cancel_poller(cancel_poll_seconds), forward_signals=True)
        return _train_ref(run, reporter, result)
    materialization = read_materialization(corpus.uri)
    result = train_opd(
        tables=materialization.tables,
        dataset_sha256=corpus.dataset_sha256,
        dataset_path=corpus.source_uri,
        student_dir=student_dir,
        adapter_name=adapter,
        config=config,
        run_root=run.uri,
        teacher_identity=parse_manifest_line(manifest.manifest_line).teacher_identity,
        teacher_alias=manifest.teacher,
        resume_checkpoint=resume,
        should_cancel=_cancel_poller(cancel_poll_seconds),
        on_progress=lambda step, total, loss: reporter.update(step, total, loss),
        handle_signals=True,
    )
    return _train_ref(run, reporter, result)


def _distributed_options(value: Any) -> dict[str, Any]:
    """``PipelineSpec.distributed`` as a dict with defaults (None → one process)."""
    options = value.model_dump() if hasattr(value, "model_dump") else dict(value or {})
    return {"nproc": int(options.get("nproc") or 1), "backend": options.get("backend") or "auto",
            "strategy": options.get("strategy") or "ddp"}


def _train_ref(run, reporter: ProgressReporter, result) -> TrainRef:
    reporter.update(result.steps, result.total_steps, result.final_loss, force=True)
    return TrainRef(
        run_uri=run.uri,
        status=result.status,
        adapter_uri=result.adapter,
        receipt_uri=result.receipt,
        latest_checkpoint=result.latest_checkpoint,
        final_loss=result.final_loss,
        steps=result.steps,
        loss_history=list(result.loss_history),
        failure_reason=result.failure_reason,
    )


def finished_run(run, adapter: str) -> TrainRef | None:
    """A run whose adapter and successful receipt are already committed is not trained again."""
    from kiln_core.training.receipt import read_receipt, receipt_status

    receipt = run.child("train_receipt.json")
    adapter_dir = run.child("adapter")
    if not adapter_dir.child("adapter_config.json").exists() or receipt_status(run) != "success":
        return None
    record = read_receipt(receipt)
    return TrainRef(
        run_uri=run.uri,
        status="success",
        adapter_uri=adapter_dir.uri,
        receipt_uri=receipt.uri,
        latest_checkpoint=None,
        final_loss=record.opd.final_opd_loss,
        steps=record.data.examples_trained,
        loss_history=list(record.loss_history),
    )
