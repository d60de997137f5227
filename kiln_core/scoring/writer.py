"""Streaming a scored corpus to storage atomically, and the JSON form of one scored row.

The corpus is written line by line into a temporary file while examples are scored (bounded memory),
hashed on the way, and published only at the end (``kiln_core.storage.AtomicFile``):

* local destination: the temp file lives beside it (``.<name>.tmp-<uuid>``, same filesystem), is
  fsynced and ``os.replace``-d into place, then the directory is fsynced;
* fsspec destination (``s3://``, ``memory://``…): the temp file is local and uploaded once, at the
  end, in a single put.

Any failure before ``commit`` removes the temp file, so nothing ever appears at the destination.

Every logprob is written as ``float(np.float32(x))``: Python prints the shortest decimal that reads
back as that double, which is exactly an f32, so the JSON round-trips to the same f32 bits admission
and training use.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln_core.scoring.examples import ScoringError


@dataclass(frozen=True)
class ScoredRows:
    """A teacher's answer for one example's action targets, in target order.

    Attributes:
        target_ids: ``int64 [n]`` the observed token at each target position.
        target_logprobs: ``float32 [n]`` the teacher's log-probability of that token.
        top_ids: ``int64 [n, K]`` candidates in rank order (descending logprob, ties → lower id).
        top_logprobs: ``float32 [n, K]`` their raw full-vocabulary log-softmax values.
    """

    target_ids: np.ndarray
    target_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class TokenTexts:
    """Decoded text of single token ids, cached (``token`` is audit-only; decoding is per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def teacher_tokens_json(rows: ScoredRows, token_text: Callable[[int], str]) -> str:
    """The ``teacher_tokens`` array of one example as compact JSON.

    Example:
        >>> rows = ScoredRows(np.array([5]), np.array([-0.5], np.float32),
        ...                   np.array([[5, 7]]), np.array([[-0.5, -1.25]], np.float32))
        >>> teacher_tokens_json(rows, lambda i: f"<{i}>")
        '[{"token":"<5>","token_id":5,"logprob":-0.5,"top_logprobs":[{"token_id":5,"logprob":-0.5},{"token_id":7,"logprob":-1.25}]}]'
    """
    # float32 → float64 is exact, so these Python floats are the f32 values themselves.
    target_ids = rows.target_ids.tolist()
    target_logprobs = rows.target_logprobs.astype(np.float32).astype(np.float64).tolist()
    top_ids = rows.top_ids.tolist()
    top_logprobs = rows.top_logprobs.astype(np.float32).astype(np.float64).tolist()
    parts = []
    for target, logprob, ids, logprobs in zip(target_ids, target_logprobs, top_ids, top_logprobs):
        candidates = ",".join(f'{{"token_id":{i},"logprob":{lp!r}}}' for i, lp in zip(ids, logprobs))
        text = json.dumps(token_text(target), ensure_ascii=False)
        parts.append(f'{{"token":{text},"token_id":{target},"logprob":{logprob!r},"top_logprobs":[{candidates}]}}')
    return "[" + ",".join(parts) + "]"


def row_head(record: dict[str, Any]) -> str:
    """The start of a scored row: the copied input fields, then the ``teacher_tokens`` key.

    The row is ``row_head(record) + teacher_tokens_json(...) + "}"``.
    """
    encoded = json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return encoded[:-1] + (',"teacher_tokens":' if len(encoded) > 2 else '"teacher_tokens":')


class CorpusWriter:
    """Write a corpus line by line and publish it atomically on ``commit``.

    Use as a context manager; leaving the block without ``commit`` (an exception anywhere) deletes
    the temp file and leaves the destination untouched.

    Example:
        >>> with CorpusWriter("out/corpus.jsonl") as writer:  # doctest: +SKIP
        ...     writer.write_line(manifest_line)
        ...     writer.commit()
    """

    def __init__(self, out_uri: str, storage_options: dict | None = None) -> None:
        from kiln_core.storage import AtomicFile, resolve

        self.location = resolve(out_uri, storage_options)
        self._file = AtomicFile(self.location)
        self._hash = hashlib.sha256()
        self.bytes_written = 0
        self.committed = False

    def __enter__(self) -> "CorpusWriter":
        try:
            self._file.__enter__()
        except OSError as error:
            raise ScoringError("storage_error", f"cannot create a temp file for {self.location.uri}: {error}") from None
        return self

    def write_line(self, text: str) -> int:
        """Append ``text`` and a newline; returns the byte offset where ``text`` starts."""
        data = text.encode("utf-8") + b"\n"
        offset = self.bytes_written
        self._file.handle.write(data)
        self._hash.update(data)
        self.bytes_written += len(data)
        return offset

    def read_back(self, offset: int, length: int) -> bytes:
        """Bytes already written (used to copy a duplicate example's rows bit for bit)."""
        self._file.handle.flush()
        return os.pread(self._file.handle.fileno(), length, offset)

    @property
    def sha256(self) -> str:
        """``sha256:`` digest of everything written so far (the file's bytes once committed)."""
        return "sha256:" + self._hash.hexdigest()

    def commit(self) -> str:
        """Publish the file at the destination; returns its URI."""
        try:
            self._file.commit()
        except OSError as error:
            raise ScoringError("storage_error", f"cannot publish {self.location.uri}: {error}") from None
        self.committed = True
        return self.location.uri

    def __exit__(self, exc_type, exc, tb) -> None:
        self._file.__exit__(exc_type, exc, tb)
