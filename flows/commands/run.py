"""``kiln-flows run PIPELINE.yaml``: run ``opd_distill`` for one pipeline spec in this process.

The spec is validated before anything is imported from Prefect or torch; an invalid one exits 2 with
the offending field named. The flow runs in-process against ``PREFECT_API_URL`` when it is set (the
run then shows in that server's UI), otherwise against a temporary local API that is started for the
duration of the command in a session of its own (``flows.local_api``), with Prefect's analytics and
telemetry off.

Exit codes: 0 success; 2 rejected (invalid spec, config, ``post_eval``, teacher, corpus or student:
nothing was trained); 3 the run failed or was cancelled; 4 trained, but the spec's gate (``post_eval``
or ``quality_gate``) held the adapter back — ``latest.json`` did not move (``kiln-flows train``'s rule). Ctrl-C stops training at the next step boundary after
a checkpoint (the receipt says ``cancelled``, exit 3); a second Ctrl-C stops at once. With ``--json``
the last stdout line is one JSON object: the run summary, or ``{"status": "rejected"|"failed"|
"cancelled", "code", ...}``.

Example:
    $ kiln-flows run deployments/example-pipeline.yaml --json
"""

from __future__ import annotations

import argparse

from flows.commands._options import add_json_argument, add_quiet_argument, add_spec_argument, spec_file
import json
import os
import shlex
import sys

NAME = "run"
HELP = "Run the distillation pipeline described by a PipelineSpec YAML file, in this process."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_argument(parser, required=True)  # PIPELINE.yaml or --spec PIPELINE.yaml, as `serve` takes it
    add_json_argument(parser)
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Validate the spec, run the flow, and map its end state to an exit code."""
    from kiln_core.contracts.spec_file import load_spec
    from kiln_core.errors import EXIT_FAILED, EXIT_HELD_BACK, EXIT_OK

    spec = load_spec(spec_file(args))  # a rejection (exit 2) goes to the CLI's guard, before Prefect loads
    # A pipeline run resumes from its newest checkpoint by itself: the same command is the resume command.
    args.resume_hint = lambda: shlex.join(["kiln-flows", "run", spec_file(args)])

    from flows.local_api import hide_rejection_tracebacks, offline_settings, start_local_api

    offline_settings()
    hide_rejection_tracebacks()
    if args.quiet:
        os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
    elif not args.json:
        os.environ.setdefault("KILN_FLOWS_PROGRESS", "1")  # a training progress bar on stderr
    start_local_api()
    from flows.local_api import links_to_the_default_ui
    from flows.opd_distill import opd_distill

    with links_to_the_default_ui():  # Prefect's "View at …" line opens the UI the server's root opens
        state = opd_distill(spec, return_state=True)
    if state.is_completed():
        summary = state.result()
        gate = summary.get("gate") or {}
        held_back = gate.get("outcome") not in (None, "promoted", "kept")
        return _emit(args, EXIT_HELD_BACK if held_back else EXIT_OK, summary, _report(spec.adapter, summary), ok=True)
    if state.is_cancelled():
        record = {"status": "cancelled", "code": "cancelled", "line": None, "field": None, "message": state.message}
        return _emit(args, EXIT_FAILED, record, f"cancelled: {state.message}")
    # The flow's own exception, re-raised from its Failed state: a Rejection exits 2, anything else 3.
    state.result(raise_on_failure=True)
    message = state.message or state.type.value
    record = {"status": "failed", "code": "run_failed", "line": None, "field": None, "message": message}
    return _emit(args, EXIT_FAILED, record, f"failed: {message}")


def _emit(args: argparse.Namespace, code: int, record: dict, human: str, ok: bool = False) -> int:
    if args.json:
        print(json.dumps(record, ensure_ascii=False, default=str), flush=True)
    elif not args.quiet or code != 0:
        print(human, file=sys.stdout if code == 0 or ok else sys.stderr, flush=True)
    return code


def _report(adapter: str, summary: dict) -> str:
    lines = [f"trained {adapter} ({summary.get('status')})"]
    if summary.get("final_loss") is not None:
        steps = len(summary.get("loss_history") or [])
        lines[0] += f": final loss {summary['final_loss']:.6g} after {steps} steps"
    for label, key in (("adapter", "adapter"), ("receipt", "receipt"), ("latest.json", "latest"), ("run", "run")):
        if summary.get(key):
            lines.append(f"  {label:<12} {summary[key]}")
    for checkpoint in summary.get("checkpoints") or []:
        lines.append(f"  {'checkpoint':<12} {checkpoint}")
    if summary.get("gate"):
        from kiln_core.engine.gate import describe_gate

        lines += describe_gate(summary["gate"])
    return "\n".join(lines)
