"""``kiln-flows drill``: provoke the failures kiln-flows promises to survive, and count the outcome.

    $ kiln-flows drill all --json
    $ kiln-flows drill sigkill --trials 40 --workdir ./drills
    $ kiln-flows drill fuzz-admission --examples 50000 --seed 7

Drills (``drills``): ``sigkill`` (kill training at random points, resume byte-identically),
``s3-outage`` (freeze the S3 server mid-publication: nothing committed is partial, a retry
completes), ``concurrent-materialize`` (two admissions of the same bytes at once: one
materialization), ``corrupt-checkpoint`` (a damaged checkpoint is refused naming the file; no silent
fallback), ``fuzz-admission`` and ``fuzz-oracle`` (mutated corpora / oracle requests: one verdict each,
never another exception).

With ``--json`` stdout holds one JSON object per drill (``drill``, ``passed``, ``trials``,
``passes``, ``failures``, ``crashes``, ``seconds`` and the drill's own figures). Exit codes: 0 every
drill passed, 3 at least one did not.
"""

from __future__ import annotations

import argparse

from flows.commands._options import add_json_argument

NAME = "drill"
HELP = "Run fault drills (SIGKILL, S3 outage, concurrent materialization, corrupt checkpoint, fuzzing)."

DRILL_CHOICES = ("sigkill", "s3-outage", "concurrent-materialize", "corrupt-checkpoint", "fuzz-admission", "fuzz-oracle")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drill", nargs="?", default="all", choices=(*DRILL_CHOICES, "all"),
                        help="which drill to run (default: all)")
    parser.add_argument("--trials", type=int, metavar="N",
                        help="trials per drill (defaults: sigkill 20, s3-outage 8, concurrent-materialize 12, "
                             "corrupt-checkpoint 9)")
    parser.add_argument("--examples", type=int, metavar="N", help="cases for the fuzz drills (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every drill's RNG (default 0)")
    parser.add_argument("--workdir", metavar="DIR",
                        help="keep inputs, runs and logs under DIR/<drill> (default: a temporary directory, removed)")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import sys
    import warnings

    for name, value in {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", category=FutureWarning)

    from drills import DRILLS, run_drill

    names = list(DRILL_CHOICES) if args.drill == "all" else [args.drill]
    if args.trials is not None and args.trials < 1 or args.examples is not None and args.examples < 1:
        print("--trials and --examples must be at least 1", file=sys.stderr)
        return 2
    reports = []
    for name in names:
        defaults = DRILLS[name][1]
        kwargs = {"seed": args.seed}
        if "examples" in defaults:
            kwargs["examples"] = args.examples if args.examples is not None else defaults["examples"]
        else:
            kwargs["trials"] = args.trials if args.trials is not None else defaults["trials"]
        size = ", ".join(f"{k} {v}" for k, v in kwargs.items() if k != "seed")
        print(f"drill {name}: {size} ...", file=sys.stderr, flush=True)
        report = run_drill(name, workdir=args.workdir, **kwargs)
        reports.append(report)
        if args.json:
            print(json.dumps(report, ensure_ascii=False), flush=True)
        else:
            print(_summary(report), flush=True)
    return 0 if all(report["passed"] for report in reports) else 3


def _summary(report: dict) -> str:
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [f"{report['drill']}: {verdict} — trials {report['trials']}, passes {report['passes']}, "
             f"failures {report['failures']}, crashes {report['crashes']} ({report['seconds']} s)"]
    skip = {"drill", "passed", "trials", "passes", "failures", "crashes", "seconds", "failure_details"}
    for key, value in report.items():
        if key not in skip:
            lines.append(f"  {key}: {value}")
    for detail in report.get("failure_details", []):
        lines.append(f"  ! {detail}")
    return "\n".join(lines)
