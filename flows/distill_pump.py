"""``distill_pump``: Kiln's ``/v1/distill/pump`` as a flow — a registered teacher into the student.

The request (Kiln's ``DistillPumpRequest``, a dict) is checked with Kiln's submit-time rules inside the
run, so a bad one fails the run with one line naming the field (``rejected (<code>) <field>: <rule>``,
as ``opd_distill``). The ``distill-pump-prepare`` task pins the teacher and writes the training data
(``kiln_core.recipes.distill_pump``); the run then goes through the engine exactly as ``opd_distill``
does (``run_pipeline`` with ``PrefectStages``): scored or sampled, trained, gated by ``post_eval``,
published, with the recipe named in ``train_receipt.json`` and Kiln's ``receipt.json``.
``prompt_bank`` is the JSONL of prompts ``domain``/``wide`` modes pump (they refuse to run without it).
"""

from typing import Any

from prefect import flow

from flows.opd_distill import finish_run, storage_credentials
from flows.run_log import quiet_run_logs, reject_run, request_adapter, request_run_name, tag_run
from kiln_core.errors import Rejection


pump_run_name = request_run_name("pump")


@flow(name="distill-pump", flow_run_name=pump_run_name, log_prints=True, validate_parameters=False)
def distill_pump(request: dict, student: str, storage_root: str = "./kiln-data",
                 prompt_bank: str | None = None, vllm_teacher: str | None = None) -> dict[str, Any]:
    """Distil a registered teacher into a LoRA student from Kiln's DistillPumpRequest.

    Args:
        request: Kiln's DistillPumpRequest: name, teacher (a registered alias), mode ({"examples": [...]},
            {"domain": ...} or {"wide": ...}), rank, rollout_budget, use_cache, config, post_eval.
        student: Student model directory.
        storage_root: Storage root holding teachers.json; runs and adapters are published here.
        prompt_bank: domain/wide modes: JSONL of Kiln OpdPrompt objects to pump (required by them).
        vllm_teacher: URL of a vLLM server serving the registered teacher: it scores the examples (off-policy;
            Kiln's rule for a remote teacher), pinned to the alias's registered manifest.

    Returns:
        The run summary (``PipelineResult.summary()``).
    """
    from kiln_core.contracts.distill_pump import check_distill_pump_request
    from kiln_core.engine import run_pipeline
    from tasks.distill_pump import prepare_distill_pump_task
    from tasks.stages import PrefectStages

    quiet_run_logs()
    adapter = request_adapter(request)
    if adapter:
        tag_run(f"adapter:{adapter}", "recipe:distill_pump")
    try:
        checked = check_distill_pump_request(request)
        spec = prepare_distill_pump_task(checked, student, storage_root, prompt_bank=prompt_bank,
                                         vllm_teacher=vllm_teacher)
        with storage_credentials(spec.options.storage_block):
            with PrefectStages(spec) as stages:
                result = run_pipeline(spec, stages)
    except Rejection as error:
        return reject_run(error, adapter)
    return finish_run(result, f"distill pump {spec.adapter} ({spec.recipe.mode})", adapter=spec.adapter)
