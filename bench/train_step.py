"""Throughput of a full OPD training step, side by side: the ``quality`` preset as Kiln steps (one sequence per
optimizer step) against the same preset with packed steps, bf16 autocast and thread settings.

Runs ``kiln_core.training.trainer.train_opd`` itself (not a copy of its loop) on a student built locally by
``kiln_core.tiny_models.build_tiny_model`` (by default SmolLM2-135M's shape with the 15 layers of the
half-depth student: hidden 576, 9 heads, 3 key/value heads, MLP 1536, vocab 49152) and a synthetic admitted
corpus of sequences of varied length (the demo's short chat answers: 60 to 200 tokens), with checkpoints every
``--interval`` steps (Kiln's default 25). Every variant trains the same examples in the same process, one
after another, in turn, ``--repeat`` times; the figures are the best of the repeats.

The trainer's phase clock splits the loop's wall time into forward, backward, optimizer step, data
preparation, checkpoint publishing and the rest (bookkeeping, callbacks). Tokens/s counts every input token
of every trained candidate over the loop's wall time. Goal: the packed variant at ≥ 2× the tokens/s of one
sequence per step, with ≤ 10 % of the loop outside forward/backward. The last line before the JSON sets the
goal against the arithmetic: the training FLOPs per token counted from the shapes, the rate the base variant
reaches, and the rate this CPU multiplies the model's own matrices at, whose ratio bounds any speedup that
keeps the arithmetic.

Usage:
    python bench/train_step.py                                   # the side-by-side table (a few minutes on 2 cores)
    python bench/train_step.py --variants base,packed --repeat 1 # a subset
    python bench/train_step.py --hidden 256 --layers 4 --vocab 4096   # a smaller student

State the machine's load with the figures (``uptime``); the bench prints it. The last line printed is one JSON
object with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from kiln_core.contracts.opd_config import OpdConfig  # noqa: E402
from kiln_core.contracts.stage_refs import TrainPlan  # noqa: E402
from kiln_core.corpus import CorpusTables, TrainingExample  # noqa: E402
from kiln_core.tiny_models import build_tiny_model  # noqa: E402
from kiln_core.training.trainer import train_opd  # noqa: E402

TARGET_OVERHEAD = 0.10
TARGET_SPEEDUP = 2.0

# Each variant: what it changes on top of the quality preset, and the torch threads it runs with (None: torch's own).
VARIANTS: dict[str, dict] = {
    "base": {"config": {}, "dtype": "fp32", "threads": None, "what": "quality preset as Kiln steps: 1 sequence/step, fp32"},
    "packed": {"config": {"sequences_per_step": 8, "pack_sequences": True}, "dtype": "fp32", "threads": None,
               "what": "8 sequences/step packed into one forward, fp32"},
    "packed-bf16": {"config": {"sequences_per_step": 8, "pack_sequences": True}, "dtype": "bf16", "threads": None,
                    "what": "8 sequences/step packed, bf16 autocast"},
    "accumulated": {"config": {"sequences_per_step": 8}, "dtype": "fp32", "threads": None,
                    "what": "8 sequences/step one after another (accumulation), fp32"},
    "packed-1thread": {"config": {"sequences_per_step": 8, "pack_sequences": True}, "dtype": "fp32", "threads": 1,
                       "what": "8 sequences/step packed, fp32, one torch thread"},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=576, help="model width")
    p.add_argument("--layers", type=int, default=15)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=1536, help="MLP width")
    p.add_argument("--vocab", type=int, default=49152, help="logit width")
    p.add_argument("--min-len", type=int, default=60, help="shortest sequence (tokens)")
    p.add_argument("--max-len", type=int, default=200, help="longest sequence (tokens)")
    p.add_argument("--action-frac", type=float, default=0.5, help="share of each sequence that is action targets")
    p.add_argument("--examples", type=int, default=48, help="examples each variant trains (one epoch)")
    p.add_argument("--top-k", type=int, default=32, choices=[16, 32])
    p.add_argument("--interval", type=int, default=25, help="checkpoint_interval")
    # bf16 is not in the default set: on a CPU without bf16 arithmetic one round of it took about 9.5 minutes
    # against 45 s in fp32 (2026-12-02, 2 cores); ask for it with --variants.
    p.add_argument("--variants", default="base,packed,accumulated,packed-1thread",
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--repeat", type=int, default=2, help="rounds over the variants; the best round counts")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    args = p.parse_args()
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if not 2 <= args.min_len <= args.max_len:
        p.error("--min-len must be at least 2 and at most --max-len")
    return args


def synthetic_corpus(n: int, min_len: int, max_len: int, action_frac: float, k: int, vocab: int,
                     seed: int = 0) -> CorpusTables:
    """Valid admitted rows of varied length: unique teacher ids, sorted logprobs with mass < 1."""
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        seq_len = int(rng.integers(min_len, max_len + 1))
        n_actions = max(1, int(seq_len * action_frac))
        ids = rng.integers(3, min(vocab, 380), size=seq_len).astype(np.int32)
        actions = np.arange(seq_len - n_actions, seq_len, dtype=np.int32)
        teacher_ids = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(n_actions)]).astype(np.int32)
        probs = np.sort(rng.dirichlet(np.full(k, 0.3), size=n_actions), axis=1)[:, ::-1] * 0.9
        examples.append(TrainingExample(
            index=i, line=i + 2, input_ids=ids, action_positions=actions, env_positions=np.zeros(0, np.int32),
            env_in_warning_prefix=np.zeros(0, bool), teacher_ids=teacher_ids, teacher_logprobs=np.log(probs).astype(np.float32)))
    return CorpusTables.from_examples(examples, k)


def measure(name: str, tables: CorpusTables, tokens: int, student: Path, work: Path, args: argparse.Namespace,
            round_: int) -> dict:
    """Train one epoch of ``tables`` (``tokens`` input tokens) with variant ``name``: phase times, tokens/s, shares."""
    variant = VARIANTS[name]
    default_threads = torch.get_num_threads()
    if variant["threads"]:
        torch.set_num_threads(variant["threads"])
    try:
        config = OpdConfig.model_validate({
            "preset": "quality", "top_k": args.top_k, "seed": 0, "checkpoint_interval": args.interval, **variant["config"]})
        plan = TrainPlan.for_config(config, str(work / "runs" / f"{name}-{round_}"), "bench", device=args.device,
                                    precision=variant["dtype"])
        result = train_opd(plan, tables, dataset_sha256="sha256:" + "0" * 64, dataset_path="synthetic.jsonl",
                           student_dir=str(student), teacher_alias="synthetic")
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(default_threads)
    if result.status != "success":
        raise SystemExit(f"{name}: training {result.status}: {result.failure_message}")
    t = result.phase_timings_ms
    loop = t["train_loop"]
    forward_backward = t.get("forward", 0.0) + t.get("backward", 0.0)
    return {
        "variant": name, "steps": result.steps, "threads": threads, "dtype": variant["dtype"],
        "loop_s": round(loop / 1e3, 3), "tokens_per_s": round(tokens / (loop / 1e3), 1),
        "outside_forward_backward_share": round((loop - forward_backward) / loop, 4),
        "ms": {key: round(value, 1) for key, value in t.items()},
        "final_loss": result.final_loss,
    }


def training_flops_per_token(args: argparse.Namespace, mean_len: float) -> float:
    """Arithmetic of one trained token, counted from the shapes (multiply-adds × 2).

    The layers' forward (projections, MLP, causal attention over half the sequence on average) and their
    backward, which costs the same again: the base weights are frozen, so only the activations' gradients are
    computed (LoRA's rank-16 products are left out). The LM head runs on action rows only (the loss reads no
    other) three times: forward, then again in backward, which recomputes the logits instead of keeping
    ``[rows, vocab]`` (``kiln_core.loss``), and the hidden states' gradient.
    """
    h, inter = args.hidden, args.intermediate
    kv = h // args.heads * args.kv_heads
    projections = h * h + 2 * h * kv + h * h + 3 * h * inter
    attention = 2 * (mean_len / 2) * h
    layers_forward = 2 * args.layers * (projections + attention)
    head_forward = 2 * args.action_frac * h * args.vocab
    return 2 * layers_forward + 3 * head_forward


def matmul_flops_per_s(rows: int, args: argparse.Namespace, seconds: float = 2.0) -> float:
    """What this CPU multiplies at on the model's own MLP shape (``rows`` tokens × hidden @ hidden × MLP)."""
    x, w = torch.randn(rows, args.hidden), torch.randn(args.hidden, args.intermediate)
    for _ in range(3):
        x @ w
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        x @ w
        n += 1
    return 2 * rows * args.hidden * args.intermediate * n / (time.perf_counter() - started)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main() -> None:
    args = parse_args()
    names = args.variants.split(",")
    work = Path(args.out or tempfile.mkdtemp(prefix="kiln-bench-train-"))
    t0 = time.perf_counter()
    student = build_tiny_model(work / "student", seed=1, hidden_size=args.hidden, num_layers=args.layers,
                               num_heads=args.heads, num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                               vocab_size=args.vocab, max_position_embeddings=max(2048, args.max_len))
    build_s = time.perf_counter() - t0
    tables = synthetic_corpus(args.examples, args.min_len, args.max_len, args.action_frac, args.top_k, args.vocab)
    tokens = sum(int(tables.example(i).input_ids.shape[0]) for i in range(tables.num_examples))
    load_before = load_average()
    best: dict[str, dict] = {}
    for round_ in range(args.repeat):
        for name in names if round_ % 2 == 0 else reversed(names):  # alternate the order: drift hits every variant
            figures = measure(name, tables, tokens, student, work, args, round_)
            if name not in best or figures["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = figures
    load_after = load_average()
    mean_len = tokens / tables.num_examples
    flops_per_token = training_flops_per_token(args, mean_len)
    matmul_rate = None  # measured only where it bounds something: the base variant, on the CPU
    if "base" in best and args.device == "cpu":
        # the best the CPU does on the model's MLP shape, as one sequence or eight packed: a ceiling for any schedule
        matmul_rate = max(matmul_flops_per_s(int(mean_len) * n, args) for n in (1, 8))

    print(f"train step bench: hidden {args.hidden}, layers {args.layers}, heads {args.heads}/{args.kv_heads}, "
          f"vocab {args.vocab}, {args.examples} sequences of {args.min_len}-{args.max_len} tokens, K {args.top_k}, "
          f"quality preset, {args.device}, checkpoint every {args.interval}, best of {args.repeat}; "
          f"load average {load_before} before, {load_after} after")
    base = best.get("base")
    print(f"{'variant':<16}{'steps':>6}{'thr':>5}{'loop s':>9}{'tokens/s':>10}{'× base':>8}{'outside f/b':>13}  what")
    for name in names:
        f = best[name]
        ratio = f["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        f["speedup_vs_base"] = round(ratio, 3)
        print(f"{name:<16}{f['steps']:>6}{f['threads']:>5}{f['loop_s']:>9.2f}{f['tokens_per_s']:>10,.0f}{ratio:>8.2f}"
              f"{f['outside_forward_backward_share']:>13.1%}  {VARIANTS[name]['what']}")
    if matmul_rate is not None:
        achieved = base["tokens_per_s"] * flops_per_token
        print(f"arithmetic: {flops_per_token / 1e6:,.0f} MFLOP per trained token; base runs at {achieved / 1e9:,.1f} GFLOP/s, "
              f"{achieved / matmul_rate:.0%} of the {matmul_rate / 1e9:,.1f} GFLOP/s this CPU multiplies the model's "
              f"MLP matrices at (best of 1 and 8 sequences of rows): no schedule of the same arithmetic exceeds "
              f"{matmul_rate / achieved:.2f}x base")
    print(json.dumps({
        "bench": "train_step", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
        "lengths": [args.min_len, args.max_len], "examples": args.examples, "top_k": args.top_k,
        "device": args.device, "checkpoint_interval": args.interval, "repeat": args.repeat,
        "build_model_s": round(build_s, 2), "load_average": {"before": load_before, "after": load_after},
        "training_flops_per_token": round(flops_per_token), "matmul_flops_per_s": None if matmul_rate is None else round(matmul_rate),
        "target_speedup": TARGET_SPEEDUP, "target_outside_forward_backward_share": TARGET_OVERHEAD,
        "variants": best,
    }))


if __name__ == "__main__":
    main()
