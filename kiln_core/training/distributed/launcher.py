"""Launching a data-parallel run from one process (CLI, Prefect task): torchrun with ``nproc`` ranks.

``launch`` writes a ``DistributedJob`` to a temporary file, runs ``python -m torch.distributed.run
--standalone --nproc-per-node N -m kiln_core.training.distributed.worker --job JOB.json --result
RESULT.json --progress PROGRESS.jsonl`` and returns rank 0's ``TrainResult``. The worker module is
named, never imported: the launcher runs in the parent, the worker in each rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict

from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan
from kiln_core.training.distributed.world import check_shared_storage
from kiln_core.training.trainer import TrainResult

__all__ = ["DistributedJob", "DistributedRunError", "WORKER_MODULE", "torchrun_command", "launch"]

WORKER_MODULE = "kiln_core.training.distributed.worker"


class DistributedRunError(RuntimeError):
    """A launched multi-process run that crashed or ended without a result."""


class DistributedJob(BaseModel):
    """Everything a worker needs to call ``train_opd`` (JSON, written by the launching process): the
    engine's ``TrainPlan`` whole (``resume`` already a checkpoint basename or None), the committed corpus
    and the pinned teacher — and round-tripped exactly through JSON, as every rank reads it.

    The corpus travels as a committed materialization URI (``corpus.uri``), so the workers never
    re-admit it; storage (the materialization and ``plan.run_uri``) must be reachable from every rank —
    a local disk for one machine, a shared file system or an object store for several.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    plan: TrainPlan
    corpus: CorpusRef
    manifest: ManifestRef
    student_dir: str


def torchrun_command(nproc: int, worker_args: Sequence[str], *, module: str = WORKER_MODULE) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m <module> <args>``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(int(nproc)), "-m", module, *worker_args]


def launch(
    job: DistributedJob,
    nproc: int,
    *,
    on_progress: Callable[[int, int, float], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    forward_signals: bool = True,
    poll_seconds: float = 0.25,
    env: dict[str, str] | None = None,
):
    """Run ``job`` on ``nproc`` local processes under torchrun and return rank 0's ``TrainResult``.

    SIGTERM/SIGINT received by this process (and ``should_cancel()`` turning True) are passed to
    torchrun, which passes them to every rank: the run stops cooperatively at the next step
    boundary, rank 0 publishes a checkpoint and the result says ``cancelled``. The workers' output
    goes to this process's stderr, so a ``--json`` stdout stays one line.

    Raises:
        ConfigError, CheckpointError/ResumeError: rank 0 rejected the job before training.
        DistributedRunError: a rank crashed (the message is rank 0's error when it had one).
    """
    if nproc < 2:
        raise ValueError("launch() is for two or more processes; call train_opd directly for one")
    check_shared_storage(job.corpus.uri, job.plan.run_uri)
    with tempfile.TemporaryDirectory(prefix="kiln-torchrun-") as tmp:
        job_path, result_path, progress_path = (Path(tmp, name) for name in ("job.json", "result.json", "progress.jsonl"))
        job_path.write_text(job.model_dump_json(), encoding="utf-8")
        progress_path.touch()
        command = torchrun_command(nproc, ["--job", str(job_path), "--result", str(result_path),
                                           "--progress", str(progress_path)])
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        proc = subprocess.Popen(command, env=child_env, stdin=subprocess.DEVNULL, stdout=_stderr_fd())
        with _forwarding(proc, forward_signals):
            cancelled = False
            seen = 0
            while True:
                done = proc.poll() is not None
                seen = _relay_progress(progress_path, seen, on_progress)
                if done:
                    break
                if not cancelled and should_cancel is not None and should_cancel():
                    cancelled = True
                    proc.send_signal(signal.SIGTERM)
                time.sleep(poll_seconds)
        if not result_path.exists():
            raise DistributedRunError(f"torchrun exited with status {proc.returncode} and no rank wrote a result "
                                      "(see the worker output above)")
        outcome = json.loads(result_path.read_text(encoding="utf-8"))
    if outcome["kind"] == "result":
        return TrainResult.model_validate(outcome["result"])
    if outcome["kind"] == "rejected":
        raise _rebuild_rejection(outcome["error"], outcome["payload"])
    raise DistributedRunError(outcome["message"])


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr (pytest capture): the real fd 2
        return 2


def _relay_progress(path: Path, seen: int, on_progress: Callable[[int, int, float], None] | None) -> int:
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1].decode("utf-8").splitlines()  # a line still being written waits
    for line in complete[seen:]:
        record = json.loads(line)
        if on_progress is not None:
            on_progress(record["step"], record["total"], record["loss"])
    return max(seen, len(complete))


class _forwarding:
    """Pass SIGTERM/SIGINT on to the torchrun process while it runs (main thread only)."""

    def __init__(self, proc: subprocess.Popen, enabled: bool) -> None:
        self.proc, self.previous = proc, {}
        self.enabled = enabled and threading.current_thread() is threading.main_thread()

    def __enter__(self) -> "_forwarding":
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, lambda signum, _frame: self._forward(signum))
        return self

    def _forward(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.proc.poll() is None:  # the parent is going away: do not orphan the ranks
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _rebuild_rejection(kind: str, payload: dict[str, Any]) -> Exception:
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.errors import AdmissionError
    from kiln_core.training.checkpoint import CheckpointError, ResumeError

    if kind in ("ResumeError", "CheckpointError"):
        error_type = ResumeError if kind == "ResumeError" else CheckpointError
        return error_type(payload["code"], payload["message"], file=payload.get("file"))
    if kind == "AdmissionError":
        return AdmissionError(payload["code"], payload.get("line"), payload["message"])
    return ConfigError(payload["message"], payload.get("field"), code=payload.get("code", "invalid_config"))
