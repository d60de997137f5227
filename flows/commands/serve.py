"""``kiln-flows serve``: serve ``opd_distill`` from this process, for the Prefect UI and schedules.

Creates (or updates) the deployment ``opd-distill/<name>`` and polls for its runs; each run executes
in a subprocess of this one, in the current directory (relative paths in the spec resolve here).
``--spec`` makes a PipelineSpec file the deployment's default parameters, so the UI's Run button
starts with it filled in; ``--cron`` adds a schedule; ``--limit`` caps concurrent runs (default 1:
one training at a time). Ctrl-C stops serving and pauses the schedule.

Schedules and the UI need a real server: ``prefect server start`` and
``PREFECT_API_URL=http://127.0.0.1:4200/api``. Without ``PREFECT_API_URL`` Prefect serves against a
temporary API of this process only (no UI, no schedules), and the command says so.

For workers and work pools (several machines, a GPU pool), use ``deployments/prefect.yaml`` instead.

Example:
    $ kiln-flows serve --spec deployments/example-pipeline.yaml --cron "0 2 * * *" --timezone Europe/Berlin
"""

from __future__ import annotations

import argparse
import sys

from flows.commands._options import add_spec_argument, spec_file

NAME = "serve"
HELP = "Serve the opd-distill flow from this process (UI runs, schedules) with a spec as defaults."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="local", help="deployment name: opd-distill/NAME (default local)")
    parser.add_argument("--cron", default=None, help='cron schedule, e.g. "0 2 * * *" (default: no schedule)')
    parser.add_argument("--timezone", default=None, help="IANA time zone of --cron (default UTC)")
    add_spec_argument(parser, required=False)  # --spec PIPELINE.yaml or PIPELINE.yaml, as `run` takes it
    parser.add_argument("--limit", type=int, default=1, help="most runs at once (default 1)")


def run(args: argparse.Namespace) -> int:
    from kiln_core.contracts.spec_file import load_spec

    if args.limit < 1:
        print("error: --limit must be at least 1", file=sys.stderr)
        return 2
    if args.timezone and not args.cron:
        print("error: --timezone applies to --cron", file=sys.stderr)
        return 2
    parameters = None
    path = spec_file(args)
    if path:
        spec = load_spec(path)  # a rejection (exit 2) goes to the CLI's guard
        # The form's view, without what its training-data choice decides (training mode, sampling): a
        # run from the form with another kind of source must not inherit the file's values for them.
        parameters = {"spec": spec.form_defaults()}

    from flows.local_api import offline_settings, start_local_api

    offline_settings()
    start_local_api()  # only without PREFECT_API_URL: a temporary API in its own session
    from prefect import serve
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron
    from prefect.settings import PREFECT_API_URL

    from flows.opd_distill import opd_distill

    # The time zone is always spelled out, so the deployment page shows it next to the schedule.
    schedules = [Cron(args.cron, timezone=args.timezone or "UTC")] if args.cron else None
    deployment = opd_distill.to_deployment(
        name=args.name,
        schedules=schedules,
        parameters=parameters,
        # Both UIs show the schedule as "At 02:00 AM", its zone only in the edit dialog: the zone as a tag is
        # on the deployment page in both.
        tags=["kiln-flows", "served"] + ([f"tz:{args.timezone or 'UTC'}"] if args.cron else []),
        # The same cap as the runner's --limit, on the deployment itself: the server enforces it (runs
        # queue) and the deployment page shows it instead of "∞".
        concurrency_limit=args.limit,
        description=_description(args.cron, args.timezone or "UTC", path),
        # The package is installed: each run imports `flows.opd_distill` in a fresh
        # `python -m prefect.engine` process. (`opd_distill.serve()` would instead ship the in-memory
        # flow to the child, where the postponed `PipelineSpec` annotation cannot be resolved.)
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    from flows.local_api import links_to_the_default_ui

    with links_to_the_default_ui() as ui:  # Prefect's own links too: the deployment's, each run's "View at"
        _print_hint(args.name, PREFECT_API_URL.value(), ui, schedules is not None)
        serve(deployment, limit=args.limit, pause_on_shutdown=True)
    return 0


def _description(cron: str | None, timezone: str, spec_file: str | None) -> str:
    """The deployment's description: what it runs, from which spec, and when (with the time zone)."""
    what = "Kiln-compatible distillation (opd-distill)" + (f", defaults from {spec_file}" if spec_file else "")
    when = f"Scheduled: cron `{cron}` in time zone {timezone}." if cron else "No schedule: runs start from the UI or the API."
    return f"{what}. {when} Run → Custom run shows the spec as a form (either Prefect UI)."


def _print_hint(name: str, api_url: str | None, ui_url: str | None, scheduled: bool) -> None:
    """What is served and where a browser finds it: the UI's address, never the API's (``…/api`` opens
    "Page not found" in a browser)."""
    from flows.local_api import ui_root

    deployment = f"opd-distill/{name}"
    if api_url:
        ui = (ui_url or ui_root(None, api_url) or "").rstrip("/")
        print(f"serving {deployment} on the Prefect server at {ui_root(ui_url, api_url)}\n"
              f"  UI: {ui}/deployments → {name} → Run → Custom run", flush=True)
        return
    print(
        f"warning: serving {deployment} on a temporary local API (PREFECT_API_URL is not set): no UI"
        + (", and the schedule will not fire" if scheduled else "") + ".\n"
        "  Run `prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api first.",
        file=sys.stderr,
        flush=True,
    )
