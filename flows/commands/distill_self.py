"""``kiln-flows distill self``: Kiln's ``/v1/distill/self`` from a request file, trained through the engine.

    $ kiln-flows distill self --request self.json --student ./student --out ./kiln-data
    $ kiln-flows distill self --request self.json --student ./student --teacher my-lora-teacher --json

The request is Kiln's ``DistillSelfRequest`` (``name``, ``mode``, ``prompts`` with their assistant actions,
``ground_truth`` or ``documents``, ``config``, ``post_eval``; docs/recipes.md). It is checked with Kiln's
submit rules before anything is read but the file (exit 2, naming the field); then the prompts are
tokenized on both sides and aligned, the teacher (the student's bare base model, or ``--teacher ALIAS``)
scores the privileged sequences into a corpus under ``<out>/recipes/distill_self/`` (reused when the same
inputs come again), and the corpus trains exactly as ``kiln-flows train`` trains one: the run directory
``<out>/runs/<name>/<run key>/``, ``latest.json``, the ``post_eval`` gate. The receipt's ``recipe`` block and
Kiln's ``receipt.json`` beside the adapter name the recipe, mode and teacher.

Exit codes as ``kiln-flows train``: 0 published (or kept by the gate), 2 rejected input, 3 failed or
cancelled, 4 held back by the gate. With ``--json`` the last stdout line is the run summary or the error.
"""

from __future__ import annotations

import argparse

from flows.commands._options import add_dtype_argument, add_json_argument, add_out_argument, add_quiet_argument

HELP = "Self-distillation with privileged information (Kiln's DistillSelfRequest): the base model, shown the " \
       "answer, a conciseness instruction or a document, teaches the student."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request", required=True, metavar="FILE", help="DistillSelfRequest JSON (name, mode, "
                        "prompts, ground_truth or documents, config, post_eval)")
    parser.add_argument("--student", required=True, metavar="DIR",
                        help="student model directory; its bare base model is the teacher unless --teacher")
    add_out_argument(parser)
    parser.add_argument("--teacher", metavar="ALIAS", help="score with this local teacher registered under --out "
                        "(kiln-flows teachers register; it may wear a LoRA) instead of the bare base model")
    parser.add_argument("--base-adapter", metavar="NAME",
                        help="warm-start the student from this published adapter (config.base_adapter)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="teacher and training device (default: cuda when "
                        "available)")
    add_dtype_argument(parser, help="teacher and training precision (default: bf16 on cuda, fp32 on cpu)")
    add_json_argument(parser)
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Check, prepare (teacher scoring) and train; rejections (2) and failures (3) go to the CLI's guard."""
    import sys

    from flows.commands._options import DTYPES
    from kiln_core.contracts.distill_self import check_distill_self_request, request_warnings

    from kiln_core.contracts.request_file import read_request_json

    request = check_distill_self_request(read_request_json(args.request, "distill/self"), file=args.request)
    for warning in request_warnings(request):
        print(f"warning: {warning}", file=sys.stderr)

    from flows.commands._progress import ProgressBar  # the same bar and exit codes as `kiln-flows train`
    from flows.commands.train import exit_code, print_result
    from kiln_core.engine.pipeline import LocalStages, run_pipeline
    from kiln_core.post_eval import SuiteRegistry, validate_post_eval_config
    from kiln_core.recipes.distill_self import prepare_distill_self
    from kiln_core.wording import counted

    if request.post_eval is not None:  # its suite is installed: before the teacher runs (the engine checks it again)
        validate_post_eval_config(request.post_eval, SuiteRegistry.for_storage_root(args.out))

    say = (lambda text: None) if (args.quiet or args.json) else (lambda text: print(text, file=sys.stderr, flush=True))
    teacher = args.teacher or f"the bare base model {args.student}"
    say(f"distill self ({request.mode}): {counted(len(request.prompts), 'prompt')}, teacher {teacher}")
    spec = prepare_distill_self(request, student_dir=args.student, out_root=args.out, base_adapter=args.base_adapter,
                                teacher=args.teacher, device=args.device,
                                dtype=DTYPES[args.dtype] if args.dtype else None)
    say(f"teacher corpus: {spec.corpus}")
    bar = ProgressBar(enabled=not (args.quiet or args.json), config=spec.config)
    try:
        result = run_pipeline(spec, LocalStages(on_progress=bar.update), device=args.device, precision=args.dtype)
    finally:
        bar.close()
    print_result(result, f"{request.name} (distill self, {request.mode})", as_json=args.json, quiet=args.quiet)
    return exit_code(result)
