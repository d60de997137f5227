"""What a checkpoint binds about the run, in Kiln's shapes, filled with kiln-flows' own values.

Kiln compares each of these with what the resuming process computes (``opd.rs``
``OpdCheckpointDescriptor::validate_resume``), so they are built here once per run, by the same
functions on write and on resume:

* the effective config is the run's settings' (``ResolvedSettings.kiln_effective_config``, ``opd.rs``
  ``opd_checkpoint_effective_config``);
* ``precision_policy`` — ``trainer/checkpointing.rs`` ``training_checkpoint_precision``.
* ``base_weight_shard_manifest`` — ``kiln-core/src/model_provenance.rs`` ``BaseWeightShardManifest``.
* ``execution_provenance`` — ``kiln-core/src/execution_provenance.rs`` ``ExecutionProvenanceV1``,
  describing the Python runtime that trains (torch build, interpreter, kiln-flows sources).
* ``checkpoint_planning`` — ``lib.rs`` ``checkpoint_planning_identity_for_device`` (schema v3).
* ``auxiliary_state`` — ``opd.rs`` ``opd_checkpoint_auxiliary_state``, every key Kiln writes.

Where Kiln's field describes a Kiln component kiln-flows does not have (Kiln's streaming prefill,
its SFT boundary cache), the value says so plainly (``"disabled"``, zeros); docs/kiln-compatibility.md
lists them. Nothing here changes a number the trainer computes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path
from typing import Any

from kiln_core.canonical import kiln_compact_json, sha256_prefixed

__all__ = ["LOOP_STATE_TYPE", "precision_policy", "training_precision_policy", "base_weight_shard_manifest",
           "execution_provenance", "checkpoint_planning", "auxiliary_state"]

LOOP_STATE_TYPE = "kiln.opd-loop-state.v1"
KERNEL_CONTRACT_TYPE = "kiln.kernel-contract.v1"
LOSS_KERNEL_VERSION = "kiln-flows.topk-reverse-kl.chunked.v1"


def _prefixed(raw_hex: str | None) -> str | None:
    return None if raw_hex is None else (raw_hex if raw_hex.startswith("sha256:") else "sha256:" + raw_hex)


# ---------------------------------------------------------------------------------------------
# Precision


def training_precision_policy(precision: str) -> str:
    """The name of our precision policy (Kiln: ``TrainingPrecisionPolicy::name``)."""
    return "kiln-flows.bf16-autocast.f32-master" if precision == "bf16" else "kiln-flows.f32"


def precision_policy(precision: str, optimizer_kind: str) -> dict[str, Any]:
    """``TrainingCheckpointPrecision``: LoRA masters, their gradients and optimizer state are f32;
    activations follow ``precision``; no stochastic rounding. Dtype names are Kiln's lowercase ones."""
    return {
        "parameter_dtype": "f32",
        "optimizer_state_dtype": "none" if optimizer_kind == "sgd" else "f32",
        "activation_dtype": "bf16" if precision == "bf16" else "f32",
        "gradient_dtype": "f32",
        "stochastic_rounding": {"mode": "round_to_nearest"},
    }


# ---------------------------------------------------------------------------------------------
# Base weights and execution provenance


def base_weight_shard_manifest(student_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``kiln.base-weight-shards.v1`` of the student's safetensors shards (per-shard SHA-256 and size,
    and the ``kiln.base-model-content.v1`` aggregate over them)."""
    from kiln_core.identity.hashing import base_model_digest, hash_files_parallel, select_weight_shards

    shards = select_weight_shards(student_dir)
    records = hash_files_parallel(shards)
    entries = sorted(({"filename": path.name, "size_bytes": size, "sha256": "sha256:" + digest.hex()}
                      for path, (digest, size) in zip(shards, records)), key=lambda entry: entry["filename"])
    return {
        "schema_version": 1,
        "manifest_type": "kiln.base-weight-shards.v1",
        "aggregate_algorithm": "kiln.base-model-content.v1",
        "aggregate_sha256": "sha256:" + base_model_digest(records),
        "total_size_bytes": sum(size for _, size in records),
        "shards": entries,
    }


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def _source_tree_sha256() -> str:
    """Digest of the kiln-flows engine sources that run (relative path and bytes of each file)."""
    root = Path(__file__).resolve().parents[1]  # kiln_core/
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return "sha256:" + digest.hexdigest()


def execution_provenance(*, device: Any, precision: str, identity: dict[str, str],
                         versions: dict[str, str]) -> dict[str, Any]:
    """``kiln.execution-provenance.v1`` of this process: torch build and device, the interpreter, the
    kiln-flows sources, the student's tokenizer/config digests and the numerics-relevant settings.

    The device is named by type and model (never by index), so every rank of a run describes it alike.
    """
    import torch

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    runtime = {"torch": versions["torch"], "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()
               if device.type == "cuda" else None, "python": versions["python"]}
    kernel_versions = {name: versions[name] for name in ("peft", "safetensors", "torch", "transformers")}
    kernel_versions["kiln-flows-loss"] = LOSS_KERNEL_VERSION
    features = sorted({f"device-{device.type}", f"precision-{precision}", "deterministic-algorithms"
                       if device.type == "cpu" else "nondeterministic-allowed"})
    kernels = {"contract_type": KERNEL_CONTRACT_TYPE, "versions": dict(sorted(kernel_versions.items())),
               "compiled_features": features}
    kernels["contract_sha256"] = sha256_prefixed(kiln_compact_json(
        [KERNEL_CONTRACT_TYPE, kernels["versions"], features]).encode())
    settings = {"device_type": device.type, "precision": precision, "loss_chunk_rows": 1024, "vocab_chunk": 8192}
    environment = {name: os.environ.get(name) for name in ("CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE")}
    record: dict[str, Any] = {
        "schema_version": 1,
        "provenance_type": "kiln.execution-provenance.v1",
        "backend": {"name": f"torch-{device.type}", "device": f"{device.type} {device_name}".strip(),
                    "numerical_runtime_sha256": sha256_prefixed(kiln_compact_json(runtime).encode())},
        "build": {"package_version": versions["kiln-flows"],
                  "target": f"{platform.machine()}-{sys.platform}-cpython{sys.version_info[0]}.{sys.version_info[1]}",
                  "executable_sha256": _file_sha256(os.path.realpath(sys.executable)),
                  "source_tree_sha256": _source_tree_sha256()},
        "model": {"model_config_sha256": _prefixed(identity["model_config_sha256"]),
                  "tokenizer_vocab_sha256": _prefixed(identity["tokenizer_vocab_sha256"]),
                  "tokenizer_config_sha256": _prefixed(identity["tokenizer_config_sha256"]),
                  "chat_template_sha256": _prefixed(identity["chat_template_sha256"])},
        "precision": {"inference_dtype": "bf16" if precision == "bf16" else "f32",
                      "training_policy": training_precision_policy(precision)},
        "kernels": kernels,
        "configuration": {"effective_server_config_sha256": sha256_prefixed(kiln_compact_json(settings).encode()),
                          "effective_environment_sha256": sha256_prefixed(kiln_compact_json(environment).encode())},
    }
    record["provenance_sha256"] = sha256_prefixed(kiln_compact_json(record).encode())
    return record


def checkpoint_planning(*, device: Any, gradient_checkpointing: bool, num_layers: int) -> dict[str, Any]:
    """``kiln.training-checkpoint-planning.v3`` for this run.

    Our activation checkpointing recomputes every decoder layer (one segment per layer) or nothing;
    kiln-flows has no streaming prefill and no SFT boundary cache, so those policies say ``disabled``.
    """
    import torch

    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return {
        "schema": "kiln.training-checkpoint-planning.v3",
        "effective_vram": {"total_bytes": int(total), "source": "torch.cuda" if device.type == "cuda" else "none",
                           "unified": False},
        "gradient_checkpoint_policy": ({"mode": "explicit_segments", "segments": int(num_layers)} if gradient_checkpointing
                                       else {"mode": "disabled", "segments": None}),
        "checkpoint_boundary_policy": {"recompute_mode": "disabled", "recompute_threshold_tokens": 0,
                                       "anchor_stride": None, "cache_target_bytes": 0},
        "runtime_device": device.type,
        "streaming_prefill_policy": {"mode": "disabled", "threshold_tokens": 0, "base_tile_tokens": 0,
                                     "tape_tile_tokens": 0, "detached_full_attn_tile_tokens": 0,
                                     "detached_full_attn_boundary_tile_tokens": 0,
                                     "detached_full_attn_tape_replay_tile_tokens": 0, "last_token_lm_head": False},
    }


def auxiliary_state(*, identity: dict[str, str], shard_manifest: dict[str, Any], provenance: dict[str, Any],
                    device_type: str, kiln_flows_version: str, prepared_source_indices: list[int],
                    capabilities: dict[str, Any], teacher_identity: dict[str, Any] | None,
                    teacher_content_revision: str, precision: str, chat_template_rollouts: bool,
                    planning: dict[str, Any]) -> dict[str, Any]:
    """``opd_checkpoint_auxiliary_state``: every key Kiln writes, none of ours.

    ``prepared_source_indices`` are the request indices of the examples (off-policy: all of them,
    admission refuses the others) or prompts (on-policy: those with an action token) that train.
    """
    from kiln_core.training.data_identity import prepared_source_order_sha256

    indices = [int(index) for index in prepared_source_indices]
    return {
        "loop_state_type": LOOP_STATE_TYPE,
        "model_config_sha256": _prefixed(identity["model_config_sha256"]),
        "tokenizer_config_sha256": _prefixed(identity["tokenizer_config_sha256"]),
        "chat_template_sha256": _prefixed(identity["chat_template_sha256"]),
        "base_model_weights_sha256": shard_manifest["aggregate_sha256"],
        "base_weight_shard_manifest": shard_manifest,
        "execution_provenance": provenance,
        "backend_runtime": f"torch-{device_type}",
        "kiln_train_version": f"kiln-flows/{kiln_flows_version}",
        "prepared_source_indices": indices,
        "prepared_source_order_sha256": prepared_source_order_sha256(indices),
        "teacher_capabilities": capabilities,
        "teacher_identity": teacher_identity,
        "teacher_content_revision": teacher_content_revision,
        "training_precision_policy": training_precision_policy(precision),
        "use_chat_template_rollout_prefixes": chat_template_rollouts,
        "checkpoint_planning": planning,
    }
