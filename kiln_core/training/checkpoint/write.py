"""Publishing a checkpoint: Kiln's commit protocol (``checkpoint.rs``
``write_training_checkpoint_atomic``) through ``StagedDirectory``.

Hidden staging directory with an ``.incomplete`` sentinel, every artifact written and fsynced, the
manifest (pretty JSON, ``files`` filled from the bytes written) created last, sentinel removed, rename
(local disk); on object stores the manifest object written last is the commit. A published basename
is never overwritten.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

from pydantic import BaseModel

from kiln_core.canonical import sha256_hex
from kiln_core.contracts.checkpoint import (
    ADAPTER_FILE,
    EXTENSION_FILE,
    LOOP_STATE_FILE,
    MANIFEST_FILE,
    MANIFEST_TYPE,
    MAX_MANIFEST_BYTES,
    OPTIMIZER_FILE,
    CheckpointError,
    CheckpointFile,
    CheckpointManifest,
    KilnFlowsState,
    OpdLoopState,
)
from kiln_core.storage import INCOMPLETE_SENTINEL, Location, StagedDirectory
from kiln_core.training.checkpoint.contract import RunContract
from kiln_core.training.checkpoint.names import checkpoint_basename, checkpoint_id, is_committed
from kiln_core.training.checkpoint.rules import manifest_problem

__all__ = ["write_checkpoint", "pretty_json"]


def pretty_json(model: BaseModel) -> bytes:
    """Pretty JSON (two-space indent, as serde's ``to_vec_pretty``), NaN and infinities refused."""
    return json.dumps(model.model_dump(mode="json"), indent=2, allow_nan=False).encode("utf-8")


def write_checkpoint(
    run_dir: Location,
    contract: RunContract,
    loop_state: OpdLoopState,
    *,
    adapter_bytes: bytes,
    optimizer_bytes: bytes | None,
    extension: KilnFlowsState,
) -> str:
    """Publish the state after ``loop_state.global_step`` committed steps; returns the basename.

    Raises:
        CheckpointError: ``checkpoint_exists`` ("refusing to overwrite immutable training checkpoint …")
            when the basename is already published; ``checkpoint_manifest_invalid`` when the records
            break one of Kiln's manifest or loop-state rules (a bug, never written).

    Example:
        >>> write_checkpoint(resolve("kiln-data/runs/demo"), contract, loop, adapter_bytes=a,
        ...                  optimizer_bytes=o, extension=state)  # doctest: +SKIP
        'demo-checkpoint-step-00000025.kiln-checkpoint'
    """
    step = loop_state.global_step
    basename = checkpoint_basename(contract.adapter_name, step)
    target = run_dir.child(basename)
    if is_committed(target) or (target.is_local and os.path.lexists(target.path)):
        raise CheckpointError("checkpoint_exists", f"refusing to overwrite immutable training checkpoint {target.uri}")
    if not target.is_local and target.exists():
        target.fs.rm(target.path, recursive=True)  # an uncommitted prefix left by a crashed attempt
    if (optimizer_bytes is not None) != contract.stateful_optimizer:
        raise CheckpointError("checkpoint_manifest_invalid", f"optimizer {contract.optimizer_kind} and its state disagree")

    artifacts = {ADAPTER_FILE: ("adapter-parameters", adapter_bytes)}
    if optimizer_bytes is not None:
        artifacts[OPTIMIZER_FILE] = ("optimizer-state", optimizer_bytes)
    artifacts[LOOP_STATE_FILE] = ("loss-history", pretty_json(loop_state))
    artifacts[EXTENSION_FILE] = ("rng-state", pretty_json(extension))
    progress = contract.progress(loop_state)
    manifest = CheckpointManifest(
        schema_version=1,
        manifest_type=MANIFEST_TYPE,
        checkpoint_kind="resumable",
        checkpoint_id=checkpoint_id(step),
        training_kind="opd",
        adapter_name=contract.adapter_name,
        created_at=datetime.now(timezone.utc).isoformat(),  # RFC 3339 with offset, as chrono's to_rfc3339
        effective_config=contract.effective_config,
        precision_policy=contract.precision(),
        progress=progress,
        data=contract.data,
        rng_states=contract.rng_states(loop_state),
        optimizer=contract.optimizer_record(step),
        scheduler=contract.scheduler_record(step),
        state_files=contract.state_files(),
        auxiliary_state=contract.auxiliary_state,
        files={rel: CheckpointFile(role=role, size_bytes=len(payload), sha256=sha256_hex(payload))
               for rel, (role, payload) in artifacts.items()},
    )
    problem = manifest_problem(manifest) or contract.loop_state_problem(progress, loop_state)
    if problem:
        raise CheckpointError("checkpoint_manifest_invalid", f"refusing to write checkpoint {basename}: {problem}")
    manifest_bytes = pretty_json(manifest)
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise CheckpointError("checkpoint_manifest_invalid", f"training checkpoint manifest exceeds {MAX_MANIFEST_BYTES} bytes")
    with StagedDirectory(target, commit_name=MANIFEST_FILE, sentinel_text=manifest.checkpoint_id + "\n") as staged:
        for rel, (_, payload) in artifacts.items():
            staged.write(rel, payload)
        if target.is_local:  # the staged set must be exactly the declared files plus the sentinel
            present = sorted(os.listdir(staged.staging.path))
            if present != sorted([*artifacts, INCOMPLETE_SENTINEL]):
                raise CheckpointError("checkpoint_manifest_invalid",
                                      f"checkpoint staging files do not match declaration: found {present}")
        staged.commit(manifest_bytes)
    return basename
