"""The ``distill_merge`` flow's teacher work as a task: ``kiln_core.recipes.distill_merge.prepare_distill_merge``.

Each source adapter's replay prompts are scored by that source's LoRA into one content-addressed corpus under
``<storage_root>/recipes/distill_merge/``; a retry of the task (or of the whole flow) with the same sources
finds that corpus and does not score again. A refused source (not found, replay log, a shared prompt, the
sampling contract, changed after admission) is a rejection and never retried.
"""

from __future__ import annotations

from prefect import task

from kiln_core.contracts.distill_merge import DistillMergeRequest
from kiln_core.contracts.pipeline import PipelineSpec
from tasks.retry import retry_unless_rejected


@task(name="merge-teachers", task_run_name="merge-teachers-{request.name}", retries=1, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_rejected)
def prepare_distill_merge_task(request: DistillMergeRequest, student: str, storage_root: str,
                               base_adapter: str | None = None, recipe: str | None = None,
                               step: int | None = None) -> PipelineSpec:
    """Admit the merge's sources and score each one's prompts with its LoRA; returns the spec that trains it.

    Example:
        ```python
        spec = prepare_distill_merge_task(request, "./student", "s3://bucket/kiln")
        ```
    """
    from kiln_core.recipes.distill_merge import prepare_distill_merge

    return prepare_distill_merge(request, student_dir=student, out_root=storage_root, base_adapter=base_adapter,
                                 recipe=recipe, step=step)
