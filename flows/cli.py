"""The ``kiln-flows`` command line.

Exit codes follow one rule everywhere, defined once in ``kiln_core.errors`` (``EXIT_CODES``, listed by
``kiln-flows --help``): 0 success, 2 rejected input (a ``Rejection``: a contract, admission or spec
rule), 3 a run that failed, was cancelled, met an environment failure (storage, network) or found an
identical run in progress, 4 trained but held back by the gate. ``--debug`` goes before or after the
command. Every command goes through ``main``'s guard: a rejection or
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
    "flows.commands.distill",
    "flows.commands.recipe",
    "flows.commands.eval",
    "flows.commands.eval_suites",
    "flows.commands.models",
    "flows.commands.oracle",
    "flows.commands.serve",
    "flows.commands.drill",
]

from kiln_core.errors import EXIT_CODES, EXIT_FAILED, EXIT_OK, EXIT_REJECTED  # noqa: F401 - EXIT_OK re-exported

DEBUG_ENV = "KILN_FLOWS_DEBUG"
DEBUG_HELP = f"print the traceback of an unexpected error (or set {DEBUG_ENV}=1); before or after COMMAND"


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
        epilog=exit_codes_text(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kiln-flows {_version()}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
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
        # Only for this command's --help: main() takes --debug out of argv wherever it stands.
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        sub.set_defaults(_run=module.run)
    return parser


def exit_codes_text() -> str:
    """The epilog of ``kiln-flows --help``: every exit code (``kiln_core.errors.EXIT_CODES``)."""
    import textwrap

    return "exit codes:\n" + "\n".join(textwrap.fill(meaning, width=96, initial_indent=f"  {code}  ",
                                                      subsequent_indent="     ") for code, meaning in EXIT_CODES)


def split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug``, and whether it was there — before or after the command (and its
    sub-action), so that every "run with --debug" hint works as written. Arguments after ``--`` are
    left alone."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept = [value for value in argv[:end] if value != "--debug"] + argv[end:]
    return kept, len(kept) != len(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kiln-flows`` console script: run one command under the error guard."""
    from flows.console import quiet_third_party_warnings

    argv, debug_flag = split_debug(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_REJECTED
    debug = debug_flag or os.environ.get(DEBUG_ENV) == "1"
    if not debug:
        quiet_third_party_warnings()
    if getattr(args, "quiet", False):
        # --quiet: no progress bar, the libraries' too ("Loading weights"); read when they are imported, later
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        return int(run_command(args) or 0)
    except KeyboardInterrupt:
        return report_interrupt(args)
    except Exception as error:  # noqa: BLE001 - the one place that turns any error into an exit code
        return report_error(error, as_json=bool(getattr(args, "json", False)), debug=debug)


def run_command(args: argparse.Namespace) -> int | None:
    """The chosen command, with log lines and warnings kept off its progress bars' lines; the storage root it
    writes into is checked first (nothing is done for a root that cannot be written where it says)."""
    from flows.commands._options import check_written_root
    from flows.console import lines_above_bars

    check_written_root(args)
    with lines_above_bars():
        return args._run(args)


def report_interrupt(args: argparse.Namespace) -> int:
    """A second Ctrl-C stopped the command at once: say so, and how to resume when the command knows (a command
    sets ``args.resume_hint``, a function returning the command line, once it has something to resume). With
    ``--json`` stdout also gets the error object (``status`` and ``code`` ``cancelled``/``interrupted``)."""
    hint = getattr(args, "resume_hint", None)
    try:
        resume = hint() if callable(hint) else None
    except Exception:  # noqa: BLE001 - a hint is a courtesy: never a traceback on the way out
        resume = None
    print("interrupted" + (f"\n  resume with: {resume}" if resume else ""), file=sys.stderr, flush=True)
    if getattr(args, "json", False):
        message = "second Ctrl-C: stopped at once" + (f"; resume with: {resume}" if resume else "")
        print(json.dumps({"status": "cancelled", "code": "interrupted", "line": None, "field": None,
                          "message": message, "resume_command": resume}, ensure_ascii=False), flush=True)
    return EXIT_FAILED


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
