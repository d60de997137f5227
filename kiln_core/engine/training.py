"""The training stage: one process or ``torchrun``, resuming as the plan says, stoppable at a step.

``train`` is what ``kiln-flows train`` and the pipeline's train task both run:

1. a run whose adapter is committed and whose training succeeded is finished: its outputs are returned (and
   its receipt composed, if a crash left it unwritten and no gate follows);
2. ``plan.resume == "latest"`` becomes the newest committed checkpoint of the run directory, if any;
3. with ``plan.settings.world_size == 1`` the trainer runs here (``kiln_core.training.trainer.train_opd``, with the
   held-out watch when ``plan.eval_watch`` is set; for ``prompts``, ``train_on_policy`` through
   ``kiln_core.engine.prompts.train_prompts``, always here, with the same watch); above 1
   the job is launched under ``torchrun`` (``kiln_core.training.distributed.launcher.launch``): the
   ranks read the committed materialization and write into the same run directory, rank 0 publishes;
   with ``plan.ray`` the same job runs on a Ray cluster's workers instead
   (``kiln_core.training.distributed.ray_launcher.launch_on_ray``; one worker included);
4. Ctrl-C / SIGTERM (``kiln_core.training.interrupt``) and ``should_cancel`` stop the run at the next
   step boundary after a checkpoint; the result then says ``cancelled``.

Rejections (a checkpoint that does not match the run, a world size other than the checkpoint's) are
raised before any model loads; a failed or cancelled run is returned, not raised.
"""

from __future__ import annotations

from typing import Callable

from kiln_core.contracts.settings import check_one_process
from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan, TrainRef
from kiln_core.engine.runs import finished_run, newest_checkpoint
from kiln_core.storage import resolve
from kiln_core.training.interrupt import stop_requests

Progress = Callable[[int, int, float], None]


def train(plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str, *,
          on_progress: Progress | None = None, should_cancel: Callable[[], bool] | None = None,
          on_step_committed: Callable[[int], None] | None = None, handle_signals: bool = True,
          stop_on_sigterm: bool = True) -> TrainRef:
    """Train (or resume, or find finished) the run ``plan`` describes and say how it ended.

    Args:
        plan: Run directory, adapter, effective config, resume point, world size and device options.
        corpus: The committed materialization to train on.
        manifest: The teacher's pinned manifest (its identity goes into checkpoints and the receipt).
        student_dir: Local student model directory.
        on_progress: Called as ``(step, total_steps, loss)`` after each committed step.
        should_cancel: Polled at each step boundary (e.g. "is the Prefect flow run cancelling?").
        on_step_committed: Called with the step number once a step (and its checkpoint, when due) is
            committed, in this process (``train_opd``'s hook; not passed to ``torchrun`` ranks).
        handle_signals: Turn Ctrl-C/SIGTERM into a stop at the next step boundary (main thread only).
        stop_on_sigterm: False leaves SIGTERM to the handler installed before (``stop_requests``).

    Returns:
        ``TrainRef`` with status ``success``, ``failed`` or ``cancelled``.

    Raises:
        Rejection: the resume checkpoint does not fit the run (``CheckpointError``/``ResumeError``), or the
            plan cannot run (``ConfigError``: shared storage, strategy, backend).

    Example:
        >>> ref = train(plan, corpus_ref, manifest_ref, "./student")  # doctest: +SKIP
        >>> ref.status  # doctest: +SKIP
        'success'
    """
    from kiln_core.training.distributed.world import check_strategy

    settings = plan.settings
    check_strategy(settings.strategy, world_size=settings.world_size)  # fsdp with one process: nothing to shard
    run = resolve(plan.run_uri)
    finished = finished_run(run, plan.adapter) if plan.run_key == plan.inputs_key else None
    if finished is not None:
        if not plan.gate_follows:  # a crash between the training record and the receipt left it to compose
            from kiln_core.training.receipt import compose_receipt

            compose_receipt(run)
        return finished
    if plan.resume == "latest":  # the trainers take a checkpoint basename or None
        plan = plan.model_copy(update={"resume": newest_checkpoint(run, plan.adapter)})
    with stop_requests(handle_signals, sigterm=stop_on_sigterm) as stop:
        def cancel_requested() -> bool:
            return stop.is_set() or (should_cancel is not None and should_cancel())

        if corpus.kind == "prompts":
            check_one_process(ray=plan.ray is not None, field="distributed.engine")  # on-policy: rollouts, teacher scoring and steps, in this process
            from kiln_core.engine.prompts import train_prompts

            result = train_prompts(plan, corpus, manifest, student_dir, on_progress=on_progress,
                                   should_cancel=cancel_requested, on_step_committed=on_step_committed,
                                   eval_watch=held_out_slice(plan))
        elif plan.ray is not None:
            result = _launch_on_ray(plan, corpus, manifest, student_dir, on_progress, cancel_requested)
        elif settings.world_size > 1:
            result = _launch(plan, corpus, manifest, student_dir, on_progress, cancel_requested)
        else:
            result = _train_here(plan, corpus, manifest, student_dir, on_progress, cancel_requested, on_step_committed)
    return TrainRef(run_uri=run.uri, status=result.status, adapter_uri=result.adapter, receipt_uri=result.receipt,
                    latest_checkpoint=result.latest_checkpoint, final_loss=result.final_loss, steps=result.steps,
                    total_steps=result.total_steps, loss_history=list(result.loss_history),
                    failure_reason=result.failure_reason, failure_message=result.failure_message,
                    resumed_from=result.resumed_from)


def training_settings(plan: TrainPlan) -> str:
    """The effective settings a run trains with, for the log line when training starts (the CLI's and the
    flow's): the plan's resolved values (a learning rate left empty is the optimizer's default, a seed left
    empty the run key's).

    Example:
        >>> training_settings(plan)  # doctest: +SKIP
        'optimizer adam_w, learning rate 0.001, top-K 16, seed 3, publish guard on'
    """
    settings = plan.settings
    config = settings.config
    optimizer = config.optimizer.kind
    rate_text = f"{settings.learning_rate:g}" + ("" if config.learning_rate is not None else f" ({optimizer}'s default)")
    return (f"optimizer {optimizer}, learning rate {rate_text}, top-K {settings.top_k}, seed {plan.seed}, "
            f"publish guard {'on' if config.publish_guard else 'off'}")


def _train_here(plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str,
                on_progress: Progress | None, should_cancel: Callable[[], bool],
                on_step_committed: Callable[[int], None] | None):
    from kiln_core.corpus_set import training_corpus
    from kiln_core.training import trainer

    return trainer.train_opd(
        plan, training_corpus(corpus), dataset_sha256=corpus.dataset_sha256, dataset_path=corpus.source_uri,
        student_dir=student_dir, teacher_alias=manifest.teacher, teacher_identity=manifest.teacher_identity,
        should_cancel=should_cancel, on_progress=on_progress, on_step_committed=on_step_committed,
        handle_signals=False, eval_watch=held_out_slice(plan))


def held_out_slice(plan: TrainPlan):
    """The held-out watch of the spec's ``eval:`` block (docs/eval-watch.md) as the trainers take it
    (``HeldOutSlice``): the corpus ``prepare`` admitted (``plan.held_out``), read back from its
    materialization, not admitted again; None without a watch."""
    if plan.eval_watch is None:
        return None
    from kiln_core.training.watch import HeldOutSlice

    return HeldOutSlice.load(plan.eval_watch, plan.held_out)


def distributed_job(plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str):
    """The ``DistributedJob`` every rank of a ``plan.settings.world_size``-process run executes (``plan.resume`` a
    checkpoint basename or None), after the refusals that must come before any launch (strategy,
    backend, shared storage, the checkpoint's world size)."""
    from kiln_core.training.checkpoint import check_world_size, load_checkpoint
    from kiln_core.training.distributed.launcher import DistributedJob
    from kiln_core.training.distributed.world import check_shared_storage, check_strategy, resolve_backend
    from kiln_core.training.plan import check_packing_world
    from kiln_core.training.student import resolve_device

    # The workers' device: on Ray, GPUs per worker decide; under torchrun, the plan's device (else CUDA when
    # this machine has it). fsdp on CPU is refused here, not on the ranks, which stay able to run it (tests).
    device = (resolve_device("cuda" if plan.ray.gpus_per_worker > 0 else "cpu") if plan.ray is not None
              else resolve_device(plan.device))
    settings = plan.settings
    check_strategy(settings.strategy, device, settings.world_size)
    check_packing_world(settings.config, settings.world_size)
    if plan.ray is None:  # on Ray the workers' devices decide (the spec refused nccl without GPUs)
        resolve_backend(plan.backend, device)
    check_shared_storage(plan.run_uri, corpus.uri)
    if plan.resume is not None:  # another number of ranks than the checkpoint's is a rejection
        check_world_size(load_checkpoint(plan.run_uri, plan.resume), settings.world_size)
    return DistributedJob(plan=plan, corpus=corpus, manifest=manifest, student_dir=student_dir)


def _launch(plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str,
            on_progress: Progress | None, should_cancel: Callable[[], bool]):
    from kiln_core.training.distributed.launcher import launch

    job = distributed_job(plan, corpus, manifest, student_dir)
    # Ctrl-C reaches the ranks from the terminal's process group; should_cancel covers SIGTERM and
    # Prefect's cancellation (launch then passes SIGTERM on to torchrun).
    return launch(job, plan.settings.world_size, on_progress=on_progress, should_cancel=should_cancel,
                  forward_signals=False)


def _launch_on_ray(plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str,
                   on_progress: Progress | None, should_cancel: Callable[[], bool]):
    from kiln_core.training.distributed.ray_launcher import import_ray, launch_on_ray

    import_ray()  # a missing package is the first thing a user hears about, before any other check
    job = distributed_job(plan, corpus, manifest, student_dir)
    # Ray restarts a failed worker group itself (plan.ray.max_failures); should_cancel covers Ctrl-C,
    # SIGTERM and Prefect's cancellation: every rank stops at the next step boundary after a checkpoint.
    return launch_on_ray(job, plan.ray, on_progress=on_progress, should_cancel=should_cancel)
