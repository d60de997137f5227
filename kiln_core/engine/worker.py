"""One rank of a data-parallel training run, started by torchrun (``python -m kiln_core.engine.worker``).

The rank joins the process group torchrun describes, reads its job — a ``DistributedJob`` written by
the launcher, or the request arguments of ``kiln-flows train`` (rank 0 validates and admits the
request first, the others reuse its materialization) — and calls ``train_opd`` with its ``World``.
Rank 0 writes the outcome (result, rejection or crash) to ``--result`` and one JSON line per
committed step to ``--progress``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from kiln_core.training.distributed.launcher import WORKER_MODULE, DistributedJob
from kiln_core.training.distributed.world import (
    BACKENDS,
    STRATEGIES,
    RankFailure,
    World,
    init_world,
    shutdown_world,
)
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
        description="One rank of a distributed kiln-flows training run (start it with torchrun). Give either "
        "--job (written by `kiln-flows train --nproc` and the pipeline) or the request arguments of "
        "`kiln-flows train`.")
    parser.add_argument("--job", metavar="FILE", help="DistributedJob JSON")
    parser.add_argument("--result", metavar="FILE", help="rank 0 writes its outcome here as JSON")
    parser.add_argument("--progress", metavar="FILE", help="rank 0 appends one JSON line per committed step")
    parser.add_argument("--request", metavar="FILE")
    parser.add_argument("--adapter", metavar="NAME")
    parser.add_argument("--student", metavar="DIR")
    parser.add_argument("--out", default="./kiln-data", metavar="ROOT_URI")
    parser.add_argument("--resume-checkpoint", metavar="BASENAME")
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--precision", choices=("fp32", "bf16"))
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp",
                        help="ddp, or fsdp: the student's base weights sharded across the ranks' GPUs")
    parser.add_argument("--kiln-lenient", action="store_true",
                        help="--request: ignore unknown request keys as Kiln does (printed, recorded in the receipt)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """One rank. Exit 0 with a result (success, failed or cancelled: the result says which), 2 for a
    rejection before training, 1 for a crash; rank 0 writes the outcome to ``--result``.

    Multi-node (every node, same arguments; storage shared by all nodes)::

        torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 \\
            --rdzv-id opd-run-1 -m kiln_core.engine.worker \\
            --request opd-request.json --adapter demo --student ./student --out s3://bucket/kiln
    """
    args = _worker_parser().parse_args(argv)
    if (args.job is None) == (args.request is None):
        print("give exactly one of --job or --request (with --adapter and --student)", file=sys.stderr)
        return 2
    job = DistributedJob.model_validate_json(Path(args.job).read_text(encoding="utf-8")) if args.job else None
    device = job.plan.device if job else args.device
    backend = job.plan.backend if job else args.backend
    strategy = job.plan.settings.strategy if job else args.strategy
    try:
        world = init_world(backend, device, strategy)
    except Exception as error:  # noqa: BLE001 - reported like any other rejection
        return _report(World(rank=int(os.environ.get("RANK", "0"))), args.result, error)
    try:
        progress = _progress_writer(args.progress) if world.is_main and args.progress else None
        try:
            if job is None:
                job = _job_from_request(args, world)
            result = run_job(job, world, on_progress=progress)
        except Exception as error:  # noqa: BLE001
            return _report(world, args.result, error)
        if world.is_main and args.result:
            _write_json(args.result, {"kind": "result", "result": result.model_dump(mode="json")})
        return 0
    finally:
        shutdown_world()


def _job_from_request(args: argparse.Namespace, world: World) -> DistributedJob:
    """Validate and admit a request file: rank 0 first (it materializes the corpus), then the others
    (they reuse the materialization), so no two ranks ever write the same corpus."""
    from kiln_core.engine.run_request import prepare_train_request

    def prepare() -> DistributedJob:
        prepared = prepare_train_request(
            args.request, adapter=args.adapter, student_dir=args.student, out_root=args.out,
            resume_checkpoint=args.resume_checkpoint, kiln_lenient=args.kiln_lenient,
            on_warning=(lambda message: print(f"warning: {message}", file=sys.stderr)) if world.is_main else None)
        return prepared.job(world_size=world.size, device=args.device, precision=args.precision,
                            gradient_checkpointing=args.gradient_checkpointing, backend=args.backend,
                            strategy=args.strategy)

    job = world.publish_on_main(prepare)
    return job if job is not None else prepare()


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
    from kiln_core.engine.worker import main as _main

    sys.exit(_main())
