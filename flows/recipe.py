"""``run_recipe``: a Kiln recipe file (``{name, description?, steps[]}``) as one Prefect flow, steps in order.

The whole recipe is checked before its first step runs (``kiln_core.recipes.recipe_plan.plan_recipe``: step kinds,
names, each ``post_eval`` against the step before it, every step's own submit rules, cycles of names); a refused
recipe fails the run with one line naming the field (``rejected (<code>) steps[2].adapter: …``), nothing trained.

Then each training step is a subflow, ``recipe_step``, whose run is named after the step (``1-opd-polished``):
a ``prepare`` task (the step's recipe: its checks that need files and its teacher work), then
``run_pipeline(spec, PrefectStages(spec))`` (the same stages, gate and publication as ``opd_distill``), and an
artifact ``recipe-<recipe>-<step>`` with the adapter, the receipt and the gate's outcome. A ``post_eval`` step is
the gate of the step before it (``post_eval {suite, min_accuracy: require_min_score}``).

Fail-fast, unlike Kiln (which queues every step and never stops later ones): a step that fails, or whose gate
holds its adapter back, stops the recipe; the remaining steps do not run, and the flow run fails with one line
naming the step and why. A retried run (the UI's Retry, the same recipe and student again) resumes at the first
unfinished step: finished steps are kept in ``<root>/recipes/runs/<recipe>/<digest>.json``
(``kiln_core.recipes.recipe_run``) and skipped while their adapter's ``latest.json`` still points at the run.
"""


import dataclasses
from typing import Any

from prefect import flow

from flows.opd_distill import cancelled_line, failed_run, storage_credentials
from flows.run_log import cancel_run, quiet_run_logs, reject_run, tag_run
from kiln_core.errors import Rejection


def recipe_run_name() -> str:
    """The flow run's name: the one it was created with when it came from a deployment, else ``recipe-<name>``."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return "recipe-run"
    if context.flow_run.deployment_id and context.flow_run.name:
        return context.flow_run.name
    recipe = (context.parameters or {}).get("recipe")
    name = recipe.get("name") if isinstance(recipe, dict) else None
    return f"recipe-{name if isinstance(name, str) and name else 'run'}"


# validate_parameters=False: the recipe is checked by plan_recipe, so a bad one fails the run with one line
# naming the field rather than with Prefect's parameter-validation traceback.
@flow(name="run-recipe", flow_run_name=recipe_run_name, log_prints=True, validate_parameters=False)
def run_recipe(recipe: dict[str, Any], student: str, storage_root: str = "./kiln-data",
               recipe_file: str | None = None) -> dict[str, Any]:
    """Run a Kiln recipe: every training step in order, each gated by the post_eval step after it; stop at the first
    step that fails or is held back.

    Args:
        recipe: The recipe document (Kiln's recipe YAML, as a mapping): name, description, steps.
        student: Student model directory (or fsspec URI) every step trains.
        storage_root: Where corpora, runs, adapters, receipts and the recipe's run record are kept.
        recipe_file: The file the recipe came from: relative paths in its steps are taken relative to it.

    Returns:
        ``{"recipe", "record", "steps": [{"index", "kind", "name", "skipped", "summary"}]}``: each step's run summary.
    """
    from prefect import get_run_logger
    from prefect.states import Failed

    from kiln_core.post_eval.registry import SuiteRegistry
    from kiln_core.recipes.recipe_plan import check_step_inputs, plan_recipe
    from kiln_core.recipes.recipe_run import (
        RecipeHeldBack,
        RecipeStepFailed,
        finished_run,
        read_run_record,
        recipe_digest,
        record_location,
        step_record,
        write_run_record,
    )

    quiet_run_logs()
    name = recipe.get("name") if isinstance(recipe, dict) else None
    if isinstance(name, str) and name:
        tag_run(f"recipe:{name}")
    try:
        plan = plan_recipe(recipe, file=recipe_file, suites=SuiteRegistry.for_storage_root(storage_root))
        check_step_inputs(plan, recipe_file)
    except Rejection as error:
        return reject_run(error, name if isinstance(name, str) else None)
    logger = get_run_logger()
    digest = recipe_digest(recipe, student)
    record = read_run_record(storage_root, plan.name, digest, student)
    done: list[dict[str, Any]] = []
    for step in plan.steps:
        earlier = finished_run(record, step.index, step.name, storage_root)
        if earlier is not None:
            logger.info("%s: finished in an earlier attempt (run %s); skipped", step.label, earlier.run)
            done.append({"index": step.index, "kind": step.kind, "name": step.name, "skipped": True,
                         "summary": {"run": earlier.run, "receipt": earlier.receipt,
                                     "gate": {"outcome": earlier.gate_outcome} if earlier.gate_outcome else None}})
            continue
        subflow = recipe_step.with_options(flow_run_name=f"{step.index}-{step.kind}-{step.name}")
        state = subflow(step=dataclasses.asdict(step), recipe=plan.name, student=student, storage_root=storage_root,
                        recipe_file=recipe_file, return_state=True)
        remaining = [later.name for later in plan.steps if later.index > step.index]
        not_run = f"; not run: {', '.join(remaining)}" if remaining else ""
        if not state.is_completed():
            why = state.message or state.type.value
            error = RecipeStepFailed("recipe_step_failed", f"recipe {plan.name} stopped at {step.label}: {why}{not_run}",
                                     field=f"steps[{step.index}]", file=recipe_file)
            return Failed(message=error.message, data=error)
        summary = state.result()
        gate = summary.get("gate") or {}
        if gate.get("outcome") not in (None, "promoted", "kept"):
            verdict = gate.get("verdict") or gate.get("outcome")
            error = RecipeHeldBack("recipe_gate_held_back", f"recipe {plan.name} stopped at {step.label}: its post_eval "
                                   f"gate (steps[{step.gate_step}]) held the adapter back ({gate.get('outcome')}): "
                                   f"{verdict}{not_run}", field=f"steps[{step.gate_step}]", file=recipe_file)
            return Failed(message=error.message, data=error)
        record = record.with_step(step_record(step.index, step.name, summary))
        write_run_record(storage_root, record)
        done.append({"index": step.index, "kind": step.kind, "name": step.name, "skipped": False, "summary": summary})
    logger.info("recipe %s: %d steps finished (%d from earlier attempts)", plan.name, len(done),
                sum(1 for step in done if step["skipped"]))
    return {"recipe": plan.name, "record": record_location(storage_root, plan.name, digest).uri, "steps": done}


@flow(name="recipe-step", log_prints=True, validate_parameters=False)
def recipe_step(step: dict[str, Any], recipe: str, student: str, storage_root: str,
                recipe_file: str | None = None) -> dict[str, Any]:
    """One training step of a recipe: its teacher work (``prepare``), then the pipeline (admit, train, gate, publish).

    Args:
        step: The planned step (``kiln_core.recipes.recipe_plan.PlannedStep`` fields).
        recipe: The recipe's name (recorded in the receipt).
        student, storage_root, recipe_file: As ``run_recipe``'s.

    Returns:
        The run summary (``PipelineResult.summary()``).
    """
    from prefect import get_run_logger

    from kiln_core.engine import run_pipeline
    from tasks.recipe import prepare_step_task
    from tasks.stages import PrefectStages

    quiet_run_logs()
    adapter = step.get("name")
    tag_run(f"adapter:{adapter}", f"recipe:{recipe}")
    try:
        spec = prepare_step_task(step, recipe, student, storage_root, recipe_file)
        with storage_credentials(spec.options.storage_block):
            with PrefectStages(spec) as stages:
                result = run_pipeline(spec, stages)
    except Rejection as error:
        return reject_run(error, adapter)
    summary = result.summary()
    _step_artifact(step, recipe, summary)
    get_run_logger().info("steps[%s] %s: %s; adapter %s; receipt %s; gate %s", step.get("index"), adapter,
                          result.status, result.adapter, result.receipt, (summary.get("gate") or {}).get("outcome"))
    if result.status == "cancelled":
        return cancel_run(cancelled_line(result))
    if result.status != "success":
        return failed_run(result, adapter)
    return summary


def _step_artifact(step: dict[str, Any], recipe: str, summary: dict[str, Any]) -> None:
    """``recipe-<recipe>-<step>``: the step's adapter, receipt and gate outcome, as the UI shows it."""
    import logging

    try:
        from prefect.artifacts import create_markdown_artifact

        from tasks.artifacts import artifact_key

        gate = summary.get("gate") or {}
        outcome = gate.get("outcome") or "no gate"
        rows = [("step", f"steps[{step.get('index')}] {step.get('kind')}"), ("adapter", summary.get("adapter")),
                ("published", summary.get("latest") or "no (latest.json not moved)"),
                ("receipt", summary.get("receipt")), ("base adapter", step.get("base_adapter") or "none"),
                ("gate", outcome if not gate.get("verdict") else f"{outcome}: {gate['verdict']}")]
        table = "\n".join(f"| {label} | `{value}` |" for label, value in rows)
        create_markdown_artifact(key=artifact_key("recipe", recipe, str(step.get("name"))),
                                 markdown=f"### Recipe {recipe}: {step.get('name')}\n\n| | |\n|---|---|\n{table}\n",
                                 description=f"{recipe} steps[{step.get('index')}] {step.get('name')}: {outcome}")
    except Exception as failure:  # noqa: BLE001 - the artifact is a courtesy; the run summary carries the facts
        logging.getLogger("kiln_flows").debug("could not write the recipe step artifact: %s", failure)
