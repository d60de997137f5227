"""``distill_self``: Kiln's ``/v1/distill/self`` as a Prefect flow, through the same engine as ``opd_distill``.

The flow takes Kiln's ``DistillSelfRequest`` as its ``request`` parameter (a JSON object), checks it with
Kiln's submit rules inside the run (a bad one fails the run at once with one line naming the field, never
retried), scores the privileged sequences in the ``self-teacher`` task (``tasks/distill_self.py``), then
trains with ``run_pipeline(spec, PrefectStages(spec))`` exactly as ``opd_distill`` does: admission,
materialization, training with checkpoints, the ``post_eval`` gate, publication, each a task. The receipt's
``recipe`` block and Kiln's ``receipt.json`` beside the adapter name the recipe, mode and teacher.
"""

from typing import Optional

from prefect import flow

from flows.opd_distill import finish_run, storage_credentials
from flows.run_log import quiet_run_logs, reject_run, request_adapter, request_run_name, tag_run
from kiln_core.errors import Rejection


run_name = request_run_name("distill-self")


# validate_parameters=False: the request is checked by Kiln's rules inside the run (one line naming the
# field), not by Prefect's parameter validation before it.
@flow(name="distill-self", flow_run_name=run_name, log_prints=True, validate_parameters=False)
def distill_self(request: dict, student: str, storage_root: str = "./kiln-data", teacher: Optional[str] = None,
                 base_adapter: Optional[str] = None) -> dict:
    """Self-distill with privileged information: the base model, shown what the student is not, teaches it.

    Args:
        request: Kiln's DistillSelfRequest: name, mode (ground_truth_conditioning, conciseness, document_as_pi), prompts with their assistant actions, ground_truth or documents, config, post_eval.
        student: Student model directory; its bare base model is the teacher unless `teacher` is set.
        storage_root: Where the teacher corpus, runs, adapters and receipts are published (path or fsspec URI).
        teacher: A local teacher alias registered under storage_root (it may wear a LoRA) instead of the base model.
        base_adapter: A published adapter the student warm-starts from (config.base_adapter).

    Returns:
        The run summary (``PipelineResult.summary()``): adapter, receipt and ``latest.json`` URIs, final loss.
    """
    from prefect import get_run_logger

    from kiln_core.contracts.distill_self import check_distill_self_request, request_warnings
    from kiln_core.engine import run_pipeline
    from tasks.distill_self import prepare_distill_self_task
    from tasks.stages import PrefectStages

    quiet_run_logs()
    name = request_adapter(request)
    if name:
        tag_run(f"adapter:{name}", "recipe:distill_self")
    logger = get_run_logger()
    try:
        checked = check_distill_self_request(request)
        for warning in request_warnings(checked):
            logger.warning(warning)
        spec = prepare_distill_self_task(checked, student, storage_root, teacher=teacher, base_adapter=base_adapter)
        with storage_credentials(spec.options.storage_block):
            with PrefectStages(spec) as stages:
                result = run_pipeline(spec, stages)
    except Rejection as error:
        return reject_run(error, name)
    return finish_run(result, f"distill self {spec.adapter} ({spec.recipe.mode})", adapter=spec.adapter)
