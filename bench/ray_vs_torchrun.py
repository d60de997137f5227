"""Step time of a Ray run vs a torchrun run at the same world size, and Ray's start-up cost, side by side.

Both runs go through ``kiln-flows train`` itself (``flows.cli.main`` in this process) on the same tiny
Qwen3-shaped student (``kiln_core.tiny_models.build_tiny_model``) and synthetic corpus, one candidate
per rank per step, a checkpoint only at the end: ``--nproc W`` (torchrun) and ``--ray local --workers W``
(Ray Train on a local Ray instance this script starts first and times, then leaves open for the run).

Figures per engine:
  * end-to-end seconds of the command (admission, launch, training, publishing);
  * rank 0's training wall time (the receipt's ``runtime.wall_clock_ms``: model load and the loop);
  * step time: rank 0's forward + backward + optimizer time per step (the receipt's ``phase_timings``
    are run totals; they include the gradient all-reduce), the figure the ≤ 10 % goal is about;
  * launch overhead: end-to-end minus rank 0's training wall (process start, imports, rendezvous,
    for Ray also the worker group's placement and start).
Ray's own start (``ray.init`` of a local instance) is measured separately, and so is what Ray's daemons
(GCS, raylet, their helpers) take while idle: CPU seconds per second over ``--idle-seconds`` right after
the start, summed over the processes this one started. On a machine with few cores that share is taken
from the ranks. The adapters of both runs are
compared byte for byte. The load average is printed before and after: on a shared machine the figures
move with it.

Usage:
    python bench/ray_vs_torchrun.py --steps 2          # smoke test
    python bench/ray_vs_torchrun.py --steps 40 --workers 2

The last line printed is one JSON object with every figure. Needs ``pip install 'kiln-flows[ray]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from kiln_core.synthetic import synthesize_corpus  # noqa: E402
from kiln_core.tiny_models import build_tiny_model  # noqa: E402

GOAL = 0.10  # Ray's step time at most 10 % above torchrun's


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (one candidate per rank each)")
    p.add_argument("--workers", type=int, default=2, help="world size of both runs")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="how long Ray's idle CPU use is sampled")
    p.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    return p.parse_args()


def write_request(work: Path, steps: int, workers: int) -> tuple[Path, Path]:
    student = build_tiny_model(work / "student", seed=1)
    synthesize_corpus(student, work / "corpus.jsonl", n_examples=steps * workers, top_k=16, seed=0)
    (work / "teacher-manifest.jsonl").write_text((work / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    config = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
              "learning_rate": 0.02, "checkpoint_interval": steps, "epochs": 1}
    (work / "request.json").write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl",
                                                   "config": config}))
    return work / "request.json", student


def train(request: Path, student: Path, out: Path, *engine: str) -> dict:
    """One ``kiln-flows train`` in this process; its figures from the command and the receipt."""
    from flows.cli import main

    stdout = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(stdout):
        code = main(["train", "--request", str(request), "--adapter", "bench", "--student", str(student),
                     "--out", str(out), "--json", "--quiet", *engine])
    seconds = time.perf_counter() - started
    result = json.loads(stdout.getvalue().strip().splitlines()[-1])
    if code != 0:
        raise SystemExit(f"{' '.join(engine)} failed ({code}): {result}")
    receipt = json.loads(Path(result["receipt"]).read_text())
    phases = receipt["phase_timings"]
    train_seconds = receipt["runtime"]["wall_clock_ms"] / 1000
    return {"end_to_end_s": round(seconds, 2), "rank0_train_s": round(train_seconds, 2),
            "step_ms": round((phases["policy_forward_ms"] + phases["backward_ms"] + phases["optimizer_ms"])
                             / max(1, result["steps"]), 2),
            "launch_overhead_s": round(seconds - train_seconds, 2), "steps": result["steps"],
            "adapter": (Path(result["adapter"]) / "adapter_model.safetensors").read_bytes()}


def idle_cpu_share(seconds: float) -> float:
    """CPU seconds per wall second used by this process's descendants (Ray's daemons) over ``seconds``."""
    import psutil

    def cpu() -> float:
        total = 0.0
        for child in psutil.Process().children(recursive=True):
            try:
                times = child.cpu_times()
                total += times.user + times.system
            except psutil.Error:  # a helper that ended meanwhile
                pass
        return total

    before = cpu()
    time.sleep(seconds)
    return (cpu() - before) / seconds


def main() -> None:
    args = parse_args()
    import ray

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        work = Path(args.out or tmp)
        work.mkdir(parents=True, exist_ok=True)
        request, student = write_request(work, args.steps, args.workers)
        torchrun = train(request, student, work / "torchrun", "--nproc", str(args.workers))
        started = time.perf_counter()
        ray.init(num_cpus=max(args.workers, os.cpu_count() or 1), include_dashboard=False, logging_level="WARNING")
        ray_start = time.perf_counter() - started
        ray_idle_cpu = idle_cpu_share(args.idle_seconds)
        try:
            on_ray = train(request, student, work / "ray", "--ray", "local", "--workers", str(args.workers))
        finally:
            ray.shutdown()
    load_after = os.getloadavg()
    same = torchrun.pop("adapter") == on_ray.pop("adapter")
    ratio = on_ray["step_ms"] / torchrun["step_ms"] if torchrun["step_ms"] else float("nan")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    print(f"{'':18}{'torchrun':>12}{'ray':>12}")
    for key in ("step_ms", "rank0_train_s", "launch_overhead_s", "end_to_end_s"):
        print(f"{key:18}{torchrun[key]:>12}{on_ray[key]:>12}")
    print(f"ray.init (local)  {ray_start:>24.2f}")
    print(f"Ray daemons idle  {ray_idle_cpu:>24.2f} CPU s/s (of {os.cpu_count()} cores)")
    print(f"Ray step time / torchrun step time: {ratio:.3f} (goal ≤ {1 + GOAL:.2f}); adapters byte-identical: {same}")
    print(json.dumps({"workers": args.workers, "steps": args.steps, "torchrun": torchrun, "ray": on_ray,
                      "ray_init_s": round(ray_start, 2), "ray_idle_cpu_per_s": round(ray_idle_cpu, 3), "step_time_ratio": round(ratio, 3), "goal_ratio": 1 + GOAL,
                      "adapters_identical": same, "load_average": {"before": load_before, "after": load_after}}))


if __name__ == "__main__":
    main()
