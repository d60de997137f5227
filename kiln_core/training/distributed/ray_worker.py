"""One Ray Train worker of a data-parallel run (``kiln_core.training.distributed.ray_launcher`` submits it).

The worker turns the process group Ray's torch backend initialized into this project's ``World``, asks the
driver's mailbox which attempt this is (a worker group Ray restarted resumes from the newest committed
checkpoint; rank 0 looks and the others take its answer) and calls ``worker.run_job`` — the torchrun
rank's entry point, so both engines train the same bytes. Rank 0 sends its progress lines and its outcome
to the mailbox and asks it whether the driver wants to stop. Bad input (a rejection) is reported, never
raised: Ray would restart the group for it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from kiln_core.errors import Rejection
from kiln_core.training.distributed.launcher import DistributedJob
from kiln_core.training.distributed.world import ClusterFacts, RankFailure, World

__all__ = ["train_loop_per_worker", "quiet_worker"]


class _StateApiNotice(logging.Filter):
    """Drops Ray Train's placement-group cleaner's "State API may be temporarily unavailable", repeated every
    few seconds of a run on a Ray instance started without its dashboard (kiln-flows' ``local``): the State API
    lives in the dashboard, and the cleaner only matters when the controller dies."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "State API may be temporarily unavailable" not in record.getMessage()


def quiet_worker() -> None:
    """Ray's ``worker_process_setup_hook`` of a kiln-flows run (``ray_launcher.ray_session``): each worker process
    keeps to the run's own lines. Libraries' deprecation notices about their own internals (transformers'
    ``is_gradient_checkpointing`` on every rank) and the cleaner's notice above are dropped."""
    import warnings

    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category,
                                module=r"(transformers|peft|huggingface_hub|torch|accelerate)(\.|$)")
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").addFilter(_StateApiNotice())


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's worker function: this rank's ``World``, the resume point, then ``run_job`` (the torchrun
    rank's entry point, imported here: only a worker process needs the trainer)."""
    import ray

    from kiln_core.training.distributed.worker import run_job

    job = DistributedJob.model_validate_json(config["job"])
    mailbox = config["mailbox"]
    world = _ray_world(job, ClusterFacts(**config["cluster"]))
    attempt = world.broadcast_int(ray.get(mailbox.start_attempt.remote()) if world.is_main else 0)
    try:
        job = _resume_point(job, world, attempt)
        result = run_job(job, world, on_progress=_relay(mailbox) if world.is_main else None, handle_signals=False,
                         should_cancel=_cancel_flag(mailbox) if world.is_main else None)
    except Rejection as error:  # bad input: told to the driver, never worth a restart
        if world.is_main:
            ray.get(mailbox.put_outcome.remote(json.dumps({"kind": "rejected", "error": type(error).__name__,
                                                           "payload": error.to_json()})))
        return
    except RankFailure:  # rank 0 failed to publish: its own error decides (a restart, or its rejection)
        return
    if world.is_main:
        ray.get(mailbox.put_outcome.remote(json.dumps({"kind": "result", "result": result.model_dump(mode="json")})))


def _ray_world(job: DistributedJob, facts: ClusterFacts) -> World:
    """This worker's ``World`` from the process group Ray's torch backend initialized."""
    import ray.train
    import torch

    context = ray.train.get_context()
    size = context.get_world_size()
    if size == 1:  # one worker trains exactly as one process does (no collectives, no backend recorded)
        return World(strategy=job.plan.settings.strategy, cluster=facts)
    backend = str(torch.distributed.get_backend())
    if backend == "nccl":
        import ray.train.torch

        torch.cuda.set_device(ray.train.torch.get_device())
    return World(rank=context.get_world_rank(), size=size, local_rank=context.get_local_rank(), backend=backend,
                 strategy=job.plan.settings.strategy, cluster=facts)


def _resume_point(job: DistributedJob, world: World, attempt: int) -> DistributedJob:
    """The first group resumes where the driver planned; a group Ray restarted resumes from the newest
    committed checkpoint of the run directory, as rank 0 sees it (every rank takes rank 0's answer)."""
    if attempt == 0:
        return job

    def newest() -> str:
        from kiln_core.storage import resolve
        from kiln_core.training.checkpoint import latest_checkpoint

        return latest_checkpoint(resolve(job.plan.run_uri), job.plan.adapter) or ""

    name = world.gather_bytes(newest().encode("utf-8") if world.is_main else b"")[0].decode("utf-8")
    if not name:
        return job
    print(f"rank {world.rank}: Ray restarted the worker group (attempt {attempt}); resuming from {name}", flush=True)
    return job.model_copy(update={"plan": job.plan.model_copy(update={"resume": name})})


def _relay(mailbox) -> Callable[[int, int, float], None]:
    def send(step: int, total: int, loss: float) -> None:
        mailbox.progress.remote(step, total, loss)
    return send


def _cancel_flag(mailbox, every_seconds: float = 1.0) -> Callable[[], bool]:
    """Rank 0 asks the driver's flag at most once a second (the trainer shares it with every rank)."""
    import ray

    state = {"at": 0.0, "value": False}

    def cancelled() -> bool:
        now = time.monotonic()
        if not state["value"] and now - state["at"] >= every_seconds:
            state["at"] = now
            state["value"] = bool(ray.get(mailbox.cancelled.remote()))
        return state["value"]

    return cancelled
