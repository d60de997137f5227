"""``kiln-flows oracle``: answer one HF next-token request, or make one.

Run mode::

    kiln-flows oracle REQUEST --model DIR [--out ROOT_URI] [--dtype bf16|fp32]
                              [--receipts-root DIR] [--json]

checks the request (file, strict JSON, schema, cross-field rules, its source receipts — always, under
``--receipts-root`` or else the current directory, as Kiln runs from its repository root — model
identity, tokenization), runs one eager HF forward pass and commits
``<root>/oracle/<request id>/result.json`` + ``logits.safetensors``. Re-running an identical request
returns the committed result; a different one never overwrites it (``result_exists``).

Make mode (``make-request`` in place of REQUEST)::

    kiln-flows oracle make-request --model DIR --message TEXT (--prefix-ids 1,2,3 | --prefix TEXT)
        --kiln-id A --vllm-id B --id REQUEST_ID --out FILE [--run-id R --phase P --source-commit HEX]

writes a validated request plus two synthetic receipts under ``<FILE's dir>/receipts/`` (pass that
directory as ``--receipts-root``). A request file literally named ``make-request`` must be given as
``./make-request``.

Exit codes: 0 success; 2 rejected (``--json``: last stdout line
``{"status":"rejected","code":…,"message":…}``, the code is the rule); 3 the forward pass failed.

Example:
    $ kiln-flows oracle req/demo-1.json --model ./student --dtype fp32 --receipts-root req --json
"""

from __future__ import annotations

import argparse
import json
import sys

from flows.commands._options import add_json_argument

NAME = "oracle"
HELP = "Check an HF next-token request and record which engine's candidate eager HF prefers."
MAKE_REQUEST = "make-request"

_MAKE_ONLY = ("message", "prefix_ids", "prefix", "kiln_id", "vllm_id", "request_id", "run_id", "phase", "source_commit", "model_id")
_RUN_ONLY = ("receipts_root",)


_EPILOG = """modes:
  kiln-flows oracle REQUEST --model DIR [--out ROOT_URI] [--dtype bf16|fp32] [--receipts-root DIR] [--json]
  kiln-flows oracle make-request --model DIR --message TEXT (--prefix-ids 1,2,3 | --prefix TEXT)
      --kiln-id A --vllm-id B --id REQUEST_ID --out FILE [--run-id R] [--phase P] [--source-commit HEX]

results go to ROOT_URI/oracle/<request id>/{logits.safetensors,result.json}; an identical re-run
returns the committed result, a different one is refused (result_exists).
exit codes: 0 ok, 2 rejected (the rule is the "code" of the last --json line), 3 the forward pass failed."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of both modes; ``run`` checks which belong to the chosen one."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser.add_argument("request", metavar="REQUEST", help=f"request file or fsspec URI, or '{MAKE_REQUEST}'")
    parser.add_argument("--model", required=True, metavar="DIR", help="local model directory named by the request")
    parser.add_argument(
        "--out", metavar="URI", default=None,
        help="run: result root URI (default ./kiln-data); make-request: the request FILE to write",
    )
    add_json_argument(parser)
    run_group = parser.add_argument_group("run options")
    run_group.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="model dtype (default bf16, as Kiln)")
    run_group.add_argument(
        "--receipts-root", metavar="DIR", default=None,
        help="repository root holding the source receipts (default: the current directory); they are always checked",
    )
    make = parser.add_argument_group(f"{MAKE_REQUEST} options")
    make.add_argument("--message", help="the single user message")
    make.add_argument("--prefix-ids", metavar="IDS", help="continuation prefix ids, comma-separated")
    make.add_argument("--prefix", metavar="TEXT", help="continuation prefix text (tokenized without special tokens)")
    make.add_argument("--kiln-id", type=int, help="Kiln's candidate token id")
    make.add_argument("--vllm-id", type=int, help="vLLM's candidate token id")
    make.add_argument("--id", dest="request_id", help="request id")
    make.add_argument("--run-id", default=None, help="prompt.generator.run_id (default kiln-flows-local)")
    make.add_argument("--phase", default=None, help="prompt.generator.phase (default oracle)")
    make.add_argument("--source-commit", default=None, metavar="HEX", help="40-hex source commit (default all zeros)")
    make.add_argument("--model-id", default=None, help="model_identity.id (default: the model directory name)")


def _emit(args: argparse.Namespace, record: dict, human: str, *, stream=None) -> None:
    if args.json:
        print(json.dumps(record, sort_keys=True, separators=(",", ":")), flush=True)
    else:
        print(human, file=stream or sys.stdout, flush=True)


def _usage_error(args: argparse.Namespace, message: str) -> int:
    _emit(args, {"status": "rejected", "code": "usage", "line": None, "field": None, "message": message},
          f"error: {message}", stream=sys.stderr)
    return 2


def _misplaced(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return ["--" + name.replace("_", "-") for name in names if getattr(args, name) not in (None, False)]


def _run_make_request(args: argparse.Namespace) -> int:
    from kiln_core.oracle import make_request

    missing = [flag for flag, value in (("--message", args.message), ("--kiln-id", args.kiln_id), ("--vllm-id", args.vllm_id),
                                        ("--id", args.request_id), ("--out", args.out)) if value is None]
    if missing:
        return _usage_error(args, f"{MAKE_REQUEST} needs {', '.join(missing)}")
    if (args.prefix_ids is None) == (args.prefix is None):
        return _usage_error(args, f"{MAKE_REQUEST} needs exactly one of --prefix-ids or --prefix")
    if misplaced := _misplaced(args, _RUN_ONLY):
        return _usage_error(args, f"{', '.join(misplaced)} only applies to running a request")
    try:
        prefix_ids = [int(part) for part in args.prefix_ids.split(",")] if args.prefix_ids is not None else None
    except ValueError:
        return _usage_error(args, "--prefix-ids must be comma-separated integers")
    options = {name: getattr(args, name) for name in ("run_id", "phase", "source_commit", "model_id") if getattr(args, name)}
    # An OracleRejection (exit 2) is reported by the CLI's guard, like every other rejection.
    made = make_request(
        args.model, message=args.message, kiln_id=args.kiln_id, vllm_id=args.vllm_id, request_id=args.request_id,
        out=args.out, prefix_ids=prefix_ids, prefix_text=args.prefix, **options,
    )
    record = {"status": "ok", "request": made.request_uri, "request_sha256": made.sha256,
              "receipts_root": made.receipts_root, "receipts": list(made.receipt_paths)}
    _emit(args, record, f"wrote {made.request_uri} ({made.sha256})\nreceipts under {made.receipts_root}/receipts/")
    return 0


def _summary(outcome) -> str:
    record = outcome.record
    verdict, oracle = record["verdict"], record["oracle"]
    lines = [
        f"request {record['request']['id']} ({record['request']['sha256']})",
        f"verdict: {verdict['argmax_candidate']}  argmax {oracle['argmax']} {oracle['argmax_text']!r}"
        f"  margin {oracle['top_logit_margin']:.6g}",
    ]
    for item in oracle["candidate_tokens"]:
        lines.append(f"  {item['engine']:<4} {item['token_id']:>7} {item['text']!r}: logit {item['logit']:.6g}, rank {item['rank']}")
    lines.append(f"receipts checked: {str(record['receipts_checked']).lower()}")
    lines.append(f"{'reused committed' if outcome.reused else 'wrote'} {outcome.result_uri}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Dispatch to make-request or run mode; rejections (exit 2) and run failures (exit 3) go to the guard."""
    if args.request == MAKE_REQUEST:
        return _run_make_request(args)
    if misplaced := _misplaced(args, _MAKE_ONLY):
        return _usage_error(args, f"{', '.join(misplaced)} only applies to '{MAKE_REQUEST}'")

    from kiln_core.oracle import run_oracle

    # A rejection (exit 2) or a failed run (exit 3) reaches the CLI's one error guard (flows/cli.py).
    outcome = run_oracle(
        args.request, args.model, out_root=args.out or "./kiln-data", dtype=args.dtype, receipts_root=args.receipts_root
    )
    _emit(args, outcome.record, _summary(outcome))
    return 0
