"""What a set of shards is: a directory's ``*.jsonl`` files or the entries of an index, each checked
against what the index says before it is admitted (``kiln_core.admission.shards`` admits them).

A directory (not a symlink to one) lists its ``*.jsonl`` files, hidden ones left out, in byte order of
their names. An index (``kiln-flows.corpus-shards.v1``, ``kiln_core.contracts.corpus_shards``) lists shard
paths relative to its own directory — never absolute, never through ``..`` or a symlink — or full fsspec
URIs, each with the size and digest its bytes must have. A directory holding an ``index.json`` is read
through that index. Codes: ``shard_set_empty``, ``shard_index_invalid``, ``shard_path_unsafe``,
``shard_unlisted``, ``shard_missing``, ``shard_digest_mismatch``.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import stat
from dataclasses import dataclass

from pydantic import ValidationError

from kiln_core.admission.source import MAX_CORPUS_BYTES
from kiln_core.contracts.corpus_shards import DIRECTORY_INDEX, INDEX_FORMAT, CorpusShardIndex, set_sha256
from kiln_core.errors import AdmissionError
from kiln_core.storage import Location, resolve, write_bytes_atomic

__all__ = ["INDEX_SUFFIX", "ShardSource", "is_shard_set", "list_shards", "check_against_index", "build_index",
           "training_files", "shard_set_digest"]

INDEX_SUFFIX = ".index.json"
_HASH_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class ShardSource:
    """One shard to admit: where its bytes are, how errors name it, and what the index says of it."""

    uri: str
    name: str
    expected_sha256: str | None = None
    expected_size: int | None = None


# --- what the set is ---------------------------------------------------------------------------------


def is_shard_set(uri: str, storage_options: dict | None = None) -> bool:
    """Whether ``uri`` names a set of shards (a directory or an index) rather than one JSONL file.

    A directory (not a symlink to one: a symlinked corpus stays the single-file ``not_regular_file``), a
    file named ``index.json`` or ``*.index.json`` (read as an index even when it does not parse, so a broken
    one is refused as the index it is, ``shard_index_invalid``), or a ``*.json`` file holding one JSON object
    whose ``format`` is ``kiln-flows.corpus-shards.v1``. Anything else — a missing path included — is a single
    file and keeps the single-file verdict.
    """
    location = resolve(uri, storage_options)
    if location.is_local:
        try:
            info = os.lstat(location.path)
        except OSError:
            return False
        if stat.S_ISDIR(info.st_mode):
            return True
        if not stat.S_ISREG(info.st_mode):
            return False
    else:
        try:
            if location.fs.isdir(location.path):
                return True
        except FileNotFoundError:
            return False
    if location.path.endswith(INDEX_SUFFIX) or posixpath.basename(location.path) == DIRECTORY_INDEX:
        return True
    if not location.path.endswith(".json"):
        return False
    try:
        value = json.loads(_read_capped(location))
    except (ValueError, OSError):
        return False
    return isinstance(value, dict) and value.get("format") == INDEX_FORMAT


def training_files(uri: str, storage_options: dict | None = None) -> list[tuple[str, str]]:
    """``(file uri, how messages name it)`` of each file of a training corpus: the file itself, or every
    shard of a set in set order.

    Example:
        >>> training_files("train.jsonl")[0][1]  # doctest: +SKIP
        'the training corpus train.jsonl'
    """
    if not is_shard_set(uri, storage_options):
        return [(uri, f"the training corpus {uri}")]
    return [(shard.uri, f"shard {shard.name} of the training set {uri}") for shard in list_shards(uri, storage_options)]


def shard_set_digest(uri: str, storage_options: dict | None = None) -> tuple[str, list[ShardSource]]:
    """The set digest of a set as its bytes are now, and its shards: each indexed shard checked against
    the index (``shard_missing``, ``shard_path_unsafe``, ``shard_digest_mismatch``), each listed one hashed.

    Raises:
        AdmissionError: the set itself or one of its shards is refused.
    """
    shards = list_shards(uri, storage_options)
    digests = []
    for shard in shards:
        if shard.expected_sha256 is not None:
            check_against_index(shard, storage_options)
            digests.append(shard.expected_sha256)
        else:
            digests.append(_file_digest(resolve(shard.uri, storage_options)))
    return set_sha256(digests), shards


def list_shards(uri: str, storage_options: dict | None = None) -> list[ShardSource]:
    """The shards of a set, in set order.

    A directory that holds an ``index.json`` is the set its index lists, read whole: a ``*.jsonl`` file beside
    the index that the index does not list is refused (``shard_unlisted``), as is (later, before admission) a
    listed shard that is gone (``shard_missing``). Without an index, a directory is its ``*.jsonl`` files.

    Raises:
        AdmissionError: ``shard_index_invalid``, ``shard_path_unsafe``, ``shard_unlisted`` or ``shard_set_empty``.
    """
    location = resolve(uri, storage_options)
    directory = location.fs.isdir(location.path)
    index = location.child(DIRECTORY_INDEX) if directory else location
    if directory and index.exists():
        shards = _index_shards(index, storage_options)
        _refuse_unlisted(_directory_shards(location), shards, index)
    else:
        shards = _directory_shards(location) if directory else _index_shards(location, storage_options)
    if not shards:
        what = "the directory holds no *.jsonl file" if directory else "the index lists no shard"
        raise AdmissionError("shard_set_empty", None, f"{what}: a set needs at least one shard", file=location.uri)
    return shards


def _directory_shards(location: Location) -> list[ShardSource]:
    if location.is_local:
        with os.scandir(location.path) as entries:
            found = [(entry.name, entry.is_symlink()) for entry in entries]
    else:
        found = [(posixpath.basename(info["name"].rstrip("/")), False)
                 for info in location.fs.ls(location.path, detail=True)]
    # Hidden files are a writer's staging (``.part.jsonl.tmp-…``), never a shard.
    names = sorted((name for name, _ in found if name.endswith(".jsonl") and not name.startswith(".")),
                   key=os.fsencode)
    links = {name for name, is_link in found if is_link}
    for name in names:
        if name in links:
            raise AdmissionError("shard_path_unsafe", None, f"shard {name} is a symlink; a shard must be a regular "
                                 f"file inside the set's directory", file=name)
    return [ShardSource(uri=location.child(name).uri, name=name) for name in names]


def _refuse_unlisted(present: list[ShardSource], listed: list[ShardSource], index: Location) -> None:
    """``shard_unlisted``: a ``*.jsonl`` file in the index's directory that the index does not list (a shard
    written after the index, or a stray corpus) would be silently left out of the set."""
    known = {shard.uri for shard in listed}
    for shard in present:
        if shard.uri not in known:
            raise AdmissionError("shard_unlisted", None, f"{shard.name} is in the directory of {index.uri} but the "
                                 f"index does not list it; a directory with an index is read through it, whole: "
                                 f"move the file out, or write the index again", file=shard.name)


def _index_shards(location: Location, storage_options: dict | None) -> list[ShardSource]:
    try:
        data = _read_capped(location)
    except FileNotFoundError:
        raise AdmissionError("file_not_found", None, f"{location.uri} does not exist") from None
    try:
        index = CorpusShardIndex.model_validate_json(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(document)"
        raise AdmissionError("shard_index_invalid", None, f"the index is not a valid {INDEX_FORMAT} document: "
                             f"{where}: {first['msg']}", file=location.uri) from None
    root_location = resolve(location.uri.rsplit("/", 1)[0], storage_options)
    return [_indexed_shard(root_location, entry.uri, entry.sha256, entry.size_bytes, number)
            for number, entry in enumerate(index.shards)]


def _indexed_shard(root: Location, entry: str, sha256: str, size: int, number: int) -> ShardSource:
    if "://" in entry:  # a full fsspec URI: the index names it on purpose
        return ShardSource(uri=entry, name=entry, expected_sha256=sha256, expected_size=size)
    parts = entry.split("/")
    unsafe = (entry.startswith("/") or "\\" in entry or ":" in parts[0]
              or any(part in ("..", "") for part in parts))
    if unsafe:
        raise AdmissionError("shard_path_unsafe", None, f"index entry {number} ({entry!r}) is not a relative path "
                             f"inside the index's directory (no absolute path, no '..', no empty part)",
                             file=entry)
    parts = [part for part in parts if part != "."]
    if root.is_local:
        # A symlinked directory on the way could lead anywhere; only the shard itself is checked later.
        for depth in range(1, len(parts)):
            path = os.path.join(root.path, *parts[:depth])
            if os.path.islink(path):
                raise AdmissionError("shard_path_unsafe", None, f"index entry {number} ({entry!r}) passes through "
                                     f"the symlink {'/'.join(parts[:depth])}", file=entry)
    return ShardSource(uri=root.child(*parts).uri, name=entry, expected_sha256=sha256, expected_size=size)


def _read_capped(location: Location) -> bytes:
    with location.fs.open(location.path, "rb") as handle:
        return handle.read(MAX_CORPUS_BYTES + 1)


def check_against_index(shard: ShardSource, storage_options: dict | None) -> None:
    """``shard_missing``, ``shard_path_unsafe`` (a symlink) and ``shard_digest_mismatch``, before admitting."""
    location = resolve(shard.uri, storage_options)
    if location.is_local:
        try:
            info = os.lstat(location.path)
        except FileNotFoundError:
            raise AdmissionError("shard_missing", None, f"shard {shard.name} listed in the index does not exist "
                                 f"({location.uri})", file=shard.name) from None
        if stat.S_ISLNK(info.st_mode):
            raise AdmissionError("shard_path_unsafe", None, f"shard {shard.name} is a symlink; a shard must be a "
                                 f"regular file", file=shard.name)
        size = info.st_size if stat.S_ISREG(info.st_mode) else None
    else:
        try:
            info = location.fs.info(location.path)
        except FileNotFoundError:
            raise AdmissionError("shard_missing", None, f"shard {shard.name} listed in the index does not exist "
                                 f"({location.uri})", file=shard.name) from None
        size = int(info.get("size") or 0) if info.get("type") == "file" else None
    if size is None:
        return  # not a regular file: the shard's own verdict (not_regular_file) says so
    if size != shard.expected_size:
        raise AdmissionError("shard_digest_mismatch", None, f"shard {shard.name} is {size} bytes; the index says "
                             f"{shard.expected_size}", file=shard.name)
    actual = _file_digest(location)
    if actual != shard.expected_sha256:
        raise AdmissionError("shard_digest_mismatch", None, f"shard {shard.name} has digest {actual}; the index "
                             f"says {shard.expected_sha256}", file=shard.name)


def _file_digest(location: Location) -> str:
    """``sha256:`` of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with location.fs.open(location.path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


# --- writing an index --------------------------------------------------------------------------------------


def build_index(index_uri: str, shard_names: list[str], storage_options: dict | None = None) -> CorpusShardIndex:
    """Write a ``kiln-flows.corpus-shards.v1`` index over shards in the index's directory, in the given order.

    Example:
        >>> build_index("corpus/corpus.index.json", ["part-0.jsonl", "part-1.jsonl"])  # doctest: +SKIP
    """
    location = resolve(index_uri, storage_options)
    directory = location.uri.rsplit("/", 1)[0]
    entries = []
    for name in shard_names:
        data = resolve(directory + "/" + name, storage_options).read_bytes()
        entries.append({"uri": name, "sha256": "sha256:" + hashlib.sha256(data).hexdigest(), "size_bytes": len(data)})
    index = CorpusShardIndex.model_validate({"format": INDEX_FORMAT, "shards": entries})
    write_bytes_atomic(location, index.model_dump_json(indent=2).encode("utf-8") + b"\n")
    return index
