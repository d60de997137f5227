"""What a student's size costs: tokens/s and peak RSS of training from SmolLM2-135M's shape to Qwen2.5-0.5B's, and
the memory of 151k- and 256k-vocabulary students at two sequence lengths.

Every model is built locally with seeded random weights (``kiln_core.tiny_models.build_tiny_model``, transformers'
0.02 init; no download) in the real family's shape, and trained by ``kiln_core.training.trainer.train_opd`` itself
(fp32 on the CPU, one sequence per step, Kiln's default loss, no checkpoints) on a synthetic admitted corpus of
``--seq`` tokens per example, half of them action targets, K = 32. Each run is a fresh process, so its peak RSS
(``ru_maxrss``) is that run's alone; the model is built by another process first.

* ``smollm2-135m`` — Llama, hidden 576, 30 layers, 9 heads (3 key/value), MLP 1536, vocab 49,152, tied head;
* ``qwen2.5-0.5b`` — Qwen2, hidden 896, 24 layers, 14 heads (2 key/value), MLP 4864, vocab 151,936, tied head;
* ``qwen-151k`` — a Qwen3 body of 2 layers at hidden 256 under Qwen's 151,936-token head;
* ``gemma-256k`` — a Gemma 2 body of 2 layers at hidden 256 under Gemma's 256,000-token head (tied, soft-capped).

The wide-vocabulary students run at ``--seq`` and at ``--long-seq`` tokens: their peak RSS grows by the small body's
activations, not by the ``[T, V]`` logits a plain loss would hold (printed beside it for scale: the top-K loss never
forms them; ``kiln_core.loss``).

Usage:
    python bench/model_sizes.py                       # everything (about 10 minutes on 2 cores)
    python bench/model_sizes.py --shapes smollm2-135m,qwen2.5-0.5b --steps 4

State the machine's load with the figures; the bench prints it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from train_step import load_average  # noqa: E402  (bench/ is on the path when a bench runs)

SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(architecture="llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(architecture="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen-151k": dict(architecture="qwen3", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=512, vocab_size=151936),
    "gemma-256k": dict(architecture="gemma2", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=512, vocab_size=256000, tie_word_embeddings=True),
}
WIDE_VOCABULARY = ("qwen-151k", "gemma-256k")
TOP_K = 32


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (examples) each run trains")
    p.add_argument("--seq", type=int, default=256, help="tokens per example")
    p.add_argument("--long-seq", type=int, default=2048, help="the wide-vocabulary students' second length")
    p.add_argument("--out", default=None, help="work directory (models are kept there and reused)")
    p.add_argument("--child", nargs=3, metavar=("ACTION", "SHAPE", "SEQ"), help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = [name for name in args.shapes.split(",") if name not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    return args


def build(shape: str, work: Path) -> dict:
    """Build ``shape``'s model once under ``work`` (in a process of its own: its init must not count)."""
    from kiln_core.tiny_models import build_tiny_model

    out = work / shape
    if not (out / "config.json").exists():
        build_tiny_model(out, seed=1, init_std=0.02, max_position_embeddings=4096, **SHAPES[shape])
    return {"model": str(out)}


def train(shape: str, work: Path, seq: int, steps: int) -> dict:
    """Train ``steps`` examples of ``seq`` tokens on ``shape``'s model; tokens/s, s/step and this process's peak RSS."""
    import numpy as np
    import torch

    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.contracts.stage_refs import TrainPlan
    from kiln_core.corpus import CorpusTables, TrainingExample
    from kiln_core.training.trainer import train_opd

    vocab = SHAPES[shape]["vocab_size"]
    rng = np.random.default_rng(0)
    actions = np.arange(seq // 2, seq, dtype=np.int32)
    examples = []
    for i in range(steps):
        probs = np.sort(rng.dirichlet(np.full(TOP_K, 0.3), size=len(actions)), axis=1)[:, ::-1] * 0.9
        examples.append(TrainingExample(
            index=i, line=i + 2, input_ids=rng.integers(3, 380, size=seq).astype(np.int32), action_positions=actions,
            env_positions=np.zeros(0, np.int32), env_in_warning_prefix=np.zeros(0, bool),
            teacher_ids=np.stack([rng.choice(vocab, size=TOP_K, replace=False) for _ in actions]).astype(np.int32),
            teacher_logprobs=np.log(probs).astype(np.float32)))
    tables = CorpusTables.from_examples(examples, TOP_K)
    config = OpdConfig.model_validate({"training_mode": "off_policy", "top_k": TOP_K, "seed": 0, "epochs": 1,
                                       "checkpoint_interval": None, "learning_rate": 1e-4, "publish_guard": False})
    plan = TrainPlan.for_config(config, str(work / "runs" / f"{shape}-{seq}"), "bench", device="cpu", precision="fp32")
    result = train_opd(plan, tables, dataset_sha256="sha256:" + "0" * 64, dataset_path="synthetic.jsonl",
                       student_dir=str(work / shape), teacher_alias="synthetic")
    if result.status != "success":
        raise SystemExit(f"{shape}: training {result.status}: {result.failure_message}")
    loop_s = result.phase_timings_ms["train_loop"] / 1e3
    from transformers import AutoConfig

    config_json = AutoConfig.from_pretrained(str(work / shape))
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config_json).parameters())
    return {"shape": shape, "seq": seq, "steps": result.steps, "parameters": parameters,
            "tokens_per_s": round(seq * result.steps / loop_s, 1), "s_per_step": round(loop_s / result.steps, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "first_loss": result.loss_history[0], "final_loss": result.final_loss,
            "threads": torch.get_num_threads()}


def child(action: str, shape: str, seq: int, steps: int, work: Path) -> None:
    figures = build(shape, work) if action == "build" else train(shape, work, seq, steps)
    print("RESULT " + json.dumps(figures))


def run_child(action: str, shape: str, seq: int, args: argparse.Namespace, work: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", action, shape, str(seq), "--steps", str(args.steps),
                           "--out", str(work)], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{action} {shape} (seq {seq}) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    args = parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="kiln-bench-sizes-"))
    if args.child:
        action, shape, seq = args.child
        child(action, shape, int(seq), args.steps, work)
        return
    shapes = args.shapes.split(",")
    load_before = load_average()
    runs = []
    for shape in shapes:
        started = time.perf_counter()
        run_child("build", shape, args.seq, args, work)
        print(f"built {shape} in {time.perf_counter() - started:.0f} s", flush=True)
        for seq in (args.seq, args.long_seq) if shape in WIDE_VOCABULARY else (args.seq,):
            figures = run_child("train", shape, seq, args, work)
            figures["load_average"] = load_average()
            runs.append(figures)
            print(f"{shape:13s} seq {seq:5d}: {figures['tokens_per_s']:8.1f} tokens/s  {figures['s_per_step']:6.2f} s/step"
                  f"  peak RSS {figures['peak_rss_mib']:6d} MiB  loss {figures['first_loss']:.3f} -> "
                  f"{figures['final_loss']:.3f}  (load {figures['load_average']})", flush=True)
    print()
    base = next((run for run in runs if run["shape"] == "smollm2-135m"), None)
    print(f"| student | parameters | tokens/example | tokens/s | s/step | peak RSS | × 135M's time per token |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        ratio = f"{base['tokens_per_s'] / run['tokens_per_s']:.2f}×" if base else "—"
        print(f"| {run['shape']} | {run['parameters'] / 1e6:.0f} M | {run['seq']} | {run['tokens_per_s']:.1f} | "
              f"{run['s_per_step']:.2f} | {run['peak_rss_mib']:,} MiB | {ratio} |")
    bounded = []
    for shape in WIDE_VOCABULARY:
        pair = [run for run in runs if run["shape"] == shape]
        if len(pair) == 2:
            short, long = pair
            logits_mib = (long["seq"] // 2) * SHAPES[shape]["vocab_size"] * 4 / 2**20
            growth = long["peak_rss_mib"] - short["peak_rss_mib"]
            bounded.append({"shape": shape, "rss_growth_mib": growth, "plain_logits_mib": round(logits_mib)})
            print(f"{shape}: peak RSS grows {growth} MiB from {short['seq']} to {long['seq']} tokens; the fp32 [T, V] "
                  f"logits of its {long['seq'] // 2} action rows alone would be {logits_mib:,.0f} MiB "
                  f"(twice that with their gradient)")
    print(f"load average before {load_before}, after {load_average()}")
    print(json.dumps({"runs": runs, "wide_vocabulary": bounded, "load_before": load_before}))


if __name__ == "__main__":
    main()
