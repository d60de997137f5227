"""File-level admission rules: where the corpus is, what it is, and its exact bytes.

The dataset identity is the SHA-256 of these exact bytes (manifest and blank lines included), so the
bytes are read once, hashed, and every later stage works on that one buffer.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass

import numpy as np

from kiln_core.errors import AdmissionError
from kiln_core.storage import resolve

MAX_CORPUS_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class CorpusBytes:
    """The corpus as read: its bytes, digest and where it came from."""

    data: bytes
    sha256_hex: str
    uri: str

    @property
    def dataset_sha256(self) -> str:
        """``sha256:`` + hex digest of the exact file bytes (Kiln's ``training_data.sha256``)."""
        return "sha256:" + self.sha256_hex


def read_corpus(uri: str, storage_options: dict | None = None) -> CorpusBytes:
    """Read a corpus and apply the file-level rules.

    Rules: the file exists (``file_not_found``), is a regular file and not a symlink
    (``not_regular_file``), is at most 64 MiB (``file_too_large``) and is valid UTF-8
    (``invalid_utf8``, with the line of the first bad byte).

    Example:
        >>> corpus = read_corpus("teacher-data.jsonl")  # doctest: +SKIP
        >>> corpus.dataset_sha256[:7]  # doctest: +SKIP
        'sha256:'
    """
    location = resolve(uri, storage_options)
    if location.is_local:
        data = _read_local(location.path)
    else:
        data = _read_remote(location)
    if not data.isascii() and not is_utf8(data):  # ASCII (what json.dumps writes by default) is UTF-8 already
        try:
            data.decode("utf-8")  # only to find the first bad byte
        except UnicodeDecodeError as error:
            line = data.count(b"\n", 0, error.start) + 1
            raise AdmissionError("invalid_utf8", line, f"{location.uri} is not valid UTF-8 (byte offset {error.start})") from None
    return CorpusBytes(data=data, sha256_hex=hashlib.sha256(data).hexdigest(), uri=location.uri)


def is_utf8(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8, by Arrow's validator over the bytes in place.

    ``bytes.decode`` would build a text copy of the whole corpus (up to four times its size) only to
    throw it away; Arrow checks the same rules (no overlong forms, surrogates or code points beyond
    U+10FFFF) without one, many times faster.
    """
    import pyarrow as pa

    offsets = pa.py_buffer(np.array([0, len(data)], dtype=np.int64).tobytes())
    as_binary = pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(data)])
    try:
        as_binary.cast(pa.large_string())  # validates, copies nothing
    except pa.ArrowInvalid:
        return False
    return True


def _read_local(path: str) -> bytes:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise AdmissionError("file_not_found", None, f"{path} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise AdmissionError("not_regular_file", None, f"{path} is a symlink; admission requires a regular file")
    if not stat.S_ISREG(info.st_mode):
        raise AdmissionError("not_regular_file", None, f"{path} is not a regular file")
    _check_size(path, info.st_size)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CORPUS_BYTES + 1)
    except PermissionError as error:
        raise AdmissionError("file_unreadable", None, f"{path} cannot be read: {error.strerror}") from None
    _check_size(path, len(data))  # the file may have grown since lstat
    return data


def _read_remote(location) -> bytes:
    try:
        info = location.fs.info(location.path)
    except FileNotFoundError:
        raise AdmissionError("file_not_found", None, f"{location.uri} does not exist") from None
    if info.get("type") != "file":
        raise AdmissionError("not_regular_file", None, f"{location.uri} is not a regular file")
    _check_size(location.uri, int(info.get("size") or 0))
    with location.fs.open(location.path, "rb") as handle:
        data = handle.read(MAX_CORPUS_BYTES + 1)
    _check_size(location.uri, len(data))
    return data


def _check_size(where: str, size: int) -> None:
    if size > MAX_CORPUS_BYTES:
        raise AdmissionError(
            "file_too_large", None, f"{where} is {size} bytes; the limit is {MAX_CORPUS_BYTES} bytes (64 MiB)"
        )


@dataclass(frozen=True)
class LineIndex:
    """Physical lines of the buffer (Rust ``str::lines`` semantics: split on ``\\n``, drop a ``\\r`` before it)."""

    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def raw(self, data: bytes, i: int) -> bytes:
        """Line ``i`` (0-based) without its terminator."""
        return data[int(self.starts[i]) : int(self.ends[i])]


def index_lines(data: bytes) -> LineIndex:
    """Find every physical line without a Python loop over bytes."""
    buffer = np.frombuffer(data, dtype=np.uint8)
    newlines = _newline_offsets(data, buffer)
    starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
    ends = np.concatenate([newlines, [len(data)]]).astype(np.int64)
    if len(data) and data.endswith(b"\n"):
        starts, ends = starts[:-1], ends[:-1]  # no empty line after the final newline
    elif not data:
        starts, ends = starts[:0], ends[:0]
    # "\r\n" ends a line too; a bare "\r" does not.
    has_cr = (ends > starts) & (ends < len(data))
    if has_cr.any():
        before = np.where(has_cr, ends - 1, 0)
        cr = has_cr & (buffer[before] == 0x0D)
        ends = ends - cr.astype(np.int64)
    return LineIndex(starts=starts, ends=ends)


def _newline_offsets(data: bytes, buffer: np.ndarray) -> np.ndarray:
    """Offsets of every ``\n``: memchr per line when lines are long (the common case), numpy otherwise."""
    count = data.count(b"\n")
    if count > 50_000:  # many short lines: one vectorized comparison beats a Python loop
        return np.flatnonzero(buffer == 0x0A)
    offsets = np.empty(count, dtype=np.int64)
    position = -1
    for i in range(count):
        position = data.index(b"\n", position + 1)
        offsets[i] = position
    return offsets


def json_blank_lines(data: bytes, lines: LineIndex) -> np.ndarray:
    """Lines made only of JSON whitespace (space, tab, CR): what the fast parser skips.

    Almost every line starts with ``{``, so only lines that are empty or start with whitespace are
    inspected one by one.
    """
    buffer = np.frombuffer(data, dtype=np.uint8)
    blank = lines.ends <= lines.starts
    nonempty = np.flatnonzero(~blank)
    first = buffer[lines.starts[nonempty]]
    suspicious = nonempty[(first == 0x20) | (first == 0x09) | (first == 0x0D)]
    for i in suspicious:
        blank[i] = not data[int(lines.starts[i]) : int(lines.ends[i])].strip(b" \t\r")
    return blank
