"""A recipe step's teacher work, ``prepare``: ``kiln_core.recipes.recipe_plan.prepare_step`` as a task.

It checks the step again (Kiln's submit rules), then runs its recipe's ``prepare_*``: the checks that need files
(the teacher, the corpus, source adapters), the teacher scoring a distill recipe does, and the ``PipelineSpec``
that the step's subflow hands to ``run_pipeline``. A refused input is never retried; a storage failure is.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from kiln_core.contracts.pipeline import PipelineSpec
from tasks.retry import retry_unless_rejected


@task(name="prepare", task_run_name="prepare-{step[name]}", retries=2, retry_delay_seconds=[2, 10],
      retry_condition_fn=retry_unless_rejected)
def prepare_step_task(step: dict[str, Any], recipe: str, student_dir: str, storage_root: str,
                      recipe_file: str | None = None) -> PipelineSpec:
    """The spec that trains one planned recipe step (``PlannedStep`` fields as a mapping).

    Example:
        ```python
        spec = prepare_step_task(dataclasses.asdict(plan.steps[0]), plan.name, "./student", "./kiln-data")
        ```
    """
    from kiln_core.recipes.recipe_plan import PlannedStep, prepare_step

    return prepare_step(PlannedStep(**step), recipe=recipe, student_dir=student_dir, storage_root=storage_root,
                        recipe_file=recipe_file)
