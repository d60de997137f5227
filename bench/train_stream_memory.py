"""Memory of off-policy training as it goes: resident set size at step 100 vs step 1,000 (issue 20).

Training that streams its corpus (Parquet row groups, shard by shard) holds about the same memory at step
1,000 as at step 100, however large the corpus; training that holds the whole corpus grows with it. This
script trains a tiny student through the engine's one path, ``run_pipeline(load_spec(spec.yaml))`` with
``LocalStages(on_step_committed=...)``, and the hook reads the process's *current* RSS (``VmRSS`` in
``/proc/self/status``, not a high-water mark) at the steps asked for.

The corpus is one of:

* ``--corpus FILE``: one Kiln corpus file;
* ``--corpus-dir DIR``: a directory of shards (``corpus:`` in the spec names the directory), e.g. the set
  ``bench/admission.py --shards 16 --shard-mib 64 --work DIR`` generated under ``DIR/set-16x64mib``;
* ``--shards N --shard-mib M``: such a set generated here (cached under ``--work``, as that bench does);
* nothing: one generated file of ``--mib`` MiB.

A generated corpus is for the tiny student built under ``--work`` (``build_tiny_model(seed=1)``, the same
one ``bench/admission.py`` builds), so pass the same ``--work`` to both scripts. A corpus that is already
scored needs no teacher model: the spec pins the teacher by the corpus's own manifest line.

Each measurement runs in a fresh Python process, after a one-step warm-up run in another: the warm-up
admits and materializes the corpus, so the measured run finds it admitted and its figures are training's
(plus the reused admission record), not the generator's or the first admission's. The measured run stops
after ``--steps`` steps (a cancellation at that step boundary; the epochs are chosen so the corpus lasts
that long).

Usage:
    python bench/train_stream_memory.py --work DIR --steps 20 --at 5,20            # a quick check
    python bench/train_stream_memory.py --work DIR --corpus-dir DIR/set-16x64mib   # the 1 GiB set
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MANIFEST_PREFIX = '{"schema":"kiln.off-policy'
MEASURED_ADAPTER = "stream-memory"
WARM_UP_ADAPTER = "stream-memory-warm-up"


def current_rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``), not its peak."""
    return _proc_status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``VmHWM``)."""
    return _proc_status_kib("VmHWM") * 1024


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])  # "VmRSS:   123456 kB"
    raise RuntimeError(f"/proc/self/status has no {field} line (this bench needs Linux)")


def corpus_files(corpus: Path) -> list[Path]:
    """The corpus's files in training order: the file itself, or a directory's ``*.jsonl`` in name order."""
    if corpus.is_dir():
        return sorted(p for p in corpus.glob("*.jsonl") if not p.name.startswith("."))
    return [corpus]


def count_examples(corpus: Path) -> int:
    """Example lines in the corpus (every shard's manifest line left out)."""
    count = 0
    for path in corpus_files(corpus):
        with path.open("rb") as handle:
            count += sum(1 for line in handle if line.strip() and not line.startswith(MANIFEST_PREFIX.encode()))
    return count


def write_spec(work: Path, corpus: Path, student_dir: Path, storage_root: Path, adapter: str, *, epochs: int,
               checkpoint_interval: int | None) -> Path:
    """A pipeline spec file training ``student_dir`` on ``corpus``, the teacher pinned by the corpus's manifest."""
    import yaml

    first = corpus_files(corpus)[0]
    with first.open("r", encoding="utf-8") as handle:
        manifest_line = handle.readline().rstrip("\n")
    if not manifest_line.startswith(MANIFEST_PREFIX):
        raise SystemExit(f"{first} does not start with a manifest line; this bench pins the teacher by it")
    manifest = work / "teacher-manifest.jsonl"
    manifest.write_text(manifest_line + "\n", encoding="utf-8")
    spec = {
        "teacher": {"kind": "manifest_file", "path": str(manifest)},
        "corpus": str(corpus),
        "student": str(student_dir),
        "storage_root": str(storage_root),
        "adapter": adapter,
        "config": {"training_mode": "off_policy", "top_k": 32, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
                   "epochs": epochs, "checkpoint_interval": checkpoint_interval},
    }
    path = work / f"spec-{adapter}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


# --- one measured run (a fresh process) --------------------------------------------------------------------


def train_child(args: argparse.Namespace) -> None:
    """Train the spec until ``--steps`` steps are committed, reading RSS at the ``--at`` steps.

    Prints one JSON line: how the run ended, the steps done and planned, seconds, RSS before training
    (after imports and admission) and at each step asked for, and the process's peak RSS.
    """
    import torch

    from kiln_core.contracts.spec_file import load_spec
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = set(args.at)
    rss_at: dict[int, int] = {}
    committed = 0
    started: dict[str, float] = {}
    total_steps: list[int] = []

    def on_train_start(settings: str) -> None:
        rss_at[0] = current_rss_bytes()  # the student not loaded yet, the corpus admitted
        started["time"] = time.perf_counter()

    def on_progress(step: int, total: int, loss: float, **_) -> None:
        if not total_steps:
            total_steps.append(total)

    def on_step_committed(step: int) -> None:
        nonlocal committed
        committed = step
        if step in wanted or step == 1:
            rss_at[step] = current_rss_bytes()

    stages = LocalStages(on_progress=on_progress, should_cancel=lambda: committed >= args.steps,
                         on_step_committed=on_step_committed, handle_signals=False,
                         on_train_start=on_train_start)
    result = run_pipeline(load_spec(args.train_child), stages, resume=None)
    seconds = time.perf_counter() - started["time"] if started else None
    print(json.dumps({
        "status": result.status,
        "failure_reason": result.failure_reason,
        "steps": result.steps,
        "total_steps": result.total_steps if result.total_steps is not None else (total_steps or [None])[0],
        "train_seconds": seconds,
        "rss_bytes_at_step": {str(step): rss_at[step] for step in sorted(rss_at)},
        # VmHWM is updated lazily by the kernel and may trail a VmRSS read a moment earlier.
        "peak_rss_bytes": max([peak_rss_bytes(), *rss_at.values()]),
    }))


def run_child(spec: Path, steps: int, at: list[int], threads: int) -> dict:
    """Run ``train_child`` in a new Python process and return what it printed."""
    command = [sys.executable, str(Path(__file__).resolve()), "--train-child", str(spec), "--steps", str(steps),
               "--at", ",".join(map(str, at)), "--threads", str(threads)]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        raise SystemExit(f"training {spec} failed (exit {completed.returncode}):\n{completed.stderr[-4000:]}")
    return json.loads(lines[-1])


# --- the bench ---------------------------------------------------------------------------------------------


def prepare_corpus(args: argparse.Namespace, work: Path, student_dir: Path) -> Path:
    """The corpus to train on: the one given, or one generated for the bench student (cached under ``work``)."""
    from admission import generate_corpus, shard_set, shard_target_bytes

    if args.corpus:
        return Path(args.corpus).resolve()
    if args.corpus_dir:
        return Path(args.corpus_dir).resolve()
    if args.shards:
        return shard_set(work, student_dir, args.shards, args.shard_mib)
    path = work / f"corpus-{args.mib:g}mib.jsonl"
    if not path.exists():
        partial = work / f".{path.name}.partial"
        generate_corpus(student_dir, partial, target_bytes=shard_target_bytes(args.mib))  # under --mib MiB
        partial.rename(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--corpus", help="train on this corpus file")
    source.add_argument("--corpus-dir", help="train on this directory of shards")
    source.add_argument("--shards", type=int, help="generate a set of this many shards to train on")
    parser.add_argument("--shard-mib", type=float, default=64.0, help="MiB per generated shard (default 64)")
    parser.add_argument("--mib", type=float, default=4.0, help="MiB of the generated single file (default 4)")
    parser.add_argument("--work", help="where the student, generated corpora and runs live (default: a temp dir)")
    parser.add_argument("--student", help="the student directory (default: the tiny student under --work)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps to train (default 1000)")
    parser.add_argument("--at", default="100,1000", help="steps to read RSS at (default 100,1000)")
    parser.add_argument("--checkpoint-interval", type=int, default=100,
                        help="steps between checkpoints, 0 for none (default 100)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--train-child", help=argparse.SUPPRESS)  # internal: one measured run
    args = parser.parse_args()
    try:
        args.at = sorted({int(part) for part in args.at.split(",") if part.strip()})
    except ValueError:
        parser.error(f"--at: expected comma-separated step numbers, got {args.at!r}")
    if args.steps < 1 or not args.at or args.at[0] < 1 or args.at[-1] > args.steps:
        parser.error("--steps must be at least 1 and every --at step between 1 and --steps")
    if args.shards is not None and (args.shards < 1 or not 0 < args.shard_mib <= 64):
        parser.error("--shards must be at least 1 and --shard-mib in (0, 64] (Kiln's cap per file)")
    if not 0 < args.mib <= 64 or args.checkpoint_interval < 0 or args.threads < 0:
        parser.error("--mib must be in (0, 64]; --checkpoint-interval and --threads at least 0")
    for given in (args.corpus, args.corpus_dir, args.student):
        if given and not Path(given).exists():
            parser.error(f"{given} does not exist")
    if args.corpus and not Path(args.corpus).is_file():
        parser.error(f"--corpus {args.corpus} is not a file")
    if args.corpus_dir and not Path(args.corpus_dir).is_dir():
        parser.error(f"--corpus-dir {args.corpus_dir} is not a directory")
    if args.train_child:
        train_child(args)
        return
    bench(args)


def bench(args: argparse.Namespace) -> None:
    """Generate or find the corpus, warm admission up, train once in a fresh process and print the figures."""
    from admission import bench_student, load_average

    work = Path(args.work or tempfile.mkdtemp(prefix="kiln-bench-stream-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    student_dir = Path(args.student).resolve() if args.student else bench_student(work)
    corpus = prepare_corpus(args, work, student_dir)
    examples = count_examples(corpus)
    if examples == 0:
        raise SystemExit(f"{corpus} holds no example")
    files = corpus_files(corpus)
    corpus_mb = sum(p.stat().st_size for p in files) / 1e6
    epochs = math.ceil(args.steps / examples)
    print(f"corpus: {corpus} ({len(files)} file(s), {corpus_mb:.1f} MB, {examples} examples; "
          f"{epochs} epoch(s) for {args.steps} steps)")

    storage_root = work / "storage"
    interval = args.checkpoint_interval or None
    for adapter in (WARM_UP_ADAPTER, MEASURED_ADAPTER):  # a fresh run each time: nothing to resume
        shutil.rmtree(storage_root / "runs" / adapter, ignore_errors=True)
    warm_spec = write_spec(work, corpus, student_dir, storage_root, WARM_UP_ADAPTER, epochs=epochs,
                           checkpoint_interval=interval)
    start = time.perf_counter()
    run_child(warm_spec, 1, [1], args.threads)
    print(f"warm-up (admission and one step): {time.perf_counter() - start:.1f} s, load average {load_average()}")

    spec = write_spec(work, corpus, student_dir, storage_root, MEASURED_ADAPTER, epochs=epochs,
                      checkpoint_interval=interval)
    load_before = load_average()
    run = run_child(spec, args.steps, args.at, args.threads)
    load_after = load_average()
    rss = {int(step): value for step, value in run["rss_bytes_at_step"].items()}
    print(f"training: {run['status']} after {run['steps']} of {run['total_steps']} planned steps in "
          f"{run['train_seconds']:.1f} s; load average {load_before} before, {load_after} after")
    print(f"{'step':>8} {'RSS MiB':>10}")
    for step, value in sorted(rss.items()):
        label = "start" if step == 0 else str(step)
        print(f"{label:>8} {value / 2**20:10.1f}")
    missing = [step for step in args.at if step not in rss]
    if missing:
        print(f"no RSS at step(s) {missing}: the run ended after {run['steps']} steps")
    first, last = args.at[0], args.at[-1]
    growth = None
    if first in rss and last in rss and first != last:
        growth = 100.0 * (rss[last] - rss[first]) / rss[first]
        print(f"RSS growth from step {first} to step {last}: {growth:+.1f} % (goal: flat)")
    print(f"peak RSS of the training process: {run['peak_rss_bytes'] / 2**20:.1f} MiB")
    print(json.dumps({
        "corpus": str(corpus),
        "corpus_files": len(files),
        "corpus_mb": round(corpus_mb, 2),
        "examples": examples,
        "epochs": epochs,
        "status": run["status"],
        "steps": run["steps"],
        "total_steps": run["total_steps"],
        "train_seconds": round(run["train_seconds"], 2) if run["train_seconds"] is not None else None,
        "rss_mib_at_step": {str(step): round(value / 2**20, 1) for step, value in sorted(rss.items())},
        "rss_growth_percent": round(growth, 2) if growth is not None else None,
        "peak_rss_mib": round(run["peak_rss_bytes"] / 2**20, 1),
        "load_average": {"before": load_before, "after": load_after},
    }))


if __name__ == "__main__":
    main()
