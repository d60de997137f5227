"""One run per run key at a time: the run lock.

Two identical runs (same adapter, same inputs: the same ``runs/<adapter>/<run key>/``) would write the
same checkpoints; the second used to fail with ``checkpoint_exists`` (or ``resume_required``), which
reads as bad input. Now the run that comes second either waits for the first (``wait_seconds``;
``kiln-flows train --wait-for-lock SECONDS``) or fails with ``run_in_progress`` (exit 3: an
environment condition, not bad input) naming the holder: host, pid and since when (UTC).

The lock is the object ``runs/<adapter>/.<run key>.lock`` beside the run directory (not inside it: the
gate may move a run directory aside while the lock is held, and readers of a run directory never see
it; names starting with ``.`` are not runs). It holds a small JSON record of the holder (``token``,
``host``, ``pid``, ``since``, ``heartbeat_at``, ``lease_seconds``, ``run``). It is taken as soon as the
run directory is known (``kiln_core.engine.runs.plan_run``), before the resume rule looks at the
directory (a live run's checkpoints are not a reason to ask for ``--resume-checkpoint``), and released
by ``run_pipeline`` on every way out (success, failure, rejection, Ctrl-C).

The rule, on local disk (any path ``os.open`` reaches, including NFS mounts with working ``flock``):

* the holder keeps an exclusive ``flock`` on the lock file for the whole run. The kernel drops it
  when the holder's process ends in any way (exit, crash, SIGKILL), so a dead pid's lock is free at
  once and the next run takes it over; the record inside only names the holder for the message. On
  release the file is removed while still locked (a run that opened the old file re-checks the inode).

On object stores (``s3://``, and any other fsspec store), where no process-lifetime lock exists:

* create: S3 conditional put ``If-None-Match: *`` (s3fs ``pipe_file(mode="create")``) — exactly one
  of two racing runs creates the record;
* the holder rewrites its record every ``lease_seconds / 4`` from a timer thread (a heartbeat,
  conditional on the record still being the one it wrote: ``If-Match: <ETag>``);
* a record is stale, and is taken over, when its holder is on this host and its pid no longer exists,
  or when its heartbeat is older than its lease (default 120 s) — a holder on another host that
  stopped heartbeating (crashed, lost its network) is taken over once its lease runs out. Clocks of
  hosts sharing a store must agree to well within the lease;
* take-over is a conditional put ``If-Match: <ETag of the stale record>``, so of two runs taking over
  the same stale record one wins; release deletes the record if its token is still ours;
* stores without conditional writes (``memory://``, ``gs://`` through fsspec's generic ``pipe_file``):
  write, then read back and compare the token. Two runs starting within the same write/read round trip
  (milliseconds) can both believe they hold it; the run directory's immutable checkpoints still refuse
  the second writer (``checkpoint_exists``). This is the documented race window.

A holder whose heartbeat was refused (it was taken over after its lease expired, e.g. a process stopped
for minutes) keeps running but is told so in a warning; it does not delete the new holder's record.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from kiln_core.errors import EnvironmentFailure
from kiln_core.storage import S3_PROTOCOLS, Location

DEFAULT_LEASE_SECONDS = 120.0
POLL_SECONDS = 1.0

log = logging.getLogger("kiln_core.run_lock")


@dataclass(frozen=True)
class Holder:
    """Who holds a run lock: the JSON record in the lock object."""

    token: str
    host: str
    pid: int
    since: str
    heartbeat_at: float
    lease_seconds: float
    run: str

    @classmethod
    def me(cls, run: str, lease_seconds: float) -> "Holder":
        now = time.time()
        return cls(token=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(), since=_utc(now),
                   heartbeat_at=now, lease_seconds=lease_seconds, run=run)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def parse(cls, data: bytes) -> "Holder | None":
        """The record in ``data``, or None when it is empty or not a record (a torn or foreign file)."""
        try:
            record = json.loads(data.decode("utf-8"))
            return cls(token=str(record["token"]), host=str(record["host"]), pid=int(record["pid"]),
                       since=str(record["since"]), heartbeat_at=float(record["heartbeat_at"]),
                       lease_seconds=float(record["lease_seconds"]), run=str(record["run"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def is_stale(self, now: float | None = None) -> bool:
        """A dead pid on this host, or a heartbeat older than the lease (any host)."""
        now = time.time() if now is None else now
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return True
        return now - self.heartbeat_at > self.lease_seconds

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {self.since} (UTC)"


class RunInProgress(EnvironmentFailure):
    """Another live run holds this run key's lock (code ``run_in_progress``, exit 3).

    Attributes:
        holder: The holder's record, or None when it could not be read.
    """

    def __init__(self, lock_uri: str, holder: Holder | None, waited: float) -> None:
        who = holder.describe() if holder is not None else "a holder that has not recorded itself yet"
        waited_text = f"after waiting {waited:.0f} s; " if waited > 0 else ""
        super().__init__("run_in_progress",
                         f"another run of this run key is in progress ({who}); {waited_text}wait for it with "
                         f"--wait-for-lock SECONDS, or run again when it has ended", file=lock_uri)
        self.holder = holder

    def to_json(self) -> dict[str, Any]:
        payload = super().to_json()
        if self.holder is not None:
            payload["holder"] = {"host": self.holder.host, "pid": self.holder.pid, "since": self.holder.since}
        return payload


def lock_location(run: Location) -> Location:
    """``runs/<adapter>/.<run key>.lock``: the lock object of the run directory ``run``."""
    parent, name = posixpath.split(run.path.rstrip("/"))
    return Location(run.fs, posixpath.join(parent, f".{name}.lock"),
                    run.uri.rstrip("/").rsplit("/", 1)[0] + f"/.{name}.lock")


class RunLock:
    """The lock of one run directory, taken with ``acquire(run)`` and given back with ``release()``.

    Args:
        wait_seconds: How long ``acquire`` waits for a live holder before raising ``RunInProgress``
            (0: not at all).
        lease_seconds: Object stores: how long a record stays valid without a heartbeat.

    Example:
        >>> lock = RunLock()
        >>> lock.acquire(resolve("./kiln-data/runs/demo/0123abcd"))  # doctest: +SKIP
        >>> lock.release()  # doctest: +SKIP
    """

    def __init__(self, *, wait_seconds: float = 0.0, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.wait_seconds = max(0.0, float(wait_seconds))
        self.lease_seconds = lease_seconds
        self.location: Location | None = None
        self.holder: Holder | None = None
        self.lost = False
        self._fd: int | None = None
        self._created_dirs: list[str] | None = None
        self._etag: Any = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- taking it -------------------------------------------------------------------------------

    def acquire(self, run: Location) -> None:
        """Hold the lock of ``run`` (waiting up to ``wait_seconds`` for a live holder).

        Raises:
            RunInProgress: a live run holds it (still, after the wait).
        """
        if self.location is not None:
            raise RuntimeError(f"this RunLock already holds {self.location.uri}")
        location = lock_location(run)
        me = Holder.me(run.uri, self.lease_seconds)
        started = time.monotonic()
        told = False
        while True:
            current = self._try_local(location, me) if location.is_local else self._try_remote(location, me)
            if current is None:
                self.location, self.holder = location, me
                if not location.is_local:
                    self._start_heartbeat()
                return
            waited = time.monotonic() - started
            if waited >= self.wait_seconds:
                raise RunInProgress(location.uri, current if isinstance(current, Holder) else None,
                                    waited if self.wait_seconds > 0 else 0.0)
            if not told:
                who = current.describe() if isinstance(current, Holder) else "another run"
                log.warning("run %s is in progress (%s); waiting up to %.0f s for it", run.uri, who, self.wait_seconds)
                told = True
            time.sleep(min(POLL_SECONDS, max(0.05, self.wait_seconds - waited)))

    def _try_local(self, location: Location, me: Holder) -> Holder | bool | None:
        """None when taken; else the holder's record (or True when it is not readable yet)."""
        import fcntl

        parent = os.path.dirname(location.path)
        if self._created_dirs is None:  # what release removes again when the run wrote nothing beside the lock
            self._created_dirs = _missing_directories(parent)
        os.makedirs(parent, exist_ok=True)
        try:
            fd = os.open(location.path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # a releasing run removed the directory it had created: look again
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            return _read_local_holder(location.path) or True
        try:  # the file we locked must still be the one at the path (a releasing run removes it)
            same = os.fstat(fd).st_ino == os.stat(location.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return True
        data = me.to_bytes()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._fd = fd
        return None

    def _try_remote(self, location: Location, me: Holder) -> Holder | bool | None:
        """None when taken; else the live holder's record (True: it changed under us, look again)."""
        store = _Store(location)
        try:
            self._etag = store.create(me.to_bytes())
            return None
        except FileExistsError:
            pass
        etag, current = store.read()
        if etag is None:
            return True  # released between our create and read: try again
        if current is not None and not current.is_stale():
            return current
        try:
            self._etag = store.replace(me.to_bytes(), etag)
        except _Changed:
            return current or True
        log.warning("took over the run lock %s from %s (its holder is gone)", location.uri,
                    current.describe() if current is not None else "an unreadable record")
        return None

    # -- keeping it (object stores) --------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="kiln-run-lock-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_seconds / 4):
            self.refresh()

    def refresh(self) -> bool:
        """Rewrite the record with a new heartbeat; False once the lock was taken over (object stores)."""
        if self.location is None or self.location.is_local or self.lost or self.holder is None:
            return not self.lost
        beat = Holder(**{**asdict(self.holder), "heartbeat_at": time.time()})
        try:
            self._etag = _Store(self.location).replace(beat.to_bytes(), self._etag)
            self.holder = beat
        except _Changed:
            self.lost = True
            log.warning("the run lock %s was taken over by another run (this run's heartbeat had lapsed)",
                        self.location.uri)
        except Exception as error:  # noqa: BLE001 - a failed heartbeat is retried at the next tick
            log.warning("could not refresh the run lock %s: %s", self.location.uri, error)
        return not self.lost

    # -- giving it back --------------------------------------------------------------------------

    def release(self) -> None:
        """Give the lock back (no-op when not held); never raises for a lock that is already gone."""
        location, self.location = self.location, None
        if location is None:
            return
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None
        if location.is_local:
            fd, self._fd = self._fd, None
            try:
                os.unlink(location.path)  # while still locked: see _try_local's inode check
            except FileNotFoundError:
                pass
            finally:
                if fd is not None:
                    os.close(fd)
            _remove_if_empty(self._created_dirs or [])
            self._created_dirs = None
            return
        if self.lost:
            return
        try:
            store = _Store(location)
            _, current = store.read()
            if current is not None and self.holder is not None and current.token == self.holder.token:
                store.delete()
        except Exception as error:  # noqa: BLE001 - an unreleased record expires with its lease
            log.warning("could not release the run lock %s (it expires after %.0f s): %s", location.uri,
                        self.lease_seconds, error)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _missing_directories(path: str) -> list[str]:
    """The directories ``os.makedirs(path)`` would create, deepest first."""
    missing = []
    while path and not os.path.isdir(path) and path not in missing:  # ``dirname`` of a root is the root itself
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_if_empty(directories: list[str]) -> None:
    """Remove the directories a lock created (deepest first) while they are empty: a run refused before it
    wrote anything leaves no ``runs/<adapter>/`` behind."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:  # not empty (the run wrote there, or another run did), or already gone
            return


class _Changed(Exception):
    """A conditional write found the object changed (or gone) since it was read."""


class _Store:
    """Create-if-absent and replace-if-unchanged of one small object, as well as the store allows."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self.fs = location.fs
        self.path = location.path
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.s3 = bool(set(S3_PROTOCOLS) & set(protocols))

    def create(self, data: bytes) -> Any:
        """Write ``data`` if nothing is there; returns its version. Raises FileExistsError otherwise."""
        parent = posixpath.dirname(self.path)
        if parent and not self.s3:
            self.fs.makedirs(parent, exist_ok=True)
        if self.s3:  # If-None-Match: * (s3fs >= 2024.12)
            try:
                return _etag(self.fs.pipe_file(self.path, data, mode="create"))
            except OSError as error:
                if not _unsupported(error):
                    raise
                self.s3 = False  # an S3-compatible store without conditional writes: the generic way
                log.warning("%s does not support conditional writes; the run lock falls back to "
                            "write-then-read-back (a small race window)", self.location.uri)
        self.location.refresh()
        self.fs.pipe_file(self.path, data, mode="create")  # exists-then-write: the documented race window
        etag, current = self.read()
        if current is None or current.to_bytes() != data:
            raise FileExistsError(self.location.uri)
        return etag

    def read(self) -> tuple[Any, Holder | None]:
        """(version, record) of the object now; (None, None) when it does not exist."""
        self.location.refresh()
        try:
            etag = self.fs.info(self.path).get("ETag") if self.s3 else None
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None
        # Without ETags the bytes themselves are the version (compared again before a replace).
        return (etag if self.s3 else data), Holder.parse(data)

    def replace(self, data: bytes, version: Any) -> Any:
        """Write ``data`` only if the object is still at ``version``; returns the new version."""
        if self.s3:
            try:  # If-Match: the ETag read before the decision; 412 when another run wrote first
                return _etag(self.fs.pipe_file(self.path, data, IfMatch=version))
            except (FileNotFoundError, FileExistsError) as error:
                raise _Changed() from error
            except OSError as error:
                if error.errno == errno.EINVAL or "Precondition" in str(error) or "ConditionalRequestConflict" in str(error):
                    raise _Changed() from error
                raise
        now, _ = self.read()
        if now != version:
            raise _Changed()
        self.fs.pipe_file(self.path, data)
        after, _ = self.read()
        if after != data:
            raise _Changed()
        return after

    def delete(self) -> None:
        self.fs.rm_file(self.path)
        self.location.refresh()


def _unsupported(error: OSError) -> bool:
    """A store that refuses the conditional header itself (501 NotImplemented), not the condition."""
    text = str(error)
    return "NotImplemented" in text or "not implemented" in text.lower()


def _etag(put_result: Any) -> Any:
    return put_result.get("ETag") if isinstance(put_result, dict) else None


def _read_local_holder(path: str) -> Holder | None:
    """The record of a locked file; the holder may be between taking the lock and writing it."""
    for _ in range(5):
        try:
            with open(path, "rb") as handle:
                holder = Holder.parse(handle.read())
        except FileNotFoundError:
            return None
        if holder is not None:
            return holder
        time.sleep(0.05)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    except OSError:
        return True
    return True


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")

