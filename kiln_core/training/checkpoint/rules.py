"""Kiln's ``TrainingCheckpointManifest::validate()`` (``checkpoint.rs``), rule for rule.

The writer runs it before the manifest is written, the loader after it is parsed; both report the
first broken rule with Kiln's wording.
"""

from __future__ import annotations

import re
from datetime import datetime

from kiln_core.contracts.checkpoint import (
    MANIFEST_FILE,
    MANIFEST_TYPE,
    MAX_ARTIFACTS,
    CheckpointManifest,
)

__all__ = ["manifest_problem", "artifact_path_problem"]

_IDENTIFIER = re.compile(r"[A-Za-z0-9._-]{1,255}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def artifact_path_problem(value: str) -> str | None:
    """``validate_relative_artifact_path``: non-empty, ≤ 1024 bytes, no backslash, not reserved,
    relative, only normal components."""
    if not value:
        return "checkpoint artifact path is empty"
    if len(value.encode("utf-8")) > 1024:
        return "checkpoint artifact path exceeds 1024 bytes"
    if "\\" in value:
        return f"checkpoint artifact path contains a backslash: {value!r}"
    if value in (MANIFEST_FILE, ".incomplete"):
        return f"reserved checkpoint artifact path {value!r}"
    if value.startswith("/"):
        return f"checkpoint artifact path is absolute: {value!r}"
    if any(part in ("", ".", "..") for part in value.split("/")):
        return f"checkpoint artifact path is not normalized: {value!r}"
    return None


def _identifier_problem(field: str, value: str) -> str | None:
    if not value.strip():
        return f"{field} must not be empty"
    if len(value.encode("utf-8")) > 255:
        return f"{field} exceeds 255 bytes"
    if not _IDENTIFIER.fullmatch(value):
        return f"{field} contains unsupported characters: {value!r}"
    return None


def _role_problem(manifest: CheckpointManifest, path: str, role: str, field: str) -> str | None:
    problem = artifact_path_problem(path)
    if problem:
        return problem
    entry = manifest.files.get(path)
    if entry is None:
        return f"{field} references untracked artifact {path!r}"
    if entry.role != role:
        return f"{field} artifact {path!r} has role {entry.role}, expected {role}"
    return None


def manifest_problem(m: CheckpointManifest) -> str | None:
    """The first rule of Kiln's ``validate()`` that ``m`` breaks, or None."""
    progress, order = m.progress, m.progress.data_order
    checks = [
        (m.schema_version != 1, f"unsupported training checkpoint schema_version {m.schema_version}; expected 1"),
        (m.manifest_type != MANIFEST_TYPE, f"invalid training checkpoint manifest_type {m.manifest_type!r}"),
    ]
    for condition, message in checks:
        if condition:
            return message
    for field, value in (("checkpoint_id", m.checkpoint_id), ("adapter_name", m.adapter_name)):
        if problem := _identifier_problem(field, value):
            return problem
    try:
        datetime.fromisoformat(m.created_at.replace("Z", "+00:00"))
        if "T" not in m.created_at and "t" not in m.created_at:
            raise ValueError
    except ValueError:
        return "training checkpoint created_at must be RFC 3339"
    if progress.global_step > progress.total_steps:
        return "training checkpoint global_step exceeds total_steps"
    if progress.cursor_in_epoch > len(order):
        return "training checkpoint cursor_in_epoch exceeds data_order length"
    if progress.global_step < progress.total_steps and not order:
        return "in-progress training checkpoint has an empty data_order"
    if m.data.item_count <= 0:
        return "training checkpoint data item_count must be positive"
    if order:
        if len(order) != m.data.item_count:
            return f"training checkpoint data_order length {len(order)} does not match data item_count {m.data.item_count}"
        seen: set[int] = set()
        for item in order:
            if item >= m.data.item_count:
                return f"training checkpoint data_order item {item} exceeds item_count {m.data.item_count}"
            if item in seen:
                return f"training checkpoint data_order contains duplicate item {item}"
            seen.add(item)
    if not _SHA256.fullmatch(m.data.content_sha256):
        return "data.content_sha256 must be 64 lowercase hexadecimal characters"
    for field, value in (("data.source_kind", m.data.source_kind), ("optimizer.kind", m.optimizer.kind),
                         ("scheduler.kind", m.scheduler.kind)):
        if not value.strip():
            return f"{field} must not be empty"
    if m.optimizer.step != progress.global_step:
        return f"optimizer step {m.optimizer.step} does not match global_step {progress.global_step}"
    if m.scheduler.step != progress.global_step:
        return f"scheduler step {m.scheduler.step} does not match global_step {progress.global_step}"
    for name, stream in m.rng_states.items():
        if problem := _identifier_problem("rng state name", name):
            return problem
        if not stream.algorithm.strip():
            return "rng algorithm must not be empty"
    precision = m.precision_policy
    for field in ("parameter_dtype", "optimizer_state_dtype", "activation_dtype", "gradient_dtype"):
        if not getattr(precision, field).strip():
            return f"{field} must not be empty"
    if not m.files:
        return "training checkpoint contains no files"
    if len(m.files) > MAX_ARTIFACTS:
        return f"training checkpoint has too many files ({len(m.files)} > {MAX_ARTIFACTS})"
    for path, entry in m.files.items():
        if problem := artifact_path_problem(path):
            return problem
        if not _SHA256.fullmatch(entry.sha256):
            return f"files[{path!r}].sha256 must be 64 lowercase hexadecimal characters"
    return _state_file_roles_problem(m)


def _state_file_roles_problem(m: CheckpointManifest) -> str | None:
    """``validate_state_file_roles``: every referenced artifact is tracked with the matching role."""
    files = m.state_files
    bindings = [(files.adapter_parameters, "adapter-parameters", "state_files.adapter_parameters"),
                (files.optimizer_state, "optimizer-state", "state_files.optimizer_state"),
                (files.reference_state, "reference-state", "state_files.reference_state"),
                (files.ema_state, "ema-state", "state_files.ema_state"),
                (files.reward_normalization_state, "reward-normalization-state", "state_files.reward_normalization_state"),
                (files.loss_history, "loss-history", "state_files.loss_history")]
    for path, role, field in bindings:
        if path is not None and (problem := _role_problem(m, path, role, field)):
            return problem
    if m.optimizer.state_file is not None:
        if problem := _role_problem(m, m.optimizer.state_file, "optimizer-state", "optimizer.state_file"):
            return problem
        if files.optimizer_state != m.optimizer.state_file:
            return "optimizer.state_file and state_files.optimizer_state disagree"
    elif files.optimizer_state is not None:
        return "state_files.optimizer_state is present but optimizer.state_file is absent"
    for stream in m.rng_states.values():
        if stream.state_file is not None and (problem := _role_problem(m, stream.state_file, "rng-state", "rng state_file")):
            return problem
    return None
