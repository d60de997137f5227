"""One module per ``kiln-flows`` subcommand.

Each module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``. Only
``argparse`` is imported at module level; everything heavy is imported inside ``run``.
"""
