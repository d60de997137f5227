"""``kiln-flows eval-suites``: register the eval suites a run's ``post_eval`` gate evaluates, and list them.

    $ kiln-flows eval-suites register math-smoke.json --out ./kiln-data
    $ kiln-flows eval-suites register header.json --examples examples.jsonl --out ./kiln-data
    $ kiln-flows eval-suites list --out ./kiln-data

A suite is stored under the storage root a run writes into, at ``<root>/.eval/suites/<name>/`` (Kiln's
``eval_root`` layout, ``kiln_core.post_eval.registry``), where ``post_eval: {suite: <name>}`` finds it.
Registering validates the suite first: a broken one exits 2 naming the rule (``eval_suite_invalid``,
``eval_scorer_unsupported``, …); a name already registered exits 2 (``eval_suite_exists``) unless
``--force`` replaces it. Exit codes: 0 ok, 2 rejected input, 3 storage failure.
"""

from __future__ import annotations

import argparse

from flows.commands._options import add_json_argument, add_out_argument, add_quiet_argument

NAME = "eval-suites"
HELP = "Register the eval suites post_eval gates a run with, and list them."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``register`` and ``list`` subcommands."""
    sub = parser.add_subparsers(dest="eval_suites_command", metavar="ACTION")
    register = sub.add_parser("register", help="validate a suite file and store it under its name")
    register.add_argument("suite", metavar="SUITE.json",
                          help="the suite: one JSON document, or a header without examples (with --examples)")
    register.add_argument("--examples", metavar="EXAMPLES.jsonl", help="the suite's examples, one per line")
    register.add_argument("--force", action="store_true", help="replace a suite registered under the same name")
    add_out_argument(register, help="storage root whose runs use the suite (default ./kiln-data)")
    add_json_argument(register)
    add_quiet_argument(register)
    listing = sub.add_parser("list", help="list the registered suites")
    add_out_argument(listing, help="storage root (default ./kiln-data)")
    add_json_argument(listing)


def _register(args: argparse.Namespace) -> int:
    import json

    from kiln_core.post_eval.registry import SuiteRegistry

    registry = SuiteRegistry.for_storage_root(args.out)
    suite = registry.register(args.suite, args.examples, force=args.force)
    where = registry.suites.child(suite.name).uri
    if args.json:
        print(json.dumps({"status": "registered", "name": suite.name, "examples": len(suite.examples), "suite": where},
                         ensure_ascii=False))
    elif not args.quiet:
        from kiln_core.wording import counted

        print(f"registered eval suite {suite.name} ({counted(len(suite.examples), 'example')}) at {where}\n"
              f"  gate a run with it: post_eval: {{suite: {suite.name}, min_accuracy: …}} (storage root {args.out})")
    return 0


def _list(args: argparse.Namespace) -> int:
    import json

    from kiln_core.post_eval.registry import SuiteRegistry

    names = SuiteRegistry.for_storage_root(args.out).names()
    if args.json:
        print(json.dumps(names, ensure_ascii=False))
    elif names:
        print("\n".join(names))
    else:
        print(f"no eval suites registered under {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch to ``register`` / ``list``; rejections (exit 2) and failures (exit 3) go to the CLI's guard."""
    import sys

    action = {"register": _register, "list": _list}.get(args.eval_suites_command or "")
    if action is None:
        print("kiln-flows eval-suites: choose an action: register SUITE.json | list", file=sys.stderr)
        return 2
    return action(args)
