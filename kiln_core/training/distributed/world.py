"""The world of a data-parallel run: this process's rank and the few collectives the trainer needs.

How a W-process run relates to a single process (docs/architecture.md, decisions 5 and 8):

* **Same math as gradient accumulation.** Each optimizer step consumes ``W × sequences_per_step``
  consecutive candidates in file order; rank r takes the r-th contiguous block of
  ``sequences_per_step`` of them. Every rank back-propagates ``loss / len(group)`` for its own
  candidates and the gradients are summed across ranks, so each rank holds the gradient of the mean
  of the group's per-sequence losses — what one process computes with ``sequences_per_step = W``.
  With W = 2 the sum is one floating-point addition either way round, so the adapter matches the
  single-process run bit for bit on CPU; with W > 2 the reduction order may differ (fp32 rounding).
* **Replicas, not a wrapper.** The LoRA gradients are all-reduced by hand (one flat buffer per step)
  instead of wrapping the PEFT model in ``DistributedDataParallel``: DDP averages gradients of
  unscaled losses (a different rounding) and adds hooks the tiny adapter does not need.
* **Rank 0 publishes** checkpoints, the adapter and the receipt (``publish_on_main``); every rank's
  generator states go into the checkpoint's extension file and are restored per rank.
* **Backends**: ``gloo`` on CPU, ``nccl`` on CUDA (each rank uses ``cuda:<LOCAL_RANK>``).
* **FSDP** (``strategy: fsdp``, ``distributed.fsdp.shard_student``): for students that do not fit one
  GPU, the frozen base weights are sharded per decoder layer after the LoRA wrap (FSDP2
  ``fully_shard``); the LoRA parameters stay replicated and their gradients are all-reduced exactly as
  here, so the step's math, the checkpoint files and the adapter are those of ``ddp``. Refused on CPU
  and with one rank at the front (``check_strategy``).

The launcher (``launcher``) starts ranks under torchrun, ``ray_launcher`` as Ray Train workers; each rank
runs the engine's ``worker.run_job``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

__all__ = ["World", "ClusterFacts", "RankFailure", "init_world", "shutdown_world", "resolve_backend", "check_strategy",
           "check_shared_storage", "BACKENDS", "STRATEGIES"]

T = TypeVar("T")
BACKENDS = ("auto", "gloo", "nccl")
STRATEGIES = ("ddp", "fsdp")


class RankFailure(RuntimeError):
    """Raised on the other ranks when rank 0 failed to publish (rank 0 raises the real error)."""


# ---------------------------------------------------------------------------------------------
# The world: rank, size, and the few collectives the trainer needs


@dataclass(frozen=True)
class ClusterFacts:
    """Who started the ranks when it was not torchrun (the receipt's ``distributed`` block records it).

    Attributes:
        engine: ``ray``.
        version: The engine's version (``ray.__version__``).
        address: The cluster address the run was given, without credentials.
    """

    engine: str
    version: str
    address: str

    def receipt_fields(self) -> dict[str, str]:
        return {"engine": self.engine, "ray_version": self.version, "address": self.address}


@dataclass(frozen=True)
class World:
    """This process's place in a ``torch.distributed`` run (``World()`` = one process).

    Attributes:
        rank: Global rank (0 publishes).
        size: World size W.
        local_rank: Rank on this machine (the CUDA device index under nccl).
        backend: ``gloo``/``nccl``, or None for a single process.
        strategy: ``ddp`` (replicated student, all-reduced LoRA gradients) or ``fsdp`` (base weights
            sharded across the ranks, the LoRA replicated as under ddp).
        cluster: The Ray cluster that started the ranks; None under torchrun or in one process.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    strategy: str = "ddp"
    cluster: ClusterFacts | None = None

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


def check_strategy(strategy: str | None, device: torch.device | None = None, world_size: int | None = None) -> str:
    """The strategy name, checked; ``fsdp`` is refused where there is nothing to gain from it.

    The front of a run (spec validation, the training stage) passes the resolved ``device`` and the
    ``world_size``; a rank (``init_world``) checks the name only, so the fsdp code path stays reachable
    on CPU for tests below the front refusal.

    Raises:
        ConfigError: ``unsupported_strategy`` on ``distributed.strategy`` — fsdp on CPU (sharding saves
            GPU memory; on CPU ddp trains the same adapter), fsdp with one rank (nothing to shard);
            ``invalid_config`` for an unknown name.
    """
    from kiln_core.contracts.opd_config import ConfigError

    strategy = strategy or "ddp"
    if strategy not in STRATEGIES:
        raise ConfigError(f"distributed strategy must be ddp or fsdp; got {strategy!r}", "distributed.strategy")
    if strategy == "fsdp" and device is not None and device.type != "cuda":
        raise ConfigError("distributed strategy fsdp shards the student across GPUs and is refused on CPU; use ddp "
                          "(it trains the same adapter)", "distributed.strategy", code="unsupported_strategy")
    if strategy == "fsdp" and world_size is not None and world_size < 2:
        raise ConfigError("distributed strategy fsdp shards the student across two or more ranks; with one there is "
                          "nothing to shard: use ddp, or more processes/workers", "distributed.strategy",
                          code="unsupported_strategy")
    return strategy


def init_world(backend: str | None = "auto", device: str | None = None, strategy: str = "ddp") -> World:
    """Join the process group described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); one process without it.

    Under nccl the rank's CUDA device is set to ``cuda:<LOCAL_RANK>`` first. ``strategy`` is the plan's
    (``fsdp`` needs two or more ranks; its device is checked at the front, not here).
    """
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.training.student import resolve_device

    size = int(os.environ.get("WORLD_SIZE", "1"))
    check_strategy(strategy, world_size=size)
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


def check_shared_storage(*uris: str) -> None:
    """Refuse ``memory://`` roots: each process has its own in-memory file system."""
    from kiln_core.contracts.opd_config import ConfigError

    for uri in uris:
        if uri.startswith("memory://"):
            raise ConfigError(f"{uri} is per-process memory; a multi-process run needs storage every rank can reach "
                              "(a local path, a shared file system or an object store)", "out", code="unshared_storage")
