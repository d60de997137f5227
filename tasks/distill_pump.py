"""The pump's teacher work as a task: ``kiln_core.recipes.distill_pump.prepare_distill_pump``.

It pins the registered teacher (its files hashed again), writes the examples or the prompt file (and, for
a vLLM teacher, scores the examples through the server) and returns the ``PipelineSpec`` the flow then
runs through ``run_pipeline``. Everything it writes is content-addressed, so a retry reuses it: no
Prefect cache is needed, and a rejected input is never retried.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_core.contracts.distill_pump import DistillPumpRequest
from kiln_core.contracts.pipeline import PipelineSpec
from tasks.retry import retry_unless_rejected


@task(name="distill-pump-prepare", task_run_name="distill-pump-prepare-{request.name}", cache_policy=NO_CACHE,
      retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_rejected)
def prepare_distill_pump_task(request: DistillPumpRequest, student_dir: str, out_root: str,
                              prompt_bank: str | None = None, base_adapter: str | None = None,
                              recipe: str | None = None, step: int | None = None,
                              vllm_teacher: str | None = None) -> PipelineSpec:
    """Pin the teacher, write the pump's training data and build its spec (warnings go to the run's log).

    Example:
        ```python
        spec = prepare_distill_pump_task(request, "./student", "./kiln-data", prompt_bank="math.jsonl")
        ```
    """
    from prefect import get_run_logger

    from kiln_core.recipes.distill_pump import prepare_distill_pump

    logger = get_run_logger()
    return prepare_distill_pump(request, student_dir=student_dir, out_root=out_root, prompt_bank=prompt_bank,
                                base_adapter=base_adapter, recipe=recipe, step=step, vllm_teacher=vllm_teacher,
                                on_warning=logger.warning)
