"""Exact, resumable OPD checkpoints in Kiln's ``.kiln-checkpoint`` layout (reference/kiln-opd-spec.md §6).

A checkpoint is a directory ``<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint`` directly under
the run directory, holding ``adapter.safetensors``, ``optimizer.safetensors`` (absent for SGD),
``opd_loop_state.json`` and, written last as the commit, ``checkpoint_manifest.json``. The manifest
binds everything a resume must match (data hash, effective config, precision, optimizer, RNG streams,
model/tokenizer/teacher identity) and the size and SHA-256 of every other file.

Publishing goes through ``kiln_core.storage.StagedDirectory``: hidden staging directory with an
``.incomplete`` sentinel, fsync, rename (local), or files then the manifest last (object stores). A
published basename is never overwritten. Loading refuses anything that is not exactly a committed
checkpoint, before the trainer does any work; ``validate_resume`` then compares each identity with
the current run and raises its own ``ResumeError`` for the first that differs.

RNG generator states are stored as base64 of their exact bytes with a SHA-256 each (JSON has no
bytes), so a restore is bit-exact and a corrupted state is detected rather than silently used.

A multi-process run (``kiln_core.training.distributed``) adds one block of ours, ``distributed``
(world size, backend, strategy, every rank's RNG streams); rank 0 alone writes the checkpoint. A
single-process manifest has no such block. Resuming needs the same world size (``resume_world_size``).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln_core.canonical import sha256_hex
from kiln_core.errors import Rejection
from kiln_core.storage import INCOMPLETE_SENTINEL, Location, StagedDirectory, iter_files, list_children, resolve

MANIFEST_TYPE = "kiln.training-checkpoint.v1"
LOOP_STATE_TYPE = "kiln.opd-loop-state.v1"
DATA_SOURCE_KIND = "inline-off-policy-opd-candidate-order-v1"
LORA_INIT_ALGORITHM = "kiln.seeded-lora-init.v1"
MANIFEST_FILE = "checkpoint_manifest.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
LOOP_STATE_FILE = "opd_loop_state.json"
SUFFIX = ".kiln-checkpoint"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_ARTIFACTS = 64
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class CheckpointError(Rejection):
    """A checkpoint that cannot be written or loaded; ``code`` is stable, the message names the file."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return self.message


class ResumeError(CheckpointError):
    """A valid checkpoint whose identity differs from the run asking to resume from it."""


# ---------------------------------------------------------------------------------------------
# The manifest and loop-state contracts (our own files: strict, unknown fields denied)


class _Contract(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class FileEntry(_Contract):
    role: Literal["adapter-parameters", "optimizer-state", "loss-history"]
    size_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Progress(_Contract):
    global_step: int = Field(ge=0)
    total_steps: int = Field(ge=1)
    epoch_index: int = Field(ge=0)
    cursor_in_epoch: int = Field(ge=0)
    data_order: list[int]


class DataBinding(_Contract):
    source_kind: str
    content_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    item_count: int = Field(ge=1)


class SeededStream(_Contract):
    algorithm: str
    seed: int = Field(ge=0)
    position: int = Field(ge=0)


class GeneratorState(_Contract):
    algorithm: str
    state_base64: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class RngStates(_Contract):
    lora_init: SeededStream = Field(alias="lora-init")
    torch_cpu: GeneratorState = Field(alias="torch-cpu")
    torch_cuda: list[GeneratorState] = Field(alias="torch-cuda")
    python_random: GeneratorState = Field(alias="python-random")
    numpy: GeneratorState


class DistributedRecord(_Contract):
    """Present only in checkpoints written by a multi-process (``torch.distributed``) run.

    ``rank_rng_states[r]`` holds rank r's RNG streams (rank 0's equal the manifest's ``rng_states``);
    a resume restores each rank's own streams and needs the same ``world_size`` (the schedule puts
    ``world_size × sequences_per_step`` candidates in each optimizer step). A single-process
    checkpoint has no such block, so its manifest stays exactly Kiln's layout.
    """

    world_size: int = Field(ge=2)
    backend: str
    strategy: Literal["ddp"]
    rank_rng_states: list[RngStates]


class OptimizerRecord(_Contract):
    kind: Literal["sgd", "adam_w", "muon"]
    step: int = Field(ge=0)
    hyperparameters: dict[str, Any]
    state_file: str | None = None


class SchedulerRecord(_Contract):
    kind: Literal["constant"]
    step: int = Field(ge=0)
    state: dict[str, float]


class StateFiles(_Contract):
    adapter_parameters: str
    optimizer_state: str | None = None
    loss_history: str


class CheckpointManifest(_Contract):
    schema_version: Literal[1]
    manifest_type: Literal["kiln.training-checkpoint.v1"]
    checkpoint_kind: Literal["resumable"]
    checkpoint_id: str
    training_kind: str
    adapter_name: str
    created_at: str
    effective_config: dict[str, Any]
    precision_policy: dict[str, Any]
    progress: Progress
    data: DataBinding
    rng_states: RngStates
    optimizer: OptimizerRecord
    scheduler: SchedulerRecord
    state_files: StateFiles
    auxiliary_state: dict[str, Any]
    files: dict[str, FileEntry]
    # Our extension, omitted when None so single-process manifests are byte-for-byte Kiln's layout.
    distributed: DistributedRecord | None = Field(default=None, exclude_if=lambda value: value is None)

    @property
    def world_size(self) -> int:
        """How many processes wrote this checkpoint (1 without a ``distributed`` block)."""
        return self.distributed.world_size if self.distributed is not None else 1

    def rng_states_of_rank(self, rank: int) -> RngStates:
        """The RNG streams rank ``rank`` saved (the manifest's ``rng_states`` for a single process)."""
        if self.distributed is None:
            return self.rng_states
        return self.distributed.rank_rng_states[rank]


class OpdLoopState(_Contract):
    """``kiln.opd-loop-state.v1``: the loop's own counters; ``epoch_index``/``cursor_in_epoch`` name
    the NEXT candidate."""

    schema_version: Literal[1] = 1
    state_type: Literal["kiln.opd-loop-state.v1"] = LOOP_STATE_TYPE
    global_step: int = Field(ge=0)
    epoch_index: int = Field(ge=0)
    cursor_in_epoch: int = Field(ge=0)
    loss_history: list[float]
    last_loss: float | None
    data_stats: dict[str, int]
    token_counts: dict[str, int]
    run_env_ce: dict[str, Any]
    lora_grad_norms: list[float]
    guardrail: dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Names


def checkpoint_basename(adapter_name: str, global_step: int) -> str:
    """``offline-distilled-checkpoint-step-00000025.kiln-checkpoint`` for step 25."""
    return f"{adapter_name}-checkpoint-step-{global_step:08d}{SUFFIX}"


def checkpoint_id(global_step: int) -> str:
    return f"opd-step-{global_step:08d}"


def _name_pattern(adapter_name: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(adapter_name)}-checkpoint-step-(\d{{8}}){re.escape(SUFFIX)}$")


def checkpoint_step(basename: str, adapter_name: str) -> int | None:
    """The step encoded in ``basename``, or None if it is not this adapter's checkpoint name."""
    match = _name_pattern(adapter_name).match(basename)
    return int(match.group(1)) if match else None


def check_resume_basename(value: str, run_dir: Location, adapter_name: str) -> str:
    """Validate ``--resume-checkpoint`` before any work: a single basename ending ``.kiln-checkpoint``
    (or, on local disk, an absolute path directly beneath the run directory) of this adapter.

    Raises:
        CheckpointError: ``invalid_checkpoint_name`` for traversal, nested or outside paths, hidden
            (staging) names and other adapters' checkpoints.
    """
    name = value
    if run_dir.is_local and os.path.isabs(value):
        if os.path.normpath(os.path.dirname(value)) != os.path.normpath(run_dir.path):
            raise CheckpointError("invalid_checkpoint_name", f"resume checkpoint {value!r} is not directly beneath {run_dir.uri}")
        name = os.path.basename(value)
    if not name or "/" in name or "\\" in name or "://" in value or name in (".", ".."):
        raise CheckpointError("invalid_checkpoint_name", f"resume checkpoint {value!r} must be a single .kiln-checkpoint basename")
    if name.startswith("."):
        raise CheckpointError("invalid_checkpoint_name", f"resume checkpoint {value!r} is a hidden (staging) directory")
    if not name.endswith(SUFFIX):
        raise CheckpointError("invalid_checkpoint_name", f"resume checkpoint {value!r} must end with {SUFFIX}")
    if checkpoint_step(name, adapter_name) is None:
        raise CheckpointError(
            "invalid_checkpoint_name",
            f"resume checkpoint {value!r} is not a checkpoint of adapter {adapter_name!r} "
            f"(expected {adapter_name}-checkpoint-step-<8 digits>{SUFFIX})",
        )
    return name


def _at(run_dir: Location | str) -> Location:
    return run_dir if isinstance(run_dir, Location) else resolve(run_dir)


def _is_committed(location: Location) -> bool:
    if location.is_local and os.path.islink(location.path):
        return False
    return location.child(MANIFEST_FILE).exists()  # exists() re-reads object-store listings


def committed_checkpoints(run_dir: Location | str, adapter_name: str) -> list[tuple[int, str]]:
    """``(step, basename)`` of every committed checkpoint of ``adapter_name``, oldest first."""
    run_dir = _at(run_dir)
    found = []
    for name in list_children(run_dir):
        step = checkpoint_step(name, adapter_name)
        if step is not None and _is_committed(run_dir.child(name)):
            found.append((step, name))
    return sorted(found)


def latest_checkpoint(run_dir: Location | str, adapter_name: str) -> str | None:
    """Basename of the newest committed checkpoint (manifest present), or None.

    Example:
        >>> latest_checkpoint("kiln-data/runs/demo", "demo")  # doctest: +SKIP
        'demo-checkpoint-step-00000050.kiln-checkpoint'
    """
    found = committed_checkpoints(run_dir, adapter_name)
    return found[-1][1] if found else None


def previous_checkpoint(run_dir: Location | str, adapter_name: str, basename: str) -> str | None:
    """Basename of the newest committed checkpoint older than ``basename``, or None."""
    step = checkpoint_step(basename, adapter_name)
    older = [name for s, name in committed_checkpoints(run_dir, adapter_name) if step is None or s < step]
    return older[-1] if older else None


# ---------------------------------------------------------------------------------------------
# RNG streams


def _generator_state(algorithm: str, raw: bytes) -> GeneratorState:
    return GeneratorState(algorithm=algorithm, state_base64=base64.b64encode(raw).decode("ascii"), sha256=sha256_hex(raw))


def _state_bytes(state: GeneratorState, stream: str) -> bytes:
    raw = base64.b64decode(state.state_base64.encode("ascii"), validate=True)
    if sha256_hex(raw) != state.sha256:
        raise CheckpointError("checkpoint_manifest_invalid", f"RNG stream {stream} state does not match its sha256")
    return raw


def capture_rng_states(seed: int) -> RngStates:
    """Snapshot every RNG stream the process has (torch CPU and CUDA, Python, NumPy)."""
    import torch

    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    cuda = [
        _generator_state(f"torch.cuda.{i}", torch.cuda.get_rng_state(i).numpy().tobytes())
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ]
    return RngStates(
        lora_init=SeededStream(algorithm=LORA_INIT_ALGORITHM, seed=int(seed), position=0),
        torch_cpu=_generator_state("torch.cpu.mt19937", torch.get_rng_state().numpy().tobytes()),
        torch_cuda=cuda,
        python_random=_generator_state("python.random.mt19937", json.dumps([version, list(internal), gauss]).encode()),
        numpy=_generator_state(
            "numpy.random.mt19937",
            json.dumps([np_name, np.asarray(np_keys).tolist(), int(np_pos), int(np_has_gauss), float(np_cached)]).encode(),
        ),
    )


def restore_rng_states(states: RngStates) -> None:
    """Restore the streams captured by ``capture_rng_states`` exactly."""
    import torch

    torch.set_rng_state(torch.frombuffer(bytearray(_state_bytes(states.torch_cpu, "torch-cpu")), dtype=torch.uint8))
    for i, state in enumerate(states.torch_cuda):
        raw = bytearray(_state_bytes(state, f"torch-cuda[{i}]"))
        torch.cuda.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8), i)
    version, internal, gauss = json.loads(_state_bytes(states.python_random, "python-random"))
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json.loads(_state_bytes(states.numpy, "numpy"))
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------------------------------
# Writing


def _pretty(model: BaseModel) -> bytes:
    return json.dumps(model.model_dump(mode="json", by_alias=True), indent=2, allow_nan=False).encode("utf-8")


def write_checkpoint(
    run_dir: Location,
    *,
    adapter_name: str,
    effective_config: dict[str, Any],
    precision_policy: dict[str, Any],
    progress: Progress,
    data: DataBinding,
    rng_states: RngStates,
    optimizer_kind: str,
    optimizer_hyperparameters: dict[str, Any],
    learning_rate: float,
    auxiliary_state: dict[str, Any],
    adapter_bytes: bytes,
    optimizer_bytes: bytes | None,
    loop_state: OpdLoopState,
    distributed: DistributedRecord | None = None,
) -> str:
    """Publish one checkpoint atomically and return its basename.

    ``distributed`` (multi-process runs only) adds every rank's RNG streams and the world size.

    Raises:
        CheckpointError: ``checkpoint_exists`` ("refusing to overwrite immutable training checkpoint …")
            when the basename is already published.

    Example:
        >>> write_checkpoint(resolve("kiln-data/runs/demo"), adapter_name="demo", ...)  # doctest: +SKIP
        'demo-checkpoint-step-00000025.kiln-checkpoint'
    """
    step = progress.global_step
    basename = checkpoint_basename(adapter_name, step)
    target = run_dir.child(basename)
    if _is_committed(target) or (target.is_local and os.path.lexists(target.path)):
        raise CheckpointError("checkpoint_exists", f"refusing to overwrite immutable training checkpoint {target.uri}")
    if not target.is_local and target.exists():
        target.fs.rm(target.path, recursive=True)  # an uncommitted prefix left by a crashed attempt

    artifacts = {ADAPTER_FILE: ("adapter-parameters", adapter_bytes)}
    if optimizer_bytes is not None:
        artifacts[OPTIMIZER_FILE] = ("optimizer-state", optimizer_bytes)
    artifacts[LOOP_STATE_FILE] = ("loss-history", _pretty(loop_state))
    manifest = CheckpointManifest(
        schema_version=1,
        manifest_type=MANIFEST_TYPE,
        checkpoint_kind="resumable",
        checkpoint_id=checkpoint_id(step),
        training_kind="opd",
        adapter_name=adapter_name,
        created_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        effective_config=effective_config,
        precision_policy=precision_policy,
        progress=progress,
        data=data,
        rng_states=rng_states,
        optimizer=OptimizerRecord(
            kind=optimizer_kind,
            step=step,
            hyperparameters=optimizer_hyperparameters,
            state_file=OPTIMIZER_FILE if optimizer_bytes is not None else None,
        ),
        scheduler=SchedulerRecord(kind="constant", step=step, state={"learning_rate": learning_rate}),
        state_files=StateFiles(
            adapter_parameters=ADAPTER_FILE,
            optimizer_state=OPTIMIZER_FILE if optimizer_bytes is not None else None,
            loss_history=LOOP_STATE_FILE,
        ),
        auxiliary_state=auxiliary_state,
        files={
            rel: FileEntry(role=role, size_bytes=len(payload), sha256=sha256_hex(payload))
            for rel, (role, payload) in artifacts.items()
        },
        distributed=distributed,
    )
    manifest_bytes = _pretty(manifest)
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise CheckpointError("checkpoint_manifest_invalid", f"checkpoint manifest is {len(manifest_bytes)} bytes (max 16 MiB)")
    with StagedDirectory(target, commit_name=MANIFEST_FILE, sentinel_text=manifest.checkpoint_id + "\n") as staged:
        for rel, (_, payload) in artifacts.items():
            staged.write(rel, payload)
        if target.is_local:  # the staged set must be exactly the declared files plus the sentinel
            present = sorted(os.listdir(staged.staging.path))
            if present != sorted([*artifacts, INCOMPLETE_SENTINEL]):
                raise CheckpointError("checkpoint_manifest_invalid", f"staged checkpoint holds unexpected files {present}")
        staged.commit(manifest_bytes)
    return basename


# ---------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that passed every loader check (not yet compared with a run)."""

    basename: str
    manifest: CheckpointManifest
    loop_state: OpdLoopState
    adapter_tensors: dict[str, Any]
    optimizer_tensors: dict[str, Any]


def load_checkpoint(run_dir: Location | str, basename: str) -> LoadedCheckpoint:
    """Load and verify one checkpoint directory (reference §6.3, loader rules).

    Refuses symlinks and non-directories, staging directories and any ``.incomplete`` sentinel, PEFT
    adapter directories and other manifest-less directories, unknown manifest fields, and any
    missing, extra, resized or changed file (each error names the file).

    Raises:
        CheckpointError: with a stable ``code``.

    Example:
        >>> loaded = load_checkpoint("kiln-data/runs/demo", "demo-checkpoint-step-00000025.kiln-checkpoint")  # doctest: +SKIP
        >>> loaded.loop_state.global_step  # doctest: +SKIP
        25
    """
    from safetensors.torch import load as load_safetensors

    run_dir = _at(run_dir)
    location = run_dir.child(basename)
    label = f"resume checkpoint {basename}"
    if basename.startswith(".") and ".incomplete-" in basename:
        raise CheckpointError("checkpoint_staging", f"{label} is an unpublished staging directory")
    if location.is_local:
        if os.path.islink(location.path):
            raise CheckpointError("checkpoint_symlink", f"{label} is a symlink; checkpoints must be real directories")
        if not os.path.lexists(location.path):
            raise CheckpointError("checkpoint_not_found", f"{label} does not exist in {run_dir.uri}")
        if not os.path.isdir(location.path):
            raise CheckpointError("checkpoint_not_directory", f"{label} is not a directory")
    else:
        location.refresh()  # object stores cache listings; another process may have just committed
        if not location.fs.isdir(location.path):
            raise CheckpointError("checkpoint_not_found", f"{label} does not exist in {run_dir.uri}")
    present = _list_regular_files(location, label)
    if INCOMPLETE_SENTINEL in present:
        raise CheckpointError("checkpoint_incomplete", f"{label} is incomplete: {INCOMPLETE_SENTINEL} is present")
    if MANIFEST_FILE not in present:
        kind = "a PEFT adapter directory" if any(name in present for name in PEFT_FILES) else "not committed"
        raise CheckpointError(
            "peft_adapter_not_checkpoint" if kind.startswith("a PEFT") else "checkpoint_missing_manifest",
            f"{label} has no {MANIFEST_FILE} ({kind}): PEFT adapter snapshots are not resumable checkpoints",
        )
    manifest_bytes = present[MANIFEST_FILE]()
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise CheckpointError("checkpoint_manifest_invalid", f"{label}: {MANIFEST_FILE} exceeds 16 MiB")
    manifest = _parse(CheckpointManifest, manifest_bytes, f"{label}: {MANIFEST_FILE}")
    _check_semantics(manifest, basename, label)

    payloads: dict[str, bytes] = {}
    for rel, entry in manifest.files.items():
        if rel not in present:
            raise CheckpointError("checkpoint_file_missing", f"{label}: file {rel} listed in the manifest is missing")
        payload = present[rel]()
        if len(payload) != entry.size_bytes:
            raise CheckpointError(
                "checkpoint_file_size", f"{label}: file {rel} has {len(payload)} bytes, the manifest says {entry.size_bytes}"
            )
        if sha256_hex(payload) != entry.sha256:
            raise CheckpointError("checkpoint_file_sha256", f"{label}: file {rel} SHA-256 does not match the manifest")
        payloads[rel] = payload
    for rel in sorted(set(present) - set(manifest.files) - {MANIFEST_FILE}):
        raise CheckpointError("checkpoint_file_untracked", f"{label}: untracked file {rel} is not in the manifest")

    files = manifest.state_files
    loop_state = _parse(OpdLoopState, payloads[files.loss_history], f"{label}: {files.loss_history}")
    optimizer_tensors = load_safetensors(payloads[files.optimizer_state]) if files.optimizer_state else {}
    return LoadedCheckpoint(
        basename=basename,
        manifest=manifest,
        loop_state=loop_state,
        adapter_tensors=load_safetensors(payloads[files.adapter_parameters]),
        optimizer_tensors=optimizer_tensors,
    )


def _list_regular_files(location: Location, label: str) -> dict[str, Any]:
    """Relative path → a reader, for every file below ``location``; refuses links and odd entries."""
    if location.is_local:
        found: dict[str, Any] = {}
        for directory, dirs, names in os.walk(location.path):
            for name in dirs + names:
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, location.path).replace(os.sep, "/")
                if os.path.islink(path):
                    raise CheckpointError("checkpoint_symlink", f"{label}: {rel} is a symlink")
                if name in dirs:
                    continue
                info = os.lstat(path)
                if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
                    raise CheckpointError("checkpoint_file_untracked", f"{label}: {rel} is not a regular, unlinked file")
                found[rel] = (lambda p=path: _read_local(p))
        return found
    return {rel: (lambda r=rel: location.child(r).read_bytes()) for rel in iter_files(location)}


def _read_local(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _parse(model: type[BaseModel], payload: bytes, what: str) -> Any:
    try:
        return model.model_validate_json(payload)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "document"
        raise CheckpointError("checkpoint_manifest_invalid", f"{what}: field `{where}`: {first['msg']}") from None


def _check_semantics(manifest: CheckpointManifest, basename: str, label: str) -> None:
    step = manifest.progress.global_step
    problems = []
    if basename != checkpoint_basename(manifest.adapter_name, step):
        problems.append(f"directory name does not match adapter {manifest.adapter_name!r} at step {step}")
    if manifest.checkpoint_id != checkpoint_id(step):
        problems.append(f"checkpoint_id {manifest.checkpoint_id!r} does not match step {step}")
    if not manifest.optimizer.step == manifest.scheduler.step == step:
        problems.append("optimizer.step, scheduler.step and progress.global_step differ")
    if len(manifest.files) > MAX_ARTIFACTS:
        problems.append(f"more than {MAX_ARTIFACTS} artifacts")
    files = manifest.state_files
    roles = {files.adapter_parameters: "adapter-parameters", files.loss_history: "loss-history"}
    if files.optimizer_state:
        roles[files.optimizer_state] = "optimizer-state"
    if files.optimizer_state != manifest.optimizer.state_file:
        problems.append("optimizer.state_file and state_files.optimizer_state differ")
    for rel, role in roles.items():
        if rel not in manifest.files or manifest.files[rel].role != role:
            problems.append(f"state file {rel} is not listed with role {role}")
    dist = manifest.distributed
    if dist is not None and (len(dist.rank_rng_states) != dist.world_size or dist.rank_rng_states[0] != manifest.rng_states):
        problems.append("distributed.rank_rng_states must hold world_size entries, rank 0's equal to rng_states")
    if problems:
        raise CheckpointError("checkpoint_manifest_invalid", f"{label}: invalid manifest: {'; '.join(problems)}")


# ---------------------------------------------------------------------------------------------
# Resume validation


@dataclass(frozen=True)
class ResumeExpectation:
    """What the run asking to resume would write into its own checkpoints (seed left out: it is
    inherited from the checkpoint unless ``requested_seed`` pins it)."""

    adapter_name: str
    data: DataBinding
    requested_seed: int | None
    effective_config_for_seed: Any  # Callable[[int], dict]: the run's effective config under a seed
    precision_policy: dict[str, Any]
    total_steps: int
    data_order: list[int]
    optimizer_kind: str
    optimizer_hyperparameters: dict[str, Any]
    learning_rate: float
    cuda_streams: int
    auxiliary_state: dict[str, Any]
    data_stats: dict[str, int]
    expected_cursor: Any  # Callable[[int], tuple[int, int]]: (epoch_index, cursor) after a step
    world_size: int = 1  # processes of the run asking to resume (torch.distributed world size)


def _both(a: Any, b: Any) -> str:
    return f"checkpoint={json.dumps(a, sort_keys=True)}, request={json.dumps(b, sort_keys=True)}"


def check_world_size(loaded: LoadedCheckpoint, world_size: int) -> None:
    """Refuse to resume a checkpoint written by a different number of processes.

    The world size decides which candidates form each optimizer step (``world_size ×
    sequences_per_step`` of them) and how many per-rank RNG streams exist, so a resume with another
    size could not continue the same run.

    Raises:
        ResumeError: ``resume_world_size`` naming both sizes.
    """
    if loaded.manifest.world_size != world_size:
        saved = loaded.manifest.world_size
        raise ResumeError(
            "resume_world_size",
            f"resume checkpoint {loaded.basename}: checkpoint was written by a run of world size {saved} "
            f"({saved} process{'es' if saved != 1 else ''}), this run has world size {world_size}; resume with "
            f"--nproc {saved} (the world size fixes which candidates form each optimizer step)",
        )


def validate_resume(loaded: LoadedCheckpoint, expected: ResumeExpectation) -> int:
    """Compare a loaded checkpoint with the run; return the seed to use (the checkpoint's).

    Raises:
        ResumeError: one per identity of reference §6.3, for the first that differs.

    Example:
        >>> seed = validate_resume(load_checkpoint(run_dir, name), expectation)  # doctest: +SKIP
    """
    m, loop = loaded.manifest, loaded.loop_state
    fail = lambda code, message: ResumeError(code, f"resume checkpoint {loaded.basename}: {message}")  # noqa: E731
    if m.training_kind != "opd":
        raise fail("resume_training_kind", "resume checkpoint is not an OPD checkpoint")
    check_world_size(loaded, expected.world_size)
    if m.adapter_name != expected.adapter_name:
        raise fail("resume_adapter_name", f"checkpoint adapter {m.adapter_name!r} differs from {expected.adapter_name!r}")
    if m.data.content_sha256 != expected.data.content_sha256:
        raise fail("resume_data_hash", "resume checkpoint OPD training data hash differs from this request: "
                   + _both(m.data.content_sha256, expected.data.content_sha256))
    seed = m.rng_states.lora_init.seed
    if expected.requested_seed is not None and expected.requested_seed != seed:
        raise fail("resume_seed", f"OPD resume seed {seed} differs from requested seed {expected.requested_seed}")
    config = expected.effective_config_for_seed(seed)
    if m.effective_config != config:
        raise fail("resume_effective_config", "resume checkpoint effective OPD configuration differs from this request: "
                   + _both(m.effective_config, config))
    if m.precision_policy != expected.precision_policy:
        raise fail("resume_precision", "precision policy differs from this run: " + _both(m.precision_policy, expected.precision_policy))
    if m.data != expected.data:
        raise fail("resume_data_identity", "OPD data identity differs from this run: "
                   + _both(m.data.model_dump(), expected.data.model_dump()))
    if m.progress.total_steps != expected.total_steps or m.progress.data_order != expected.data_order:
        raise fail("resume_candidate_order", "resume checkpoint OPD candidate order differs from this run")
    has_state = expected.optimizer_kind != "sgd"
    if (m.optimizer.kind, m.optimizer.hyperparameters, m.optimizer.state_file is not None) != (
        expected.optimizer_kind, expected.optimizer_hyperparameters, has_state
    ):
        raise fail("resume_optimizer", "optimizer contract differs from this run: "
                   + _both([m.optimizer.kind, m.optimizer.hyperparameters], [expected.optimizer_kind, expected.optimizer_hyperparameters]))
    if m.scheduler.state != {"learning_rate": expected.learning_rate}:
        raise fail("resume_scheduler", "scheduler contract differs from this run: "
                   + _both(m.scheduler.state, {"learning_rate": expected.learning_rate}))
    lora = m.rng_states.lora_init
    if (lora.algorithm, lora.position, len(m.rng_states.torch_cuda)) != (LORA_INIT_ALGORITHM, 0, expected.cuda_streams):
        raise fail("resume_rng_streams", "resume checkpoint RNG streams differ from this request")
    state_files = StateFiles(adapter_parameters=ADAPTER_FILE, loss_history=LOOP_STATE_FILE,
                             optimizer_state=OPTIMIZER_FILE if has_state else None)
    if m.state_files != state_files:
        raise fail("resume_state_files", "state-file contract differs from this run")
    if m.auxiliary_state != expected.auxiliary_state:
        keys = sorted(k for k in set(m.auxiliary_state) | set(expected.auxiliary_state)
                      if m.auxiliary_state.get(k) != expected.auxiliary_state.get(k))
        raise fail("resume_auxiliary_state", f"resume checkpoint model/tokenizer/teacher/runtime identity differs from this run (keys {keys})")
    step = m.progress.global_step
    cursor = expected.expected_cursor(step)
    if (loop.global_step, loop.epoch_index, loop.cursor_in_epoch) != (step, m.progress.epoch_index, m.progress.cursor_in_epoch) \
            or (m.progress.epoch_index, m.progress.cursor_in_epoch) != cursor or len(loop.loss_history) != step:
        raise fail("resume_loop_state", "OPD loop state is inconsistent with the manifest")
    if loop.data_stats != expected.data_stats:
        raise fail("resume_prepared_rows", "resume checkpoint OPD prepared-row counters differ: " + _both(loop.data_stats, expected.data_stats))
    if step >= expected.total_steps:
        raise fail("resume_complete", f"checkpoint is at step {step} of {expected.total_steps}: nothing left to train")
    return seed
