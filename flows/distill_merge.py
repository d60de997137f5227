"""``distill_merge``: Kiln's ``/v1/adapters/distill_merge`` as a flow — several LoRAs, one student.

Run it from the UI's Run button or a schedule (deployments/prefect.yaml, ``distill-merge``), or as a step of
a recipe. The request is Kiln's ``DistillMergeRequest`` as a dict; it is checked inside the flow with Kiln's
submit-time rules, so a bad one fails the run at once with one line naming the field
(``rejected (merge_duplicate_source) sources[1].adapter: …``), never retried. The ``merge-teachers`` task then
scores each source's replay prompts with that source's LoRA into one corpus, and the engine trains the merged
student exactly as ``opd_distill`` does (same run directory, checkpoints, gate, ``latest.json``); the receipt's
``recipe`` block and Kiln's ``receipt.json`` name the recipe, the ``merge-multi:<name>`` teacher and every
pinned source.
"""

from typing import Any

from prefect import flow

from flows.opd_distill import finish_run, storage_credentials
from flows.run_log import quiet_run_logs, reject_run, request_adapter, request_run_name, tag_run
from kiln_core.errors import Rejection


merge_run_name = request_run_name("merge")


@flow(name="distill-merge", flow_run_name=merge_run_name, log_prints=True, validate_parameters=False)
def distill_merge(request: dict[str, Any], student: str, storage_root: str = "./kiln-data",
                  storage_block: str | None = None) -> dict[str, Any]:
    """Merge LoRAs by distillation: each source adapter teaches the prompts it was trained on to one student.

    Args:
        request: Kiln's DistillMergeRequest: name, sources [{adapter, weight}], student ("base" or a warm-start
            adapter), rollout_budget, config (Kiln's OpdConfig, off_policy), post_eval; kiln-flows'
            weighted_sampling (default false).
        student: Student base model directory (every source LoRA is loaded on it).
        storage_root: Storage root holding the source adapters (runs/<adapter>/latest.json) and receiving the
            corpus and the merged run.
        storage_block: Optional ``secret/<name>`` Prefect block with fsspec options for storage_root.

    Returns:
        The run summary (``PipelineResult.summary()``).
    """
    from kiln_core.contracts.distill_merge import check_distill_merge_request
    from kiln_core.engine import run_pipeline
    from tasks.distill_merge import prepare_distill_merge_task
    from tasks.stages import PrefectStages

    quiet_run_logs()
    adapter = request_adapter(request)
    if adapter:
        tag_run(f"adapter:{adapter}", "recipe:distill_merge")
    try:
        checked = check_distill_merge_request(request)
        with storage_credentials(storage_block):
            spec = prepare_distill_merge_task(checked, student, storage_root)
            with PrefectStages(spec) as stages:
                result = run_pipeline(spec, stages)
    except Rejection as error:
        return reject_run(error, adapter)
    sources = ", ".join(f"{source.adapter}={source.rows}" for source in spec.recipe.sources)
    return finish_run(result, f"distill merge {checked.name}", f"; sources {sources}", adapter=checked.name)
