"""A corpus admitted as a set of shards, read the way training reads it: one shard at a time.

Admission (``kiln_core.admission.shards``) materializes every shard under its own digest and writes the
set record (``kiln-flows.corpus-set.v1``) last. Training takes the set's examples in file order within
a shard and in shard order across the set, so example ``i`` of the set is row ``i - start[s]`` of the
shard ``s`` it falls in. Only the shard being trained is held in memory: its Parquet files are read
(and verified against its ``admission.json``) when training reaches it and dropped when training moves
on, so peak memory follows the largest shard, never the size of the set.

A set of one shard trains exactly as that shard's file does on its own: the same examples in the same
order (only the run's data digests differ: a set is bound by its set digest).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from kiln_core.contracts.checkpoint import DataCursor
from kiln_core.contracts.corpus_shards import CorpusSetRecord
from kiln_core.corpus import CorpusTables, TrainingExample
from kiln_core.storage import Location, resolve

__all__ = ["ShardLayout", "ShardedCorpus", "SET_REVISION_FORMAT", "combined_revision", "training_corpus"]

SET_REVISION_FORMAT = "kiln-flows.corpus-set-revision.v1"


@dataclass(frozen=True)
class ShardLayout:
    """Where each shard's examples sit in the set's example order.

    Attributes:
        set_sha256: The set digest.
        shard_sha256: Each shard's ``sha256:`` digest, in set order.
        starts: The set index of each shard's first example, then the set's example count.
    """

    set_sha256: str
    shard_sha256: tuple[str, ...]
    starts: tuple[int, ...]

    @property
    def examples(self) -> int:
        return self.starts[-1]

    def locate(self, example: int) -> tuple[int, int]:
        """``(shard, row)`` of the set's example ``example``.

        Example:
            >>> ShardLayout("sha256:s", ("sha256:a", "sha256:b"), (0, 3, 5)).locate(4)
            (1, 1)
        """
        if not 0 <= example < self.examples:
            raise IndexError(f"example {example} is outside the set's {self.examples} examples")
        shard = bisect.bisect_right(self.starts, example) - 1
        return shard, example - self.starts[shard]

    def cursor(self, candidate: int, *, samples_per_prompt: int) -> DataCursor:
        """The cursor of candidate ``candidate`` (0-based over the whole run; one past the last is the
        start of the next epoch)."""
        per_epoch = self.examples * samples_per_prompt
        epoch, within = divmod(candidate, per_epoch)
        example, sample = divmod(within, samples_per_prompt)
        shard, row = self.locate(example)
        return DataCursor(set_sha256=self.set_sha256, epoch=epoch, shard=shard, shard_sha256=self.shard_sha256[shard],
                          row=row, sample=sample)


class ShardedCorpus:
    """The admitted set as the trainer reads it: ``num_examples``, ``top_k``, ``example(i)`` like
    ``CorpusTables``, with one shard's tables in memory at a time.

    Example:
        >>> corpus = ShardedCorpus.open("kiln-data/corpora/sets/<hex>/<variant>.json")  # doctest: +SKIP
        >>> corpus.layout.locate(1200)  # doctest: +SKIP
        (2, 176)
    """

    kiln_prompts_sha256 = None
    """A set has no single Kiln prompt list; the run binds the set digest instead (``plan``)."""

    def __init__(self, record: CorpusSetRecord, root: Location) -> None:
        self.record, self.root = record, root
        starts = np.concatenate([[0], np.cumsum([shard.examples for shard in record.shards])]).astype(int)
        self.layout = ShardLayout(record.set_sha256, tuple(s.dataset_sha256 for s in record.shards),
                                  tuple(int(x) for x in starts))
        self._loaded: tuple[int, CorpusTables] | None = None

    @classmethod
    def open(cls, record_uri: str, storage_options: dict | None = None) -> "ShardedCorpus":
        """Read a committed set record; its storage root is the one it lives under
        (``<root>/corpora/sets/<set hex>/<variant>.json``)."""
        location = resolve(record_uri, storage_options)
        record = CorpusSetRecord.model_validate_json(location.read_bytes())
        root_uri = location.uri.rsplit("/", 4)[0]
        return cls(record, resolve(root_uri, storage_options))

    @property
    def num_examples(self) -> int:
        return self.layout.examples

    @property
    def top_k(self) -> int:
        return self.record.effective_top_k

    @property
    def shard_count(self) -> int:
        return len(self.record.shards)

    def shard_location(self, shard: int) -> Location:
        return self.root.child(*self.record.shards[shard].materialized.split("/"))

    def shard(self, shard: int) -> CorpusTables:
        """Shard ``shard``'s tables, read and verified now unless it is the one already loaded."""
        if self._loaded is None or self._loaded[0] != shard:
            self._loaded = None  # the previous shard's arrays go before the next one's are read
            self._loaded = (shard, self._read(shard))
        return self._loaded[1]

    def _read(self, shard: int) -> CorpusTables:
        from kiln_core.materialize import read_materialization_at

        location = self.shard_location(shard)
        materialization = read_materialization_at(location)
        expected = self.record.shards[shard]
        if materialization is None or materialization.record.dataset_sha256 != expected.dataset_sha256:
            raise FileNotFoundError(f"shard {shard} of set {self.record.set_sha256} is not materialized at "
                                    f"{location.uri} (admit the set again)")
        tables = materialization.tables  # reading verifies every file's size and SHA-256
        if tables.num_examples != expected.examples or tables.top_k != self.top_k:
            raise ValueError(f"shard {shard} at {location.uri} holds {tables.num_examples} examples at top-K "
                             f"{tables.top_k}; the set record says {expected.examples} at {self.top_k}")
        return tables

    def example(self, i: int) -> TrainingExample:
        """The set's example ``i`` (its ``index`` is ``i``; its ``line`` the line in its shard)."""
        shard, row = self.layout.locate(i)
        return dataclasses.replace(self.shard(shard).example(row), index=i)

    def shards(self) -> Iterator[CorpusTables]:
        """Every shard's tables in set order, one in memory at a time."""
        for shard in range(self.shard_count):
            yield self.shard(shard)

    def __len__(self) -> int:
        return self.num_examples

    def __iter__(self) -> Iterator[TrainingExample]:
        return (self.example(i) for i in range(self.num_examples))


def combined_revision(shard_revisions: list[str]) -> str:
    """The set's teacher content revision from its shards' (one shard: that shard's own revision).

    Example:
        >>> combined_revision(["sha256:ab"])
        'sha256:ab'
    """
    if len(shard_revisions) == 1:
        return shard_revisions[0]
    payload = SET_REVISION_FORMAT + "\n" + "".join(revision + "\n" for revision in shard_revisions)
    return "sha256:" + hashlib.sha256(payload.encode("ascii")).hexdigest()


def training_corpus(corpus: Any) -> CorpusTables | ShardedCorpus:
    """What the trainer reads for a ``CorpusRef``: one materialization's tables, or a set read shard by shard.

    Example:
        >>> training_corpus(corpus_ref).num_examples  # doctest: +SKIP
        1200
    """
    from kiln_core.materialize import read_materialization

    if corpus.kind == "shard_set":
        return ShardedCorpus.open(corpus.uri)
    return read_materialization(corpus.uri).tables
