"""``kiln-flows recipe run|list``: Kiln recipe files as one Prefect flow run, in this process.

    $ kiln-flows recipe run my-recipe.yaml --student ./student --out ./kiln-data
    $ kiln-flows recipe run distill-and-gate --student ./student --out ./kiln-data --json
    $ kiln-flows recipe list [--all] [--json]

``run`` checks the whole recipe before Prefect or torch is imported (every rule of
``kiln_core.recipes.recipe_plan``: exit 2 naming ``steps[i].<field>``, nothing trained), then runs the
``run_recipe`` flow like ``kiln-flows run``: against ``PREFECT_API_URL`` when set, otherwise a temporary local API.
FILE is a recipe file, or the name of a bundled recipe (whose relative paths are then taken relative to the working
directory; a file's are taken relative to the file). Steps run in order and stop at the first that fails or is held
back. Exit codes: 0 every step finished; 2 rejected before any step ran; 3 a step failed (the remaining steps were
not run); 4 a step's post_eval gate held its adapter back (the remaining steps were not run). With ``--json`` the
last stdout line is one JSON object: the recipe summary, or ``{"status": "rejected"|"failed"|"held_back", "code",
"field", "message"}``.

``list`` shows the bundled recipes that can run, and with ``--all`` also Kiln's built-in recipes, each marked not
runnable with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from flows.commands._options import add_json_argument, add_out_argument, add_quiet_argument

NAME = "recipe"
HELP = "Run a Kiln recipe file (steps in order, each gated, fail-fast) or list the recipes that can run."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` and ``list`` subcommands."""
    sub = parser.add_subparsers(dest="recipe_action", metavar="ACTION")
    run_parser = sub.add_parser("run", help="run a recipe file (or a bundled recipe by name) as one flow run",
                                description="Run a recipe's steps in order; stop at the first that fails or is held "
                                "back. Exit 0 done, 2 rejected before any step, 3 a step failed, 4 a gate held an "
                                "adapter back.")
    run_parser.add_argument("recipe", metavar="FILE", help="recipe YAML file, or the name of a bundled recipe")
    run_parser.add_argument("--student", required=True, metavar="DIR", help="student model directory every step trains")
    add_out_argument(run_parser)
    add_json_argument(run_parser)
    add_quiet_argument(run_parser)
    list_parser = sub.add_parser("list", help="the bundled recipes that can run (--all: Kiln's built-ins too)")
    list_parser.add_argument("--all", action="store_true", help="also list Kiln's built-in recipes, with why each "
                             "cannot run here")
    add_json_argument(list_parser)


def run(args: argparse.Namespace) -> int:
    """Dispatch to ``run`` or ``list``; without an action, say which exist (exit 2)."""
    if args.recipe_action == "run":
        return run_recipe_command(args)
    if args.recipe_action == "list":
        return list_recipes(args)
    print("kiln-flows recipe: choose an action: run | list", file=sys.stderr)
    return 2


def resolve_recipe_argument(value: str) -> tuple[str, str | None]:
    """The file to read and the ``recipe_file`` that anchors its relative paths: a file anchors at itself, a
    bundled recipe (given by name) at the working directory (``None``).

    Example:
        >>> resolve_recipe_argument("distill-and-gate")[1] is None
        True
    """
    from kiln_core.recipes.catalog import bundled_recipe_path

    if os.path.exists(value) or "://" in value:
        return value, value if "://" in value else os.path.abspath(value)
    bundled = bundled_recipe_path(value)
    if bundled is not None:
        return str(bundled), None
    return value, os.path.abspath(value)  # unreadable: load_recipe names it


def run_recipe_command(args: argparse.Namespace) -> int:
    """Check the recipe, run the flow, and map its end state to an exit code."""
    from kiln_core.contracts.pipeline import SpecError
    from kiln_core.contracts.recipe import recipe_value
    from kiln_core.errors import EXIT_OK
    from kiln_core.post_eval.registry import SuiteRegistry
    from kiln_core.recipes.recipe_plan import check_step_inputs, plan_recipe

    path, recipe_file = resolve_recipe_argument(args.recipe)
    document = recipe_value(path)  # rejections (exit 2) go to the CLI's guard, before Prefect loads
    plan = plan_recipe(document, file=recipe_file or path, suites=SuiteRegistry.for_storage_root(args.out))
    check_step_inputs(plan, recipe_file)
    if "://" not in args.student and not os.path.isdir(args.student):
        raise SpecError(f"--student {args.student} is not a directory", "student", code="invalid_student")

    from flows.local_api import hide_rejection_tracebacks, offline_settings, start_local_api

    offline_settings()
    hide_rejection_tracebacks()
    if args.quiet:
        os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
    elif not args.json:
        os.environ.setdefault("KILN_FLOWS_PROGRESS", "1")
    start_local_api()
    from flows.recipe import run_recipe

    state = run_recipe(document, os.path.abspath(args.student) if "://" not in args.student else args.student,
                       args.out, recipe_file=recipe_file, return_state=True)
    if state.is_completed():
        summary = state.result()
        if args.json:
            print(json.dumps(summary, ensure_ascii=False, default=str), flush=True)
        elif not args.quiet:
            print(_report(plan.name, summary), flush=True)
        return EXIT_OK
    # The flow's error, re-raised from its Failed state: a rejection exits 2, a failed step 3, a held-back one 4.
    state.result(raise_on_failure=True)
    from kiln_core.recipes.recipe_run import RecipeStepFailed

    raise RecipeStepFailed("recipe_step_failed", state.message or state.type.value)


def _report(name: str, summary: dict) -> str:
    lines = [f"recipe {name}: {len(summary['steps'])} steps finished"]
    for step in summary["steps"]:
        result = step["summary"]
        how = "finished earlier, skipped" if step["skipped"] else (result.get("gate") or {}).get("outcome") or "published"
        lines.append(f"  steps[{step['index']}] {step['kind']:<13} {step['name']:<24} {how}")
        lines.append(f"      receipt {result.get('receipt')}")
    lines.append(f"  record {summary['record']}")
    return "\n".join(lines)


def list_recipes(args: argparse.Namespace) -> int:
    """Print the bundled recipes (and with ``--all`` Kiln's built-ins): name, steps, runnable or why not."""
    from kiln_core.recipes.catalog import bundled_recipes, kiln_builtin_recipes

    entries = bundled_recipes() + (kiln_builtin_recipes() if args.all else [])
    if args.json:
        print(json.dumps([entry.to_json() for entry in entries], ensure_ascii=False), flush=True)
        return 0
    for entry in entries:
        status = "runnable" if entry.runnable else "not runnable"
        print(f"{entry.name}  [{entry.source}, {status}]")
        print(f"  steps: {'; '.join(entry.steps)}")
        print(f"  {entry.description if entry.runnable else 'why not: ' + (entry.reason or '')}")
    return 0
