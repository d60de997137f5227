"""The ``kiln-flows`` command line.

Exit codes follow one rule everywhere (``kiln_core.errors``): 0 success, 2 rejected input (a
``Rejection``: a contract, admission or spec rule), 3 a run that failed, was cancelled, or met an
environment failure (storage, network). Every command goes through ``main``'s guard: a rejection or
failure prints one line (``--json``: one JSON object with ``status`` and ``code``), and anything
unexpected exits 3 with one line too — the traceback only with ``--debug`` or ``KILN_FLOWS_DEBUG=1``.

Example:
    $ kiln-flows admit corpus.jsonl --student ./student --json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
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


DEBUG_ENV = "KILN_FLOWS_DEBUG"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kiln-flows")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with one subparser per available command module."""
    parser = argparse.ArgumentParser(
        prog="kiln-flows",
        description="Kiln-compatible offline distillation pipelines for Prefect 3.",
    )
    parser.add_argument("--version", action="version", version=f"kiln-flows {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of an unexpected error (or set {DEBUG_ENV}=1)")
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
    """Entry point of the ``kiln-flows`` console script: run one command under the error guard."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_REJECTED
    debug = args.debug or os.environ.get(DEBUG_ENV) == "1"
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except Exception as error:  # noqa: BLE001 - the one place that turns any error into an exit code
        return report_error(error, as_json=bool(getattr(args, "json", False)), debug=debug)


def report_error(error: BaseException, *, as_json: bool, debug: bool = False) -> int:
    """Print ``error`` as one line (or one JSON object on stdout) and return its exit code.

    ``Rejection`` → 2, ``EnvironmentFailure`` → 3 (storage and network errors of fsspec/botocore are
    classified as environment failures first); anything else is unexpected → 3, traceback with debug.
    """
    from kiln_core.errors import KilnFlowsError
    from kiln_core.storage import as_environment_failure

    known = error if isinstance(error, KilnFlowsError) else as_environment_failure(error)
    if known is None:
        if debug:
            import traceback

            traceback.print_exception(error)
        message = f"{type(error).__name__}: {error}".strip()
        hint = "" if debug else f" (run with --debug or {DEBUG_ENV}=1 for the traceback)"
        payload = {"status": "failed", "code": "unexpected_error", "line": None, "field": None, "message": message}
        if as_json:
            print(json.dumps(payload, ensure_ascii=False), flush=True)
        else:
            print(f"failed [unexpected_error]: {message}{hint}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    if debug and known is not error:
        import traceback

        traceback.print_exception(error)
    if as_json:
        print(json.dumps(known.to_json(), ensure_ascii=False, default=str), flush=True)
    else:
        print(f"{type(known).status}: {known.describe()}", file=sys.stderr, flush=True)
    return known.exit_code


if __name__ == "__main__":
    sys.exit(main())
