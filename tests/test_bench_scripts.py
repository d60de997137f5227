"""The issue-20 measurement scripts under ``bench/``, run at a size small enough for a test.

The big runs (a 1 GiB shard set, 1,000 training steps) are for a quiet machine; here each script runs end to
end on a tiny student and a few small shards, and what it prints is checked against what it measured: the
figures are present, positive and consistent with the files it generated, and bad options are refused
before any work.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ADMISSION_BENCH = REPO / "bench" / "admission.py"


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_script(script: Path, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=environment(),
                          timeout=timeout, cwd=REPO)


def load_script(path: Path):
    """Import a bench script as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def examples_in(directory: Path) -> int:
    """Example lines of every shard in a directory (the manifest line of each left out)."""
    count = 0
    for shard in directory.glob("*.jsonl"):
        count += sum(1 for line in shard.read_text(encoding="utf-8").splitlines()
                     if line.strip() and not line.startswith('{"schema":"kiln.off-policy'))
    return count


# ---------------------------------------------------------------------------------------------
# bench/admission.py --shards


def test_generated_shards_are_cached_distinct_and_pin_one_teacher(tiny_student, tmp_path):
    bench = load_script(ADMISSION_BENCH)
    two = bench.shard_set(tmp_path, tiny_student, 2, 0.25)
    first = sorted(two.glob("*.jsonl"))
    stamps = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in first]
    assert [p.name for p in first] == ["shard-00000.jsonl", "shard-00001.jsonl"]

    # A rerun generates nothing, and a larger set of the same shard size starts with the very same files.
    assert bench.shard_set(tmp_path, tiny_student, 2, 0.25) == two
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in first] == stamps
    three = sorted(bench.shard_set(tmp_path, tiny_student, 3, 0.25).glob("*.jsonl"))
    assert [p.stat().st_ino for p in three[:2]] == [ino for ino, _ in stamps]
    assert not any(p.is_symlink() for p in three)  # a symlinked shard is refused (shard_path_unsafe)

    contents = [p.read_bytes() for p in three]
    assert len({hashlib.sha256(data).hexdigest() for data in contents}) == 3  # nothing reused by digest
    manifests = {data.split(b"\n", 1)[0] for data in contents}
    assert len(manifests) == 1 and manifests.pop().startswith(b'{"schema":"kiln.off-policy')
    assert not list((tmp_path / "shards-0.25mib").glob(".*"))  # no partial file left behind


def test_shard_bench_prints_its_figures_with_the_load_average(tiny_student, tmp_path):
    work = tmp_path / "work"
    done = run_script(ADMISSION_BENCH, "--shards", "2", "--shard-mib", "0.5", "--work", str(work),
                      "--student", str(tiny_student), "--workers", "1,2", "--repeat", "1",
                      "--compare-sizes", "0.5,1", "--compare-workers", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    directory = work / "set-2x0.5mib"
    set_bytes = sum(p.stat().st_size for p in directory.glob("*.jsonl"))
    assert summary["mode"] == "shards" and summary["shards"] == 2 and summary["shard_mib"] == 0.5
    assert summary["set_mb"] == round(set_bytes / 1e6, 2)
    assert summary["examples"] == examples_in(directory) > 0

    raw = summary["raw_parse"]
    assert raw["seconds"] > 0 and raw["mb_per_s"] == pytest.approx(set_bytes / 1e6 / raw["seconds"], rel=0.01)
    assert [figure["workers"] for figure in summary["admission"]] == [1, 2]
    for figure in summary["admission"]:
        assert figure["examples"] == summary["examples"]
        assert figure["seconds"] > 0 and figure["student_load_seconds"] > 0
        assert figure["mb_per_s"] == pytest.approx(set_bytes / 1e6 / figure["seconds"], rel=0.01)
        assert figure["ratio_to_raw_parse"] == pytest.approx(raw["seconds"] / figure["seconds"], rel=0.01)
        assert figure["peak_rss_mib"] >= figure["maxrss_self_mib"] > 0
        assert len(figure["load_average"]) == 3 and all(value >= 0 for value in figure["load_average"])
    one, two = summary["admission"]
    assert one["speedup_over_one_worker"] == 1
    assert two["speedup_over_one_worker"] == pytest.approx(one["seconds"] / two["seconds"], rel=0.01)
    # With two workers the shards are admitted in worker processes: their memory is counted too.
    assert two["maxrss_largest_worker_mib"] > 0 and two["peak_rss_mib"] > two["maxrss_self_mib"]

    compared = summary["compare_sizes"]
    assert compared["workers"] == 1
    assert [(size["total_mib"], size["shards"]) for size in compared["sizes"]] == [(0.5, 1), (1.0, 2)]
    small, large = compared["sizes"]
    assert small["peak_rss_mib"] > 0 and large["set_mb"] > small["set_mb"]
    growth = 100 * (large["peak_rss_mib"] - small["peak_rss_mib"]) / small["peak_rss_mib"]
    assert compared["rss_growth_percent"] == pytest.approx(growth, abs=0.05)

    lines = done.stdout.splitlines()
    for row in ("raw pyarrow.json parse", "admit_shard_set, workers=1", "admit_shard_set, workers=2"):
        assert any(line.startswith(row) and line.rstrip().endswith("]") for line in lines), row  # load average
    assert any("peak RSS growth 0.5 -> 1 MiB" in line for line in lines)
    assert not list(work.glob("kiln-data-*"))  # every measured storage root was removed


@pytest.mark.parametrize(("argv", "message"), [
    (["--shards", "0"], "--shards must be at least 1"),
    (["--shards", "2", "--shard-mib", "65"], "--shard-mib in (0, 64]"),
    (["--shards", "2", "--workers", "1,3"], "--workers 3 needs at least that many shards"),
    (["--shards", "2", "--workers", "one"], "comma-separated list"),
    (["--shards", "2", "--shard-mib", "1", "--compare-sizes", "1.5"], "not a whole number of 1 MiB shards"),
    (["--shards", "2", "--shard-mib", "1", "--compare-sizes", "1,4"], "fewer than --compare-workers 2"),
    (["--shards", "2", "--repeat", "0"], "--repeat and --compare-workers must be at least 1"),
])
def test_shard_bench_refuses_bad_options_before_any_work(tmp_path, argv, message):
    work = tmp_path / "work"
    done = run_script(ADMISSION_BENCH, *argv, "--work", str(work), timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not work.exists()  # nothing generated


# ---------------------------------------------------------------------------------------------
# bench/train_stream_memory.py


STREAM_BENCH = REPO / "bench" / "train_stream_memory.py"


def test_stream_memory_bench_reads_rss_at_the_steps_asked_for(tiny_student, tmp_path):
    work = tmp_path / "work"
    done = run_script(STREAM_BENCH, "--work", str(work), "--student", str(tiny_student), "--mib", "0.5",
                      "--steps", "6", "--at", "2,6", "--checkpoint-interval", "3", "--threads", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    corpus = Path(summary["corpus"])
    assert corpus.parent == work and summary["corpus_files"] == 1
    assert summary["examples"] == examples_in(work) > 0
    assert summary["epochs"] == -(-6 // summary["examples"])  # enough passes for the steps asked for
    # The run trained exactly the steps asked for: stopped there, or ended there when the corpus did.
    assert summary["steps"] == 6 and summary["total_steps"] >= 6
    assert summary["status"] == ("success" if summary["total_steps"] == 6 else "cancelled")
    rss = summary["rss_mib_at_step"]
    assert sorted(rss, key=int) == ["0", "1", "2", "6"]  # before training, the first step, and --at
    assert all(value > 0 for value in rss.values()) and rss["6"] > rss["0"]  # the student loaded in between
    assert summary["peak_rss_mib"] >= max(rss.values())
    assert summary["rss_growth_percent"] == pytest.approx(100 * (rss["6"] - rss["2"]) / rss["2"], abs=0.1)
    assert len(summary["load_average"]["before"]) == 3 and len(summary["load_average"]["after"]) == 3
    assert "RSS growth from step 2 to step 6" in done.stdout

    # The measured run is its own: one run directory, trained from scratch, checkpointed at the interval.
    runs = [p for p in (work / "storage" / "runs" / "stream-memory").iterdir() if p.is_dir()]
    assert len(runs) == 1
    receipt = json.loads((runs[0] / "train_receipt.json").read_text())
    assert receipt["status"] == summary["status"] and receipt["data"]["resumed_from_checkpoint"] is None
    assert receipt["data"]["examples_trained"] == 6 and receipt["data"]["examples_read"] == summary["examples"]
    assert (runs[0] / "stream-memory-checkpoint-step-00000003.kiln-checkpoint").is_dir()


def test_stream_memory_bench_trains_across_the_shards_of_a_set(tiny_student, tmp_path):
    work = tmp_path / "work"
    done = run_script(STREAM_BENCH, "--work", str(work), "--student", str(tiny_student), "--shards", "2",
                      "--shard-mib", "0.5", "--steps", "8", "--at", "2,8", "--checkpoint-interval", "4",
                      "--threads", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    directory = work / "set-2x0.5mib"
    assert Path(summary["corpus"]) == directory and summary["corpus_files"] == 2
    assert summary["examples"] == examples_in(directory) and summary["examples"] < 8  # past the last shard
    assert summary["steps"] == 8 and sorted(summary["rss_mib_at_step"], key=int) == ["0", "1", "2", "8"]
    assert all(value > 0 for value in summary["rss_mib_at_step"].values())
    runs = [p for p in (work / "storage" / "runs" / "stream-memory").iterdir() if p.is_dir()]
    assert len(runs) == 1 and (runs[0] / "stream-memory-checkpoint-step-00000004.kiln-checkpoint").is_dir()


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "10", "--at", "5,20"], "every --at step between 1 and --steps"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--at", "five"], "--at: expected comma-separated step numbers"),
    (["--corpus-dir", "missing-dir"], "missing-dir does not exist"),
    (["--corpus", "."], "is not a file"),
    (["--shards", "2", "--shard-mib", "100"], "--shard-mib in (0, 64]"),
    (["--corpus", "a.jsonl", "--shards", "2"], "not allowed with argument"),
])
def test_stream_memory_bench_refuses_bad_options_before_any_work(tmp_path, argv, message):
    work = tmp_path / "work"
    done = run_script(STREAM_BENCH, *argv, "--work", str(work), timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not work.exists()


# ---------------------------------------------------------------------------------------------
# bench/model_sizes.py


@pytest.mark.slow
def test_model_sizes_bench_trains_each_wide_vocabulary_student_at_two_lengths(tmp_path):
    done = run_script(REPO / "bench" / "model_sizes.py", "--shapes", "qwen-151k,gemma-256k", "--steps", "1",
                      "--seq", "16", "--long-seq", "32", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert [(run["shape"], run["seq"]) for run in figures["runs"]] == [
        ("qwen-151k", 16), ("qwen-151k", 32), ("gemma-256k", 16), ("gemma-256k", 32)]
    for run in figures["runs"]:
        assert run["steps"] == 1 and run["tokens_per_s"] > 0 and run["peak_rss_mib"] > 100
        assert run["parameters"] > 256000 * 256 if run["shape"] == "gemma-256k" else run["parameters"] > 151936 * 256
    assert {entry["shape"] for entry in figures["wide_vocabulary"]} == {"qwen-151k", "gemma-256k"}
    assert "load average before" in done.stdout
