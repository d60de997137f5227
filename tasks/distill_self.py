"""The teacher work of ``distill self`` as a Prefect task: a thin wrapper over ``prepare_distill_self``.

The task checks what needs files (the ``post_eval`` suite, student, registered teacher), aligns the prompts, scores the
privileged sequences with the teacher and returns the ``PipelineSpec`` that trains the corpus. The corpus is
content-addressed under ``<storage_root>/recipes/distill_self/``, so a retried task (or a retried flow run)
finds it and does not run the teacher again. A rejection is never retried.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_core.contracts.distill_self import DistillSelfRequest
from kiln_core.contracts.pipeline import PipelineSpec
from tasks.retry import retry_unless_rejected


# No result cache: the corpus on storage is the cache (the spec is rebuilt in milliseconds around it).
@task(name="self-teacher", task_run_name="self-teacher-{request.name}", cache_policy=NO_CACHE, persist_result=False,
      retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_rejected)
def prepare_distill_self_task(request: DistillSelfRequest, student: str, storage_root: str, teacher: str | None = None,
                              base_adapter: str | None = None, recipe: str | None = None,
                              step: int | None = None) -> PipelineSpec:
    """Score the request's prompts with the privileged teacher and return the spec that trains them.

    Example:
        ```python
        spec = prepare_distill_self_task(request, "./student", "./kiln-data")
        ```
    """
    from kiln_core.post_eval import SuiteRegistry, validate_post_eval_config
    from kiln_core.recipes.distill_self import prepare_distill_self
    from kiln_core.wording import counted

    if request.post_eval is not None:  # its suite is installed: before the teacher runs (the engine checks it again)
        validate_post_eval_config(request.post_eval, SuiteRegistry.for_storage_root(storage_root))
    # print, not get_run_logger: the flow logs prints (log_prints), and the plain function runs without a run
    print(f"distill self ({request.mode}): {counted(len(request.prompts), 'prompt')}, teacher "
          f"{teacher or f'the bare base model {student}'}")
    spec = prepare_distill_self(request, student_dir=student, out_root=storage_root, base_adapter=base_adapter,
                                recipe=recipe, step=step, teacher=teacher)
    print(f"teacher corpus: {spec.corpus}")
    return spec
