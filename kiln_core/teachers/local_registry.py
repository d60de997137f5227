"""The local teacher registry: ``<root>/teachers.json``, one pinned identity per alias.

Like Kiln's own registry (crates/kiln-server/src/api/teachers.rs) aliases are immutable: an alias names one
exact teacher identity forever, so a corpus scored under that alias can be checked against it later.
Registering the same identity again is a no-op; a different identity under a used alias is refused.
A teacher may wear a LoRA (``adapter=``): Kiln's identity rule and the use-time pin check are in
``kiln_core.teachers.lora_teacher``.

The file is rewritten whole on every change (local: temp file + ``os.replace``; object stores: one
PUT). On local disk an advisory lock serializes concurrent registrations; object stores have no such
lock, so concurrent registrations against the same remote root may lose one of the writes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ValidationError

from kiln_core.contracts.identity import ManifestError, build_manifest_line, parse_manifest_line
from kiln_core.contracts.teachers import (
    REGISTRY_FILE,
    REGISTRY_SCHEMA,
    LocalTeacherEntry,
    LocalTeachersFile,
    encode_teachers,
)
from kiln_core.contracts.spec_blocks import TeacherSource
from kiln_core.errors import Rejection
from kiln_core.storage import Location, resolve, write_bytes_atomic

# A manifest is ≤ ~4.2 KB (4096-byte identity + wrapper); anything longer is not a manifest line.
_MAX_MANIFEST_LINE_BYTES = 64 * 1024


class LocalRegistryError(Rejection, ValueError):
    """A local registry operation that was refused; ``code`` is stable.

    Codes: ``bad_alias``, ``alias_exists``, ``unknown_alias``, ``corrupt_registry``, ``bad_manifest_file``.
    All are rejections: a corrupt ``teachers.json`` fails the same way on every retry.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def _registry_location(root: str | os.PathLike[str]) -> Location:
    return resolve(os.fspath(root)).child(REGISTRY_FILE)


def _read_entries(location: Location) -> list[LocalTeacherEntry]:
    if not location.exists():
        return []
    try:
        document = json.loads(location.read_bytes())
        if not isinstance(document, dict) or document.get("schema") != REGISTRY_SCHEMA:
            raise ValueError(f"schema is not {REGISTRY_SCHEMA!r}")
        entries = list(LocalTeachersFile.model_validate(document).teachers)
    except (ValueError, KeyError, TypeError, ValidationError) as error:
        message = f"{location.uri} is not a readable teacher registry: {error}"
        raise LocalRegistryError("corrupt_registry", message) from None
    for entry in entries:
        _check_entry(entry, location)
    return entries


def _check_entry(entry: LocalTeacherEntry, location: Location) -> None:
    """An entry's manifest, identity and revision must describe the same identity."""
    try:
        identity = parse_manifest_line(entry.off_policy_manifest).teacher_identity
    except ManifestError as error:
        raise LocalRegistryError("corrupt_registry", f"{location.uri}: alias {entry.alias!r}: {error}") from None
    if identity.as_ordered_dict() != entry.identity or identity.identity_revision() != entry.identity_revision:
        raise LocalRegistryError(
            "corrupt_registry", f"{location.uri}: alias {entry.alias!r}: identity, revision and manifest disagree"
        )
    if entry.adapter_dir is not None and identity.adapter is None:
        raise LocalRegistryError(
            "corrupt_registry", f"{location.uri}: alias {entry.alias!r}: records adapter directory "
            f"{entry.adapter_dir} but its identity names no adapter"
        )


def _write_entries(location: Location, entries: list[LocalTeacherEntry]) -> None:
    write_bytes_atomic(location, encode_teachers(entries))


@contextlib.contextmanager
def _locked(location: Location) -> Iterator[None]:
    """Hold an exclusive advisory lock beside a local registry file (no-op for object stores)."""
    if not location.is_local:
        yield
        return
    import fcntl

    lock_path = location.path + ".lock"
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _check_alias(alias: str) -> str:
    # Aliases follow the adapter-name rule (kiln_core.contracts.names): one safe path component.
    from kiln_core.contracts.names import NAME_RULE, is_valid_name

    if not is_valid_name(alias):
        raise LocalRegistryError("bad_alias", f"alias {alias!r} must be {NAME_RULE}")
    return alias


def register_local_teacher(
    root: str | os.PathLike[str],
    alias: str,
    teacher_dir: str | os.PathLike[str],
    *,
    max_top_k: int = 32,
    max_model_len: int | None = None,
    dtype: str | None = None,
    attn_implementation: str = "eager",
    device_kind: str | None = None,
    adapter: str | None = None,
) -> LocalTeacherEntry:
    """Compute a local teacher's identity and pin it under ``alias`` in ``<root>/teachers.json``.

    With ``adapter`` the teacher is ``teacher_dir`` (the base) wearing that LoRA, under Kiln's rule: the
    base's identity as a bare local teacher with ``adapter = {name, weights_sha256, config_sha256}`` in
    its place (``served_model_id`` stays the base's); the entry records the adapter's directory.

    Args:
        root: Storage root, a local path or fsspec URI.
        alias: Immutable registry name; also the ``served_model_id`` when it is valid identity text.
        teacher_dir: Local Hugging Face model (or PEFT adapter) directory.
        max_top_k: Most top-K candidates the scorer returns.
        max_model_len: Context cap; default the config's ``max_position_embeddings``.
        dtype: Scoring dtype; default ``float32`` on CPU, ``bfloat16`` on CUDA.
        attn_implementation: Attention kernel used for scoring.
        device_kind: ``cpu`` or ``cuda``; default: what torch sees.
        adapter: A LoRA the teacher wears: a published adapter NAME (``<root>/runs/<NAME>/latest.json``)
            or a PEFT adapter directory (``kiln_core.teachers.lora_teacher.resolve_teacher_adapter``).

    Returns:
        The stored entry (the existing one when the same identity was already registered).

    Raises:
        LocalRegistryError: ``bad_alias``, ``alias_exists`` (a different identity holds the alias),
            ``corrupt_registry``.
        TeacherAdapterError: ``teacher_adapter_not_found``, ``invalid_adapter_name``.
        IdentityHashError: the directory cannot be hashed into an identity (``bad_adapter``: with
            ``adapter``, ``teacher_dir`` is itself an adapter directory).

    Example:
        >>> entry = register_local_teacher("./kiln-data", "tiny-teacher", "./teacher")  # doctest: +SKIP
        >>> entry.identity_revision  # doctest: +SKIP
        'sha256:...'
    """
    from kiln_core.identity.local_teacher import local_teacher_identity, served_model_id_for, with_adapter
    from kiln_core.teachers.lora_teacher import resolve_teacher_adapter

    _check_alias(alias)
    lora = resolve_teacher_adapter(root, adapter) if adapter is not None else None  # not found: before hashing
    # Hash first, outside the lock: it is the slow part and reads nothing from the registry.
    identity = local_teacher_identity(
        teacher_dir,
        served_model_id=served_model_id_for(alias, teacher_dir),
        max_top_k=max_top_k,
        max_model_len=max_model_len,
        dtype=dtype,
        attn_implementation=attn_implementation,
        device_kind=device_kind,
    )
    if lora is not None:
        identity = with_adapter(identity, name=lora.name, adapter_dir=lora.directory)
    candidate = LocalTeacherEntry(
        alias=alias,
        identity=identity.as_ordered_dict(),
        identity_revision=identity.identity_revision(),
        off_policy_manifest=build_manifest_line(identity),
        teacher_dir=str(Path(teacher_dir).resolve()),
        registered_at=datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        adapter_dir=lora.directory if lora is not None else None,
    )
    location = _registry_location(root)
    with _locked(location):
        entries = _read_entries(location)
        for entry in entries:
            if entry.alias != alias:
                continue
            if entry.off_policy_manifest == candidate.off_policy_manifest:
                return entry
            raise LocalRegistryError(
                "alias_exists",
                f"alias {alias!r} is pinned to {entry.identity_revision} (from {entry.teacher_dir}); "
                f"{candidate.teacher_dir} has identity {candidate.identity_revision}. Aliases are "
                "immutable: register the new teacher under a new alias",
            )
        _write_entries(location, [*entries, candidate])
    return candidate


def list_local_teachers(root: str | os.PathLike[str]) -> list[LocalTeacherEntry]:
    """Every registered teacher under ``root``, in registration order (empty if none).

    Example:
        >>> [entry.alias for entry in list_local_teachers("./kiln-data")]  # doctest: +SKIP
        ['tiny-teacher']
    """
    return _read_entries(_registry_location(root))


def get_local_teacher(root: str | os.PathLike[str], alias: str) -> LocalTeacherEntry:
    """The entry for ``alias``; ``LocalRegistryError("unknown_alias")`` lists the known aliases.

    Example:
        >>> get_local_teacher("./kiln-data", "tiny-teacher").off_policy_manifest  # doctest: +SKIP
    """
    location = _registry_location(root)
    entries = _read_entries(location)
    for entry in entries:
        if entry.alias == alias:
            return entry
    known = [entry.alias for entry in entries]
    raise LocalRegistryError("unknown_alias", f"no local teacher {alias!r} in {location.uri}; known aliases: {known}")


def read_manifest_file(path: str | os.PathLike[str]) -> str:
    """The manifest line of a file holding it on its first line (a manifest file or a scored corpus).

    One trailing newline (``\\n`` or ``\\r\\n``) is stripped; nothing else is, because any other
    whitespace makes the line non-canonical.
    """
    with open(path, "rb") as handle:
        raw = handle.readline(_MAX_MANIFEST_LINE_BYTES + 2)
    if raw.endswith(b"\r\n"):
        raw = raw[:-2]
    elif raw.endswith(b"\n"):
        raw = raw[:-1]
    elif len(raw) > _MAX_MANIFEST_LINE_BYTES:
        raise LocalRegistryError("bad_manifest_file", f"{path}: first line is longer than any manifest")
    try:
        line = raw.decode("utf-8")
        parse_manifest_line(line)
    except (UnicodeDecodeError, ManifestError) as error:
        message = f"{path}: first line is not a canonical manifest: {error}"
        raise LocalRegistryError("bad_manifest_file", message) from None
    return line


def resolve_pinned_manifest(root: str | os.PathLike[str], alias_or_file: str | os.PathLike[str]) -> str:
    """The manifest line a run is pinned to: read from a file if one exists, else a local alias.

    Args:
        root: Storage root holding ``teachers.json``.
        alias_or_file: Path of an existing file whose first line is the manifest, or a registered alias.

    Returns:
        The canonical manifest line (no trailing newline).

    Example:
        >>> line = resolve_pinned_manifest("./kiln-data", "tiny-teacher")  # doctest: +SKIP
        >>> line == resolve_pinned_manifest("./kiln-data", "manifest.jsonl")  # doctest: +SKIP
        True
    """
    if os.path.isfile(alias_or_file):
        return read_manifest_file(alias_or_file)
    return get_local_teacher(root, os.fspath(alias_or_file)).off_policy_manifest


def teacher_source(teacher: str, request_path: str, registry_root: str) -> TeacherSource:
    """A manifest file when ``teacher`` names an existing file (relative to the request or recipe file that
    names it), else an alias registered under ``registry_root``.

    Raises:
        ConfigError: ``teacher_not_registered`` when it is neither.

    Example:
        >>> teacher_source("manifest.jsonl", "/data/request.json", "./kiln-data")  # doctest: +SKIP
        TeacherSource(kind='manifest_file', path='/data/manifest.jsonl', ...)
    """
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.storage import anchored_path

    anchored = anchored_path(teacher, request_path)
    if os.path.isfile(anchored):
        return TeacherSource(kind="manifest_file", path=anchored)
    try:
        get_local_teacher(registry_root, teacher)
        return TeacherSource(kind="local_registry", alias=teacher)
    except (LocalRegistryError, ValueError) as error:
        detail = error.message if isinstance(error, LocalRegistryError) else "not a valid alias"
        raise ConfigError(f"teacher {teacher!r} is neither a manifest file nor a registered alias: {detail}",
                          "teacher", code="teacher_not_registered") from None
