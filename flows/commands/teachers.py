"""``kiln-flows teachers``: the local teacher registry (``<root>/teachers.json``).

    $ kiln-flows teachers register tiny-teacher ./teacher --out ./kiln-data --max-top-k 32
    $ kiln-flows teachers register rust-teacher ./teacher --adapter rust-helper --out ./kiln-data
    $ kiln-flows teachers list --out ./kiln-data --json

Aliases are immutable and follow the adapter-name rule: registering the same identity again is a
no-op, a different identity under a used alias exits 2. ``--adapter`` registers the base model wearing a
LoRA (a published adapter NAME under ``--out``, or a PEFT adapter directory), pinned by its digests: a
rewritten adapter is refused when the teacher is used. Exit codes: 0 ok, 2 rejected input (also a
corrupt registry: it fails the same way every time), 3 storage failure.
"""

from __future__ import annotations

import argparse

from flows.commands._options import DTYPES, add_json_argument, add_out_argument
from flows.commands.manifest import add_local_teacher_arguments

NAME = "teachers"
HELP = "Register local Hugging Face teachers under immutable aliases, and list them."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``register`` and ``list`` subcommands."""
    sub = parser.add_subparsers(dest="teachers_command", metavar="ACTION")
    register = sub.add_parser("register", help="hash a local teacher dir and pin its identity under ALIAS")
    register.add_argument("alias", metavar="ALIAS")
    register.add_argument("teacher_dir", metavar="DIR", help="the teacher's (base) model directory")
    register.add_argument("--adapter", metavar="NAME|DIR",
                          help="the LoRA the teacher wears: a published adapter NAME (<out>/runs/NAME/latest.json) "
                               "or a PEFT adapter directory (a path with a '/')")
    add_out_argument(register, aliases=("--root",))
    add_local_teacher_arguments(register)
    add_json_argument(register)
    listing = sub.add_parser("list", help="list registered teachers")
    add_out_argument(listing, aliases=("--root",), writes=False)
    add_json_argument(listing)


def _register(args: argparse.Namespace) -> int:
    import json
    import sys

    from kiln_core.teachers.local_registry import register_local_teacher

    entry = register_local_teacher(
        args.out,
        args.alias,
        args.teacher_dir,
        max_top_k=args.max_top_k,
        max_model_len=args.max_model_len,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        attn_implementation=args.attn_implementation,
        device_kind=args.device,
        adapter=args.adapter,
    )
    if args.json:
        print(json.dumps(entry.model_dump(mode="json"), ensure_ascii=False))
    else:
        adapter = f"\t{_adapter_text(entry)}" if entry.adapter_dir is not None else ""
        print(f"{entry.alias}\t{entry.identity_revision}\t{entry.identity['served_model_id']}\t{entry.teacher_dir}"
              f"{adapter}")
    sys.stdout.flush()
    return 0


def _list(args: argparse.Namespace) -> int:
    import json

    from kiln_core.teachers.local_registry import list_local_teachers

    entries = list_local_teachers(args.out)
    if args.json:
        print(json.dumps([entry.model_dump(mode="json") for entry in entries], ensure_ascii=False))
        return 0
    if not entries:
        print(f"no teachers registered under {args.out}")
        return 0
    print("ALIAS\tIDENTITY_REVISION\tMAX_TOP_K\tREGISTERED_AT\tTEACHER_DIR\tADAPTER")
    for entry in entries:
        max_top_k = entry.identity["max_top_k"]
        print(f"{entry.alias}\t{entry.identity_revision}\t{max_top_k}\t{entry.registered_at}\t{entry.teacher_dir}"
              f"\t{_adapter_text(entry)}")
    return 0


def _adapter_text(entry) -> str:
    """``<name> weights:<digest>`` of the LoRA a teacher wears (its identity's ``adapter``), else ``-``."""
    adapter = entry.identity.get("adapter")
    if not adapter:
        return "-"
    return f"{adapter['name']} weights:{adapter['weights_sha256']}"


def run(args: argparse.Namespace) -> int:
    """Dispatch to ``register`` / ``list``; rejections (exit 2) and failures (exit 3) go to the guard."""
    import sys

    action = {"register": _register, "list": _list}.get(args.teachers_command or "")
    if action is None:
        print("kiln-flows teachers: choose an action: register ALIAS DIR | list", file=sys.stderr)
        return 2
    return action(args)
