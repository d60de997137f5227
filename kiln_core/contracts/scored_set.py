"""What a sharded scoring run wrote (``kiln_core.scoring.shards``): the set's shards, its index and digest.

``score_corpus`` returns it and the CLI prints it (``kiln-flows score --shard-size … --json``); the index it
names is a ``kiln-flows.corpus-shards.v1`` document (``kiln_core.contracts.corpus_shards``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ScoredShard", "ScoreSetResult"]


class ScoredShard(BaseModel):
    """One shard of a scored set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str
    sha256: str
    size_bytes: int
    examples: int
    action_tokens: int
    first_line: int
    """Physical line of the examples file its first example came from."""
    resumed: bool
    """Finished by an earlier run and kept as it was (not scored again)."""


class ScoreSetResult(BaseModel):
    """What a sharded scoring run wrote."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out_uri: str
    """The set's directory."""
    index_uri: str
    """The ``kiln-flows.corpus-shards.v1`` index (what ``admit`` and ``score_corpus`` name)."""
    set_sha256: str
    """The set digest over the ordered shard digests (``kiln_core.contracts.corpus_shards.set_sha256``)."""
    examples: int
    action_tokens: int
    manifest_line: str
    identity_revision: str
    shard_size: int
    shards: list[ScoredShard]
    resumed_shards: int
    reused_rows: int
    """Examples whose rows were copied from an identical earlier example (this run's shards only)."""
