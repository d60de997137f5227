"""Storage through fsspec: local paths and any URI fsspec reaches (``file://``, ``memory://``, ``s3://``).

Everything kiln-flows publishes is a *directory of files plus one commit file*:

* local disk: files are written into a hidden sibling staging directory
  (``.<name>.incomplete-<uuid>``) holding an ``.incomplete`` sentinel; every file is fsynced, the
  sentinel removed, the directory renamed into place and the parent fsynced. A crash leaves only
  a staging directory that readers never look at (Kiln's crates/kiln-train/src/checkpoint.rs).
* object stores: there is no rename, so files are written under the final prefix and the commit
  file (a manifest) is written last; readers treat a prefix without its commit file as absent
  (docs/architecture.md, decision 7).

Single files are written with one primitive, ``AtomicFile`` (local: a temp file beside the target,
fsync, ``os.replace``, fsync of the directory; object stores: one PUT at commit).

A storage root a command writes into is checked before any work (``kiln_core.storage_root.check_storage_root``).

Credentials, timeouts and the errors storage raises are in ``kiln_core.storage_settings``:
``resolve`` applies the run's scoped options and the product's S3 timeouts to every location, and
turns an unknown protocol or a missing package into a ``StorageRejection``.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kiln_core.storage_settings import (  # noqa: F401 - re-exported: callers import them from here
    S3_PROTOCOLS,
    StorageFailure,
    StorageRejection,
    as_environment_failure,
    effective_options,
    storage_options_scope,
)

INCOMPLETE_SENTINEL = ".incomplete"

@dataclass(frozen=True)
class Location:
    """A resolved storage location: the filesystem and the path inside it."""

    fs: Any
    path: str
    uri: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def child(self, *parts: str) -> "Location":
        """The location of a path below this one."""
        path = posixpath.join(self.path, *parts)
        uri = self.uri.rstrip("/") + "/" + "/".join(parts)
        return Location(self.fs, path, uri)

    def exists(self) -> bool:
        self.refresh()
        return bool(self.fs.exists(self.path))

    def refresh(self) -> None:
        """Forget cached listings of this path (object stores cache them without expiry).

        Another process may have committed a checkpoint or a materialization since we last looked;
        commit checks must see the store as it is now.
        """
        if not self.is_local:
            self.fs.invalidate_cache(self.path)

    def read_bytes(self) -> bytes:
        # One GET, not open-then-read: s3fs's file object takes the ETag first and reads with
        # If-Match, so an object rewritten in between (a run lock's heartbeat) fails to read.
        return bytes(self.fs.cat_file(self.path))

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")


def is_local_uri(uri: str) -> bool:
    """Whether ``uri`` names this machine's file system (a plain path or ``file://``), not a remote store.

    Example:
        >>> is_local_uri("./kiln-data"), is_local_uri("file:///data"), is_local_uri("s3://bucket/kiln")
        (True, True, False)
    """
    return "://" not in uri or uri.startswith("file://")


def anchored_path(path: str, request_path: str) -> str:
    """A relative local path is taken relative to the directory of the file that names it (a request, a recipe);
    a URI or an absolute path, or any path named by a file that is itself a URI, stays as written.

    Example:
        >>> anchored_path("corpus.jsonl", "/data/request.json")
        '/data/corpus.jsonl'
    """
    if "://" in path or os.path.isabs(path) or "://" in request_path:
        return path
    return os.path.join(os.path.dirname(os.path.abspath(request_path)), path)


def resolve(uri: str, storage_options: dict[str, Any] | None = None) -> Location:
    """Resolve a local path or fsspec URI into a ``Location``.

    Local paths are made absolute so that the URI recorded in receipts names the same place
    whatever the working directory is later.

    Example:
        >>> resolve("memory://bucket/x").path
        '/bucket/x'
    """
    if "://" not in uri:
        uri = os.path.abspath(uri)
    try:
        fs, path = fsspec.core.url_to_fs(uri, **effective_options(uri, storage_options))
    except ImportError as error:
        protocol = uri.split("://", 1)[0]
        hint = " (`pip install 'kiln-flows[s3]'`)" if protocol in S3_PROTOCOLS else ""
        raise StorageRejection("storage_package_missing", f"{protocol}:// needs a package that is not installed: "
                               f"{error}{hint}", file=uri) from None
    except ValueError as error:
        if "Protocol not known" not in str(error):
            raise
        protocol = uri.split("://", 1)[0]
        raise StorageRejection("unknown_protocol", f"fsspec knows no protocol {protocol!r}", file=uri) from None
    if isinstance(fs, LocalFileSystem) and not uri.startswith("file://"):
        uri = path
    if getattr(fs, "protocol", None) and set(S3_PROTOCOLS) & set(fs.protocol if isinstance(fs.protocol, tuple) else [fs.protocol]):
        fs.retries = 1  # botocore's bounded retries (s3_client_settings) are the only retry loop
    return Location(fs, path.rstrip("/") or path, uri.rstrip("/") or uri)


# Object stores whose first path component is a bucket (or container) that has to exist before a write.
class AtomicFile:
    """A file that appears at ``location`` whole or not at all: the one atomic-write primitive.

    Write through ``handle`` (binary, readable: ``w+b``), then ``commit()``. Local disk: the temp
    file lives beside the target (``.<name>.tmp-<uuid>``, same file system), is fsynced and
    ``os.replace``-d into place, then the directory is fsynced. Object stores: the temp file is local
    and uploaded in one put at commit. Leaving the block without ``commit`` removes the temp file.

    Example:
        >>> import tempfile, os
        >>> target = resolve(os.path.join(tempfile.mkdtemp(), "out.txt"))
        >>> with AtomicFile(target) as out:
        ...     _ = out.handle.write(b"hello")
        ...     _ = out.commit()
        >>> target.read_bytes()
        b'hello'
    """

    def __init__(self, location: Location) -> None:
        self.location = location
        self.handle: Any = None
        self._temp: str | None = None
        self.committed = False

    def __enter__(self) -> "AtomicFile":
        if self.location.is_local:
            directory = os.path.dirname(self.location.path)
            os.makedirs(directory, exist_ok=True)
            self._temp = os.path.join(directory, f".{os.path.basename(self.location.path)}.tmp-{uuid.uuid4().hex}")
            self.handle = open(self._temp, "x+b")
        else:
            descriptor, self._temp = tempfile.mkstemp(prefix="kiln-flows-", suffix=".tmp")
            self.handle = os.fdopen(descriptor, "w+b")
        return self

    def commit(self) -> str:
        """Publish the file; returns the target URI."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        if self.location.is_local:
            os.replace(self._temp, self.location.path)
            _fsync_dir(os.path.dirname(self.location.path))
        else:
            parent = posixpath.dirname(self.location.path)
            if parent:
                self.location.fs.makedirs(parent, exist_ok=True)
            self.location.fs.put_file(self._temp, self.location.path)
            os.unlink(self._temp)
        self._temp = None
        self.committed = True
        return self.location.uri

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.handle is not None and not self.handle.closed:
            self.handle.close()
        if self._temp is not None and os.path.exists(self._temp):
            os.unlink(self._temp)


def write_bytes_atomic(location: Location, data: bytes) -> None:
    """Write one object so that readers see either the old state or the whole new bytes.

    Local: ``AtomicFile``. Object stores: a single PUT is already atomic per key.
    """
    if location.is_local:
        with AtomicFile(location) as out:
            out.handle.write(data)
            out.commit()
        return
    parent = posixpath.dirname(location.path)
    if parent:
        location.fs.makedirs(parent, exist_ok=True)
    with location.fs.open(location.path, "wb") as handle:
        handle.write(data)


def write_bytes_exclusive(location: Location, data: bytes) -> None:
    """Like ``write_bytes_atomic`` but refuse to replace an existing object (``FileExistsError``)."""
    if location.exists():
        raise FileExistsError(f"refusing to overwrite {location.uri}")
    write_bytes_atomic(location, data)


@dataclass
class StagedDirectory:
    """A directory being published: add files, then ``commit()`` with the commit file last.

    Use as a context manager; leaving the block with an exception removes local staging (object
    store prefixes stay uncommitted, which readers ignore).

    Example:
        >>> with StagedDirectory(resolve("memory://root/run-1"), commit_name="manifest.json") as staged:
        ...     staged.write("data.bin", b"...")
        ...     _ = staged.commit(b"{}")
    """

    target: Location
    commit_name: str
    sentinel_text: str = ""
    _staging: Location | None = field(default=None, init=False)
    _written: list[str] = field(default_factory=list, init=False)
    committed: bool = field(default=False, init=False)

    def __enter__(self) -> "StagedDirectory":
        if self.target.exists() and self._is_committed(self.target):
            raise FileExistsError(f"refusing to overwrite committed {self.target.uri}")
        if self.target.is_local:
            parent = os.path.dirname(self.target.path)
            os.makedirs(parent, exist_ok=True)
            name = f".{os.path.basename(self.target.path)}.incomplete-{uuid.uuid4()}"
            staging_path = os.path.join(parent, name)
            os.makedirs(staging_path)
            self._staging = Location(self.target.fs, staging_path, staging_path)
            sentinel = os.path.join(staging_path, INCOMPLETE_SENTINEL)
            with open(sentinel, "w", encoding="utf-8") as handle:
                handle.write(self.sentinel_text)
                handle.flush()
                os.fsync(handle.fileno())
            _fsync_dir(staging_path)
        else:
            self._staging = self.target
        return self

    def _is_committed(self, location: Location) -> bool:
        return bool(location.fs.exists(posixpath.join(location.path, self.commit_name)))

    @property
    def staging(self) -> Location:
        assert self._staging is not None, "use StagedDirectory as a context manager"
        return self._staging

    def write(self, relative_path: str, data: bytes) -> None:
        """Write one file of the directory (not the commit file)."""
        if relative_path == self.commit_name:
            raise ValueError("write the commit file with commit()")
        destination = self.staging.child(relative_path)
        if self.target.is_local:
            os.makedirs(os.path.dirname(destination.path), exist_ok=True)
            with open(destination.path, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        else:
            with destination.fs.open(destination.path, "wb") as handle:
                handle.write(data)
        self._written.append(relative_path)

    def commit(self, commit_data: bytes) -> Location:
        """Write the commit file last and make the directory visible; returns the target."""
        if self.target.is_local:
            commit_path = os.path.join(self.staging.path, self.commit_name)
            with open(commit_path, "xb") as handle:
                handle.write(commit_data)
                handle.flush()
                os.fsync(handle.fileno())
            os.unlink(os.path.join(self.staging.path, INCOMPLETE_SENTINEL))
            _fsync_tree(self.staging.path)
            if os.path.exists(self.target.path):
                if self._is_committed(self.target):
                    # Another writer committed the same target since __enter__: theirs stands.
                    raise FileExistsError(f"{self.target.uri} was committed by another writer")
                _remove_local_tree(self.target.path)  # an uncommitted leftover is never visible
            try:
                os.rename(self.staging.path, self.target.path)
            except OSError as error:  # ENOTEMPTY/EEXIST: a concurrent commit landed first
                raise FileExistsError(f"{self.target.uri} was committed by another writer") from error
            _fsync_dir(os.path.dirname(self.target.path))
        else:
            with self.target.fs.open(posixpath.join(self.target.path, self.commit_name), "wb") as handle:
                handle.write(commit_data)
        self.committed = True
        return self.target

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.committed and self.target.is_local and self._staging is not None:
            _remove_local_tree(self._staging.path)


def remove_tree(location: Location) -> None:
    """Delete a directory (or prefix) and everything below it."""
    if location.is_local:
        _remove_local_tree(location.path)
    elif location.exists():
        location.fs.rm(location.path, recursive=True)
        location.refresh()


def move_aside(location: Location, new_name: str) -> Location:
    """Rename a directory (or prefix) to a sibling ``new_name``; returns the new location.

    Local disk renames atomically; object stores copy then delete.
    """
    target = Location(location.fs, posixpath.join(posixpath.dirname(location.path), new_name),
                      location.uri.rstrip("/").rsplit("/", 1)[0] + "/" + new_name)
    if location.is_local:
        os.rename(location.path, target.path)
        _fsync_dir(os.path.dirname(target.path))
    else:
        location.fs.mv(location.path, target.path, recursive=True)
        location.refresh()
    return target


def list_children(location: Location) -> list[str]:
    """Base names directly under ``location`` (empty when it does not exist)."""
    location.refresh()
    try:
        entries = location.fs.ls(location.path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(posixpath.basename(str(entry).rstrip("/")) for entry in entries)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every file and directory below ``root``, bottom-up."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(directory)


def _remove_local_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def iter_files(location: Location) -> Iterable[str]:
    """Relative paths of all files below ``location`` (sorted)."""
    location.refresh()
    found = location.fs.find(location.path)
    prefix = location.path.rstrip("/") + "/"
    return sorted(str(p)[len(prefix):] for p in found if str(p).startswith(prefix))


def localize_directory(uri: str, cache_dir: str | None = None, storage_options: dict[str, Any] | None = None) -> str:
    """A local path for a directory that may live behind an fsspec URI (model dirs must be local).

    Local paths are returned as they are; remote directories are copied once into
    ``cache_dir/<digest of the URI>/`` (default: the system temp dir) and reused afterwards.
    """
    import hashlib
    import shutil
    import tempfile

    location = resolve(uri, storage_options)
    if location.is_local:
        return location.path
    cache = os.path.join(cache_dir or tempfile.gettempdir(), "kiln-flows-cache", hashlib.sha256(location.uri.encode()).hexdigest()[:16])
    marker = os.path.join(cache, ".complete")
    if os.path.exists(marker):
        return cache
    staging = f"{cache}.incomplete-{uuid.uuid4().hex}"
    location.fs.get(location.path.rstrip("/") + "/", staging, recursive=True)
    open(os.path.join(staging, ".complete"), "w").close()
    try:
        os.rename(staging, cache)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process finished first
    return cache
