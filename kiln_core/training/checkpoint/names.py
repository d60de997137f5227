"""Checkpoint names and listing: ``<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint`` under a run.

Naming follows Kiln's OPD writer (``opd.rs`` ``OpdCheckpointDescriptor::capture``); a directory is
"committed" when its manifest exists (the manifest is written last: ``checkpoint.rs`` ``write_training_checkpoint_atomic``).
"""

from __future__ import annotations

import os
import re

from kiln_core.contracts.checkpoint import MANIFEST_FILE, SUFFIX, CheckpointError
from kiln_core.storage import Location, list_children, resolve

__all__ = ["checkpoint_basename", "checkpoint_id", "checkpoint_step", "check_resume_basename",
           "committed_checkpoints", "latest_checkpoint", "previous_checkpoint", "is_committed", "at"]


def checkpoint_basename(adapter_name: str, global_step: int) -> str:
    """``offline-distilled-checkpoint-step-00000025.kiln-checkpoint`` for step 25."""
    return f"{adapter_name}-checkpoint-step-{global_step:08d}{SUFFIX}"


def checkpoint_id(global_step: int) -> str:
    return f"opd-step-{global_step:08d}"


def _name_pattern(adapter_name: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(adapter_name)}-checkpoint-step-(\d{{8}}){re.escape(SUFFIX)}")


def checkpoint_step(basename: str, adapter_name: str) -> int | None:
    """The step encoded in ``basename``, or None if it is not this adapter's checkpoint name."""
    match = _name_pattern(adapter_name).fullmatch(basename)
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


def at(run_dir: Location | str) -> Location:
    return run_dir if isinstance(run_dir, Location) else resolve(run_dir)


def is_committed(location: Location) -> bool:
    if location.is_local and os.path.islink(location.path):
        return False
    return location.child(MANIFEST_FILE).exists()  # exists() re-reads object-store listings


def committed_checkpoints(run_dir: Location | str, adapter_name: str) -> list[tuple[int, str]]:
    """``(step, basename)`` of every committed checkpoint of ``adapter_name``, oldest first."""
    run_dir = at(run_dir)
    found = []
    for name in list_children(run_dir):
        step = checkpoint_step(name, adapter_name)
        if step is not None and is_committed(run_dir.child(name)):
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
