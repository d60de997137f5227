"""A corpus as an ordered set of shards: the index file and the committed set record.

Kiln admits one JSONL file of at most 64 MiB (Kiln's docs/OPD_TEACHER_JSONL.md); kiln-flows also takes an
ordered set of such files, each admitted exactly as Kiln admits it. Two documents describe a set:

``kiln-flows.corpus-shards.v1`` — the index a user (or ``kiln-flows score``) writes beside the shards::

    {"format": "kiln-flows.corpus-shards.v1",
     "shards": [{"uri": "part-00000.jsonl", "sha256": "sha256:<64 hex>", "size_bytes": 1234}, ...]}

``uri`` is relative to the index file's directory (no absolute path, no ``..`` out of it) or a full
fsspec URI (``s3://bucket/part.jsonl``); ``sha256`` and ``size_bytes`` are of the shard's exact bytes.
The order of ``shards`` is the set's order. Unknown keys are refused.

``kiln-flows.corpus-set.v1`` — the set record, written last (atomically) under the storage root at
``corpora/sets/<set hex>/<variant key>.json`` once every shard is materialized under its own digest
(``corpora/<shard hex>/``). Its content follows from the shard bytes, the student and the top-K alone,
so admitting the same set again writes the same bytes.

The set digest (``set_sha256``) is the SHA-256 of these ASCII bytes::

    b"kiln-flows.corpus-set.v1\\n" + for each shard in set order: b"sha256:" + <64 lowercase hex> + b"\\n"

e.g. one shard with digest ``sha256:ab…`` → ``sha256(b"kiln-flows.corpus-set.v1\\nsha256:ab…\\n")``. The
leading line keeps a set digest from ever equalling a single file's digest (Kiln's
``training_data.sha256``, which stays the digest of one file).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "INDEX_FORMAT",
    "DIRECTORY_INDEX",
    "SET_FORMAT",
    "ShardEntry",
    "CorpusShardIndex",
    "SetShard",
    "SetTotals",
    "CorpusSetRecord",
    "set_sha256",
]

INDEX_FORMAT = "kiln-flows.corpus-shards.v1"
DIRECTORY_INDEX = "index.json"
"""The index a directory of shards holds (``kiln-flows score --shard-size`` writes it last): a directory with one
is read through it, whole, never as the ``*.jsonl`` files that happen to be there."""
SET_FORMAT = "kiln-flows.corpus-set.v1"
SHA256_PATTERN = r"^sha256:[0-9a-f]{64}$"


class ShardEntry(BaseModel):
    """One shard of an index, in set order."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    uri: str = Field(min_length=1)
    """Relative to the index file's directory, or a full fsspec URI."""
    sha256: str = Field(pattern=SHA256_PATTERN)
    """``sha256:`` + hex digest of the shard's exact bytes."""
    size_bytes: int = Field(ge=0)


class CorpusShardIndex(BaseModel):
    """``kiln-flows.corpus-shards.v1``: the ordered shards of a corpus."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: Literal["kiln-flows.corpus-shards.v1"]
    shards: list[ShardEntry]


class SetShard(BaseModel):
    """One admitted shard as the set record lists it."""

    model_config = ConfigDict(extra="forbid")

    dataset_sha256: str
    materialized: str
    """The shard's materialization directory, relative to the storage root (``corpora/<hex>`` or a variant)."""
    examples: int
    action_tokens: int
    env_tokens: int
    observation_tokens: int


class SetTotals(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shards: int
    examples: int
    action_tokens: int
    env_tokens: int
    observation_tokens: int


class CorpusSetRecord(BaseModel):
    """``kiln-flows.corpus-set.v1``: a set of shards, every one admitted for this student and top-K."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal["kiln-flows.corpus-set.v1"] = SET_FORMAT
    set_sha256: str
    student: dict[str, Any]
    effective_top_k: int
    manifest_line: str | None
    """The manifest line every shard carries byte for byte (None: no shard has one)."""
    teacher_identity_revision: str | None
    shards: list[SetShard]
    totals: SetTotals
    kiln_flows_version: str


def set_sha256(shard_digests: list[str]) -> str:
    """The set digest over the ordered ``sha256:<hex>`` shard digests (recipe in the module docstring).

    Example:
        >>> set_sha256(["sha256:" + "0" * 64])[:7]
        'sha256:'
    """
    payload = SET_FORMAT + "\n" + "".join(digest + "\n" for digest in shard_digests)
    return "sha256:" + hashlib.sha256(payload.encode("ascii")).hexdigest()
