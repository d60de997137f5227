"""One rank of a data-parallel training run (``python -m kiln_core.training.distributed.worker``).

torchrun starts it on every rank: ``kiln-flows train --nproc N`` and the pipeline's train stage through
``launcher.launch``, or a user on every node of a multi-node run. The rank joins the process group
torchrun describes, reads its ``DistributedJob`` (``--job``: a path or any storage URI every node can
read; written by the launcher, or by ``kiln-flows train --write-job`` for a multi-node run) and calls
``train_opd`` with its ``World``. Rank 0 writes the outcome (result, rejection or crash) to ``--result``
and one JSON line per committed step to ``--progress``. A Ray Train worker calls ``run_job`` too
(``ray_worker``), so both engines train the same bytes.

A job is made by the one door that trains a request (``kiln_core.engine``: ``spec_from_request``, then
``prepare`` and ``distributed_job``), never here: this module sits below the engine and reads no request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Sequence

from kiln_core.training.distributed.launcher import WORKER_MODULE, DistributedJob
from kiln_core.training.distributed.world import RankFailure, World, init_world, shutdown_world
from kiln_core.training.trainer import TrainResult, train_opd

__all__ = ["run_job", "main"]


def run_job(job: DistributedJob, world: World, *, on_progress: Callable[[int, int, float], None] | None = None,
            on_step_committed: Callable[[int], None] | None = None, handle_signals: bool = True,
            should_cancel: Callable[[], bool] | None = None) -> TrainResult:
    """Train one job on this rank (called on every rank: by a torchrun rank's ``main`` or a Ray worker).

    ``should_cancel`` may be given on one rank only (rank 0 under Ray): the trainer asks every rank at
    each step boundary whether any of them wants to stop."""
    from kiln_core.corpus_set import training_corpus

    return train_opd(job.plan, training_corpus(job.corpus), dataset_sha256=job.corpus.dataset_sha256,
                     dataset_path=job.corpus.source_uri, student_dir=job.student_dir,
                     teacher_alias=job.manifest.teacher, teacher_identity=job.manifest.teacher_identity,
                     on_progress=on_progress, on_step_committed=on_step_committed, handle_signals=handle_signals,
                     should_cancel=should_cancel, world=world)


def _worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {WORKER_MODULE}",
        description="One rank of a distributed kiln-flows training run (start it with torchrun). The job is "
        "written by `kiln-flows train --nproc` and the pipeline, or by `kiln-flows train --write-job URI` for a "
        "multi-node run.")
    parser.add_argument("--job", required=True, metavar="URI", help="DistributedJob JSON: a path or a storage URI")
    parser.add_argument("--result", metavar="FILE", help="rank 0 writes its outcome here as JSON")
    parser.add_argument("--progress", metavar="FILE", help="rank 0 appends one JSON line per committed step")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """One rank. Exit 0 with a result (success, failed or cancelled: the result says which), 2 for a
    rejection before training, 1 for a crash; rank 0 writes the outcome to ``--result``.

    Multi-node (storage shared by all nodes): ``kiln-flows train ... --nproc 16 --write-job URI`` validates,
    admits and plans the run once and prints this command, which every node then runs::

        torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 \\
            --rdzv-id opd-run-1 -m kiln_core.training.distributed.worker --job s3://bucket/kiln/jobs/opd-1.json
    """
    args = _worker_parser().parse_args(argv)
    rank = World(rank=int(os.environ.get("RANK", "0")))
    try:
        job = read_job(args.job)
    except Exception as error:  # noqa: BLE001 - an unreadable job is reported like a rejection
        return _report(rank, args.result, error)
    try:
        world = init_world(job.plan.backend, job.plan.device, job.plan.settings.strategy)
    except Exception as error:  # noqa: BLE001 - reported like any other rejection
        return _report(rank, args.result, error)
    try:
        progress = _progress_writer(args.progress) if world.is_main and args.progress else None
        try:
            check_world(job, world)
            result = run_job(job, world, on_progress=progress)
        except Exception as error:  # noqa: BLE001
            return _report(world, args.result, error)
        if world.is_main and args.result:
            _write_json(args.result, {"kind": "result", "result": result.model_dump(mode="json")})
        return 0
    finally:
        shutdown_world()


def check_world(job: DistributedJob, world: World) -> None:
    """The ranks torchrun started are the ranks the job was planned for: the world size decides which
    candidates form a step and is part of the run key (docs/distributed.md).

    Raises:
        ConfigError: ``unsupported`` on ``nproc`` when they differ.
    """
    if world.size != job.plan.settings.world_size:
        from kiln_core.contracts.opd_config import ConfigError

        raise ConfigError(f"the job was planned for {job.plan.settings.world_size} ranks but torchrun started {world.size}: "
                          f"run NODES × RANKS_PER_NODE = {job.plan.settings.world_size} ranks, or write the job again with "
                          f"--nproc {world.size}", "nproc", code="unsupported")


def read_job(uri: str) -> DistributedJob:
    """The ``DistributedJob`` at ``uri`` (a local path or any storage URI the ranks can read).

    Raises:
        ConfigError: ``invalid_job``: the file cannot be read or is not a job this version writes.
    """
    from pydantic import ValidationError

    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.storage import resolve

    try:
        return DistributedJob.model_validate_json(resolve(uri).read_bytes())
    except OSError as error:
        raise ConfigError(f"cannot read the job {uri}: {error.strerror or error}", "job", code="invalid_job") from None
    except ValidationError as error:
        raise ConfigError(f"{uri} is not a kiln-flows distributed job: {error.errors()[0]['msg']}", "job",
                          code="invalid_job") from None


def _progress_writer(path: str) -> Callable[[int, int, float], None]:
    def write(step: int, total: int, loss: float) -> None:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "total": total, "loss": loss}) + "\n")
    return write


def _report(world: World, result_path: str | None, error: Exception) -> int:
    """Write rank 0's outcome for an error; rejections exit 2, anything else 1."""
    from kiln_core.errors import Rejection

    rejected = isinstance(error, Rejection)
    if not isinstance(error, RankFailure):
        print(f"rank {world.rank}: {type(error).__name__}: {error}", file=sys.stderr)
    if world.is_main and result_path:
        if rejected:
            _write_json(result_path, {"kind": "rejected", "error": type(error).__name__, "payload": error.to_json()})
        else:
            _write_json(result_path, {"kind": "error", "message": f"{type(error).__name__}: {error}"})
    return 2 if rejected else 1


def _write_json(path: str, value: dict[str, Any]) -> None:
    from kiln_core.storage import resolve, write_bytes_atomic

    write_bytes_atomic(resolve(path), json.dumps(value).encode("utf-8"))


if __name__ == "__main__":  # run the module's own import, not a second copy named __main__
    from kiln_core.training.distributed.worker import main as _main

    sys.exit(_main())
