"""Throughput of a full OPD training step, and the share of wall time spent outside forward/backward.

Runs ``kiln_core.training.trainer.train_opd`` itself (not a copy of its loop) on a Qwen3-shaped student
built locally by ``kiln_core.tiny_models.build_tiny_model`` and a synthetic admitted corpus, with
checkpoints every ``--interval`` steps (Kiln's default 25). The trainer's phase clock splits the
loop's wall time into forward+backward (model, loss, backward), optimizer step (and its finite
check), data preparation, checkpoint publishing, and the rest (bookkeeping, callbacks).

Target: the overhead share — loop time outside forward/backward and the optimizer step, i.e. data
prep + checkpointing + bookkeeping — stays ≤ 5% at interval 25. Tokens/s counts every input token
of every trained candidate over the loop's wall time.

Usage:
    python bench/train_step.py                                   # hidden 256, 4 layers, vocab 4096, CPU fp32
    python bench/train_step.py --device cuda --dtype bf16 --hidden 2560

The last line printed is one JSON object with every figure.
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

TARGET_OVERHEAD = 0.05


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/64)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default heads/2)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3×hidden)")
    p.add_argument("--vocab", type=int, default=4096, help="logit width")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per candidate")
    p.add_argument("--action-frac", type=float, default=0.5, help="share of each sequence that is action targets")
    p.add_argument("--examples", type=int, default=60, help="examples (one step each, one epoch)")
    p.add_argument("--top-k", type=int, default=32, choices=[16, 32])
    p.add_argument("--interval", type=int, default=25, help="checkpoint_interval")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--optimizer", choices=["muon", "adam_w", "sgd"], default="muon")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    return p.parse_args()


def synthetic_corpus(n: int, seq_len: int, action_frac: float, k: int, vocab: int, seed: int = 0) -> CorpusTables:
    """Valid admitted rows: unique teacher ids, sorted logprobs with mass < 1."""
    rng = np.random.default_rng(seed)
    n_actions = max(1, int(seq_len * action_frac))
    examples = []
    for i in range(n):
        ids = rng.integers(3, min(vocab, 380), size=seq_len).astype(np.int32)
        actions = np.arange(seq_len - n_actions, seq_len, dtype=np.int32)
        teacher_ids = np.argsort(rng.random((n_actions, vocab)), axis=1)[:, :k].astype(np.int32)
        probs = np.sort(rng.dirichlet(np.full(k, 0.3), size=n_actions), axis=1)[:, ::-1] * 0.9
        examples.append(TrainingExample(
            index=i, line=i + 2, input_ids=ids, action_positions=actions, env_positions=np.zeros(0, np.int32),
            env_in_warning_prefix=np.zeros(0, bool), teacher_ids=teacher_ids, teacher_logprobs=np.log(probs).astype(np.float32)))
    return CorpusTables.from_examples(examples, k)


def main() -> None:
    args = parse_args()
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = args.heads or max(1, args.hidden // 64)
    work = Path(args.out or tempfile.mkdtemp(prefix="kiln-bench-train-"))
    t0 = time.perf_counter()
    student = build_tiny_model(work / "student", seed=1, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                               num_kv_heads=args.kv_heads or max(1, heads // 2),
                               intermediate_size=args.intermediate or 3 * args.hidden, vocab_size=args.vocab,
                               max_position_embeddings=max(2048, args.seq_len))
    build_s = time.perf_counter() - t0
    tables = synthetic_corpus(args.examples, args.seq_len, args.action_frac, args.top_k, args.vocab)
    config = OpdConfig.model_validate({
        "training_mode": "off_policy", "top_k": args.top_k, "lora_rank": args.rank, "lora_alpha": 2.0 * args.rank,
        "seed": 0, "checkpoint_interval": args.interval, "optimizer": {"kind": args.optimizer}})
    plan = TrainPlan.for_config(config, str(work / "runs" / "bench"), "bench", device=args.device, precision=args.dtype)
    result = train_opd(plan, tables, dataset_sha256="sha256:" + "0" * 64, dataset_path="synthetic.jsonl",
                       student_dir=str(student), teacher_alias="synthetic")
    if result.status != "success":
        raise SystemExit(f"training {result.status}: {result.failure_message}")

    t = result.phase_timings_ms
    loop = t["train_loop"]
    fwd_bwd, optim = t.get("forward_backward", 0.0), t.get("optimizer", 0.0)
    data, ckpt = t.get("data", 0.0), t.get("checkpoint", 0.0)
    other = loop - fwd_bwd - optim - data - ckpt
    steps = result.steps
    tokens = args.seq_len * steps
    overhead = (loop - fwd_bwd - optim) / loop
    checkpoints = sum(1 for s in range(1, steps) if s % args.interval == 0)

    print(f"train step bench: hidden {args.hidden}, layers {args.layers}, vocab {args.vocab}, seq {args.seq_len}, "
          f"K {args.top_k}, rank {args.rank}, {args.optimizer}, {args.device} {args.dtype}, "
          f"{steps} steps, checkpoint every {args.interval} ({checkpoints} written), torch threads {torch.get_num_threads()}")
    print(f"{'phase':<22}{'total ms':>12}{'ms/step':>10}{'share':>9}")
    for name, value in [("forward+backward", fwd_bwd), ("optimizer step", optim), ("data prep", data),
                        ("checkpointing", ckpt), ("other (bookkeeping)", other), ("train loop", loop)]:
        print(f"{name:<22}{value:>12.1f}{value / steps:>10.2f}{value / loop:>9.1%}")
    print(f"tokens/s (all input tokens): {tokens / (loop / 1e3):,.0f}; action tokens/s: "
          f"{int(args.seq_len * args.action_frac) * steps / (loop / 1e3):,.0f}")
    print(f"overhead outside forward/backward/optimizer: {overhead:.2%} (target ≤ {TARGET_OVERHEAD:.0%}); "
          f"outside forward/backward only: {(loop - fwd_bwd) / loop:.2%}")
    print(json.dumps({
        "bench": "train_step", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "seq_len": args.seq_len,
        "top_k": args.top_k, "rank": args.rank, "optimizer": args.optimizer, "device": args.device, "dtype": args.dtype,
        "steps": steps, "checkpoint_interval": args.interval, "checkpoints_written": checkpoints,
        "torch_threads": torch.get_num_threads(), "build_model_s": round(build_s, 2),
        "ms": {k: round(v, 2) for k, v in t.items()}, "ms_per_step": round(loop / steps, 3),
        "tokens_per_s": round(tokens / (loop / 1e3), 1),
        "overhead_share": round(overhead, 4), "outside_forward_backward_share": round((loop - fwd_bwd) / loop, 4),
        "checkpoint_share": round(ckpt / loop, 4), "target_overhead_share": TARGET_OVERHEAD,
        "meets_target": overhead <= TARGET_OVERHEAD,
    }))


if __name__ == "__main__":
    main()
