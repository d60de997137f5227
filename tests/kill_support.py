"""Run a Python driver in a subprocess and SIGKILL it at a chosen moment (what a crashed worker looks like)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


def sigkill_when(driver: str, ready: Callable[[], bool], *, what: str, timeout_s: float = 120.0) -> None:
    """Start ``driver`` with this interpreter in the repository root; SIGKILL it once ``ready()`` is true.

    The driver's stdin is a pipe nothing is written to, so a driver can wait for its kill
    event-driven (``sys.stdin.readline()`` after the step of interest) instead of sleeping per step.
    Fails the test when the driver exits first (its stderr is shown) or ``ready`` never holds.
    """
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=Path(__file__).parents[1], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    try:
        while not ready():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, f"{what} did not happen in time"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
