"""Admission throughput, side by side in one process.

Generates a ~64 MiB K=32 corpus for a generated tiny student, then measures on the same bytes:

1. raw ``pyarrow.json`` parsing (type inference, no validation) — the speed of light;
2. a straightforward per-record validator: pydantic ``OpdExample.model_validate_json`` per line,
   per-record tokenization and Python loops for the candidate rules;
3. kiln-flows admission end to end (file rules, parsing, every rule, alignment, materialization).

Targets on a 2-core machine: ≥ 100 MB/s end to end, ≥ 0.5× raw parse, ≥ 10× the per-record
baseline, peak extra memory ≤ 4× the file size.

With ``--shards N --shard-mib M`` it measures a shard set instead (issue 20): N generated shards of M MiB
each (every shard a valid Kiln corpus with the same manifest line, no example shared between shards),
cached under ``--work DIR`` by their parameters, on the same bytes:

1. raw ``pyarrow.json`` parsing of every shard (as above);
2. ``admit_shard_set`` with each ``--workers`` count (default 1 and 2), each run in a fresh subprocess
   with a fresh storage root, so nothing is reused and its peak RSS is its own: the admitting process
   plus its worker processes;
3. with ``--compare-sizes A,B`` (MiB in all): peak RSS of an A MiB and a B MiB set of M MiB shards,
   admitted with the same worker count, and the growth (goal: < 10 %).

Each figure is printed with the load average at the time; the last line is a JSON summary.

Usage:
    python bench/admission.py [--mib 64] [--workdir DIR] [--repeat 3]
    python bench/admission.py --shards 16 --shard-mib 64 --work DIR [--workers 1,2] [--compare-sizes 256,1024]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure  # noqa: E402


def per_record_baseline(path: Path, student) -> int:
    """Validate record by record with pydantic and Python loops (what a first version would do)."""
    from kiln_core.contracts.example import OpdExample
    from kiln_core.contracts.identity import parse_manifest_line
    from kiln_core.tokenization import Conversation, Segment, encode_conversations, normalize_content

    examples = 0
    top_k = 32
    for number, raw in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith('{"schema":"kiln.off-policy'):
            parse_manifest_line(raw)
            continue
        example = OpdExample.model_validate_json(line)
        messages = [{"role": m.role, "content": normalize_content(
            [p.model_dump() for p in m.content] if isinstance(m.content, list) else m.content)} for m in example.messages]
        segments = None
        if example.trajectory:
            segments = [Segment(s.role, s.content, s.kind, s.tool_call_id, s.warning_prefix_len or 0)
                        for s in example.trajectory]
        encoded = encode_conversations(student, [Conversation(messages, example.teacher_response, segments)])[0]
        targets = encoded.input_ids[encoded.action_positions].tolist()
        assert len(example.teacher_tokens) == len(targets), number
        for token, target in zip(example.teacher_tokens, targets):
            assert token.token_id is None or token.token_id == target
            row = token.top_logprobs[:top_k]
            assert len(row) == top_k
            ids = [c.token_id for c in row]
            assert len(set(ids)) == top_k and max(ids) < student.vocab_size
            values = [c.logprob for c in row]
            assert all(math.isfinite(v) and v <= 0 for v in values)
            assert all(b <= a for a, b in zip(values, values[1:]))
            assert sum(math.exp(v) for v in values) <= 1 + 32 * 1.1920929e-07
        examples += 1
    return examples


def bench_student(work: Path) -> Path:
    """The generated tiny student every corpus here is admitted for (built once per work directory)."""
    from kiln_core.tiny_models import build_tiny_model

    student_dir = work / "student"
    if not (student_dir / "config.json").exists():
        build_tiny_model(student_dir, seed=1)
    return student_dir


def generate_corpus(student_dir: Path, path: Path, *, target_bytes: int, seed: int = 0) -> Path:
    """A valid K=32 corpus of about ``target_bytes``: 24-word turns, every fifth example a trajectory.

    Every corpus generated for one student carries the same manifest line (the synthetic teacher's), so
    corpora with different seeds are shards of one set; their random 24-word texts never repeat a token
    sequence, so no two shards hold conflicting duplicate rows.
    """
    from kiln_core.synthetic import synthesize_corpus

    return synthesize_corpus(student_dir, path, top_k=32, seed=seed, target_bytes=target_bytes, words=24,
                             trajectory_every=5)


def single_file(args: argparse.Namespace) -> None:
    """The single-file bench: raw parse vs per-record validator vs admission on one corpus."""
    import pyarrow.json as pj

    from kiln_core.admission import admit_corpus
    from kiln_core.tokenization import load_student_tokenizer

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kiln-bench-admission-"))
    student_dir = bench_student(work)
    corpus = work / "corpus.jsonl"
    target = int(min(args.mib, 64.0) * 1024 * 1024) - 256 * 1024
    if not corpus.exists() or abs(corpus.stat().st_size - target) > 512 * 1024:
        generate_corpus(student_dir, corpus, target_bytes=target)
    data = corpus.read_bytes()
    size_mb = len(data) / 1e6
    student = load_student_tokenizer(student_dir)
    student.identity()  # warm the tokenizer digests once, like a long-running worker

    def best(fn, repeat):
        runs = []
        for _ in range(repeat):
            with measure() as m:
                value = fn()
            runs.append(m)
        return min(runs, key=lambda m: m.seconds), max(r.peak_extra_bytes for r in runs), value

    raw, raw_mem, _ = best(lambda: pj.read_json(io.BytesIO(data)), args.repeat)

    def admit_once():
        out = work / "kiln-data"
        shutil.rmtree(out, ignore_errors=True)
        return admit_corpus(str(corpus), str(student_dir), top_k=32, out_root=str(out), student=student)

    admit_corpus(str(corpus), str(student_dir), top_k=32, student=student)  # warm imports
    ours, ours_mem, result = best(admit_once, args.repeat)
    baseline, baseline_mem, baseline_examples = best(lambda: per_record_baseline(corpus, student), 1)
    assert baseline_examples == result.examples

    rows = [
        ("raw pyarrow.json parse", raw.seconds, raw_mem),
        ("per-record pydantic validator", baseline.seconds, baseline_mem),
        ("kiln-flows admission (end to end)", ours.seconds, ours_mem),
    ]
    print(f"corpus: {size_mb:.1f} MB, {result.examples} examples, {result.action_tokens} action tokens, K=32, "
          f"parser={result.parser}")
    print(f"{'measurement':36} {'seconds':>9} {'MB/s':>9} {'peak extra MiB':>15}")
    for name, seconds, memory in rows:
        print(f"{name:36} {seconds:9.3f} {size_mb / seconds:9.1f} {memory / 2**20:15.1f}")
    figures = {
        "file_mb": round(size_mb, 2),
        "end_to_end_mb_per_s": round(size_mb / ours.seconds, 1),
        "ratio_to_raw_parse": round(raw.seconds / ours.seconds, 3),
        "ratio_to_per_record": round(baseline.seconds / ours.seconds, 2),
        "peak_memory_over_file_size": round(ours_mem / len(data), 2),
        "targets": {"mb_per_s": 100, "ratio_to_raw_parse": 0.5, "ratio_to_per_record": 10, "peak_memory_over_file_size": 4},
    }
    print(json.dumps(figures))



# --- a shard set (issue 20) -------------------------------------------------------------------------------

SHARD_SEED_BASE = 1000  # shard i is generated with seed SHARD_SEED_BASE + i: distinct from the single-file corpus


def shard_target_bytes(shard_mib: float) -> int:
    """Bytes to generate per shard: a little under ``shard_mib`` so one more example never crosses Kiln's 64 MiB."""
    size = int(shard_mib * 1024 * 1024)
    return size - min(256 * 1024, size // 4)


def shard_set(work: Path, student_dir: Path, shards: int, shard_mib: float) -> Path:
    """The directory of a generated set of ``shards`` shards of ``shard_mib`` MiB, cached under ``work``.

    Shard i is the same file in every set with the same shard size (seed ``SHARD_SEED_BASE + i``), generated
    once into ``work/shards-<size>/`` and hard-linked into ``work/set-<n>x<size>/`` (a shard must not be a
    symlink), so a 4-shard set is the first four shards of a 16-shard one and a rerun generates nothing.
    A shard is written under a temporary name and renamed, so an interrupted generation is never reused.
    """
    label = f"{shard_mib:g}mib"
    pool = work / f"shards-{label}"
    pool.mkdir(parents=True, exist_ok=True)
    directory = work / f"set-{shards}x{label}"
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        name = f"shard-{i:05d}.jsonl"
        source = pool / name
        if not source.exists():
            partial = pool / f".{name}.partial"
            generate_corpus(student_dir, partial, target_bytes=shard_target_bytes(shard_mib),
                            seed=SHARD_SEED_BASE + i)
            partial.rename(source)
            print(f"generated {source} ({source.stat().st_size / 1e6:.1f} MB)", flush=True)
        target = directory / name
        if not target.exists():
            try:
                os.link(source, target)
            except OSError:  # a file system without hard links: a copy is the same bytes
                shutil.copyfile(source, target)
    return directory


def significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits: a tiny test set's 0.03 MB/s keeps its precision too."""
    return float(f"{value:.{digits}g}")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded for printing."""
    return [round(value, 2) for value in os.getloadavg()]


def raw_parse_seconds(directory: Path, repeat: int) -> float:
    """Best total time of ``pyarrow.json`` parsing every shard's bytes (reading them is not timed)."""
    import pyarrow.json as pj

    best = math.inf
    for _ in range(repeat):
        total = 0.0
        for shard in sorted(directory.glob("*.jsonl")):
            data = shard.read_bytes()
            start = time.perf_counter()
            pj.read_json(io.BytesIO(data))
            total += time.perf_counter() - start
            del data
        best = min(best, total)
    return best


def admit_in_fresh_process(directory: Path, student_dir: Path, workers: int, work: Path) -> dict:
    """Admit the set once in a new Python process (``--admit-child``) and return what it measured.

    A fresh process per measurement: ``ru_maxrss`` is a high-water mark for a process's whole life, and a
    fresh storage root means every shard is admitted and materialized, none reused.
    """
    out_root = Path(tempfile.mkdtemp(prefix="kiln-data-", dir=work))
    try:
        command = [sys.executable, str(Path(__file__).resolve()), "--admit-child", str(directory),
                   "--student", str(student_dir), "--out-root", str(out_root), "--workers", str(workers)]
        completed = subprocess.run(command, capture_output=True, text=True, check=False)
        if completed.returncode != 0:
            raise SystemExit(f"admission of {directory} with {workers} worker(s) failed "
                             f"(exit {completed.returncode}):\n{completed.stderr[-4000:]}")
        return json.loads(completed.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out_root, ignore_errors=True)


def admit_child(args: argparse.Namespace) -> None:
    """In a fresh process: time ``admit_shard_set`` and measure the peak RSS of this process and its workers.

    Prints one JSON line: seconds, examples, the sampled peak of the summed RSS of this process and every
    descendant (every 10 ms), and the exact high-water marks ``ru_maxrss`` of this process and of its
    largest reaped worker.

    The student is loaded once before the clock starts (``student_load_seconds``, reported apart), like
    the single-file bench's warm-up: a long-running admitting process has it loaded already. Worker
    processes are new, so each one's own student load stays inside the measured time.
    """
    import psutil

    from kiln_core.admission.admit import load_admission_student
    from kiln_core.admission.shards import admit_shard_set

    start = time.perf_counter()
    load_admission_student(args.student)
    student_load_seconds = time.perf_counter() - start
    process = psutil.Process()
    peak = 0
    done = threading.Event()

    def tree_rss() -> int:
        total = process.memory_info().rss
        for child in process.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:  # a worker that just exited
                pass
        return total

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss())
            done.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = admit_shard_set(args.admit_child, args.student, top_k=32, out_root=args.out_root, workers=args.workers)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    # ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN is the largest reaped descendant, not a sum.
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    totals = result.totals()
    print(json.dumps({
        "seconds": seconds,
        "student_load_seconds": student_load_seconds,
        "shards": totals["shards"],
        "reused_shards": sum(s.reused for s in result.shards),
        "examples": totals["examples"],
        "action_tokens": totals["action_tokens"],
        "peak_rss_bytes": max(peak, self_kib * 1024),
        "maxrss_self_bytes": self_kib * 1024,
        "maxrss_largest_worker_bytes": children_kib * 1024,
    }))


def shards_bench(args: argparse.Namespace) -> None:
    """The shard-set bench: raw parse vs ``admit_shard_set`` per worker count, and peak RSS vs set size."""
    work = Path(args.work or tempfile.mkdtemp(prefix="kiln-bench-shards-"))
    work.mkdir(parents=True, exist_ok=True)
    student_dir = Path(args.student) if args.student else bench_student(work)
    directory = shard_set(work, student_dir, args.shards, args.shard_mib)
    set_mb = sum(p.stat().st_size for p in directory.glob("*.jsonl")) / 1e6
    print(f"shard set: {directory} ({args.shards} shards x {args.shard_mib:g} MiB, {set_mb:.1f} MB, K=32)")

    raw_seconds = raw_parse_seconds(directory, args.repeat)
    raw_load = load_average()
    print("admission is timed with the student already loaded in the admitting process (its load time apart);")
    print("peak RSS: the admitting process plus its workers, summed, sampled every 10 ms")
    print(f"{'measurement':34} {'seconds':>9} {'MB/s':>9} {'ratio to raw':>13} {'peak RSS MiB':>13} {'load s':>7}"
          f"  load average")
    print(f"{'raw pyarrow.json parse':34} {raw_seconds:9.3f} {set_mb / raw_seconds:9.1f} {1.0:13.3f} {'-':>13} "
          f"{'-':>7}  {raw_load}")

    admissions = []
    for workers in args.workers:
        runs = [admit_in_fresh_process(directory, student_dir, workers, work) for _ in range(args.repeat)]
        best = min(runs, key=lambda run: run["seconds"])
        if best["shards"] != args.shards or best["reused_shards"] != 0:
            raise SystemExit(f"expected {args.shards} freshly admitted shards, got {best}")
        figure = {
            "workers": workers,
            "seconds": round(best["seconds"], 4),
            "student_load_seconds": round(best["student_load_seconds"], 3),
            "mb_per_s": significant(set_mb / best["seconds"]),
            "ratio_to_raw_parse": significant(raw_seconds / best["seconds"]),
            "peak_rss_mib": round(max(run["peak_rss_bytes"] for run in runs) / 2**20, 1),
            "maxrss_self_mib": round(max(run["maxrss_self_bytes"] for run in runs) / 2**20, 1),
            "maxrss_largest_worker_mib": round(max(run["maxrss_largest_worker_bytes"] for run in runs) / 2**20, 1),
            "examples": best["examples"],
            "load_average": load_average(),
        }
        admissions.append(figure)
        name = f"admit_shard_set, workers={workers}"
        print(f"{name:34} {figure['seconds']:9.3f} {figure['mb_per_s']:9.1f} {figure['ratio_to_raw_parse']:13.3f} "
              f"{figure['peak_rss_mib']:13.1f} {figure['student_load_seconds']:7.2f}  {figure['load_average']}")

    one_worker = next((figure for figure in admissions if figure["workers"] == 1), None)
    if one_worker is not None:  # issue 20's goal: near N x with N workers on N cores
        for figure in admissions:
            figure["speedup_over_one_worker"] = significant(one_worker["seconds"] / figure["seconds"])
        print("speedup over one worker: " + ", ".join(
            f"workers={figure['workers']}: {figure['speedup_over_one_worker']:g}x" for figure in admissions))
    summary = {
        "mode": "shards",
        "shards": args.shards,
        "shard_mib": args.shard_mib,
        "set_mb": round(set_mb, 2),
        "examples": admissions[0]["examples"] if admissions else None,
        "raw_parse": {"seconds": round(raw_seconds, 4), "mb_per_s": significant(set_mb / raw_seconds),
                      "load_average": raw_load},
        "admission": admissions,
        "targets": {"ratio_to_raw_parse_one_worker": 0.5, "rss_growth_percent": 10},
    }
    if args.compare_sizes:
        summary["compare_sizes"] = compare_sizes(work, student_dir, args)
    print(json.dumps(summary))


def compare_sizes(work: Path, student_dir: Path, args: argparse.Namespace) -> dict:
    """Peak RSS of admitting a small and a large set of the same shards with the same workers, and the growth."""
    workers = args.compare_workers
    sizes = []
    print(f"peak RSS by set size ({args.shard_mib:g} MiB shards, workers={workers}):")
    for total_mib in args.compare_sizes:
        shards = round(total_mib / args.shard_mib)
        directory = shard_set(work, student_dir, shards, args.shard_mib)
        run = admit_in_fresh_process(directory, student_dir, workers, work)
        figure = {
            "total_mib": total_mib,
            "shards": run["shards"],
            "set_mb": round(sum(p.stat().st_size for p in directory.glob("*.jsonl")) / 1e6, 2),
            "seconds": round(run["seconds"], 3),
            "peak_rss_mib": round(run["peak_rss_bytes"] / 2**20, 1),
            "maxrss_self_mib": round(run["maxrss_self_bytes"] / 2**20, 1),
            "maxrss_largest_worker_mib": round(run["maxrss_largest_worker_bytes"] / 2**20, 1),
            "load_average": load_average(),
        }
        sizes.append(figure)
        print(f"  {total_mib:g} MiB ({figure['shards']} shards): peak RSS {figure['peak_rss_mib']:.1f} MiB "
              f"(this process {figure['maxrss_self_mib']:.1f}, "
              f"largest worker {figure['maxrss_largest_worker_mib']:.1f}), "
              f"{figure['seconds']:.1f} s, load average {figure['load_average']}")
    smallest, largest = sizes[0], sizes[-1]
    growth = 100.0 * (largest["peak_rss_mib"] - smallest["peak_rss_mib"]) / smallest["peak_rss_mib"]
    print(f"  peak RSS growth {smallest['total_mib']:g} -> {largest['total_mib']:g} MiB: {growth:+.1f} % (goal < 10 %)")
    return {"workers": workers, "sizes": sizes, "rss_growth_percent": round(growth, 1)}


def comma_list(kind):
    """An argparse type for a comma-separated list of ``kind``."""
    def parse(text: str):
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None
        if not values or any(value <= 0 for value in values):
            raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
        return values
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=64.0, help="corpus size in MiB (≤ 64)")
    parser.add_argument("--workdir", help="where to build the student and corpus (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the fast measurements (best is kept)")
    shards = parser.add_argument_group("a shard set")
    shards.add_argument("--shards", type=int, help="measure a generated set of this many shards")
    shards.add_argument("--shard-mib", type=float, default=64.0, help="size of each shard in MiB (≤ 64)")
    shards.add_argument("--work", help="where generated shard sets are cached (default: a temp dir)")
    shards.add_argument("--workers", type=comma_list(int), default=[1, 2], help="worker counts (default 1,2)")
    shards.add_argument("--compare-sizes", type=comma_list(float),
                        help="set sizes in MiB (e.g. 256,1024) to compare peak RSS of, smallest first")
    shards.add_argument("--compare-workers", type=int, default=2, help="workers for --compare-sizes (default 2)")
    shards.add_argument("--student", help="an existing student directory to admit for (default: a generated tiny one)")
    parser.add_argument("--admit-child", help=argparse.SUPPRESS)  # internal: one measured admission
    parser.add_argument("--out-root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.admit_child:
        args.workers = args.workers[0] if isinstance(args.workers, list) else args.workers
        admit_child(args)
    elif args.shards is not None:
        if args.shards < 1 or not 0 < args.shard_mib <= 64:
            parser.error("--shards must be at least 1 and --shard-mib in (0, 64] (Kiln's cap per file)")
        if args.repeat < 1 or args.compare_workers < 1:
            parser.error("--repeat and --compare-workers must be at least 1")
        if max(args.workers) > args.shards:  # admit_shard_set runs at most one worker per shard
            parser.error(f"--workers {max(args.workers)} needs at least that many shards (--shards {args.shards})")
        if args.compare_sizes is not None:
            args.compare_sizes = sorted(args.compare_sizes)
            for total_mib in args.compare_sizes:
                shards = round(total_mib / args.shard_mib)
                if shards < 1 or abs(shards * args.shard_mib - total_mib) > 1e-9:
                    parser.error(f"--compare-sizes: {total_mib:g} MiB is not a whole number of "
                                 f"{args.shard_mib:g} MiB shards")
                if shards < args.compare_workers:  # admit_shard_set admits a set smaller than that in-process
                    parser.error(f"--compare-sizes: {total_mib:g} MiB is {shards} shard(s), fewer than "
                                 f"--compare-workers {args.compare_workers}; compare sets of at least that many shards")
        shards_bench(args)
    else:
        single_file(args)


if __name__ == "__main__":
    main()
