"""``opd_distill``: manifest → admit → materialize → train → publish, from one ``PipelineSpec``.

Run it on a schedule or from the UI's Run button (deployments/prefect.yaml), or from the command line
with ``kiln-flows run pipeline.yaml``. Stages hand each other URIs and digests only. The run's output
location ``<root>/runs/<adapter>/<run key>/`` is derived from the input digests, so a retry — in the
same process, from the UI, or on new infrastructure — resumes from the same checkpoints.
"""


from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Cancelled

from flows.spec import PipelineSpec, SpecError
from tasks.admit import admit_task, cache_options, fingerprint_inputs
from tasks.manifest import fetch_manifest
from tasks.materialize import materialize_task
from tasks.publish import publish_task, record_artifacts
from tasks.train import run_key, train_task


def prepare_config(spec: PipelineSpec):
    """Validate ``spec.config`` for offline training before any work (field named on error)."""
    from kiln_core.contracts.opd_config import ConfigError, validate_for_offline_training

    try:
        validate_for_offline_training(spec.config)
    except ConfigError as error:
        field = error.field if error.field and error.field.startswith("config") else "config"
        raise SpecError(f"invalid pipeline spec: `{field}`: {error.message}") from None
    return spec.config


@contextmanager
def storage_credentials(block_slug: str | None):
    """Apply fsspec credentials from a Prefect ``Secret`` block for the duration of a run.

    The block (slug ``secret/<name>``) holds a JSON object of fsspec options per protocol, e.g.
    ``{"s3": {"key": "...", "secret": "...", "client_kwargs": {"endpoint_url": "..."}}}``. It is merged
    into fsspec's process configuration and the previous configuration is restored afterwards, so
    secrets never travel as parameters, never reach logs and do not outlive the run.
    """
    if not block_slug:
        yield
        return
    import copy
    import json

    import fsspec
    from prefect.blocks.core import Block
    from prefect.blocks.system import Secret

    if "/" not in block_slug:
        raise SpecError(f"invalid pipeline spec: `options.storage_block`: expected `secret/<name>`, got {block_slug!r}")
    block = Block.load(block_slug)
    if not isinstance(block, Secret):
        raise SpecError(
            f"invalid pipeline spec: `options.storage_block`: {block_slug} is a {type(block).__name__} block; "
            "a `secret` block holding fsspec options is expected"
        )
    options = block.get()
    if isinstance(options, str):
        options = json.loads(options)
    saved = copy.deepcopy(fsspec.config.conf)
    try:
        for protocol, settings in dict(options).items():
            fsspec.config.conf.setdefault(protocol, {}).update(settings)
        yield
    finally:
        fsspec.config.conf.clear()
        fsspec.config.conf.update(saved)


def run_location(spec: PipelineSpec, corpus_ref, manifest_ref, student_dir: str) -> tuple[str, Any]:
    """The run directory URI and the config with a seed derived from the inputs when none is set."""
    from kiln_core.identity.hashing import base_model_sha256
    from kiln_core.storage import resolve

    config = spec.config
    decides = config.model_dump(mode="json")
    if spec.distributed and spec.distributed.nproc > 1:
        # The world size decides which candidates share a step, so it decides the run (and its checkpoints).
        decides["world_size"] = spec.distributed.nproc
    key = run_key(corpus_ref, manifest_ref, base_model_sha256(student_dir), decides)
    if config.seed is None:
        # Kiln draws a seed once per job; deriving it from the run key gives every retry the same one.
        config = config.model_copy(update={"seed": int(key, 16) % (2**63)})
    return resolve(spec.storage_root).child("runs", spec.adapter, key).uri, config


@flow(name="opd-distill", flow_run_name="opd-{spec.adapter}", log_prints=True)
def opd_distill(spec: PipelineSpec) -> dict[str, Any]:
    """Distill a teacher into a LoRA student from a teacher-scored corpus, Kiln-compatibly.

    Args:
        spec: What to train and where: teacher, corpus (or examples to score), student, storage root,
            adapter name, Kiln ``OpdConfig`` and run options.

    Returns:
        A small summary: adapter, receipt and ``latest.json`` URIs, final loss and loss history.
    """
    prepare_config(spec)
    with storage_credentials(spec.options.storage_block):
        return _run_pipeline(spec)


def _run_pipeline(spec: PipelineSpec):
    from kiln_core.storage import localize_directory

    logger = get_run_logger()
    student_dir = localize_directory(spec.student)

    manifest_ref = fetch_manifest(spec.teacher, spec.storage_root, max(32, spec.config.top_k))
    corpus_uri = spec.corpus
    if spec.examples is not None:
        from flows.score_corpus import score_for_pipeline

        corpus_uri = score_for_pipeline(spec, manifest_ref, student_dir)

    inputs = fingerprint_inputs(corpus_uri, student_dir, spec.config.top_k)
    admit = admit_task.with_options(**cache_options(spec.storage_root, spec.options.refresh))
    corpus_ref = admit(
        inputs,
        inputs.dataset_sha256,
        inputs.student_digest,
        inputs.effective_top_k,
        manifest_ref.identity_revision,
        spec.storage_root,
        manifest_ref.manifest_line,
        spec.options.kiln_strict,
    )
    corpus_ref = materialize_task(corpus_ref)
    logger.info("corpus %s: %d examples, %d action tokens", corpus_ref.dataset_sha256, corpus_ref.examples,
                corpus_ref.action_tokens)

    run_uri, config = run_location(spec, corpus_ref, manifest_ref, student_dir)
    if spec.options.train_deployment:
        train_ref = _train_on_pool(spec, corpus_ref, manifest_ref, student_dir, config, run_uri)
    else:
        train = train_task.with_options(retries=spec.options.train_retries)
        train_ref = train(
            corpus_ref,
            manifest_ref,
            student_dir,
            spec.adapter,
            config,
            run_uri,
            spec.options.progress_every_seconds,
            spec.options.cancel_poll_seconds,
            spec.distributed,
        )
    summary = {
        "status": train_ref.status,
        "adapter": train_ref.adapter_uri,
        "receipt": train_ref.receipt_uri,
        "run": train_ref.run_uri,
        "latest_checkpoint": train_ref.latest_checkpoint,
        "final_loss": train_ref.final_loss,
        "loss_history": train_ref.loss_history,
        "dataset_sha256": corpus_ref.dataset_sha256,
    }
    if train_ref.status == "success":
        published = publish_task(train_ref, spec.storage_root, spec.adapter)
        summary["latest"] = published.latest_uri
        summary["checkpoints"] = published.checkpoints
        return summary
    record_artifacts(train_ref, spec.adapter, None)
    if train_ref.status == "cancelled":
        return Cancelled(message=f"training cancelled at step {train_ref.steps}; checkpoint {train_ref.latest_checkpoint}")
    raise RuntimeError(f"training failed ({train_ref.failure_reason}); receipt {train_ref.receipt_uri}")


def _train_on_pool(spec: PipelineSpec, corpus_ref, manifest_ref, student_dir: str, config, run_uri: str):
    """Hand training to the ``kiln-train`` deployment named in the spec (e.g. on a GPU pool)."""
    from prefect.runtime import flow_run

    from flows.train_stage import dispatch_training

    parameters = {
        "corpus": corpus_ref.model_dump(mode="json"),
        "manifest": manifest_ref.model_dump(mode="json"),
        "student_dir": spec.student,  # the GPU worker localizes it itself: local paths are per machine
        "adapter": spec.adapter,
        "config": config.model_dump(mode="json", by_alias=True),
        "run_uri": run_uri,
        "progress_every_seconds": spec.options.progress_every_seconds,
        "cancel_poll_seconds": spec.options.cancel_poll_seconds,
        "retries": spec.options.train_retries,
        "distributed": spec.distributed.model_dump(mode="json") if spec.distributed else None,
    }
    return dispatch_training(
        spec.options.train_deployment,
        parent_run_id=str(flow_run.get_id()),
        run_key=run_uri.rstrip("/").rsplit("/", 1)[-1],
        parameters=parameters,
    )
