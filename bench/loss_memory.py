"""Peak extra memory and wall time of the default loss, kiln-flows vs naive full logits, one process.

Both sides compute the same top-K reverse KL (Kiln's crates/kiln-opd-loss-kernel/src/lib.rs) forward + backward:

* kiln-flows: `kiln_core.loss.topk_reverse_kl` (student logits at the K ids only, chunked).
* naive: `naive_topk_reverse_kl` (below): ``hidden @ W.T`` gives real ``[T, V]`` logits in autograd, then the
  K columns are gathered (its backward builds a ``[T, V]`` gradient too).

Memory is the peak EXTRA over a baseline taken right before each call, with the inputs already
allocated. CPU: process RSS sampled by a background thread about every 1 ms (freed heap is handed
back with ``malloc_trim`` before each baseline). CUDA: ``torch.cuda.max_memory_allocated`` delta.
Time is the best of a few runs. Targets: memory ratio ours/naive ≤ 0.10, time ratio ≤ 1.5. Hidden
rows require grad and the head is frozen (the LoRA case) unless ``--train-head``.

Usage:
    python bench/loss_memory.py                      # T=4096 V=248320 H=1024 K=32 fp32 cpu
    python bench/loss_memory.py --device cuda --dtype bf16 --H 2560

If the naive side cannot fit in the memory available, T is halved (for both sides) until it does,
and the output says so. The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import math
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from kiln_core.logit_head import LogitHead  # noqa: E402
from kiln_core.loss import topk_reverse_kl  # noqa: E402

MIB = 2**20


def naive_topk_reverse_kl(hidden, head_weight, teacher_ids, teacher_logprobs, *, head_bias=None):
    """The baseline a plain implementation writes: full ``[T, V]`` logits, then the K columns."""
    logits = hidden @ head_weight.T
    if head_bias is not None:
        logits = logits + head_bias
    log_p = torch.log_softmax(logits.float().gather(1, teacher_ids.long()), dim=-1)
    log_q = torch.log_softmax(teacher_logprobs.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=4096, help="action targets in the sequence")
    p.add_argument("--V", type=int, default=248_320, help="vocabulary size (Qwen3.5: 248,320)")
    p.add_argument("--H", type=int, default=1024, help="hidden size")
    p.add_argument("--K", type=int, default=32, help="teacher top-K")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--chunk-rows", type=int, default=1024, help="topk_reverse_kl chunk_rows")
    p.add_argument("--train-head", action="store_true", help="lm_head weight requires grad too")
    p.add_argument("--repeats", type=int, default=3, help="runs of kiln-flows (best time is kept)")
    p.add_argument("--naive-repeats", type=int, default=2, help="runs of the naive reference")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# Measurement


class PeakRSS:
    """Samples this process's RSS in a background thread (~1 ms) and keeps the maximum."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s, self.peak = interval_s, 0
        self._proc, self._stop = psutil.Process(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _release_freed_memory(device: str) -> None:
    """Drop garbage and return freed heap pages, so the baseline is not inflated by old frees."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        return
    libc_name = ctypes.util.find_library("c")
    if libc_name:  # glibc keeps freed small-to-medium blocks in its arenas until trimmed
        try:
            ctypes.CDLL(libc_name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: RSS figures are then slightly pessimistic
            pass


def measure(step, params, device: str) -> tuple[int, float, float]:
    """Run ``step()`` once (forward + backward); return (peak extra bytes, seconds, loss value)."""
    for t in params:
        t.grad = None
    _release_freed_memory(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        extra = torch.cuda.max_memory_allocated() - base
    else:
        proc = psutil.Process()
        base = proc.memory_info().rss
        with PeakRSS() as sampler:
            start = time.perf_counter()
            loss = step()
            seconds = time.perf_counter() - start
        extra = sampler.peak - base
    value = float(loss)
    del loss
    for t in params:
        t.grad = None
    return max(extra, 0), seconds, value


def bench(name: str, loss_fn, inputs, params, repeats: int, device: str) -> dict:
    hidden, weight, ids, logprobs = inputs

    def step():
        loss = loss_fn(hidden, weight, ids, logprobs)
        loss.backward()
        return loss.detach()

    runs = [measure(step, params, device) for _ in range(repeats)]
    # Worst memory (conservative: a later run may reuse pages an earlier one left mapped), best time.
    return {
        "name": name,
        "peak_extra_bytes": max(r[0] for r in runs),
        "best_seconds": min(r[1] for r in runs),
        "runs": repeats,
        "loss": runs[0][2],
    }


# ---------------------------------------------------------------------------------------------
# Inputs and sizing


def naive_bytes_needed(T: int, V: int, H: int, dtype: torch.dtype, train_head: bool) -> int:
    """Upper estimate of the naive side's peak: logits in dtype + their fp32 copy (or the fp32
    gradient in backward), plus ``grad_W`` when the head trains."""
    elem = torch.empty((), dtype=dtype).element_size()
    return T * V * (elem + 4) + (V * H * elem if train_head else 0)


def available_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available


def make_inputs(args, T: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(T, args.H, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(args.V, args.H, generator=gen) / math.sqrt(args.H)).to(device=device, dtype=dtype)
    weight.requires_grad_(args.train_head)
    # Duplicate ids inside a row are harmless for timing and memory; unique sampling would itself
    # need a [T, V] permutation.
    ids = torch.randint(0, args.V, (T, args.K), generator=gen).to(device)
    logprobs = torch.log_softmax(torch.randn(T, args.K, generator=gen) * 2.0, -1) + math.log(0.9)
    logprobs = logprobs.sort(-1, descending=True).values.to(device)
    return (hidden, weight, ids, logprobs), [t for t in (hidden, weight) if t.requires_grad]


def main() -> None:
    args = parse_args()
    dtype, device = DTYPES[args.dtype], args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")

    notes = []
    weight_bytes = args.V * args.H * torch.empty((), dtype=dtype).element_size()
    budget = available_bytes(device) - weight_bytes - 2 * 2**30  # keep W and 2 GiB of headroom
    T = args.T
    while T > 1 and naive_bytes_needed(T, args.V, args.H, dtype, args.train_head) > budget:
        T //= 2
    if T != args.T:
        notes.append(f"naive reference cannot fit at T={args.T}; both sides run at T={T}")

    inputs, params = make_inputs(args, T, dtype, device)
    def ours_fn(hidden, weight, ids, logprobs):
        return topk_reverse_kl(hidden, LogitHead(weight), ids, logprobs, chunk_rows=args.chunk_rows)

    ours = bench("kiln-flows topk_reverse_kl", ours_fn, inputs, params, args.repeats, device)
    naive = bench("naive [T,V] logits", naive_topk_reverse_kl, inputs, params, args.naive_repeats, device)

    mem_ratio = ours["peak_extra_bytes"] / max(naive["peak_extra_bytes"], 1)
    time_ratio = ours["best_seconds"] / naive["best_seconds"]
    loss_rel_diff = abs(ours["loss"] - naive["loss"]) / abs(naive["loss"])
    head = "trained" if args.train_head else "frozen"
    threads = torch.get_num_threads() if device == "cpu" else "-"
    print(
        f"top-K reverse KL fwd+bwd: T={T} V={args.V} H={args.H} K={args.K} {args.dtype} {device} "
        f"head={head} chunk_rows={args.chunk_rows} torch_threads={threads}"
    )
    for note in notes:
        print(f"NOTE: {note}")
    print(f"{'implementation':<28}{'peak extra MiB':>16}{'best time s':>14}{'runs':>6}{'loss':>14}")
    for r in (ours, naive):
        print(
            f"{r['name']:<28}{r['peak_extra_bytes'] / MIB:>16.1f}{r['best_seconds']:>14.3f}"
            f"{r['runs']:>6}{r['loss']:>14.6f}"
        )
    mem_ok, time_ok = mem_ratio <= 0.10, time_ratio <= 1.5
    print(f"memory ratio ours/naive: {mem_ratio:.4f}  (target <= 0.10: {'PASS' if mem_ok else 'FAIL'})")
    print(f"time ratio ours/naive:   {time_ratio:.4f}  (target <= 1.5:  {'PASS' if time_ok else 'FAIL'})")
    print(f"loss relative difference: {loss_rel_diff:.2e}")
    print(
        json.dumps(
            {
                "bench": "loss_memory",
                "T": T,
                "T_requested": args.T,
                "V": args.V,
                "H": args.H,
                "K": args.K,
                "dtype": args.dtype,
                "device": device,
                "train_head": args.train_head,
                "chunk_rows": args.chunk_rows,
                "ours_peak_extra_bytes": ours["peak_extra_bytes"],
                "naive_peak_extra_bytes": naive["peak_extra_bytes"],
                "ours_best_seconds": round(ours["best_seconds"], 4),
                "naive_best_seconds": round(naive["best_seconds"], 4),
                "memory_ratio": round(mem_ratio, 5),
                "time_ratio": round(time_ratio, 5),
                "memory_target_met": mem_ok,
                "time_target_met": time_ok,
                "loss_rel_diff": loss_rel_diff,
                "notes": notes,
            }
        )
    )


if __name__ == "__main__":
    main()
