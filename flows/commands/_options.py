"""Options that mean the same thing in every command, spelled once.

* ``--out ROOT_URI`` — the storage root a command writes into (corpora, runs, oracle results, the
  teacher registry); default ``./kiln-data``. Older spellings stay as hidden aliases (``--root``,
  ``--workdir``). ``score`` and ``oracle make-request`` write one file instead, and their ``--out``
  names that file.
* ``--registry ROOT_URI`` — a storage root that is only read, for its teacher registry (``manifest``,
  ``score``); ``--root`` is its hidden alias.
* ``--json`` and ``--quiet`` — one wording and one meaning in every command (``JSON_HELP``, ``QUIET_HELP``):
  ``--quiet`` prints nothing but warnings and errors, a success included (no report on stdout), so a
  script reads the exit code; ``--json`` wins over it.
* ``PIPELINE.yaml`` or ``--spec PIPELINE.yaml`` — a pipeline spec file, either spelling, in ``run`` and
  ``serve`` alike (``add_spec_argument``).
* ``--dtype fp32|bf16`` — the dtype of a model the command loads (``--precision`` and the long
  names ``float32``/``bfloat16`` are accepted as hidden aliases).
"""

from __future__ import annotations

import argparse

DEFAULT_ROOT = "./kiln-data"
JSON_HELP = "print JSON on stdout instead of text (an error too: one object with status and code); messages go to stderr"
QUIET_HELP = ("print nothing but warnings and errors: no progress bar, info lines or report (the exit code says "
              "how it ended)")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_LONG = {long: short for short, long in DTYPES.items()}


def add_out_argument(parser, *, default: str | None = DEFAULT_ROOT, help: str | None = None,
                     aliases: tuple[str, ...] = (), writes: bool = True) -> None:
    """``--out ROOT_URI`` (dest ``out``), plus hidden ``aliases`` such as ``--root``.

    A root the command ``writes`` into is checked before the command runs (``flows.cli.run_command``,
    ``kiln_core.storage_root.check_storage_root``): a malformed URI, a missing fsspec package or bucket, a file in
    the way or a read-only directory is refused before any work, never written somewhere else."""
    text = help or f"storage root, a local path or fsspec URI (default {default})"
    parser.add_argument("--out", dest="out", default=default, metavar="ROOT_URI", help=text)
    for alias in aliases:
        parser.add_argument(alias, dest="out", metavar="ROOT_URI", help=argparse.SUPPRESS)
    if writes:
        parser.set_defaults(written_root_flag="--out")


def check_written_root(args: argparse.Namespace) -> None:
    """Refuse the storage root the command writes into (``add_out_argument``) before the command runs.

    Raises:
        StorageRejection, StorageFailure: what ``kiln_core.storage_root.check_storage_root`` refuses, naming ``--out``.
    """
    flag = getattr(args, "written_root_flag", None)
    if flag is not None and getattr(args, "out", None) is not None:
        from kiln_core.storage_root import check_storage_root

        check_storage_root(args.out, field=flag)


def add_registry_argument(parser, *, default: str = DEFAULT_ROOT) -> None:
    """``--registry ROOT_URI`` (dest ``registry``): the root whose ``teachers.json`` is read."""
    parser.add_argument("--registry", dest="registry", default=default, metavar="ROOT_URI",
                        help=f"storage root of the local teacher registry, for aliases (default {default})")
    parser.add_argument("--root", dest="registry", metavar="ROOT_URI", help=argparse.SUPPRESS)


def add_json_argument(parser) -> None:
    """``--json`` (dest ``json``), worded as in every other command."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def add_quiet_argument(parser) -> None:
    """``--quiet`` (dest ``quiet``), worded as in every other command."""
    parser.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def add_spec_argument(parser, *, required: bool) -> None:
    """A PipelineSpec file as ``PIPELINE.yaml`` or ``--spec PIPELINE.yaml`` (dest ``spec``; ``spec_file`` reads it)."""
    parser.add_argument("spec_path", metavar="PIPELINE.yaml", nargs="?",
                        help="PipelineSpec file (YAML or JSON)" + ("" if required else "; the deployment's defaults"))
    parser.add_argument("--spec", metavar="PIPELINE.yaml", help="the same, as an option")
    parser.set_defaults(_spec_required=required)


def spec_file(args: argparse.Namespace) -> str | None:
    """The spec file ``add_spec_argument`` took, given once (positional or ``--spec``).

    Raises:
        Rejection: ``invalid_option`` — given twice, or not at all where it is required (exit 2, one line).
    """
    from kiln_core.errors import Rejection

    given = [path for path in (args.spec_path, args.spec) if path is not None]
    if len(given) > 1:
        raise Rejection("invalid_option", f"give the spec file once: {given[0]} or --spec {given[1]}", field="--spec")
    if not given and args._spec_required:
        raise Rejection("invalid_option", "give a PipelineSpec file: PIPELINE.yaml or --spec PIPELINE.yaml", field="--spec")
    return given[0] if given else None


def dtype_name(value: str) -> str:
    """``fp32``/``bf16``/``fp16``, also from ``float32``/``bfloat16``/``float16``."""
    short = _LONG.get(value, value)
    if short not in DTYPES:
        raise argparse.ArgumentTypeError(f"invalid dtype {value!r} (choose from {', '.join(DTYPES)})")
    return short


def add_dtype_argument(parser, *, choices: tuple[str, ...] = ("fp32", "bf16"), default: str | None = None,
                       help: str = "model dtype", aliases: tuple[str, ...] = ()) -> None:
    """``--dtype {choices}`` (dest ``dtype``, short names), plus hidden ``aliases`` (``--precision``)."""

    def parse(value: str) -> str:
        short = dtype_name(value)
        if short not in choices:
            raise argparse.ArgumentTypeError(f"invalid dtype {value!r} (choose from {', '.join(choices)})")
        return short

    parser.add_argument("--dtype", dest="dtype", type=parse, default=default, metavar="|".join(choices), help=help)
    for alias in aliases:
        parser.add_argument(alias, dest="dtype", type=parse, help=argparse.SUPPRESS)


def require_at_least(args: argparse.Namespace, minimum: int, *dests: str) -> None:
    """Refuse each given option below ``minimum`` with one line naming the flag (``invalid_option``, exit 2),
    before the command does any work; an option left out (None) is not checked.

    Raises:
        Rejection: ``invalid_option``, ``field`` the flag (``--epochs``).

    Example:
        >>> require_at_least(argparse.Namespace(epochs=0), 1, "epochs")
        Traceback (most recent call last):
        ...
        kiln_core.errors.Rejection: [invalid_option] field --epochs: --epochs must be at least 1, got 0
    """
    from kiln_core.errors import Rejection

    for dest in dests:
        value = getattr(args, dest)
        if value is not None and value < minimum:
            flag = "--" + dest.replace("_", "-")
            raise Rejection("invalid_option", f"{flag} must be at least {minimum}, got {value}", field=flag)
