"""``kiln-flows teachers``: the local teacher registry (``<root>/teachers.json``).

    $ kiln-flows teachers register tiny-teacher ./teacher --root ./kiln-data --max-top-k 32
    $ kiln-flows teachers list --root ./kiln-data --json

Aliases are immutable: registering the same identity again is a no-op, a different identity under a
used alias exits 2. Exit codes: 0 ok, 2 rejected input, 3 failure (storage, corrupt registry).
"""

from __future__ import annotations

import argparse

from flows.commands.manifest import add_local_teacher_arguments

NAME = "teachers"
HELP = "Register local Hugging Face teachers under immutable aliases, and list them."
DEFAULT_ROOT = "./kiln-data"
_ROOT_HELP = f"storage root, a local path or fsspec URI (default {DEFAULT_ROOT})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``register`` and ``list`` subcommands."""
    sub = parser.add_subparsers(dest="teachers_command", metavar="ACTION")
    register = sub.add_parser("register", help="hash a local teacher dir and pin its identity under ALIAS")
    register.add_argument("alias", metavar="ALIAS")
    register.add_argument("teacher_dir", metavar="DIR")
    register.add_argument("--root", default=DEFAULT_ROOT, metavar="ROOT_URI", help=_ROOT_HELP)
    add_local_teacher_arguments(register)
    register.add_argument("--json", action="store_true", help="print the stored entry as JSON")
    listing = sub.add_parser("list", help="list registered teachers")
    listing.add_argument("--root", default=DEFAULT_ROOT, metavar="ROOT_URI", help=_ROOT_HELP)
    listing.add_argument("--json", action="store_true", help="print the entries as a JSON list")


def _register(args: argparse.Namespace) -> int:
    import json
    import sys

    from kiln_core.teachers.local_registry import register_local_teacher

    entry = register_local_teacher(
        args.root,
        args.alias,
        args.teacher_dir,
        max_top_k=args.max_top_k,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        device_kind=args.device,
    )
    if args.json:
        print(json.dumps(entry.model_dump(mode="json"), ensure_ascii=False))
    else:
        print(f"{entry.alias}\t{entry.identity_revision}\t{entry.identity['served_model_id']}\t{entry.teacher_dir}")
    sys.stdout.flush()
    return 0


def _list(args: argparse.Namespace) -> int:
    import json

    from kiln_core.teachers.local_registry import list_local_teachers

    entries = list_local_teachers(args.root)
    if args.json:
        print(json.dumps([entry.model_dump(mode="json") for entry in entries], ensure_ascii=False))
        return 0
    if not entries:
        print(f"no teachers registered under {args.root}")
        return 0
    print("ALIAS\tIDENTITY_REVISION\tMAX_TOP_K\tREGISTERED_AT\tTEACHER_DIR")
    for entry in entries:
        max_top_k = entry.identity["max_top_k"]
        print(f"{entry.alias}\t{entry.identity_revision}\t{max_top_k}\t{entry.registered_at}\t{entry.teacher_dir}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch to ``register`` / ``list``; map failures to exit codes 2 and 3."""
    import sys

    action = {"register": _register, "list": _list}.get(args.teachers_command or "")
    if action is None:
        print("kiln-flows teachers: choose an action: register ALIAS DIR | list", file=sys.stderr)
        return 2

    from kiln_core.identity.hashing import IdentityHashError
    from kiln_core.teachers.local_registry import LocalRegistryError

    try:
        return action(args)
    except LocalRegistryError as error:
        print(f"kiln-flows teachers: {error}", file=sys.stderr)
        return 3 if error.code == "corrupt_registry" else 2
    except IdentityHashError as error:
        print(f"kiln-flows teachers: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"kiln-flows teachers: {error}", file=sys.stderr)
        return 3
