"""Exact, resumable OPD checkpoints that Kiln can load (Kiln's crates/kiln-train/src/checkpoint.rs).

A checkpoint is a directory ``<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint`` directly under
the run directory:

* ``checkpoint_manifest.json`` — Kiln's ``TrainingCheckpointManifest``, exactly its fields, written last;
* ``adapter.safetensors``, ``optimizer.safetensors`` (absent for SGD) — Kiln's tensor names;
* ``opd_loop_state.json`` — Kiln's ``OpdCheckpointLoopState``;
* ``kiln_flows_state.json`` — ours (every rank's generator states, world size, sequences per step,
  the loss extension), declared in the manifest's ``files`` with role ``rng-state`` so it is covered
  by the same commit and digests.

The file models are ``kiln_core.contracts.checkpoint``. Modules: ``names`` (naming and listing),
``rules`` (Kiln's manifest ``validate()``), ``contract`` (what a run binds), ``rng`` (generator
states), ``write`` (publish), ``load`` (load, verify, resume checks).
"""

from kiln_core.contracts.checkpoint import (
    ADAPTER_FILE,
    EXTENSION_FILE,
    LOOP_STATE_FILE,
    MANIFEST_FILE,
    OFF_POLICY_SOURCE_KIND,
    OPTIMIZER_FILE,
    CheckpointError,
    CheckpointManifest,
    DataBinding,
    DataStats,
    KilnFlowsState,
    LoraGradNorms,
    OpdLoopState,
    ResumeError,
    TokenCounts,
)
from kiln_core.training.checkpoint.contract import RunContract
from kiln_core.training.checkpoint.load import LoadedCheckpoint, check_world_size, load_checkpoint, validate_resume
from kiln_core.training.checkpoint.names import (
    check_resume_basename,
    checkpoint_basename,
    checkpoint_id,
    checkpoint_step,
    committed_checkpoints,
    latest_checkpoint,
    previous_checkpoint,
)
from kiln_core.training.checkpoint.rng import capture_rng_state, restore_rng_state
from kiln_core.training.checkpoint.write import write_checkpoint

__all__ = [
    "ADAPTER_FILE", "EXTENSION_FILE", "LOOP_STATE_FILE", "MANIFEST_FILE", "OFF_POLICY_SOURCE_KIND", "OPTIMIZER_FILE",
    "CheckpointError", "CheckpointManifest", "DataBinding", "DataStats", "KilnFlowsState", "LoraGradNorms",
    "OpdLoopState", "ResumeError", "TokenCounts", "RunContract", "LoadedCheckpoint", "check_world_size",
    "load_checkpoint", "validate_resume", "check_resume_basename", "checkpoint_basename", "checkpoint_id",
    "checkpoint_step", "committed_checkpoints", "latest_checkpoint", "previous_checkpoint", "capture_rng_state",
    "restore_rng_state", "write_checkpoint",
]
