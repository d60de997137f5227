"""Benchmark: identity hashing of weight shards against ``sha256sum``, side by side in one run.

    .venv/bin/python bench/hashing.py [--shards 4 --shard-mib 256 --single-mib 1024 --repeats 3]

Creates one large file and a directory of shards in a temp dir, reads everything once so the page
cache holds it (the disk is not what is measured), then times, best of ``--repeats`` (interleaved
so drift in machine load hits every row alike):

* ``sha256sum FILE`` vs ``sha256_file(FILE)`` on the single file → our streaming hash per core;
  target ≥ 0.9× sha256sum;
* ``sha256sum SHARD...`` (sequential) vs ``base_model_sha256`` over the shards with 1 and with 2
  worker threads → parallel speedup; target ~1.8-2× on 2 cores.

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln_core.identity.hashing import base_model_sha256, select_weight_shards, sha256_file  # noqa: E402

MIB = 1024 * 1024
_BLOCK = 8 * MIB


def _write_file(path: Path, size_mib: int, seed_block: bytes) -> None:
    """Write ``size_mib`` MiB: one random block, varied per block so no two blocks repeat."""
    with open(path, "wb") as handle:
        written = 0
        index = 0
        while written < size_mib * MIB:
            block = index.to_bytes(8, "little") + seed_block[8:]
            block = block[: min(_BLOCK, size_mib * MIB - written)]
            handle.write(block)
            written += len(block)
            index += 1


def _warm(paths: list[Path]) -> None:
    buffer = bytearray(_BLOCK)
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def _timed(fn) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (all threads) for one call."""
    cpu = time.process_time()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started, time.process_time() - cpu


def _sha256sum(paths: list[Path]) -> list[str]:
    out = subprocess.run(["sha256sum", *map(str, paths)], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table and the JSON line."""
    parser = argparse.ArgumentParser(description="identity hashing vs sha256sum")
    parser.add_argument("--shards", type=int, default=4, help="number of shards (default 4)")
    parser.add_argument("--shard-mib", type=int, default=256, help="MiB per shard (default 256)")
    parser.add_argument("--single-mib", type=int, default=1024, help="MiB of the single file (default 1024)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the best is reported (default 3)")
    parser.add_argument("--dir", help="work directory (default: a fresh temp dir, removed afterwards)")
    args = parser.parse_args(argv)
    if shutil.which("sha256sum") is None:
        print("sha256sum not found", file=sys.stderr)
        return 3

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kiln-bench-hashing-"))
    try:
        return _run(args, work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> int:
    seed_block = os.urandom(_BLOCK)
    single = work / "single.bin"
    shard_dir = work / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    t_create, _ = _timed(lambda: _write_file(single, args.single_mib, seed_block))
    names = [f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors" for i in range(args.shards)]
    for name in names:
        _write_file(shard_dir / name, args.shard_mib, os.urandom(_BLOCK))
    index = {"metadata": {}, "weight_map": {f"layer.{i}": name for i, name in enumerate(names)}}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    shards = select_weight_shards(shard_dir)
    _warm([single, *shards])

    # Correctness first: the numbers below are only worth reading if the digests agree.
    digest, _ = sha256_file(single)
    assert digest.hex() == _sha256sum([single])[0], "streaming digest disagrees with sha256sum"
    assert [sha256_file(p)[0].hex() for p in shards] == _sha256sum(shards)
    assert base_model_sha256(shard_dir, max_workers=1) == base_model_sha256(shard_dir, max_workers=2)

    rows = {
        "sha256sum_single": lambda: _sha256sum([single]),
        "ours_single": lambda: sha256_file(single),
        "sha256sum_shards_seq": lambda: _sha256sum(shards),
        "ours_shards_1w": lambda: base_model_sha256(shard_dir, max_workers=1),
        "ours_shards_2w": lambda: base_model_sha256(shard_dir, max_workers=2),
    }
    best = {name: float("inf") for name in rows}
    cpu_at_best = {name: 0.0 for name in rows}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for name, fn in rows.items():
            wall, cpu = _timed(fn)
            if wall < best[name]:
                best[name], cpu_at_best[name] = wall, cpu

    single_mib = float(args.single_mib)
    shards_mib = float(args.shards * args.shard_mib)
    sizes = {"sha256sum_single": single_mib, "ours_single": single_mib, "sha256sum_shards_seq": shards_mib,
             "ours_shards_1w": shards_mib, "ours_shards_2w": shards_mib}
    throughput = {name: sizes[name] / best[name] for name in rows}
    result = {
        "bench": "identity_hashing",
        "cpus": os.cpu_count(),
        # Other work on the machine steals cores from the 2-worker row; the load shows how much.
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "single_mib": args.single_mib,
        "shards": args.shards,
        "shard_mib": args.shard_mib,
        "repeats": args.repeats,
        "seconds": {name: round(value, 4) for name, value in best.items()},
        "mib_per_s": {name: round(value, 1) for name, value in throughput.items()},
        "ratio_ours_vs_sha256sum_single": round(throughput["ours_single"] / throughput["sha256sum_single"], 3),
        "ratio_ours_1w_vs_sha256sum_shards": round(best["sha256sum_shards_seq"] / best["ours_shards_1w"], 3),
        "speedup_2w_vs_1w": round(best["ours_shards_1w"] / best["ours_shards_2w"], 3),
        "speedup_2w_vs_sha256sum_shards": round(best["sha256sum_shards_seq"] / best["ours_shards_2w"], 3),
        # CPU seconds / wall seconds of the 2-worker row: ~2 when both threads really ran at once.
        "cores_used_2w": round(cpu_at_best["ours_shards_2w"] / best["ours_shards_2w"], 2),
        "create_single_s": round(t_create, 2),
    }

    print(f"identity hashing bench: {os.cpu_count()} CPUs, best of {args.repeats}, page cache warm")
    print(f"{'row':<24}{'MiB':>8}{'seconds':>10}{'MiB/s':>10}")
    for name in rows:
        print(f"{name:<24}{sizes[name]:>8.0f}{best[name]:>10.3f}{throughput[name]:>10.1f}")
    print(f"ours/sha256sum single file : {result['ratio_ours_vs_sha256sum_single']:.3f}x (target >= 0.9)")
    print(f"2 workers / 1 worker       : {result['speedup_2w_vs_1w']:.3f}x (target ~1.8-2 on 2 cores)")
    print(f"2 workers / sha256sum seq  : {result['speedup_2w_vs_sha256sum_shards']:.3f}x")
    print(f"cores busy during 2w row   : {result['cores_used_2w']:.2f} (load avg {load_before:.2f} before timing)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
