"""The recommended recipe through the CLI, on a real model: off-policy, then on-policy from that adapter.

    python bench/on_policy_cli.py --out /tmp/onpolicy-cli     # about 10 minutes on 2 cores

Set-up: ``bench/distill_quality.py``'s models, corpora and held-out split (reused from ``--cache-dir``):
SmolLM2-135M-Instruct is the teacher, registered under the alias its corpora were scored with, and the
student keeps teacher layers 0–7 and 23–29 (``--keep-layers``). Two ``kiln-flows train --request`` runs
write into ``OUT/kiln-data``, both watched on the held-out corpus (``--eval-corpus``):

1. ``smol-offpol``: off-policy, one epoch over the teacher-scored train corpus;
2. ``smol-onpol``: on-policy over the first 24 train prompts × 2 samples (at most 32 tokens), with
   ``config.base_adapter: "smol-offpol"``, so it starts from the published off-policy adapter.

Prints each command with its exit status and time, then each run's held-out curve from its receipt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from distill_quality import prepare  # noqa: E402

TEACHER_ALIAS = "teacher"  # the served_model_id the cached corpora were scored under
SHARED_CONFIG = {"top_k": 32, "lora_rank": 16, "lora_alpha": 32.0, "learning_rate": 1e-3, "seed": 7, "auto_load": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="a fresh directory for the requests and the storage root")
    parser.add_argument("--cache-dir", default="./kiln-data/distill-quality", help="shared with distill_quality.py")
    parser.add_argument("--keep-layers", default="0,1,2,3,4,5,6,7,23,24,25,26,27,28,29")
    args = parser.parse_args()

    from kiln_core.data import load_prompts

    setup = prepare(Path(args.cache_dir).resolve(), None, args.keep_layers)
    out = Path(args.out).resolve()
    root = out / "kiln-data"
    out.mkdir(parents=True, exist_ok=True)
    student, heldout = str(setup["student"]), str(setup["heldout_corpus"])
    kiln(["teachers", "register", TEACHER_ALIAS, str(setup["teacher"]), "--out", str(root), "--device", "cpu"])

    off_policy = {"teacher": TEACHER_ALIAS, "dataset_path": str(setup["train_corpus"]),
                  "config": {**SHARED_CONFIG, "training_mode": "off_policy", "epochs": 1, "checkpoint_interval": 50}}
    prompts = [{"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": ""}]}
               for row in load_prompts("train")[:24]]
    on_policy = {"teacher": TEACHER_ALIAS, "prompts": prompts,
                 "config": {**SHARED_CONFIG, "training_mode": "on_policy", "samples_per_prompt": 2, "max_tokens": 32,
                            "temperature": 1.0, "top_p": 0.9, "epochs": 1, "checkpoint_interval": 8,
                            "base_adapter": "smol-offpol"}}
    for adapter, request, every in (("smol-offpol", off_policy, 50), ("smol-onpol", on_policy, 8)):
        path = out / f"{adapter}.json"
        path.write_text(json.dumps(request, indent=1) + "\n", encoding="utf-8")
        result = kiln(["train", "--request", str(path), "--adapter", adapter, "--student", student, "--out", str(root),
                       "--eval-corpus", heldout, "--eval-every", str(every), "--json"])
        receipt = json.loads(Path(result["receipt"]).read_text(encoding="utf-8"))
        print(f"{adapter}: {receipt['status']}, base adapter {receipt['config'].get('base_adapter')}")
        for point in receipt["eval_curve"]["points"]:
            loss = "" if point["train_loss"] is None else f", train loss {point['train_loss']:.3f}"
            print(f"  step {point['step']:>4}: held-out reverse KL {point['reverse_kl']:.4f}, "
                  f"top-1 {point['top1_agreement']:.1%}, NLL {point['teacher_token_nll']:.3f}{loss}")


def kiln(args: list[str]) -> dict:
    """Run ``kiln-flows ARGS`` from this interpreter's environment; the ``--json`` result, if any."""
    started = time.perf_counter()
    cli = Path(sys.executable).parent / "kiln-flows"
    proc = subprocess.run([str(cli), *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    print(f"$ kiln-flows {' '.join(args[:2])} …  exit {proc.returncode} in {time.perf_counter() - started:.0f} s",
          flush=True)
    if proc.returncode != 0:
        sys.exit(f"failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if "--json" in args and lines else {}


if __name__ == "__main__":
    main()
