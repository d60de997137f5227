"""Fault drills: the failures kiln-flows promises to survive, provoked on purpose and counted.

Each drill is a plain function ``run(workdir=..., trials=..., seed=...) -> dict`` that returns a small
report with the figures (``trials``, ``passes``, ``failures``, ``crashes``, ``seconds`` and what is
particular to the drill) and ``passed``. ``kiln-flows drill`` prints the reports; ``tests/fault_drills``
runs them at CI size.

* ``sigkill`` — SIGKILL a training process at random points (mid-step, mid-checkpoint, right after a
  commit, at a random time); every resume from the newest checkpoint ends byte-identical to an
  uninterrupted run.
* ``s3-outage`` — freeze the S3 server (moto, SIGSTOP) in the middle of a publication (corpus,
  checkpoint, adapter, receipt); nothing committed is partial, and a retry after the server comes
  back completes.
* ``concurrent-materialize`` — two admissions of the same bytes at once; one materialization, both
  succeed with the same tables.
* ``corrupt-checkpoint`` — a damaged checkpoint is refused naming the file; the automatic path never
  falls back, the user may ask for the previous checkpoint.
* ``fuzz-admission`` / ``fuzz-oracle`` — many mutated corpora and oracle requests; each ends in an
  acceptance or exactly one rejection with a known code, never another exception.

Nothing here imports Prefect or the test suite; the modules import torch and transformers only inside
the drills that train.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = [
    "DRILLS",
    "DrillReport",
    "TrainingInputs",
    "drill_names",
    "prepare_training_inputs",
    "run_drill",
    "tiny_student",
    "run_directory",
    "where",
    "workspace",
]

# drill name -> (module, default trials/examples). Modules are imported on use.
DRILLS: dict[str, tuple[str, dict[str, int]]] = {
    "sigkill": ("drills.sigkill", {"trials": 20}),
    "s3-outage": ("drills.s3_outage", {"trials": 8}),
    "concurrent-materialize": ("drills.concurrency", {"trials": 12}),
    "corrupt-checkpoint": ("drills.corruption", {"trials": 9}),
    "fuzz-admission": ("drills.fuzz", {"examples": 10_000}),
    "fuzz-oracle": ("drills.fuzz_oracle", {"examples": 10_000}),
}

MAX_DETAILS = 20


def drill_names() -> list[str]:
    return list(DRILLS)


class DrillReport:
    """Counts and a bounded list of failure details; ``finish()`` gives the report dict."""

    def __init__(self, drill: str, **settings: Any) -> None:
        self.drill = drill
        self.started = time.perf_counter()
        self.figures: dict[str, Any] = {"drill": drill, "passed": False, **settings,
                                        "trials": 0, "passes": 0, "failures": 0, "crashes": 0}
        self.details: list[str] = []

    def __setitem__(self, key: str, value: Any) -> None:
        self.figures[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.figures[key]

    def count(self, key: str, by: int = 1) -> None:
        self.figures[key] = self.figures.get(key, 0) + by

    def bump(self, key: str, sub: str, by: int = 1) -> None:
        table = self.figures.setdefault(key, {})
        table[sub] = table.get(sub, 0) + by

    def passed_trial(self) -> None:
        self.count("trials")
        self.count("passes")

    def failed_trial(self, detail: str, *, crash: bool = False) -> None:
        self.count("trials")
        self.count("crashes" if crash else "failures")
        self.note(detail)

    def note(self, detail: str) -> None:
        if len(self.details) < MAX_DETAILS:
            self.details.append(detail[:2000])

    def finish(self, passed: bool | None = None) -> dict[str, Any]:
        figures = dict(self.figures)
        if passed is None:
            passed = figures["failures"] == 0 and figures["crashes"] == 0 and figures["trials"] > 0
        figures["passed"] = bool(passed)
        figures["seconds"] = round(time.perf_counter() - self.started, 2)
        for key, value in list(figures.items()):
            if isinstance(value, float):
                figures[key] = round(value, 2)
            if isinstance(value, dict):
                figures[key] = dict(sorted(value.items()))
        if self.details:
            figures["failure_details"] = list(self.details)
        return figures


def run_drill(name: str, *, workdir: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run one drill by name and return its report (an unexpected exception is a failed report)."""
    import importlib

    module_name, _ = DRILLS[name]
    module = importlib.import_module(module_name)
    function: Callable[..., dict[str, Any]]
    function = getattr(module, "run_" + name.replace("-", "_")) if name.startswith("fuzz") else module.run
    started = time.perf_counter()
    with workspace(workdir, name) as directory:
        try:
            return function(workdir=directory, **kwargs)
        except Exception as error:  # the drill itself broke: report it, never hide it
            import traceback

            return {"drill": name, "passed": False, "trials": 0, "passes": 0, "failures": 0, "crashes": 1,
                    "seconds": round(time.perf_counter() - started, 2),
                    "failure_details": [f"drill aborted: {type(error).__name__}: {error}",
                                        traceback.format_exc()[-3000:]]}


@contextlib.contextmanager
def workspace(workdir: str | None, name: str) -> Iterator[Path]:
    """``<workdir>/<name>`` (kept) or a temporary directory (removed afterwards)."""
    if workdir is not None:
        path = Path(workdir).absolute() / name
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=f"kiln-drill-{name}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Training in this process uses one thread (as the drivers do), restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a driver subprocess: one thread, offline, quiet, this repository importable."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def tiny_student(directory: Path) -> Path:
    """The tests' tiny student (seed 1), built once under ``directory`` (byte-identical each time)."""
    from kiln_core.tiny_models import build_tiny_model

    target = directory / "student"
    if (target / ".complete").exists():
        return target
    staging = directory / f".student-{uuid.uuid4().hex}"
    build_tiny_model(staging, seed=1)
    (staging / ".complete").write_text("")
    if target.exists():
        shutil.rmtree(target)
    os.rename(staging, target)
    return target


# The training fixture of the sigkill, s3-outage and corrupt-checkpoint drills: a tiny student, a
# 5-example corpus, 2 epochs -> 10 one-sequence steps of ~25 ms each on one CPU thread.
TRAIN_CONFIG = {"training_mode": "off_policy", "objective": "reverse_kl", "loss": "teacher_top_k", "top_k": 16,
                "lora_rank": 4, "lora_alpha": 8.0, "seed": 3, "learning_rate": 0.02, "checkpoint_interval": 1,
                "epochs": 2, "optimizer": {"kind": "adam_w"}}


@dataclass(frozen=True)
class TrainingInputs:
    """Request files (one per checkpoint interval), the corpus they name and the student."""

    directory: Path
    student: Path
    corpus: Path
    requests: dict[int, Path]

    def request(self, interval: int = 1) -> Path:
        return self.requests[interval]


def prepare_training_inputs(directory: Path, *, examples: int = 5, intervals: tuple[int, ...] = (1, 2),
                            **config: Any) -> TrainingInputs:
    """Write the corpus, teacher manifest and ``request-interval-<n>.json`` files under ``directory``."""
    from kiln_core.synthetic import synthesize_corpus

    directory.mkdir(parents=True, exist_ok=True)
    student = tiny_student(directory)
    inputs = directory / "inputs"
    inputs.mkdir(exist_ok=True)
    corpus = inputs / "corpus.jsonl"
    if not corpus.exists():
        synthesize_corpus(student, corpus, n_examples=examples, top_k=16, seed=0)
    (inputs / "teacher-manifest.jsonl").write_text(corpus.read_text().splitlines()[0] + "\n")
    requests = {}
    for interval in intervals:
        body = {"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl",
                "config": {**TRAIN_CONFIG, **config, "checkpoint_interval": interval}}
        path = inputs / f"request-interval-{interval}.json"
        path.write_text(json.dumps(body, indent=2))
        requests[interval] = path
    return TrainingInputs(directory=directory, student=student, corpus=corpus, requests=requests)


def train(request: Path | str, *, adapter: str, student: Path | str, out: Path | str, resume: str | None = None,
          on_progress: Callable[[int, int, float], None] | None = None):
    """Train a request file through the one door ``kiln-flows train`` uses (``spec_from_request``, then
    ``run_pipeline``), in this process, signals left alone. ``resume``: a checkpoint basename, ``"latest"``
    (what every pipeline attempt does) or None. Returns the ``PipelineResult``."""
    from kiln_core.engine import run_pipeline, spec_from_request

    named = None if resume == "latest" else resume
    run = spec_from_request(str(request), adapter=adapter, student_dir=str(student), out_root=str(out),
                            resume_checkpoint=named)
    return run_pipeline(run.spec, run.stages(on_progress=on_progress, handle_signals=False),
                        resume="latest" if resume == "latest" else run.resume)


def where(error: BaseException) -> str:
    """``file:line in function`` of the innermost kiln-flows frame of ``error`` (the drills' own frames
    skipped), for failure details that point at the code."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/drills/" not in f.filename and any(
        f"/{package}/" in f.filename for package in ("kiln_core", "tasks", "flows"))]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "?"
    name = frame.filename
    for package in ("kiln_core", "tasks", "flows"):
        if f"/{package}/" in name:
            name = package + "/" + name.split(f"/{package}/", 1)[1]
            break
    return f"{name}:{frame.lineno} in {frame.name}"


def run_directory(out: str, adapter: str) -> str:
    """The run directory of ``adapter`` under the storage root ``out``: ``runs/<adapter>/<run key>/``.

    The drills train one input set per adapter name, so there is exactly one run key; before the run
    has started the URI names a directory that does not exist yet (nothing is committed in it).
    """
    from kiln_core.storage import list_children, resolve

    runs = resolve(out).child("runs", adapter)
    keys = [name for name in list_children(runs) if not name.startswith(".") and name != "latest.json"]
    if len(keys) > 1:
        raise RuntimeError(f"{runs.uri} holds {len(keys)} runs; a drill trains one input set per adapter name")
    return runs.child(keys[0] if keys else "not-started").uri


def fresh_dir(parent: Path, name: str) -> Path:
    path = parent / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
