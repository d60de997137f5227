"""``kiln-flows train``: train a LoRA student from a Kiln ``OpdRequest`` file.

    $ kiln-flows train --request opd-request.json --adapter offline-distilled --student ./student
    $ kiln-flows train --request opd-request.json --adapter offline-distilled --student ./student \\
          --resume-checkpoint offline-distilled-checkpoint-step-00000025.kiln-checkpoint --json

Outputs go under ``<out>/runs/<adapter>/``: periodic ``.kiln-checkpoint`` directories, the PEFT
``adapter/`` and ``train_receipt.json``. With ``--json`` the last stdout line is
``{"status", "adapter", "receipt", "latest_checkpoint", "final_loss"}``. Exit codes: 0 success,
2 rejected input (request, config, admission, resume checkpoint), 3 failed or cancelled run.
SIGTERM/SIGINT stop the run at the next step boundary after publishing a checkpoint (exit 3).

Several processes on this machine (data parallel on ``torch.distributed``)::

    $ kiln-flows train --request opd-request.json --adapter demo --student ./student --nproc 4 --json

validates and admits here, then launches ``python -m torch.distributed.run --standalone
--nproc-per-node 4 -m kiln_core.training.distributed.worker`` (gloo on CPU, nccl on CUDA: one GPU per rank).
Each optimizer step takes ``4 × sequences_per_step`` candidates; rank 0 publishes checkpoints, the
adapter and the receipt. A checkpoint resumes only with the ``--nproc`` that wrote it.
"""

from __future__ import annotations

import argparse

NAME = "train"
HELP = "Train a LoRA student on a teacher-scored corpus from a Kiln OPD request file."
DEFAULT_ROOT = "./kiln-data"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request", required=True, metavar="FILE", help="OpdRequest JSON (dataset_path, teacher, config)")
    parser.add_argument("--adapter", required=True, metavar="NAME", help="adapter name (the run directory and checkpoint prefix)")
    parser.add_argument("--student", required=True, metavar="DIR", help="student model directory")
    parser.add_argument("--out", default=DEFAULT_ROOT, metavar="ROOT_URI",
                        help=f"storage root, a local path or fsspec URI (default {DEFAULT_ROOT})")
    parser.add_argument("--resume-checkpoint", metavar="BASENAME",
                        help="resume exactly from <adapter>-checkpoint-step-<8 digits>.kiln-checkpoint in the run directory")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute activations in backward (less memory, same result)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="data-parallel processes on this machine, launched with torchrun (default 1); each "
                        "optimizer step takes N × sequences_per_step candidates")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="torch.distributed backend with --nproc > 1 (default: gloo on cpu, nccl on cuda)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line on stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the request; map rejections to exit 2 and failed/cancelled runs to exit 3."""
    import json
    import sys

    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.errors import AdmissionError
    from kiln_core.identity.hashing import IdentityHashError
    from kiln_core.tokenization import TokenizationError
    from kiln_core.training.checkpoint import CheckpointError
    from kiln_core.training.run_request import run_train_request

    bar = _ProgressBar(enabled=not (args.quiet or args.json))
    try:
        result = run_train_request(
            args.request,
            adapter=args.adapter,
            student_dir=args.student,
            out_root=args.out,
            resume_checkpoint=args.resume_checkpoint,
            on_progress=bar.update,
            on_warning=lambda message: print(f"warning: {message}", file=sys.stderr),
            handle_signals=True,
            device=args.device,
            precision=args.precision,
            gradient_checkpointing=args.gradient_checkpointing,
            nproc=args.nproc,
            backend=args.backend,
        )
    except (AdmissionError, ConfigError, CheckpointError) as error:
        return _rejected(args, bar, error.to_json())
    except (TokenizationError, IdentityHashError) as error:
        return _rejected(args, bar, {"status": "rejected", "code": getattr(error, "code", "invalid_student"), "message": str(error)})
    except Exception as error:  # a crash after validation: the receipt (if any) says failed
        bar.close()
        print(json.dumps({"status": "failed", "message": f"{type(error).__name__}: {error}"}) if args.json
              else f"failed: {type(error).__name__}: {error}", file=sys.stdout if args.json else sys.stderr)
        return 3
    bar.close()
    summary = {
        "status": result.status,
        "adapter": result.adapter,
        "receipt": result.receipt,
        "latest_checkpoint": result.latest_checkpoint,
        "final_loss": result.final_loss,
    }
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    elif result.status == "success":
        print(f"trained {args.adapter}: {result.steps} steps, final loss {result.final_loss:.6f}\n"
              f"  adapter: {result.adapter}\n  receipt: {result.receipt}")
    else:
        print(f"{result.status} ({result.failure_reason}): {result.failure_message}\n"
              f"  latest checkpoint: {result.latest_checkpoint}\n  receipt: {result.receipt}", file=sys.stderr)
    return 0 if result.status == "success" else 3


def _rejected(args: argparse.Namespace, bar: "_ProgressBar", payload: dict) -> int:
    import json
    import sys

    bar.close()
    if args.json:
        print(json.dumps(payload, ensure_ascii=False))
    else:
        print(f"rejected [{payload['code']}]: {payload['message']}", file=sys.stderr)
    return 2


class _ProgressBar:
    """A tqdm bar on stderr, created on the first step (when the total is known)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None

    def update(self, step: int, total: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            import sys

            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=step - 1, desc="train", unit="step", file=sys.stderr)
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
