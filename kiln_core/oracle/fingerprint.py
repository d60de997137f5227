"""Model directory fingerprint: the ``model_identity`` of Kiln's
``scripts/qualification/model_fingerprint.py`` (``fingerprint_model``).

The identity binds the exact bytes the oracle will load: every weight shard (path, size, SHA-256),
the raw ``config.json``, the raw ``tokenizer.json`` and the chat template. Its ``content_sha256`` is
the canonical digest of everything but itself — not a Merkle tree; shard digests enter only through
the ``weight_files`` list.

Shards are found the way Kiln finds them (first rule that applies): the unique values of
``model.safetensors.index.json``'s ``weight_map`` in first-seen order, else ``model.safetensors``,
else every top-level ``*.safetensors`` sorted by filesystem bytes. Every file read must be a regular
file reached without symlinks (Hugging Face cache snapshots, which are symlinks into ``blobs/``, are
refused: pass a real directory), shards must be non-empty and no two shards may share an inode.

Each file is hashed through one descriptor whose ``fstat`` identity is compared before and after the
read, and the path is re-checked to still name that inode. Kiln additionally hashes every file a
second time; we skip that second full read of multi-GiB shards (a deliberate deviation).

A bad directory raises ``OracleRejection("model_invalid", ...)``; a directory whose identity differs
from the request raises ``model_identity_mismatch`` listing each differing field.

Example:
    >>> identity = model_identity(fingerprint_model("./student", "tiny-student"))  # doctest: +SKIP
    >>> sorted(identity)  # doctest: +SKIP
    ['chat_template_hash', 'config_hash', 'content_sha256', 'id', 'tokenizer_hash', 'weight_files']
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from kiln_core.canonical import SHA256_PREFIX, canonical_sha256, sha256_prefixed
from kiln_core.contracts.oracle_request import ModelIdentity
from kiln_core.oracle.errors import OracleRejection
from kiln_core.oracle.request import is_normalized_relative
from kiln_core.strict_json import StrictJsonError, loads_strict

INDEX_FILE = "model.safetensors.index.json"
SINGLE_SHARD = "model.safetensors"
_CHUNK = 1 << 20
_MAX_SMALL_FILE = 64 << 20  # config, tokenizer, template and index files


def _invalid(message: str) -> OracleRejection:
    return OracleRejection("model_invalid", message)


def _stat_identity(info: os.stat_result) -> tuple[int, ...]:
    return (info.st_dev, info.st_ino, info.st_mode, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _check_no_symlinks(root: Path, relative: str) -> Path:
    """Refuse a symlink in any component of ``root/relative`` (the components below ``root``)."""
    current = root
    for part in Path(relative).parts:
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            raise _invalid(f"{relative}: {current} does not exist") from None
        if stat.S_ISLNK(info.st_mode):
            raise _invalid(f"{relative}: path component {current.name!r} is a symlink")
    return current


def _hash_file(root: Path, relative: str, *, max_bytes: int | None = None) -> tuple[str, int, tuple[int, ...], bytes | None]:
    """Hash one regular file below ``root``; returns (``sha256:`` digest, size, stat identity, bytes if small)."""
    path = _check_no_symlinks(root, relative)
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(descriptor, "rb") as handle:
        before = os.fstat(handle.fileno())
        if not stat.S_ISREG(before.st_mode):
            raise _invalid(f"{relative} is not a regular file")
        if max_bytes is not None and before.st_size > max_bytes:
            raise _invalid(f"{relative} is {before.st_size} bytes, limit {max_bytes}")
        digest = hashlib.sha256()
        kept = bytearray() if max_bytes is not None else None
        size = 0
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if kept is not None:
                kept.extend(chunk)
        after = os.fstat(handle.fileno())
    if _stat_identity(before) != _stat_identity(after) or size != before.st_size:
        raise _invalid(f"{relative} changed while it was being hashed")
    if _stat_identity(os.lstat(path)) != _stat_identity(before):
        raise _invalid(f"{relative} was replaced while it was being hashed")
    return SHA256_PREFIX + digest.hexdigest(), size, _stat_identity(before), bytes(kept) if kept is not None else None


def _read_small(root: Path, relative: str) -> tuple[str, bytes]:
    digest, _, _, data = _hash_file(root, relative, max_bytes=_MAX_SMALL_FILE)
    assert data is not None
    return digest, data


def discover_weight_files(model_dir: str | Path) -> list[str]:
    """Shard paths in Kiln's discovery order (index ``weight_map`` → ``model.safetensors`` → glob).

    Raises:
        OracleRejection: ``model_invalid`` for a bad index, unsafe shard names, or no shards.
    """
    root = Path(model_dir)
    if os.path.lexists(root / INDEX_FILE):
        _, data = _read_small(root, INDEX_FILE)
        try:
            index = loads_strict(data)
        except StrictJsonError as error:
            raise _invalid(f"{INDEX_FILE}: {error}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise _invalid(f"{INDEX_FILE} has no non-empty object `weight_map`")
        shards: list[str] = []
        for name in weight_map.values():
            if not isinstance(name, str) or not is_normalized_relative(name):
                raise _invalid(f"{INDEX_FILE} names an unsafe shard path {name!r}")
            if name not in shards:
                shards.append(name)
        return shards
    if os.path.lexists(root / SINGLE_SHARD):
        return [SINGLE_SHARD]
    names = sorted((name for name in os.listdir(root) if name.endswith(".safetensors")), key=os.fsencode)
    if not names:
        raise _invalid(f"{root} contains no .safetensors weight files")
    return names


def _chat_template_hash(root: Path) -> str | None:
    if os.path.lexists(root / "chat_template.jinja"):
        digest, data = _read_small(root, "chat_template.jinja")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise _invalid("chat_template.jinja is not valid UTF-8") from None
        return digest
    if os.path.lexists(root / "tokenizer_config.json"):
        _, data = _read_small(root, "tokenizer_config.json")
        try:
            config = loads_strict(data)
        except StrictJsonError as error:
            raise _invalid(f"tokenizer_config.json: {error}") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, str):
            return sha256_prefixed(template.encode("utf-8"))
    return None


def fingerprint_model(model_dir: str | Path, model_id: str) -> dict[str, Any]:
    """Fingerprint a local model directory (Kiln's ``fingerprint_model`` output).

    Args:
        model_dir: A real (non-symlink) directory holding ``config.json``, ``tokenizer.json`` and
            the safetensors shards.
        model_id: The human-readable id recorded in the identity (the request's ``model_identity.id``).

    Returns:
        ``{id, path, weight_files, config_hash, tokenizer_hash, chat_template_hash}``; ``path`` is the
        absolute directory and ``chat_template_hash`` may be ``None``.

    Raises:
        OracleRejection: ``model_invalid``.
    """
    root = Path(model_dir).absolute()
    try:
        root_info = os.lstat(root)
    except FileNotFoundError:
        raise _invalid(f"model directory {root} does not exist") from None
    if not stat.S_ISDIR(root_info.st_mode):
        raise _invalid(f"model directory {root} is not a real directory (symlinks are refused)")

    weight_files = []
    seen_inodes: dict[tuple[int, int], str] = {}
    for relative in discover_weight_files(root):
        digest, size, identity, _ = _hash_file(root, relative)
        if size == 0:
            raise _invalid(f"weight shard {relative} is empty")
        inode = identity[:2]
        if inode in seen_inodes:
            raise _invalid(f"weight shards {seen_inodes[inode]} and {relative} are the same file (shared inode)")
        seen_inodes[inode] = relative
        weight_files.append({"path": relative, "bytes": size, "sha256": digest})
    weight_files.sort(key=lambda item: item["path"].encode("utf-8"))

    config_hash, _ = _read_small(root, "config.json")
    tokenizer_hash, _ = _read_small(root, "tokenizer.json")
    fingerprint = {
        "id": model_id,
        "path": str(root),
        "weight_files": weight_files,
        "config_hash": config_hash,
        "tokenizer_hash": tokenizer_hash,
        "chat_template_hash": _chat_template_hash(root),
    }
    if _stat_identity(os.lstat(root))[:3] != _stat_identity(root_info)[:3]:
        raise _invalid(f"model directory {root} was replaced while it was being fingerprinted")
    return fingerprint


def model_identity(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The request-shaped identity: the fingerprint without ``path``, plus ``content_sha256``.

    Example:
        >>> fp = {"id": "m", "path": "/x", "weight_files": [], "config_hash": "c",
        ...       "tokenizer_hash": "t", "chat_template_hash": None}
        >>> model_identity(fp)["content_sha256"] == canonical_sha256(
        ...     {k: v for k, v in fp.items() if k != "path"})
        True
    """
    content = {key: fingerprint[key] for key in ("chat_template_hash", "config_hash", "id", "tokenizer_hash", "weight_files")}
    return {
        "id": fingerprint["id"],
        "content_sha256": canonical_sha256(content),
        "config_hash": fingerprint["config_hash"],
        "tokenizer_hash": fingerprint["tokenizer_hash"],
        "chat_template_hash": fingerprint["chat_template_hash"],
        "weight_files": fingerprint["weight_files"],
    }


def identity_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """One ``field: expected X, actual Y`` line per differing field (weight files per shard).

    Example:
        >>> identity_differences({"id": "a", "config_hash": "x"}, {"id": "a", "config_hash": "y"})
        ['config_hash: expected x, actual y']
    """
    lines = []
    for key in expected.keys() | actual.keys():
        if key == "weight_files":
            continue
        if expected.get(key) != actual.get(key):
            lines.append(f"{key}: expected {expected.get(key)}, actual {actual.get(key)}")
    lines.sort()
    want = {item["path"]: item for item in expected.get("weight_files", [])}
    have = {item["path"]: item for item in actual.get("weight_files", [])}
    for path in sorted(want.keys() | have.keys()):
        if path not in have:
            lines.append(f"weight_files[{path}]: expected present, actual missing")
        elif path not in want:
            lines.append(f"weight_files[{path}]: expected absent, actual present")
        else:
            for field in ("bytes", "sha256"):
                if want[path][field] != have[path][field]:
                    lines.append(f"weight_files[{path}].{field}: expected {want[path][field]}, actual {have[path][field]}")
    return lines


def check_model_identity(expected: ModelIdentity, model_dir: str | Path) -> dict[str, Any]:
    """Fingerprint ``model_dir`` under ``expected.id`` and require the identity to match exactly.

    Returns:
        The fingerprint (with ``path``), for receipts and logging.

    Raises:
        OracleRejection: ``model_invalid`` or ``model_identity_mismatch`` (every differing field listed).
    """
    fingerprint = fingerprint_model(model_dir, expected.id)
    actual = model_identity(fingerprint)
    wanted = expected.model_dump(mode="json")
    if actual != wanted:
        differences = identity_differences(wanted, actual) or ["weight_files: order differs"]
        raise OracleRejection(
            "model_identity_mismatch", f"model directory {fingerprint['path']} differs from the request: " + "; ".join(differences)
        )
    return fingerprint
