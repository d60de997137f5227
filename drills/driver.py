"""The training driver the SIGKILL and S3 outage drills kill: a subprocess that reports each event.

``python -m drills.driver --request ... --adapter ... --student ... --out ...`` runs one training
request (``kiln_core.engine.request.train_request``, the glue behind ``kiln-flows train``) and writes
``EVENT <kind> <arg>`` on stdout at every step and every publication write (``write``, ``commit``,
``committed``, ``put``, ``put-done``); with ``--handshake all`` it then waits for ``go`` on stdin, so a
drill can SIGKILL it exactly at that point. ``Driver`` is the drill's side of that conversation.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from drills import subprocess_env

EVENT_TIMEOUT_S = 180.0


class Driver:
    """A training subprocess that reports ``EVENT <kind> <arg>`` lines and (optionally) waits for
    ``go`` after each one."""

    def __init__(self, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None, cwd: str | None = None):
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        env=env or subprocess_env(), cwd=cwd)
        self._buffer = b""
        self.lines: list[str] = []

    @classmethod
    def training(cls, *, request: Path, adapter: str, student: Path, out: str, log_path: Path,
                 handshake: str = "all", resume: str | None = None, s3_fast_fail: bool = False,
                 env: dict[str, str] | None = None) -> "Driver":
        argv = [sys.executable, "-m", "drills.driver", "--request", str(request),
                "--adapter", adapter, "--student", str(student), "--out", out, "--handshake", handshake]
        if resume:
            argv += ["--resume", resume]
        env = dict(env or subprocess_env())
        if s3_fast_fail:
            env.update(FAST_FAILING_S3)
        return cls(argv, log_path=log_path, env=env)

    def next_line(self, timeout: float = EVENT_TIMEOUT_S) -> str | None:
        """The next stdout line, or None at EOF; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"driver said nothing for {timeout}s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                if self._buffer:
                    line, self._buffer = self._buffer, b""
                    return line.decode("utf-8", "replace")
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        text = line.decode("utf-8", "replace")
        self.lines.append(text)
        return text

    def next_event(self, timeout: float = EVENT_TIMEOUT_S) -> tuple[str, str] | None:
        """The next ``(kind, arg)`` event; None once the driver has exited."""
        while True:
            line = self.next_line(timeout)
            if line is None:
                return None
            if line.startswith("EVENT "):
                _, kind, arg = (line.split(" ", 2) + [""])[:3]
                return kind, arg

    def go(self) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(b"go\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass

    def kill(self) -> int:
        """SIGKILL (if still running) and reap; returns the exit status."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        return self.wait()

    def wait(self, timeout: float | None = None) -> int:
        try:
            code = self.process.wait(timeout)
        finally:
            if self.process.returncode is not None:
                self.close()
        return code

    def close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self.log.close()

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_bytes().decode("utf-8", "replace")[-chars:]
        except OSError:
            return ""

    def result(self) -> dict[str, Any] | None:
        for line in reversed(self.lines):
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        return None


# The product's storage settings (kiln_core.storage), shortened: a frozen server fails a write within
# seconds, not minutes. Nothing is patched: the driver runs with these in its environment.
FAST_FAILING_S3 = {"KILN_FLOWS_STORAGE_CONNECT_TIMEOUT": "2", "KILN_FLOWS_STORAGE_READ_TIMEOUT": "3",
                   "KILN_FLOWS_STORAGE_MAX_ATTEMPTS": "1"}


def driver_main(argv: list[str]) -> int:
    """Run one training request with every publication step reported as an event."""
    parser = argparse.ArgumentParser(prog="python -m drills.driver")
    parser.add_argument("--request", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume")
    parser.add_argument("--handshake", choices=("all", "none", "laststep"), default="all")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from kiln_core import storage
    from kiln_core.training import receipt as receipt_module
    from kiln_core.engine.request import train_request

    def event(kind: str, arg: Any, wait: bool | None = None) -> None:
        sys.stdout.write(f"EVENT {kind} {arg}\n")
        sys.stdout.flush()
        if wait if wait is not None else args.handshake == "all":
            if not sys.stdin.readline():
                os._exit(70)  # the drill went away

    original_write, original_commit = storage.StagedDirectory.write, storage.StagedDirectory.commit
    original_atomic = receipt_module.write_bytes_atomic

    def write(self, relative_path, data):
        event("write", self.target.child(relative_path).uri)
        return original_write(self, relative_path, data)

    def commit(self, data):
        event("commit", self.target.uri)
        target = original_commit(self, data)
        event("committed", self.target.uri)
        return target

    def atomic(location, data):
        event("put", location.uri)
        original_atomic(location, data)
        event("put-done", location.uri)

    storage.StagedDirectory.write, storage.StagedDirectory.commit = write, commit
    receipt_module.write_bytes_atomic = atomic

    def progress(step: int, total: int, loss: float) -> None:
        event("step", step, wait=args.handshake == "all" or (args.handshake == "laststep" and step == total))

    event("start", os.getpid())
    result = train_request(args.request, adapter=args.adapter, student_dir=args.student, out_root=args.out,
                           resume_checkpoint=args.resume, on_progress=progress)
    sys.stdout.write("RESULT " + json.dumps({"status": result.status, "steps": result.steps,
                                             "latest_checkpoint": result.latest_checkpoint}) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(driver_main(sys.argv[1:]))
