"""``kiln-flows manifest``: print a teacher's canonical ``off_policy_manifest`` line.

Three sources, one output (the line exactly, plus one newline, on stdout), so it can start a corpus:

    $ kiln-flows manifest --kiln http://127.0.0.1:8420 --alias teacher-large@vllm > teacher-data.jsonl
    $ kiln-flows manifest --teacher ./teacher --max-top-k 32
    $ kiln-flows manifest --registry ./kiln-data --alias tiny-teacher

Exit codes: 0 printed, 2 rejected input (unknown alias, unusable teacher, bad directory), 3 the
server or storage failed (unreachable, timed out, 5xx).
"""

from __future__ import annotations

import argparse
from typing import Any

from flows.commands._options import DTYPES, add_dtype_argument

NAME = "manifest"
HELP = "Print a teacher's canonical off_policy_manifest line (from Kiln, a local teacher dir, or the local registry)."


def add_local_teacher_arguments(group: Any) -> None:
    """Add the options that shape a local teacher's identity to a parser or argument group.

    Shared with ``teachers register`` so both commands hash a teacher under the same options.
    """
    group.add_argument("--max-top-k", type=int, default=32, metavar="K", help="most top-K candidates (default 32)")
    group.add_argument("--max-model-len", type=int, metavar="N", help="context cap (default: max_position_embeddings)")
    add_dtype_argument(group, choices=("fp32", "bf16", "fp16"), help="teacher dtype (default: fp32 CPU, bf16 CUDA)")
    group.add_argument("--attn-implementation", default="eager", choices=["eager", "sdpa"])
    group.add_argument("--device", choices=["cpu", "cuda"], help="device kind (default: cuda if available)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``manifest`` options to its subparser."""
    source = parser.add_argument_group("source (exactly one)")
    source.add_argument("--kiln", metavar="URL", help="Kiln server URL, e.g. http://127.0.0.1:8420 (needs --alias)")
    source.add_argument("--teacher", metavar="DIR", help="local Hugging Face teacher directory to hash")
    source.add_argument("--registry", metavar="ROOT_URI", help="storage root of the local registry (needs --alias)")
    source.add_argument("--root", dest="registry", help=argparse.SUPPRESS)  # the older spelling
    parser.add_argument(
        "--alias",
        help="teacher alias (with --registry also a file whose first line is the manifest; "
        "with --teacher the served_model_id)",
    )
    add_local_teacher_arguments(parser.add_argument_group("local teacher options (--teacher)"))
    remote = parser.add_argument_group("Kiln options (--kiln); the bearer token comes from $KILN_API_KEY")
    remote.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds per attempt (default 10)")
    remote.add_argument("--retries", type=int, default=3, metavar="N", help="retries on transient failures (default 3)")


def _manifest_line(args: argparse.Namespace) -> str:
    if args.kiln is not None:
        from kiln_core.teachers.kiln_client import fetch_off_policy_manifest

        return fetch_off_policy_manifest(args.alias, args.kiln, timeout=args.timeout, retries=args.retries)
    if args.teacher is not None:
        from kiln_core.contracts.identity import build_manifest_line
        from kiln_core.identity.local_teacher import local_teacher_identity, served_model_id_for

        identity = local_teacher_identity(
            args.teacher,
            served_model_id=served_model_id_for(args.alias, args.teacher),
            max_top_k=args.max_top_k,
            max_model_len=args.max_model_len,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            attn_implementation=args.attn_implementation,
            device_kind=args.device,
        )
        return build_manifest_line(identity)
    from kiln_core.teachers.local_registry import resolve_pinned_manifest

    return resolve_pinned_manifest(args.registry, args.alias)


def run(args: argparse.Namespace) -> int:
    """Print the manifest line; a rejection (exit 2) or server/storage failure (exit 3) goes to the guard."""
    import sys

    sources = [name for name in ("kiln", "teacher", "registry") if getattr(args, name) is not None]
    if len(sources) != 1:
        print("kiln-flows manifest: give exactly one of --kiln URL, --teacher DIR, --registry ROOT_URI", file=sys.stderr)
        return 2
    if sources[0] in ("kiln", "registry") and not args.alias:
        print(f"kiln-flows manifest: --{sources[0]} needs --alias", file=sys.stderr)
        return 2
    line = _manifest_line(args)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return 0
