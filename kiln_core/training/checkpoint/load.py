"""Loading a checkpoint and deciding whether a run may resume from it.

``load_checkpoint`` refuses anything that is not exactly a committed checkpoint, in the order of
Kiln's loader (``checkpoint.rs`` ``read_training_checkpoint_manifest`` then
``load_training_checkpoint``): suffix, real directory, no ``.incomplete``, a manifest
(a PEFT adapter directory is not a checkpoint), its size, a strict parse, Kiln's ``validate()``,
then the exact file set, sizes and digests. The OPD loop state and our extension file are parsed
strictly too. A manifest in kiln-flows' earlier layout is refused as such, not as a parse error.

``validate_resume`` compares the checkpoint with what this run would write, in the order of Kiln's
``opd_train`` and ``OpdCheckpointDescriptor::validate_resume`` (``opd.rs``), each with Kiln's
message and its own stable code, then our extension (world size, sequences per step, loss).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from kiln_core.canonical import kiln_compact_json, sha256_hex, sha256_prefixed
from kiln_core.contracts.checkpoint import (
    EXTENSION_FILE,
    EXTENSION_FORMAT,
    LOOP_STATE_FILE,
    LORA_INIT_ALGORITHM,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    SUFFIX,
    CheckpointError,
    CheckpointManifest,
    KilnFlowsState,
    OpdLoopState,
    ResumeError,
)
from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.contracts.settings import legacy_loss_record
from kiln_core.storage import INCOMPLETE_SENTINEL, Location, iter_files
from kiln_core.training.checkpoint.contract import RunContract
from kiln_core.training.checkpoint.names import at
from kiln_core.training.checkpoint.rules import manifest_problem

__all__ = ["LoadedCheckpoint", "load_checkpoint", "validate_resume", "check_world_size"]

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that passed every loader check (not yet compared with a run)."""

    basename: str
    manifest: CheckpointManifest
    loop_state: OpdLoopState
    extension: KilnFlowsState
    adapter_tensors: dict[str, Any]
    optimizer_tensors: dict[str, Any]

    @property
    def world_size(self) -> int:
        return self.extension.world_size


def load_checkpoint(run_dir: Location | str, basename: str) -> LoadedCheckpoint:
    """Load and verify one checkpoint directory.

    Raises:
        CheckpointError: with a stable ``code`` and a message naming the checkpoint and the file.

    Example:
        >>> loaded = load_checkpoint("kiln-data/runs/demo", "demo-checkpoint-step-00000025.kiln-checkpoint")  # doctest: +SKIP
        >>> loaded.loop_state.global_step  # doctest: +SKIP
        25
    """
    from safetensors.torch import load as load_safetensors

    run_dir = at(run_dir)
    location = run_dir.child(basename)
    label = f"resume checkpoint {basename}"
    if basename.startswith(".") and ".incomplete-" in basename:
        raise CheckpointError("checkpoint_staging", f"{label} is an unpublished staging directory")
    if not basename.endswith(SUFFIX):
        raise CheckpointError("invalid_checkpoint_name",
                              f"path is not a resumable training checkpoint: directory must end with {SUFFIX!r}")
    _check_directory(location, run_dir, label)
    present = _list_regular_files(location, label)
    if INCOMPLETE_SENTINEL in present:
        raise CheckpointError("checkpoint_incomplete", f"training checkpoint is incomplete: {label} holds {INCOMPLETE_SENTINEL}",
                              file=INCOMPLETE_SENTINEL)
    if MANIFEST_FILE not in present:
        peft = any(name in present for name in PEFT_FILES)
        raise CheckpointError(
            "peft_adapter_not_checkpoint" if peft else "checkpoint_missing_manifest",
            f"missing training checkpoint manifest {MANIFEST_FILE} in {label} ({'a PEFT adapter directory' if peft else 'not committed'}); "
            "PEFT adapter snapshots are not resumable checkpoints", file=MANIFEST_FILE)
    manifest_bytes = present[MANIFEST_FILE]()
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise CheckpointError("checkpoint_manifest_invalid", f"{label}: training checkpoint manifest exceeds {MAX_MANIFEST_BYTES} bytes",
                              file=MANIFEST_FILE)
    _refuse_old_layout(manifest_bytes, label)
    manifest = _parse(CheckpointManifest, manifest_bytes, f"{label}: {MANIFEST_FILE} (parse strict training checkpoint manifest)", MANIFEST_FILE)
    if problem := manifest_problem(manifest):
        raise CheckpointError("checkpoint_manifest_invalid", f"{label}: {MANIFEST_FILE}: {problem}", file=MANIFEST_FILE)

    expected = sorted([*manifest.files, MANIFEST_FILE])
    if sorted(present) != expected:
        extra = sorted(set(present) - set(expected))
        missing = sorted(set(expected) - set(present))
        code, named = ("checkpoint_file_untracked", extra[0]) if extra else ("checkpoint_file_missing", missing[0])
        raise CheckpointError(code, f"{label}: checkpoint files do not match manifest: expected {expected}, found "
                                    f"{sorted(present)} ({named} is {'not in the manifest' if extra else 'missing'})", file=named)
    payloads: dict[str, bytes] = {}
    for rel, entry in manifest.files.items():
        payload = present[rel]()
        if len(payload) != entry.size_bytes:
            raise CheckpointError("checkpoint_file_size", f"{label}: checkpoint artifact size mismatch for {rel!r}: "
                                                          f"expected {entry.size_bytes}, found {len(payload)}", file=rel)
        if sha256_hex(payload) != entry.sha256:
            raise CheckpointError("checkpoint_file_sha256", f"{label}: checkpoint artifact checksum mismatch for {rel!r}", file=rel)
        payloads[rel] = payload

    files = manifest.state_files
    if files.loss_history is None:
        raise CheckpointError("checkpoint_loop_state_missing", f"{label}: OPD resume checkpoint has no loop-state file")
    if files.loss_history != LOOP_STATE_FILE:
        raise CheckpointError("checkpoint_loop_state_missing", f"{label}: unsupported OPD loop-state artifact {files.loss_history!r}")
    loop_state = _parse(OpdLoopState, payloads[LOOP_STATE_FILE], f"{label}: {LOOP_STATE_FILE} (parse strict OPD checkpoint loop state)",
                        LOOP_STATE_FILE)
    extension = _load_extension(manifest, payloads, label)
    return LoadedCheckpoint(
        basename=basename, manifest=manifest, loop_state=loop_state, extension=extension,
        adapter_tensors=load_safetensors(payloads[files.adapter_parameters]),
        optimizer_tensors=load_safetensors(payloads[files.optimizer_state]) if files.optimizer_state else {},
    )


def _check_directory(location: Location, run_dir: Location, label: str) -> None:
    if location.is_local:
        if os.path.islink(location.path):
            raise CheckpointError("checkpoint_symlink", f"{label} is a symlink; checkpoints must be real directories")
        if not os.path.lexists(location.path):
            raise CheckpointError("checkpoint_not_found", f"{label} does not exist in {run_dir.uri}")
        if not os.path.isdir(location.path):
            raise CheckpointError("checkpoint_not_directory", f"training checkpoint is not a regular directory: {label}")
        return
    location.refresh()  # object stores cache listings; another process may have just committed
    if not location.fs.isdir(location.path):
        raise CheckpointError("checkpoint_not_found", f"{label} does not exist in {run_dir.uri}")


def _refuse_old_layout(manifest_bytes: bytes, label: str) -> None:
    """kiln-flows before the Kiln-exact layout kept generator states inside ``rng_states`` and a
    ``distributed`` block at the top level; neither parses as Kiln's manifest."""
    try:
        value = json.loads(manifest_bytes)
    except ValueError:
        return  # the strict parse reports it
    streams = value.get("rng_states") if isinstance(value, dict) else None
    old = isinstance(value, dict) and ("distributed" in value or (isinstance(streams, dict) and any(
        isinstance(s, (dict, list)) and (isinstance(s, list) or "state_base64" in s) for s in streams.values())))
    if old:
        raise CheckpointError(
            "checkpoint_old_format",
            f"{label} was written by an older kiln-flows (generator states inside the manifest, before the "
            f"Kiln-exact {EXTENSION_FORMAT} layout); it cannot be resumed by this version: finish that run with "
            "the kiln-flows version that started it, or start a new run", file=MANIFEST_FILE)


def _load_extension(manifest: CheckpointManifest, payloads: dict[str, bytes], label: str) -> KilnFlowsState:
    entry = manifest.files.get(EXTENSION_FILE)
    if entry is None:
        raise CheckpointError(
            "checkpoint_extension_missing",
            f"{label} has no {EXTENSION_FILE}: it was not written by kiln-flows (a checkpoint written by Kiln "
            "records no Python/NumPy/torch generator states, so kiln-flows cannot resume it exactly)", file=EXTENSION_FILE)
    if entry.role != "rng-state":
        raise CheckpointError("checkpoint_extension_invalid", f"{label}: {EXTENSION_FILE} has role {entry.role}, expected rng-state",
                              file=EXTENSION_FILE)
    extension = _parse(KilnFlowsState, payloads[EXTENSION_FILE], f"{label}: {EXTENSION_FILE}", EXTENSION_FILE,
                       code="checkpoint_extension_invalid")
    if len(extension.rank_rng) != extension.world_size:
        raise CheckpointError("checkpoint_extension_invalid",
                              f"{label}: {EXTENSION_FILE} holds generator states of {len(extension.rank_rng)} ranks "
                              f"for a world size of {extension.world_size}", file=EXTENSION_FILE)
    return extension


def _list_regular_files(location: Location, label: str) -> dict[str, Callable[[], bytes]]:
    """Relative path → a reader, for every file below ``location``; refuses links and odd entries."""
    if not location.is_local:
        return {rel: (lambda r=rel: location.child(r).read_bytes()) for rel in iter_files(location)}
    found: dict[str, Callable[[], bytes]] = {}
    for directory, dirs, names in os.walk(location.path):
        for name in dirs + names:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, location.path).replace(os.sep, "/")
            if os.path.islink(path):
                raise CheckpointError("checkpoint_symlink", f"{label}: checkpoint entries may not be symlinks: {rel}", file=rel)
            if name in dirs:
                continue
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
                raise CheckpointError("checkpoint_file_untracked", f"{label}: {rel} is not a regular, unlinked file", file=rel)
            found[rel] = (lambda p=path: _read_local(p))
    return found


def _read_local(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _parse(model: type[BaseModel], payload: bytes, what: str, file: str, code: str = "checkpoint_manifest_invalid") -> Any:
    try:
        return model.model_validate_json(payload)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "document"
        raise CheckpointError(code, f"{what}: field `{where}`: {first['msg']}", file=file) from None


# ---------------------------------------------------------------------------------------------
# Resume


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def check_world_size(loaded: LoadedCheckpoint, world_size: int) -> None:
    """Refuse to resume a checkpoint written by a different number of processes.

    The world size decides which candidates form each optimizer step (``world_size ×
    sequences_per_step`` of them) and how many generator states exist.

    Raises:
        ResumeError: ``resume_world_size`` naming both sizes.
    """
    saved = loaded.world_size
    if saved != world_size:
        raise ResumeError(
            "resume_world_size",
            f"resume checkpoint {loaded.basename}: checkpoint was written by a run of world size {saved} "
            f"({saved} process{'es' if saved != 1 else ''}), this run has world size {world_size}; resume with "
            f"--nproc {saved} (the world size fixes which candidates form each optimizer step)", file=EXTENSION_FILE)


def _base_weight_problem(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """``validate_checkpoint_base_weight_resume_binding`` (``checkpoint.rs`` bf4a394)."""
    from kiln_core.identity.hashing import base_model_digest

    manifest = saved.get("base_weight_shard_manifest")
    if not isinstance(manifest, dict) or not manifest.get("shards"):
        return "checkpoint has no base_weight_shard_manifest; exact resume requires per-shard base-weight provenance"
    try:
        records = [(bytes.fromhex(s["sha256"].removeprefix("sha256:")), int(s["size_bytes"])) for s in manifest["shards"]]
        aggregate = "sha256:" + base_model_digest(records)
    except (KeyError, TypeError, ValueError, AttributeError):
        return "checkpoint base_weight_shard_manifest is malformed"
    if aggregate != manifest.get("aggregate_sha256") or saved.get("base_model_weights_sha256") != aggregate:
        return (f"checkpoint base-model aggregate {saved.get('base_model_weights_sha256')} differs from its shard "
                f"manifest {manifest.get('aggregate_sha256')}")
    mine = current["base_weight_shard_manifest"]
    if (manifest.get("aggregate_algorithm"), aggregate) != (mine["aggregate_algorithm"], mine["aggregate_sha256"]):
        return "resume checkpoint base-weight shard content differs from this run"
    return None


def _provenance_problem(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The execution-provenance binding: the record is self-consistent and equals this process's."""
    record = saved.get("execution_provenance")
    if not isinstance(record, dict) or "provenance_sha256" not in record:
        return "checkpoint has no execution_provenance; exact resume requires the runtime that wrote it"
    body = {key: value for key, value in record.items() if key != "provenance_sha256"}
    if sha256_prefixed(kiln_compact_json(body).encode()) != record["provenance_sha256"]:
        return "checkpoint execution_provenance does not match its provenance_sha256"
    mine = current["execution_provenance"]
    if record["provenance_sha256"] != mine["provenance_sha256"]:
        parts = sorted(key for key in set(body) | set(mine) if key != "provenance_sha256" and body.get(key) != mine.get(key))
        return f"resume checkpoint execution provenance differs from this run (in {parts})"
    return None


def recorded_loss_matches(recorded: str, trained: str) -> bool:
    """Whether a checkpoint state's ``loss`` is the loss ``trained``: by name, or as kiln-flows recorded it before
    issue 31 (``legacy_loss_record``: ``teacher_top_k`` for the forward-KL and cross-entropy losses, and only
    them — their Kiln ``effective_config.loss``, compared earlier, names them exactly)."""
    return recorded == trained or recorded == legacy_loss_record(trained)


def validate_resume(loaded: LoadedCheckpoint, contract_for_seed: Callable[[int], RunContract],
                    requested_seed: int | None) -> RunContract:
    """Compare a loaded checkpoint with this run; return the run's contract under the checkpoint's seed.

    Raises:
        ResumeError: one stable code per check, for the first that differs.

    Example:
        >>> contract = validate_resume(load_checkpoint(run_dir, name), plan.contract_for_seed, None)  # doctest: +SKIP
    """
    m, loop = loaded.manifest, loaded.loop_state

    def fail(code: str, message: str, file: str = "checkpoint_manifest.json") -> ResumeError:
        return ResumeError(code, f"resume checkpoint {loaded.basename}: {message}", file=file)

    if m.training_kind != "opd":
        raise fail("resume_training_kind", "resume checkpoint is not an OPD checkpoint")
    probe = contract_for_seed(0)  # the adapter and the data do not depend on the seed
    if m.adapter_name != probe.adapter_name:
        raise fail("resume_adapter_name", f"resume checkpoint adapter {m.adapter_name!r} does not match {probe.adapter_name!r}")
    if m.data.content_sha256 != probe.data.content_sha256:
        raise fail("resume_data_hash", "resume checkpoint OPD training data hash differs from this request: "
                   f"checkpoint={m.data.content_sha256}, request={probe.data.content_sha256}")
    stream = m.rng_states.get("lora-init")
    if stream is None:
        raise fail("resume_lora_init", "OPD resume checkpoint has no lora-init RNG state")
    if stream.algorithm != LORA_INIT_ALGORITHM or stream.position != 0:
        raise fail("resume_lora_init", "unsupported OPD lora-init RNG state")
    if requested_seed is not None and requested_seed != stream.seed:
        raise fail("resume_seed", f"OPD resume seed {stream.seed} differs from requested seed {requested_seed}")
    contract = contract_for_seed(stream.seed)
    step = m.progress.global_step
    checks = [
        ("resume_effective_config", m.effective_config == contract.effective_config,
         "resume checkpoint effective OPD configuration differs from this request: "
         f"checkpoint={_compact(m.effective_config)}, request={_compact(contract.effective_config)}"),
        ("resume_precision", m.precision_policy == contract.precision(),
         "resume checkpoint precision policy differs from this runtime: "
         f"checkpoint={_compact(m.precision_policy.model_dump())}, request={_compact(contract.precision_policy)}"),
        ("resume_data_identity", m.data == contract.data, "resume checkpoint OPD data identity differs from this request"),
        ("resume_candidate_order", (m.progress.total_steps, m.progress.data_order) == (contract.total_candidates, contract.data_order()),
         "resume checkpoint OPD candidate order differs from this run"),
        ("resume_optimizer", m.optimizer == contract.optimizer_record(step), "resume checkpoint optimizer contract differs from this request"),
        ("resume_scheduler", m.scheduler == contract.scheduler_record(step), "resume checkpoint scheduler contract differs from this request"),
        ("resume_rng_streams", m.rng_states == contract.rng_states(loop), "resume checkpoint RNG streams differ from this request"),
        ("resume_state_files", m.state_files == contract.state_files(), "resume checkpoint OPD artifact contract differs from this runtime"),
    ]
    for code, ok, message in checks:
        if not ok:
            raise fail(code, message)
    if problem := _base_weight_problem(m.auxiliary_state, contract.auxiliary_state):
        raise fail("resume_base_weights", problem)
    if problem := _provenance_problem(m.auxiliary_state, contract.auxiliary_state):
        raise fail("resume_execution_provenance", problem)
    if m.auxiliary_state != contract.auxiliary_state:
        keys = sorted(k for k in set(m.auxiliary_state) | set(contract.auxiliary_state)
                      if m.auxiliary_state.get(k) != contract.auxiliary_state.get(k))
        raise fail("resume_auxiliary_state", f"resume checkpoint model/tokenizer/teacher/runtime identity differs from this run (keys {keys})")
    if problem := contract.loop_state_problem(m.progress, loop):
        raise fail("resume_loop_state", problem, LOOP_STATE_FILE)
    if (loop.data_stats.examples_read, loop.data_stats.examples_filtered) != (contract.examples_read, contract.examples_filtered):
        raise fail("resume_prepared_rows", "resume checkpoint OPD prepared-row counters differ from this request", LOOP_STATE_FILE)
    if contract.stateful_optimizer != (m.state_files.optimizer_state is not None):
        raise fail("resume_optimizer", "stateful OPD checkpoint has no optimizer artifact" if contract.stateful_optimizer
                   else "SGD OPD checkpoint unexpectedly contains optimizer state")
    # ours, from the extension file
    check_world_size(loaded, contract.world_size)
    ext = loaded.extension
    if ext.sequences_per_step != contract.sequences_per_step:
        raise fail("resume_sequences_per_step", f"checkpoint was written with sequences_per_step {ext.sequences_per_step}, "
                   f"this run asks for {contract.sequences_per_step}", EXTENSION_FILE)
    if not recorded_loss_matches(ext.loss, contract.loss):
        raise fail("resume_loss", f"checkpoint trained loss {ext.loss!r}, this run asks for {contract.loss!r}", EXTENSION_FILE)
    if ext.lr_schedule != contract.lr_schedule:
        raise fail("resume_lr_schedule", f"checkpoint was written with learning-rate schedule {ext.lr_schedule}, "
                   f"this run asks for {contract.lr_schedule}", EXTENSION_FILE)
    if bool(ext.pack_sequences) != bool(contract.pack_sequences):
        raise fail("resume_pack_sequences", f"checkpoint was written with pack_sequences {bool(ext.pack_sequences)}, "
                   f"this run asks for {bool(contract.pack_sequences)}", EXTENSION_FILE)
    if ext.lora_targets != contract.lora_targets:
        def named(targets: LoraTargets | None) -> str:
            return "Kiln's seven projections" if targets is None else f"[{targets.describe()}]"

        raise fail("resume_lora_targets", f"checkpoint's LoRA adapts {named(ext.lora_targets)}, this run's student "
                   f"resolves to {named(contract.lora_targets)}", EXTENSION_FILE)
    return contract
