"""Ctrl-C and SIGTERM during training: stop at the next step boundary; a second Ctrl-C stops now.

The first SIGINT or SIGTERM sets a flag that training polls at each step boundary: the run publishes
a checkpoint, writes a ``cancelled`` receipt and returns (the CLI exits 3). A second SIGINT raises
``KeyboardInterrupt`` at once, wherever the main thread is; the loop records that as ``cancelled``
too (``lifecycle.outcome_recorded``).

This is the one SIGINT/SIGTERM handler: the engine's training stage installs it around a run, and
the trainers' ``handle_signals`` (``lifecycle.stop_signals``, e.g. a ``torchrun`` rank) use the same.
Handlers can only be installed from the main thread; elsewhere ``stop_requests`` yields a flag that
only ``request_stop`` sets.

A caller whose SIGTERM belongs to someone else passes ``sigterm=False``: then only Ctrl-C is taken
over, and a SIGTERM does whatever the installed handler does (in a run a Prefect worker started, it
raises Prefect's termination signal; ``tasks/train.py`` says why). The loop records such an end as
``cancelled`` as well.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator


class StopRequests:
    """The flag training polls (``is_set``) and the count of Ctrl-Cs received."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.interrupts = 0

    def is_set(self) -> bool:
        return self.event.is_set()

    def request_stop(self, reason: str) -> None:
        if not self.event.is_set():
            print(f"\n{reason}: stopping at the next step boundary after a checkpoint "
                  "(Ctrl-C again to stop now)", file=sys.stderr, flush=True)
        self.event.set()

    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt("second Ctrl-C: stopping now")
        self.request_stop("interrupted" if signum == signal.SIGINT else "terminated")


@contextlib.contextmanager
def stop_requests(enabled: bool = True, *, sigterm: bool = True) -> Iterator[StopRequests]:
    """Install the SIGINT/SIGTERM handlers for the block (main thread only) and restore them after.

    Args:
        enabled: False installs nothing (the flag is then set only by ``request_stop``).
        sigterm: False leaves SIGTERM to the handler already installed (Prefect's, in a worker's run).

    Example:
        >>> with stop_requests() as stop:
        ...     stop.is_set()
        False
    """
    stop = StopRequests()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    signals = (signal.SIGINT, signal.SIGTERM) if sigterm else (signal.SIGINT,)
    previous = {sig: signal.signal(sig, stop._on_signal) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
