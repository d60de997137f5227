"""The smaller blocks of a ``PipelineSpec``: where the teacher comes from, how the pipeline runs, how
many processes train, and which vLLM servers an on-policy run uses (``kiln_core.contracts.pipeline``
assembles them into the spec).

Example:
    >>> TeacherSource(kind="local_registry", alias="qwen-teacher").label()
    'qwen-teacher'
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln_core.contracts.names import NAME_RULE, is_valid_name

__all__ = ["TeacherSource", "RunOptions", "DistributedOptions", "RayOptions", "VllmBackends", "check_ray_address"]


class TeacherSource(BaseModel):
    """Where the teacher's identity comes from."""

    model_config = ConfigDict(extra="forbid", title="Teacher",
                              json_schema_extra={"description": "Where the teacher's identity comes from."})

    kind: Literal["kiln_server", "local_registry", "local_dir", "manifest_file"] = Field(
        default="local_registry",
        description="kiln_server: fetch the manifest from a running Kiln server; local_registry: a teacher "
        "registered with kiln-flows teachers register; local_dir: a Hugging Face teacher directory; "
        "manifest_file: a file whose first line is the pinned manifest. Default: local_registry.",
        json_schema_extra={"position": 0},
    )
    alias: str | None = Field(
        default=None,
        description="Teacher alias (kiln_server and local_registry only).",
        json_schema_extra={"position": 1},
    )
    url: str = Field(
        default="http://127.0.0.1:8420",
        description="Kiln server base URL (kiln_server only). Default: http://127.0.0.1:8420.",
        json_schema_extra={"position": 2},
    )
    path: str | None = Field(
        default=None,
        description="Teacher model directory (local_dir) or manifest file (manifest_file), a path or fsspec URI.",
        json_schema_extra={"position": 3},
    )

    @model_validator(mode="after")
    def _fields_for_kind(self) -> "TeacherSource":
        if self.kind in ("kiln_server", "local_registry") and not self.alias:
            raise ValueError(f"`alias` is required when `kind` is {self.kind}")
        if self.kind in ("local_dir", "manifest_file") and not self.path:
            raise ValueError(f"`path` is required when `kind` is {self.kind}")
        if self.kind == "local_registry" and not is_valid_name(self.alias):
            raise ValueError(f"`alias`: a local teacher alias must be {NAME_RULE}")
        return self

    def label(self) -> str:
        """A short name for run names and receipts."""
        return self.alias or Path(self.path or "teacher").name



DEFAULT_MAX_TRAINING_HOURS = 168.0
"""One week: the longest a run may be projected to train (``kiln_core.training.time_bound``) unless allowed more."""


class RunOptions(BaseModel):
    """How the pipeline runs (not what it trains)."""

    model_config = ConfigDict(extra="forbid", title="Run options")

    refresh: bool = Field(
        default=False, description="Re-admit and re-materialize even when this exact corpus was admitted before. "
        "Default: false."
    )
    train_retries: int = Field(
        default=2, ge=0, le=10, description="Retries of the training stage (0-10); each resumes from the newest checkpoint. Default: 2."
    )
    kiln_strict: bool = Field(default=False, description="Accept only Kiln's vLLM teacher protocol in the manifest. Default: false.")
    admit_workers: int = Field(
        default=1, ge=1, le=64, description="For a corpus given as a set of shards (a directory or an index): shards "
        "admitted at once (kiln-flows train/run: worker processes; the opd_distill flow: concurrent admit-shard "
        "tasks). Default: 1."
    )
    storage_block: str | None = Field(
        default=None,
        description="Prefect Secret block (secret/NAME) holding fsspec options per protocol, e.g. "
        "{\"s3\": {\"key\": ..., \"secret\": ...}}, used by this run's storage calls only; credentials never "
        "go in the spec itself. Default: empty (the environment's credentials).",
    )
    progress_every_seconds: float = Field(
        default=5.0, gt=0, description="Seconds between updates of the training progress artifact. Default: 5."
    )
    cancel_poll_seconds: float = Field(
        default=2.0, gt=0, description="Seconds between checks whether the flow run is being cancelled. Default: 2."
    )
    train_deployment: str | None = Field(
        default=None,
        description="Run training as this deployment of the kiln-train flow (e.g. kiln-train/gpu) on its "
        "work pool, instead of in this flow run. Default: empty (train here).",
    )
    max_training_hours: float | None = Field(
        default=DEFAULT_MAX_TRAINING_HOURS, gt=0,
        description="Refuse a run that, at the pace of its first steps, would train longer than this many hours "
        "(training_too_long); empty: no bound. Default: 168 (a week).",
    )


def _is_torchrun(value: str) -> bool:
    return value == "torchrun"


def _is_none(value: object) -> bool:
    return value is None


RAY_DEFAULT_MAX_FAILURES = 3


class RayOptions(BaseModel):
    """Where and how a Ray run trains (``distributed: {engine: ray}``; the world size is ``workers``).

    The plan carries this block to the train stage (``kiln_core.training.distributed.ray_launcher``);
    none of it is part of the run's identity: the same inputs on torchrun or on Ray with the same world
    size train the same run.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, title="Ray cluster")

    address: str = Field(default="local", description="local: start a Ray instance on this machine for the run; "
                         "auto: the running cluster (RAY_ADDRESS); or ray://host:10001. Default: local.")
    gpus_per_worker: float = Field(default=0, ge=0, description="GPUs each Ray worker takes (0 = CPU, gloo). Default: 0.")
    max_failures: int = Field(default=RAY_DEFAULT_MAX_FAILURES, ge=0, le=100,
                              description="Worker-group restarts Ray makes after a worker dies, each resuming from "
                              "the newest checkpoint (0-100). Default: 3.")

    @property
    def is_local(self) -> bool:
        """True when the run starts its own Ray instance on this machine."""
        return self.address == "local"


_FSDP_ONE_RANK = ("`distributed.strategy`: fsdp shards the student across two or more ranks; with one there is "
                  "nothing to shard: use ddp, or more ranks")


class DistributedOptions(BaseModel):
    """Data-parallel training on several processes: on one machine through ``torchrun`` (``engine:
    torchrun``, ``nproc`` ranks), or on a Ray cluster (``engine: ray``, ``workers`` ranks).

    Each optimizer step takes ``W × config.sequences_per_step`` consecutive candidates (rank r trains
    the r-th block of them, W the world size) and the LoRA gradients are summed across ranks, so the
    result equals a one-process run with ``sequences_per_step × W``, whichever engine started the ranks.
    Checkpoints resume only with the same world size. Storage must be reachable from every process
    (not ``memory://``; on a Ray cluster of several machines, not a local path).
    """

    model_config = ConfigDict(extra="forbid", title="Distributed training",
                              json_schema_extra={"description": "Data-parallel training on several processes "
                                                 "of one machine (torchrun) or on a Ray cluster."})

    engine: Literal["torchrun", "ray"] = Field(
        default="torchrun", exclude_if=_is_torchrun,
        description="torchrun: nproc processes on this machine; ray: workers on a Ray cluster (address). "
        "Default: torchrun.",
    )
    nproc: int = Field(default=1, ge=1, le=1024,
                       description="torchrun only: processes (ranks) on the training machine, 1-1024; 1 = no "
                       "torchrun. Default: 1.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="torch.distributed backend: auto = gloo on CPU, nccl on CUDA (one GPU per rank). Default: auto.",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="ddp: every rank holds the whole student, the LoRA gradients are all-reduced; fsdp: the "
        "student's base weights are sharded across the ranks' GPUs (for students that do not fit one GPU), the "
        "LoRA replicated as under ddp — same adapter; needs GPUs and two or more ranks. Default: ddp.",
    )
    address: str | None = Field(
        default=None, exclude_if=_is_none,
        description="ray only: local (a Ray instance for this run), auto (the running cluster, RAY_ADDRESS) or "
        "ray://host:10001. Default: local.",
    )
    workers: int | None = Field(default=None, ge=1, le=1024, exclude_if=_is_none,
                                description="ray only: training workers (ranks), 1-1024. Required for ray.")
    gpus_per_worker: float | None = Field(default=None, ge=0, exclude_if=_is_none,
                                          description="ray only: GPUs per worker; 0 trains on CPU with gloo. Default: 0.")
    max_failures: int | None = Field(default=None, ge=0, le=100, exclude_if=_is_none,
                                     description="ray only: worker-group restarts after a worker dies (0-100), each "
                                     "resuming from the newest checkpoint. Default: 3.")

    @model_validator(mode="after")
    def _engine_fields(self) -> "DistributedOptions":
        ray_fields = [name for name in ("address", "workers", "gpus_per_worker", "max_failures")
                      if getattr(self, name) is not None]
        if self.engine == "torchrun":
            if ray_fields:
                raise ValueError(f"`distributed.{ray_fields[0]}`: only for engine ray (torchrun uses nproc); "
                                 "add `engine: ray` or remove it")
            if self.strategy == "fsdp" and self.nproc < 2:
                raise ValueError(_FSDP_ONE_RANK)
            # fsdp on CPU: the training stage refuses it once the device is resolved (check_strategy).
            return self
        if self.nproc != 1:
            raise ValueError("`distributed.nproc`: engine ray counts ranks with `workers`, not nproc")
        if self.workers is None:
            raise ValueError("`distributed.workers`: required for engine ray (the number of training workers)")
        gpus = self.gpus_per_worker or 0
        if self.strategy == "fsdp":
            if gpus == 0:
                raise ValueError("`distributed.strategy`: fsdp shards the student across GPUs and is refused on CPU "
                                 "(gpus_per_worker: 0); use ddp (it trains the same adapter)")
            if self.workers < 2:
                raise ValueError(_FSDP_ONE_RANK)
        if self.backend == "nccl" and gpus == 0:
            raise ValueError("`distributed.backend`: nccl needs GPUs (gpus_per_worker: 0 trains on CPU); use gloo or auto")
        if self.address is not None:
            check_ray_address(self.address)
        return self

    @property
    def world_size(self) -> int:
        """The number of ranks: ``workers`` on Ray, ``nproc`` on torchrun."""
        return self.workers if self.engine == "ray" else self.nproc

    def ray_options(self) -> RayOptions | None:
        """The Ray block the plan carries (None for torchrun)."""
        if self.engine != "ray":
            return None
        return RayOptions(address=self.address or "local", gpus_per_worker=self.gpus_per_worker or 0,
                          max_failures=RAY_DEFAULT_MAX_FAILURES if self.max_failures is None else self.max_failures)


def check_ray_address(address: str) -> str:
    """``local``, ``auto``, ``ray://host:port`` or ``host:port`` (a GCS address); refuses credentials in it.

    Raises:
        ValueError: another form, or a ``user:password@`` part (secrets never go in a spec or a receipt).
    """
    if address in ("local", "auto"):
        return address
    rest = address.split("://", 1)[1] if "://" in address else address
    if "://" in address and not address.startswith("ray://"):
        raise ValueError(f"`distributed.address`: {address!r} must be local, auto, ray://host:port or host:port")
    if "@" in rest:
        raise ValueError("`distributed.address`: credentials do not go in the address (use the cluster's own "
                         "authentication)")
    if not rest or rest.startswith(":"):
        raise ValueError(f"`distributed.address`: {address!r} names no host")
    if "://" not in address and not _HOST_PORT.match(address):
        # A bare word would be handed to Ray as a cluster address and fail only when the run connects.
        raise ValueError(f"`distributed.address`: {address!r} must be local, auto, ray://host:port or host:port "
                         "(a port number after the host)")
    return address


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


class VllmBackends(BaseModel):
    """vLLM servers for an on-policy run: one samples the rollouts, one scores them (either or both).

    The rollout server serves the student base model with runtime LoRA loading
    (``kiln_core.on_policy.vllm_rollouts``); the teacher server serves the pinned teacher
    (``kiln_core.on_policy.vllm_teacher``). Plain HTTP only to a loopback host; an API key comes from
    the ``VLLM_API_KEY`` environment variable, never from here.
    """

    model_config = ConfigDict(extra="forbid", title="vLLM servers (on-policy)",
                              json_schema_extra={"description": "vLLM servers for an on-policy run: one samples "
                                                 "the rollouts, one scores them (either or both)."})

    rollouts_url: str | None = Field(
        default=None,
        description="Base URL of a vLLM server serving the student base model with --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; it samples the rollouts with the LoRA reloaded after every step. "
        "Empty: the training process samples.",
    )
    teacher_url: str | None = Field(
        default=None,
        description="Base URL of a vLLM server serving the pinned teacher (its served_model_id and Kiln "
        "fingerprint); it scores the rollouts. Empty: the local teacher scores.",
    )
    sync_dir: str | None = Field(
        default=None,
        description="Local directory the rollout server can read (a filesystem both see), where the LoRA is "
        "saved after every step. Default: vllm-sync inside the run directory (a local storage_root only).",
    )
    timeout_seconds: float = Field(default=120.0, gt=0, description="Seconds per request to either server. Default: 120.")

    @model_validator(mode="after")
    def _something_to_do(self) -> "VllmBackends":
        if self.rollouts_url is None and self.teacher_url is None:
            raise ValueError("`rollouts_url`: give rollouts_url, teacher_url or both (or remove the vllm block)")
        if self.sync_dir is not None and "://" in self.sync_dir:
            raise ValueError("`sync_dir`: must be a local directory the vLLM server can read, not a URI")
        return self
