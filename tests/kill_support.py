"""Stop a run at a chosen step: SIGKILL a driver subprocess (a crashed worker), or SIGTERM this process (`kill <pid>`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator


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


@contextlib.contextmanager
def sigterm_after_step(module: Any, trainer: str, step: int, *, hook: str) -> Iterator[None]:
    """While active, ``module.<trainer>`` sends this process SIGTERM (what ``kill <pid>`` does to a CLI run)
    right after its ``hook`` callback (``on_progress`` or ``on_step_committed``) reports ``step``.

    The caller's own callback is still called first; the trainer is restored on exit.
    """
    original = getattr(module, trainer)

    def terminating(*args: Any, **kwargs: Any) -> Any:
        chained = kwargs.get(hook)

        def reported(done: int, *rest: Any) -> None:
            if chained is not None:
                chained(done, *rest)
            if done == step:
                os.kill(os.getpid(), signal.SIGTERM)

        return original(*args, **{**kwargs, hook: reported})

    setattr(module, trainer, terminating)
    try:
        yield
    finally:
        setattr(module, trainer, original)
