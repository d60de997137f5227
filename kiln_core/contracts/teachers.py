"""``<root>/teachers.json``: the local teacher registry, one pinned identity per alias.

A local teacher is a bare model directory, or (Kiln's ``kind: "local", adapter``) a base model wearing a
LoRA: the entry then also records where the adapter lives (``adapter_dir``).

kiln-flows' own file (Kiln keeps its registry in its server: crates/kiln-server/src/api/teachers.rs).
``{"schema": "kiln-flows.local-teachers.v1", "teachers": [entry, ...]}``, pretty JSON with non-ASCII
kept as UTF-8 and a trailing newline; ``kiln_core.teachers.local_registry`` reads, checks and rewrites
it whole.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["REGISTRY_FILE", "REGISTRY_SCHEMA", "LocalTeacherEntry", "LocalTeachersFile", "encode_teachers"]

REGISTRY_FILE = "teachers.json"
REGISTRY_SCHEMA = "kiln-flows.local-teachers.v1"


class LocalTeacherEntry(BaseModel):
    """One registered teacher as stored in ``teachers.json`` (our own file: strict, no extras)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    alias: str
    """The immutable name users pass to ``score`` / ``manifest``."""
    identity: dict[str, Any]
    """The ``kiln.teacher-identity.v1`` object, keys in canonical order."""
    identity_revision: str
    """``sha256:`` + the identity's content revision."""
    off_policy_manifest: str
    """The canonical manifest line for this identity (no trailing newline)."""
    teacher_dir: str
    """Absolute path of the teacher directory at registration time (a LoRA teacher's base model)."""
    registered_at: str
    """UTC registration time, ISO 8601."""
    adapter_dir: str | None = Field(default=None, exclude_if=lambda value: value is None)
    """A LoRA teacher's adapter: absolute path of the PEFT adapter directory it was pinned from (the
    identity's ``adapter`` holds its name and digests). Absent for a bare model, so files written before
    LoRA teachers existed read, and bare entries are written, exactly as before."""


class LocalTeachersFile(BaseModel):
    """The whole ``teachers.json`` document, entries in registration order."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["kiln-flows.local-teachers.v1"] = Field(default=REGISTRY_SCHEMA, alias="schema")
    """The format tag; the key is ``schema`` (``schema_`` here: pydantic models own ``schema``)."""
    teachers: list[LocalTeacherEntry]


def encode_teachers(entries: list[LocalTeacherEntry] | tuple[LocalTeacherEntry, ...]) -> bytes:
    """The bytes of ``teachers.json`` holding ``entries``: two-space indent, UTF-8, trailing newline."""
    document = LocalTeachersFile(teachers=list(entries)).model_dump(mode="json", by_alias=True)
    return (json.dumps(document, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
