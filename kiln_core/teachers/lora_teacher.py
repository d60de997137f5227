"""A local teacher wearing a LoRA (Kiln's ``kind: "local", adapter``): find the adapter, pin it, refuse a rewrite.

Kiln (crates/kiln-server/src/api/teachers.rs · register_teacher; teacher_identity.rs ·
build_local_adapter_teacher_identity_from_source; kiln-train teacher_identity.rs · with_static_adapter):

* at registration the adapter is found by name and fingerprinted (``weights_sha256``, ``config_sha256``,
  ``scripts/vllm_teacher.py``); the teacher's identity is the bare base's with ``adapter = {name, weights_sha256,
  config_sha256}`` put in its place (``kiln_core.identity.local_teacher.with_adapter``);
* at every use the adapter's current digests are recomputed and compared with the pinned ones; a rewritten
  adapter is refused (``teacher_adapter_changed``) before anything is scored, and the teacher is the base
  model with the adapter applied from the pinned directory (not from the ``base_model_name_or_path`` its
  ``adapter_config.json`` names).

A kiln-flows adapter NAME owns ``<root>/runs/<NAME>/``; its ``latest.json`` names the published adapter
directory (``kiln_core.contracts.latest``), the same rule ``config.base_adapter`` follows. Anything that is
not a valid adapter name (a path with ``/``) is taken as a PEFT adapter directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.errors import Rejection

__all__ = [
    "TeacherAdapterError",
    "TeacherAdapterSource",
    "check_pinned_adapter",
    "load_pinned_adapter",
    "resolve_teacher_adapter",
]

RUNS_DIR = "runs"  # kiln_core.engine.runs' layout: <root>/runs/<adapter>/latest.json
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class TeacherAdapterError(Rejection, ValueError):
    """A LoRA teacher's adapter that cannot be registered or used; ``code`` is stable.

    Codes: ``teacher_adapter_not_found``, ``invalid_adapter_name``, ``teacher_adapter_changed``,
    ``teacher_invalid`` (the adapter does not load onto the base). All are rejections: the same adapter
    fails the same way on every retry.
    """

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class TeacherAdapterSource:
    """Where a teacher's LoRA was found.

    Attributes:
        name: The adapter's name (``adapter.name`` in the identity).
        directory: Absolute local path of the PEFT adapter directory.
        looked_up: What was read to find it (a ``latest.json`` or the directory itself).
    """

    name: str
    directory: str
    looked_up: str


def _not_found(value: str, where: str, why: str = "") -> TeacherAdapterError:
    detail = f" ({why})" if why else ""
    return TeacherAdapterError("teacher_adapter_not_found",
                               f"teacher adapter `{value}` not found at {where}{detail} — train or upload it first",
                               field="adapter", file=where)


def _checked_directory(value: str, directory: str) -> str:
    """``directory`` when it holds a PEFT adapter (its config and safetensors weights), else not found."""
    if not os.path.isdir(directory):
        raise _not_found(value, directory, "no such directory")
    missing = [name for name in ADAPTER_FILES if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise _not_found(value, directory, f"no {' or '.join(missing)}")
    return directory


def resolve_teacher_adapter(root: str | os.PathLike[str], value: str) -> TeacherAdapterSource:
    """Find the LoRA ``value`` names: a published adapter NAME, or a PEFT adapter directory.

    Args:
        root: Storage root whose ``runs/<NAME>/latest.json`` a name is looked up in.
        value: An adapter name (the adapter-name rule: no ``/``), or a directory path.

    Returns:
        The adapter's name (NAME, or the directory's basename) and its absolute local directory.

    Raises:
        TeacherAdapterError: ``teacher_adapter_not_found`` (no ``latest.json``, or no adapter files where it
            points; Kiln's text shape), ``invalid_adapter_name`` (a directory whose basename is not a valid
            adapter name).

    Example:
        >>> resolve_teacher_adapter("./kiln-data", "rust-helper").name  # doctest: +SKIP
        'rust-helper'
        >>> resolve_teacher_adapter("./kiln-data", "./loras/rust-helper").directory  # doctest: +SKIP
        '/abs/loras/rust-helper'
    """
    from pydantic import ValidationError

    from kiln_core.contracts.latest import LATEST_FILE, decode_latest
    from kiln_core.contracts.names import NAME_RULE, is_valid_name
    from kiln_core.storage import resolve

    value = os.fspath(value)
    if not is_valid_name(value):  # a path: that directory itself, named by its basename
        directory = _checked_directory(value, os.path.abspath(value.removeprefix("file://")))
        name = os.path.basename(directory.rstrip(os.sep))
        if not is_valid_name(name):
            raise TeacherAdapterError("invalid_adapter_name", f"teacher adapter directory {directory}: its name "
                                      f"{name!r} is not an adapter name ({NAME_RULE}); copy or publish it under one",
                                      field="adapter", file=directory)
        return TeacherAdapterSource(name=name, directory=directory, looked_up=directory)
    latest = resolve(os.fspath(root)).child(RUNS_DIR, value, LATEST_FILE)
    try:
        pointer = decode_latest(latest.read_bytes())
    except FileNotFoundError:
        raise _not_found(value, latest.uri, "no published adapter of that name; a directory needs a path with a "
                         "'/', e.g. ./" + value) from None
    except (OSError, ValueError, ValidationError) as error:
        raise _not_found(value, latest.uri, f"not a readable latest.json: {type(error).__name__}") from None
    adapter = resolve(pointer.adapter)
    if not adapter.is_local:
        raise _not_found(value, adapter.uri, "a LoRA teacher's adapter must be on this machine's disk")
    return TeacherAdapterSource(name=value, directory=_checked_directory(value, adapter.path), looked_up=latest.uri)


def _changed(alias: str, name: str, adapter_dir: str, why: str) -> TeacherAdapterError:
    return TeacherAdapterError(
        "teacher_adapter_changed",
        f"teacher '{alias}' is pinned to adapter '{name}', but the exact registered content could not be loaded "
        f"from {adapter_dir} ({why}); re-register after any adapter rewrite", field="teacher", file=adapter_dir)


def check_pinned_adapter(alias: str, identity: TeacherIdentity, adapter_dir: str) -> None:
    """Refuse a LoRA teacher whose adapter files are no longer the ones its identity pins.

    Args:
        alias: The registry alias (for the message).
        identity: The pinned identity; its ``adapter`` holds the registered digests.
        adapter_dir: The directory the registry recorded for the adapter.

    Raises:
        TeacherAdapterError: ``teacher_adapter_changed`` (Kiln's text shape) naming what differs, or a file
            that is gone; ``teacher_invalid`` when the identity names no adapter.

    Example:
        >>> check_pinned_adapter("rust-teacher", entry_identity, entry.adapter_dir)  # doctest: +SKIP
    """
    from kiln_core.identity.hashing import IdentityHashError, adapter_config_sha256, adapter_weights_sha256

    pinned = identity.adapter
    if pinned is None:
        raise TeacherAdapterError("teacher_invalid", f"teacher '{alias}' records adapter directory {adapter_dir} but "
                                  "its pinned identity is the bare base model", field="teacher")
    try:
        current = {"weights_sha256": adapter_weights_sha256(adapter_dir),
                   "config_sha256": adapter_config_sha256(adapter_dir)}
    except IdentityHashError as error:
        raise _changed(alias, pinned.name, adapter_dir, error.message) from None
    differing = [f"{field} {current[field]} ≠ pinned {getattr(pinned, field)}" for field in current
                 if current[field] != getattr(pinned, field)]
    if differing:
        raise _changed(alias, pinned.name, adapter_dir, "; ".join(differing))


def load_pinned_adapter(model: Any, *, alias: str, identity: TeacherIdentity, adapter_dir: str) -> Any:
    """The loaded base ``model`` wearing the pinned LoRA from ``adapter_dir`` (checked first), for inference.

    The adapter is applied with PEFT from this directory whatever ``base_model_name_or_path`` its config
    names: the registry, not the adapter, says which base it sits on.

    Raises:
        TeacherAdapterError: ``teacher_adapter_changed`` (``check_pinned_adapter``), ``teacher_invalid`` when
            PEFT cannot apply it to this base (shapes, target modules).

    Example:
        >>> model = load_pinned_adapter(base, alias="rust-teacher", identity=identity,
        ...                             adapter_dir=entry.adapter_dir)  # doctest: +SKIP
    """
    check_pinned_adapter(alias, identity, adapter_dir)
    from peft import PeftModel

    try:
        wearing = PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise TeacherAdapterError(
            "teacher_invalid", f"teacher '{alias}' is pinned to adapter '{identity.adapter.name}', but it could not be "
            f"applied to the base model from {adapter_dir}: {type(error).__name__}: {error}", field="teacher",
            file=adapter_dir) from None
    wearing.eval()
    return wearing
