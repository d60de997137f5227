"""Do a model directory's files parse? A cheap check before any model loads.

A truncated ``model.safetensors`` (a copy cut short, a disk that filled up) or a ``config.json`` that is
not JSON would otherwise fail deep inside transformers, after admission and planning, as an error
nobody planned for. ``check_model_files`` reads what a loader reads first — ``config.json`` whole, and
each safetensors file's header: an 8-byte little-endian length, that many bytes of JSON, and tensors
whose ``data_offsets`` must cover the rest of the file exactly (the rule the safetensors loader applies)
— and refuses the first file that does not parse with ``model_unreadable``, naming the file. Headers
are a few kilobytes even for multi-gigabyte shards, so the check costs next to nothing.

Which files, and the symlink rule (a Hugging Face cache snapshot's links into its own ``blobs/`` are
followed, any other symlink is refused), are ``kiln_core.identity.hashing``'s: the files checked are
exactly the ones hashed into the model's identity.

Example:
    >>> check_model_files("./student", role="student")  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln_core.errors import MODEL_UNREADABLE, Rejection
from kiln_core.identity.hashing import SAFETENSORS_INDEX, checked_regular_file, select_weight_shards

__all__ = ["ModelUnreadable", "check_model_files", "check_safetensors"]

# The safetensors format's own ceiling on the JSON header (its MAX_HEADER_SIZE): anything larger is not
# a header, and reading it would be reading the weights.
MAX_HEADER_BYTES = 100_000_000
JSON_FILES = ("config.json", "adapter_config.json")
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class ModelUnreadable(Rejection, ValueError):
    """A student or teacher file that does not parse (code ``model_unreadable``); ``file`` names it and
    ``field`` is the role (``student``, ``teacher``)."""

    def __init__(self, path: Path, problem: str, role: str) -> None:
        super().__init__(MODEL_UNREADABLE, f"{role} model file {path} cannot be read: {problem}", field=role,
                         file=str(path))

    def __str__(self) -> str:
        return self.message


def check_model_files(model_dir: str | Path, *, role: str = "student") -> None:
    """Refuse a model directory whose ``config.json`` or safetensors weights do not parse.

    Only files that are there are checked: a directory without them is refused, with its own codes, by the
    stage that needs them (``invalid_student``, ``no_shards``, ``teacher_invalid``, ...).

    Args:
        model_dir: A Hugging Face model directory, or a PEFT adapter directory.
        role: ``student`` or ``teacher``: named in the message and the error's field.

    Raises:
        ModelUnreadable: ``model_unreadable`` — the first file that does not parse.
        IdentityHashError: ``symlink`` (a link that is not a cache snapshot's into its own ``blobs/``),
            ``bad_index``, ``missing_file``, ``empty_file`` — the weight-selection rules of the identity.
    """
    root = Path(model_dir)
    if not root.is_dir():
        return
    for name in JSON_FILES:
        path = root / name
        if path.exists() or path.is_symlink():
            _check_json_object(checked_regular_file(path, "model config"), role)
    for path in _weight_files(root):
        check_safetensors(path, role=role)


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files a loader reads: the model's shards (the identity's selection) and a PEFT
    adapter's weights."""
    files = []
    has_shards = (root / SAFETENSORS_INDEX).exists() or any(
        entry.name.endswith(".safetensors") and entry.name != ADAPTER_WEIGHTS for entry in root.iterdir())
    if has_shards:
        files += select_weight_shards(root)
    adapter = root / ADAPTER_WEIGHTS
    if (adapter.exists() or adapter.is_symlink()) and adapter not in files:
        files.append(checked_regular_file(adapter, "adapter weights"))
    return files


def _check_json_object(path: Path, role: str) -> None:
    try:
        value = json.loads(_read(path, role))
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelUnreadable(path, f"not valid JSON ({error})", role) from None
    if not isinstance(value, dict):
        raise ModelUnreadable(path, "not a JSON object", role)


def _read(path: Path, role: str, size: int = -1) -> bytes:
    """The first ``size`` bytes of a model file (all with -1). A file this process may not read (its
    permissions, a directory in its place) is the model's fault, not the storage's: ``model_unreadable``."""
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except OSError as error:
        hint = " (check the file's permissions)" if isinstance(error, PermissionError) else ""
        raise ModelUnreadable(path, f"{error.strerror or error}{hint}", role) from None


def check_safetensors(path: str | Path, *, role: str = "student") -> None:
    """Parse one safetensors file's header and check that its tensors cover the file exactly.

    Raises:
        ModelUnreadable: shorter than its header, a header that is not a JSON object, a tensor without valid
            ``data_offsets``, or data that is cut short (truncated) or runs on past the last tensor.
    """
    path = Path(path)
    size = path.stat().st_size
    prefix = _read(path, role, 8)
    if len(prefix) < 8:
        raise ModelUnreadable(path, f"{size} bytes is shorter than the safetensors header length", role)
    header_bytes = int.from_bytes(prefix, "little")
    if header_bytes > min(MAX_HEADER_BYTES, size - 8):
        raise ModelUnreadable(path, f"its safetensors header claims {header_bytes} bytes but the file has "
                              f"{size}: truncated, or not a safetensors file", role)
    raw = _read(path, role, 8 + header_bytes)[8:]
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ModelUnreadable(path, "its safetensors header is not JSON: truncated, or not a safetensors file",
                              role) from None
    if not isinstance(header, dict):
        raise ModelUnreadable(path, "its safetensors header is not a JSON object", role)
    data_bytes = size - 8 - header_bytes
    covered = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ModelUnreadable(path, f"tensor {name!r} has no valid data_offsets", role)
        if offsets[1] > data_bytes:
            raise ModelUnreadable(path, f"tensor {name!r} ends at byte {offsets[1]} of the data but the file holds "
                                  f"{data_bytes}: the file is truncated", role)
        covered = max(covered, offsets[1])
    if covered != data_bytes:
        raise ModelUnreadable(path, f"its tensors cover {covered} of its {data_bytes} data bytes", role)
