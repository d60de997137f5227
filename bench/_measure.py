"""Side-by-side measurement helpers shared by the benches: wall time and peak extra RSS."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import psutil


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_extra_bytes: int = 0


@contextmanager
def measure(interval: float = 0.001):
    """Time a block and sample this process's RSS every ``interval`` seconds for its peak increase."""
    process = psutil.Process(os.getpid())
    baseline = process.memory_info().rss
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            done.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    result = Measurement()
    thread.start()
    start = time.perf_counter()
    try:
        yield result
    finally:
        result.seconds = time.perf_counter() - start
        done.set()
        thread.join()
        peak = max(peak, process.memory_info().rss)
        result.peak_extra_bytes = peak - baseline
