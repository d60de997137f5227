"""Data-parallel OPD training on ``torch.distributed``: rank helpers, the gradient all-reduce,
rank-0 publishing, the ``torchrun`` launcher and the per-rank worker entry point.

How a W-process run relates to a single process (DESIGN.md decisions 5 and 8):

* **Same math as gradient accumulation.** Each optimizer step consumes ``W × sequences_per_step``
  consecutive candidates in file order; rank r takes the r-th contiguous block of
  ``sequences_per_step`` of them (with the default ``sequences_per_step = 1``: candidate r of the
  group). Every rank back-propagates ``loss / len(group)`` for its own candidates and the gradients
  are summed across ranks, so each rank holds the gradient of the mean of the group's per-sequence
  losses — what one process computes with ``sequences_per_step = W``. With W = 2 the sum is one
  floating-point addition either way round, so the adapter matches the single-process run bit for
  bit on CPU; with W > 2 the reduction order of the collective may differ from sequential
  accumulation (fp32 rounding only).
* **Replicas, not a wrapper.** The LoRA parameters are all-reduced by hand (one flat buffer per
  step) instead of wrapping the PEFT model in ``DistributedDataParallel``: DDP averages gradients
  of unscaled losses (a different rounding than the single-process accumulation) and adds hooks and
  buckets the tiny adapter does not need. Every rank starts from the same seeded LoRA init (or the
  same checkpoint) and applies the same update, so the replicas never diverge.
* **Rank 0 publishes** checkpoints, the adapter and the receipt; the others wait at a collective
  that also tells them whether rank 0 succeeded. Every rank's RNG streams are gathered into the
  checkpoint manifest (``distributed.rank_rng_states``) and restored per rank on resume.
* **Resume needs the same world size**: W decides which candidates form each step. A checkpoint
  records W, and a resume with another is refused (``ResumeError`` ``resume_world_size``) before
  any model loads.
* **Backends**: ``gloo`` on CPU, ``nccl`` on CUDA (each rank uses ``cuda:<LOCAL_RANK>``).
* **FSDP** is not implemented (``strategy: fsdp`` is refused). It would plug in at
  ``kiln_core.training.student.load_student``: shard the frozen base weights with
  ``torch.distributed.fsdp.fully_shard`` per decoder layer after the LoRA wrap, keep the LoRA
  parameters replicated (they are small) and all-reduce their gradients exactly as here; only the
  base model's memory would change, not the step's math.

Launching: ``launch`` runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m
kiln_core.training.distributed --job JOB.json --result RESULT.json --progress PROGRESS.jsonl`` and
returns rank 0's ``TrainResult``. For several machines run ``torchrun`` yourself on each node with
the request arguments of ``kiln-flows train`` (see ``main``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

__all__ = ["World", "DistributedJob", "DistributedRunError", "RankFailure", "init_world", "shutdown_world",
           "resolve_backend", "check_strategy", "torchrun_command", "launch", "main"]

T = TypeVar("T")
BACKENDS = ("auto", "gloo", "nccl")
STRATEGIES = ("ddp", "fsdp")
WORKER_MODULE = "kiln_core.training.distributed"


class RankFailure(RuntimeError):
    """Raised on the other ranks when rank 0 failed to publish (rank 0 raises the real error)."""


class DistributedRunError(RuntimeError):
    """A launched multi-process run that crashed or ended without a result."""


# ---------------------------------------------------------------------------------------------
# The world: rank, size, and the few collectives the trainer needs


@dataclass(frozen=True)
class World:
    """This process's place in a ``torch.distributed`` run (``World()`` = one process).

    Attributes:
        rank: Global rank (0 publishes).
        size: World size W.
        local_rank: Rank on this machine (the CUDA device index under nccl).
        backend: ``gloo``/``nccl``, or None for a single process.
        strategy: ``ddp`` (replicated LoRA, all-reduced gradients).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    strategy: str = "ddp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> "World":
        """The initialized default process group as a ``World``; ``World()`` when there is none."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        rank = dist.get_rank()
        return cls(rank=rank, size=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                   backend=str(dist.get_backend()))

    # -- sharding

    def shard(self, group: range, per_rank: int) -> range:
        """This rank's contiguous block of a step's candidates (empty when the group is short)."""
        start = group.start + self.rank * per_rank
        return range(min(start, group.stop), min(start + per_rank, group.stop))

    # -- collectives (all are no-ops for a single process)

    @property
    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on at least one (a collective: all ranks call it)."""
        if self.size == 1:
            return bool(flag)
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return bool(value.item())

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (e.g. a seed drawn at random)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self._device)
        torch.distributed.broadcast(tensor, src=0)
        return int(tensor.item())

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def all_gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``[...]`` per rank → ``[W, ...]`` on every rank, in rank order."""
        if self.size == 1:
            return rows[None]
        local = rows.to(self._device).contiguous()
        out = [torch.empty_like(local) for _ in range(self.size)]
        torch.distributed.all_gather(out, local)
        return torch.stack(out).cpu()

    def gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order (on every rank). No pickle: raw bytes only."""
        if self.size == 1:
            return [payload]
        lengths = self.all_gather_rows(torch.tensor([len(payload)], dtype=torch.int64))[:, 0].tolist()
        width = max(lengths)
        padded = torch.zeros(width, dtype=torch.uint8)
        if payload:
            padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = self.all_gather_rows(padded)
        return [bytes(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]

    def all_reduce_gradients_(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's ``.grad`` across ranks, in place (one flat buffer, one collective).

        A rank with no candidate in a short final group contributes zeros; a parameter that got no
        gradient on any rank keeps ``grad = None`` (as a single process would leave it).
        """
        if self.size == 1:
            return
        params = list(parameters)
        if not params:
            return
        like = params[0]
        grads = [p.grad.detach().reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params]
        present = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype, device=like.device)
        flat = torch.cat([*grads, present]).to(self._device)
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        flat = flat.to(like.device)
        offset = 0
        for p in params:
            n = p.numel()
            summed = flat[offset: offset + n].view_as(p)
            offset += n
            if p.grad is not None:
                p.grad.copy_(summed)
            else:
                p.grad = summed.clone()
        for p, count in zip(params, flat[offset:].tolist()):
            if count == 0:
                p.grad = None

    def publish_on_main(self, publish: Callable[[], T]) -> T | None:
        """Run ``publish`` on rank 0 only while the others wait; returns its value on rank 0, None elsewhere.

        Raises:
            The error of ``publish`` on rank 0; ``RankFailure`` on the other ranks when it failed.
        """
        if self.size == 1:
            return publish()
        value, error = None, None
        if self.is_main:
            try:
                value = publish()
            except BaseException as caught:  # told to the others below, then re-raised
                error = caught
        failed = self.any_rank(error is not None)  # also the barrier: nobody runs ahead of the publish
        if error is not None:
            raise error
        if failed:
            raise RankFailure("rank 0 failed to publish; see its error")
        return value


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """``gloo`` for CPU, ``nccl`` for CUDA when ``backend`` is ``auto``/None; refuses nccl on CPU."""
    from kiln_core.contracts.opd_config import ConfigError

    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ConfigError(f"distributed backend must be one of {', '.join(BACKENDS)}; got {backend!r}", "distributed.backend")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("the nccl backend needs CUDA devices; use gloo (or auto) to train on CPU", "distributed.backend",
                          code="unsupported_backend")
    return backend


def check_strategy(strategy: str | None) -> str:
    """``ddp`` is implemented; ``fsdp`` is refused with a clear error (see the module docstring)."""
    from kiln_core.contracts.opd_config import ConfigError

    strategy = strategy or "ddp"
    if strategy == "fsdp":
        raise ConfigError("distributed strategy fsdp is not implemented; use ddp (the LoRA adapter is replicated on "
                          "every rank and its gradients all-reduced)", "distributed.strategy", code="unsupported_strategy")
    if strategy != "ddp":
        raise ConfigError(f"distributed strategy must be ddp or fsdp; got {strategy!r}", "distributed.strategy")
    return strategy


def init_world(backend: str | None = "auto", device: str | None = None, strategy: str = "ddp") -> World:
    """Join the process group described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); one process without it.

    Under nccl the rank's CUDA device is set to ``cuda:<LOCAL_RANK>`` first.
    """
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.training.student import resolve_device

    size = int(os.environ.get("WORLD_SIZE", "1"))
    check_strategy(strategy)
    if size <= 1:
        return World()
    dev = resolve_device(device)
    chosen = resolve_backend(backend, dev)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if chosen == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible on this machine; "
                              "lower --nproc-per-node", "distributed.nproc", code="not_enough_devices")
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=chosen)
    return World(rank=torch.distributed.get_rank(), size=torch.distributed.get_world_size(), local_rank=local_rank,
                 backend=chosen, strategy=strategy)


def shutdown_world() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The job a launcher hands its workers


class DistributedJob(BaseModel):
    """Everything a worker needs to call ``train_opd`` (JSON, written by the launching process).

    The corpus travels as a committed materialization URI, so the workers never re-admit it; storage
    (the materialization and ``run_root``) must be reachable from every rank — a local disk for one
    machine, a shared file system or an object store for several.
    """

    model_config = ConfigDict(extra="forbid")

    materialization: str
    dataset_sha256: str
    dataset_path: str
    student_dir: str
    adapter_name: str
    config: dict[str, Any]
    run_root: str
    manifest_line: str | None = None
    teacher_alias: str
    resume_checkpoint: str | None = None
    fail_at_step: int | None = None
    device: str | None = None
    precision: str | None = None
    gradient_checkpointing: bool = False
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    strategy: Literal["ddp"] = "ddp"


def check_shared_storage(*uris: str) -> None:
    """Refuse ``memory://`` roots: each process has its own in-memory file system."""
    from kiln_core.contracts.opd_config import ConfigError

    for uri in uris:
        if uri.startswith("memory://"):
            raise ConfigError(f"{uri} is per-process memory; a multi-process run needs storage every rank can reach "
                              "(a local path, a shared file system or an object store)", "out", code="unshared_storage")


def run_job(job: DistributedJob, world: World, *, on_progress: Callable[[int, int, float], None] | None = None,
            handle_signals: bool = True):
    """Train one job on this rank (called on every rank)."""
    from kiln_core.contracts.identity import parse_manifest_line
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.materialize import read_materialization
    from kiln_core.training.trainer import train_opd

    materialization = read_materialization(job.materialization)
    teacher = (parse_manifest_line(job.manifest_line).teacher_identity if job.manifest_line
               else materialization.teacher_identity())
    return train_opd(
        tables=materialization.tables, dataset_sha256=job.dataset_sha256, dataset_path=job.dataset_path,
        student_dir=job.student_dir, adapter_name=job.adapter_name, config=OpdConfig.model_validate(job.config),
        run_root=job.run_root, teacher_identity=teacher, teacher_alias=job.teacher_alias,
        resume_checkpoint=job.resume_checkpoint, on_progress=on_progress, fail_at_step=job.fail_at_step,
        device=job.device, precision=job.precision, gradient_checkpointing=job.gradient_checkpointing,
        handle_signals=handle_signals, world=world)


# ---------------------------------------------------------------------------------------------
# Launching torchrun from one process (CLI, Prefect task)


def torchrun_command(nproc: int, worker_args: Sequence[str], *, module: str = WORKER_MODULE) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m <module> <args>``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(int(nproc)), "-m", module, *worker_args]


def launch(
    job: DistributedJob,
    nproc: int,
    *,
    on_progress: Callable[[int, int, float], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    forward_signals: bool = True,
    poll_seconds: float = 0.25,
    env: dict[str, str] | None = None,
):
    """Run ``job`` on ``nproc`` local processes under torchrun and return rank 0's ``TrainResult``.

    SIGTERM/SIGINT received by this process (and ``should_cancel()`` turning True) are passed to
    torchrun, which passes them to every rank: the run stops cooperatively at the next step
    boundary, rank 0 publishes a checkpoint and the result says ``cancelled``. The workers' output
    goes to this process's stderr, so a ``--json`` stdout stays one line.

    Raises:
        ConfigError, CheckpointError/ResumeError: rank 0 rejected the job before training.
        DistributedRunError: a rank crashed (the message is rank 0's error when it had one).
    """
    from kiln_core.training.trainer import TrainResult

    if nproc < 2:
        raise ValueError("launch() is for two or more processes; call train_opd directly for one")
    check_shared_storage(job.materialization, job.run_root)
    with tempfile.TemporaryDirectory(prefix="kiln-torchrun-") as tmp:
        job_path, result_path, progress_path = (Path(tmp, name) for name in ("job.json", "result.json", "progress.jsonl"))
        job_path.write_text(job.model_dump_json(), encoding="utf-8")
        progress_path.touch()
        command = torchrun_command(nproc, ["--job", str(job_path), "--result", str(result_path),
                                           "--progress", str(progress_path)])
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        proc = subprocess.Popen(command, env=child_env, stdin=subprocess.DEVNULL, stdout=_stderr_fd())
        with _forwarding(proc, forward_signals):
            cancelled = False
            seen = 0
            while True:
                done = proc.poll() is not None
                seen = _relay_progress(progress_path, seen, on_progress)
                if done:
                    break
                if not cancelled and should_cancel is not None and should_cancel():
                    cancelled = True
                    proc.send_signal(signal.SIGTERM)
                time.sleep(poll_seconds)
        if not result_path.exists():
            raise DistributedRunError(f"torchrun exited with status {proc.returncode} and no rank wrote a result "
                                      "(see the worker output above)")
        outcome = json.loads(result_path.read_text(encoding="utf-8"))
    if outcome["kind"] == "result":
        return TrainResult.model_validate(outcome["result"])
    if outcome["kind"] == "rejected":
        raise _rebuild_rejection(outcome["error"], outcome["payload"])
    raise DistributedRunError(outcome["message"])


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr (pytest capture): the real fd 2
        return 2


def _relay_progress(path: Path, seen: int, on_progress: Callable[[int, int, float], None] | None) -> int:
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1].decode("utf-8").splitlines()  # a line still being written waits
    for line in complete[seen:]:
        record = json.loads(line)
        if on_progress is not None:
            on_progress(record["step"], record["total"], record["loss"])
    return max(seen, len(complete))


class _forwarding:
    """Pass SIGTERM/SIGINT on to the torchrun process while it runs (main thread only)."""

    def __init__(self, proc: subprocess.Popen, enabled: bool) -> None:
        self.proc, self.previous = proc, {}
        self.enabled = enabled and threading.current_thread() is threading.main_thread()

    def __enter__(self) -> "_forwarding":
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, lambda signum, _frame: self._forward(signum))
        return self

    def _forward(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.proc.poll() is None:  # the parent is going away: do not orphan the ranks
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _rebuild_rejection(kind: str, payload: dict[str, Any]) -> Exception:
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.errors import AdmissionError
    from kiln_core.training.checkpoint import CheckpointError, ResumeError

    if kind in ("ResumeError", "CheckpointError"):
        return (ResumeError if kind == "ResumeError" else CheckpointError)(payload["code"], payload["message"])
    if kind == "AdmissionError":
        return AdmissionError(payload["code"], payload.get("line"), payload["message"])
    return ConfigError(payload["message"], payload.get("field"), code=payload.get("code", "invalid_config"))


# ---------------------------------------------------------------------------------------------
# The worker: one per rank, started by torchrun


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """One rank. Exit 0 with a result (success, failed or cancelled: the result says which), 2 for a
    rejection before training, 1 for a crash; rank 0 writes the outcome to ``--result``.

    Multi-node (every node, same arguments; storage shared by all nodes)::

        torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 \\
            --rdzv-id opd-run-1 -m kiln_core.training.distributed \\
            --request opd-request.json --adapter demo --student ./student --out s3://bucket/kiln
    """
    args = _worker_parser().parse_args(argv)
    if (args.job is None) == (args.request is None):
        print("give exactly one of --job or --request (with --adapter and --student)", file=sys.stderr)
        return 2
    job = DistributedJob.model_validate_json(Path(args.job).read_text(encoding="utf-8")) if args.job else None
    device = job.device if job else args.device
    backend = job.backend if job else args.backend
    try:
        world = init_world(backend, device)
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
    from kiln_core.training.run_request import prepare_train_request

    def prepare() -> DistributedJob:
        prepared = prepare_train_request(
            args.request, adapter=args.adapter, student_dir=args.student, out_root=args.out,
            resume_checkpoint=args.resume_checkpoint,
            on_warning=(lambda message: print(f"warning: {message}", file=sys.stderr)) if world.is_main else None)
        return prepared.job(world_size=world.size, device=args.device, precision=args.precision,
                            gradient_checkpointing=args.gradient_checkpointing, backend=args.backend)

    job = world.publish_on_main(prepare)
    return job if job is not None else prepare()


def _progress_writer(path: str) -> Callable[[int, int, float], None]:
    def write(step: int, total: int, loss: float) -> None:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "total": total, "loss": loss}) + "\n")
    return write


def _report(world: World, result_path: str | None, error: Exception) -> int:
    """Write rank 0's outcome for an error; rejections exit 2, anything else 1."""
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.errors import AdmissionError
    from kiln_core.training.checkpoint import CheckpointError

    rejected = isinstance(error, (ConfigError, CheckpointError, AdmissionError))
    if not isinstance(error, RankFailure):
        print(f"rank {world.rank}: {type(error).__name__}: {error}", file=sys.stderr)
    if world.is_main and result_path:
        if rejected:
            _write_json(result_path, {"kind": "rejected", "error": type(error).__name__, "payload": error.to_json()})
        else:
            _write_json(result_path, {"kind": "error", "message": f"{type(error).__name__}: {error}"})
    return 2 if rejected else 1


def _write_json(path: str, value: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(value, handle)
    os.replace(tmp, path)


if __name__ == "__main__":  # run the module's own import, not a second copy named __main__
    from kiln_core.training.distributed import main as _main

    sys.exit(_main())
