"""The ``kiln-flows`` command line.

Exit codes follow one rule everywhere: 0 success, 2 rejected input (a contract or admission rule),
3 a run that failed or was cancelled.

Example:
    $ kiln-flows admit corpus.jsonl --student ./student --json
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `--help` lists them. Each is imported only to add its parser.
COMMAND_MODULES = [
    "flows.commands.demo",
    "flows.commands.run",
    "flows.commands.admit",
    "flows.commands.manifest",
    "flows.commands.teachers",
    "flows.commands.score",
    "flows.commands.train",
    "flows.commands.eval",
    "flows.commands.models",
    "flows.commands.oracle",
    "flows.commands.serve",
    "flows.commands.drill",
]

EXIT_OK = 0
EXIT_REJECTED = 2
EXIT_FAILED = 3


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with one subparser per available command module."""
    parser = argparse.ArgumentParser(
        prog="kiln-flows",
        description="Kiln-compatible offline distillation pipelines for Prefect 3.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue  # command not shipped in this build
            raise
        sub = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kiln-flows`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_REJECTED
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
