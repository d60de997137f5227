"""``kiln-flows distill pump``: Kiln's ``/v1/distill/pump`` request, trained through the engine.

    $ kiln-flows distill pump --request pump.json --student ./student --out ./kiln-data
    $ kiln-flows distill pump --request math-pump.json --student ./student --prompt-bank math-prompts.jsonl
    $ kiln-flows distill pump --request pump.json --student ./student --vllm-teacher http://127.0.0.1:8000 --json

The request is Kiln's ``DistillPumpRequest`` (``name``, ``teacher``, ``mode``, ``rank``, ``rollout_budget``,
``use_cache``, ``config``, ``post_eval``), checked with Kiln's submit-time rules before anything is read
or loaded (exit 2 naming the field). ``teacher`` is an alias registered under ``--out``
(``kiln-flows teachers register``), pinned: a teacher whose files changed since registration is refused.
``mode: {"examples": [...]}`` trains the request's prompts, on-policy (Kiln's default) or off-policy
(each prompt ends with the assistant answer the teacher scores); ``{"domain": ...}`` and ``{"wide": ...}``
train on-policy on the prompts of ``--prompt-bank FILE`` (a JSONL of Kiln ``OpdPrompt`` objects), which
they require. ``--vllm-teacher URL`` scores off-policy examples on a vLLM server serving the registered
teacher. Output, ``--json`` and exit codes are ``kiln-flows train``'s: 0 published (or kept by the gate),
2 rejected input, 3 failed, 4 held back by the ``post_eval`` gate. docs/recipes.md has the details.
"""

from __future__ import annotations

import argparse

from flows.commands._options import add_json_argument, add_out_argument, add_quiet_argument

HELP = "Distil a registered teacher into the student from Kiln's DistillPumpRequest (examples, domain or wide)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``distill pump`` options to its subparser."""
    parser.add_argument("--request", required=True, metavar="FILE",
                        help="DistillPumpRequest JSON (name, teacher, mode, rank, rollout_budget, use_cache, config, "
                        "post_eval)")
    parser.add_argument("--student", required=True, metavar="DIR", help="student model directory")
    add_out_argument(parser)
    parser.add_argument("--prompt-bank", metavar="FILE",
                        help="domain/wide modes: JSONL of Kiln OpdPrompt objects to pump (one user prompt per line "
                        "is enough); required by them, refused with examples")
    parser.add_argument("--vllm-teacher", metavar="URL",
                        help="score off-policy examples on this vLLM server serving the registered teacher (a "
                        "remote teacher runs off-policy only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    add_json_argument(parser)
    add_quiet_argument(parser)


def load_pump_request(path: str):
    """Read, parse and check a request file (Kiln's submit-time rules; nothing else is read).

    Raises:
        Rejection: ``invalid_request`` (unreadable, not JSON) or any rule of ``check_distill_pump_request``.
    """
    from kiln_core.contracts.distill_pump import check_distill_pump_request
    from kiln_core.contracts.request_file import read_request_json

    return check_distill_pump_request(read_request_json(path, "distill/pump"), file=path)


def run(args: argparse.Namespace) -> int:
    """Check, prepare (teacher work) and train; rejections (exit 2) and failures (exit 3) go to the guard."""
    import sys

    from flows.commands._progress import ProgressBar
    from flows.commands.train import exit_code, print_result

    request = load_pump_request(args.request)  # before anything heavy is imported or read

    from kiln_core.engine import run_pipeline
    from kiln_core.engine.pipeline import LocalStages
    from kiln_core.recipes.distill_pump import prepare_distill_pump

    def warn(message: str) -> None:
        print(f"warning: {message}", file=sys.stderr)

    spec = prepare_distill_pump(request, student_dir=args.student, out_root=args.out, prompt_bank=args.prompt_bank,
                                vllm_teacher=args.vllm_teacher, on_warning=warn)
    bar = ProgressBar(enabled=not (args.quiet or args.json), config=spec.config)
    on_train_start = None if args.quiet else (
        lambda settings: print(f"training {spec.adapter}: {settings}", file=sys.stderr, flush=True))
    try:
        result = run_pipeline(spec, LocalStages(on_progress=bar.update, on_train_start=on_train_start),
                              device=args.device)
    finally:
        bar.close()
    print_result(result, f"{spec.adapter} (distill pump, {spec.recipe.mode})", as_json=args.json, quiet=args.quiet)
    return exit_code(result)
