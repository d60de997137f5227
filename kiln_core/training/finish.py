"""Finishing a run: the PEFT adapter directory, then the run's records (also on failure).

Rank 0 of a multi-process run publishes both; the other ranks only return the receipt's URI. The trainer
always leaves ``training_record.json``; it composes ``train_receipt.json`` itself unless a gate follows a
successful run, whose stage composes it once the gate decided (``kiln_core.training.receipt``).
"""

from __future__ import annotations

import resource
import time

import torch

from kiln_core.canonical import sha256_prefixed
from kiln_core.contracts.receipt import RECEIPT_FILE
from kiln_core.storage import Location, StagedDirectory
from kiln_core.training.plan import ADAPTER_DIR, RunPlan
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.training.publish_guard import GUARD_CODE, GuardTripped, guard_before_publish
from kiln_core.contracts.training_record import RunOutcome, TrainingRecord
from kiln_core.training.receipt import compose_receipt, write_training_record
from kiln_core.training.step import StopTraining, lora_delta_norms
from kiln_core.training.student import Student

__all__ = ["publish_adapter", "record_adapter", "publish_final_adapter", "finish_run"]


def publish_adapter(student: Student, run_dir: Location) -> dict[str, bytes]:
    """Write the PEFT adapter directory (``adapter_config.json`` last = committed); returns its files."""
    files = student.peft_adapter_files()
    with StagedDirectory(run_dir.child(ADAPTER_DIR), commit_name="adapter_config.json") as staged:
        staged.write("adapter_model.safetensors", files["adapter_model.safetensors"])
        staged.commit(files["adapter_config.json"])
    return files


def record_adapter(outcome: RunOutcome, plan: RunPlan, student: Student, files: dict[str, bytes] | None) -> None:
    """Note a published adapter in the outcome (``files`` is None on the ranks that did not publish)."""
    outcome.status = "success"
    outcome.adapter_uri = plan.run_dir.child(ADAPTER_DIR).uri
    if files is not None:
        outcome.adapter_sha256 = sha256_prefixed(files["adapter_model.safetensors"])
        outcome.adapter_bytes = len(files["adapter_model.safetensors"])
    config = plan.settings.config
    outcome.lora_delta_norms = lora_delta_norms(student, float(config.lora_alpha) / config.lora_rank)


def publish_final_adapter(plan: RunPlan, outcome: RunOutcome, student: Student, clock: Clock,
                          progress: LoopProgress) -> None:
    """After the last step: the publish guard, then the PEFT adapter (rank 0 only), noted in the outcome.

    Raises:
        StopTraining: ``training_diverged`` — the publish guard refused the run (``kiln_core.training.publish_guard``);
            nothing was published.
    """
    with clock.phase("publish"):
        try:
            outcome.publish_guard = guard_before_publish(
                enabled=plan.settings.config.publish_guard, tensors=student.adapter_tensors(), loss_history=progress.loss_history,
                base_adapter=plan.base_adapter)
        except GuardTripped as tripped:
            message, outcome.publish_guard = tripped.args
            raise StopTraining(GUARD_CODE, message) from None
        files = plan.world.publish_on_main(lambda: publish_adapter(student, plan.run_dir))
    record_adapter(outcome, plan, student, files)


def finish_run(plan: RunPlan, outcome: RunOutcome, progress: LoopProgress, clock: Clock) -> str:
    """Fill the outcome from the loop's progress and write the run's records: ``training_record.json``, and
    ``train_receipt.json`` when nothing follows (a failed or cancelled run, or no gate); returns the receipt's
    URI."""
    outcome.global_step = progress.global_step
    outcome.loss_history = list(progress.loss_history)
    outcome.token_counts = dict(progress.token_counts)
    outcome.final_env_ce = progress.last_env_ce
    outcome.lora_grad_norms = progress.grad_norms.summaries()
    outcome.phase_timings_ms = dict(clock.totals_ms)
    outcome.wall_clock_ms = (time.perf_counter() - clock.started) * 1e3
    outcome.peak_rss_mib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # Linux: KiB
    outcome.peak_memory_mib = outcome.peak_rss_mib
    if plan.device.type == "cuda":  # on a GPU the number that matters is device memory
        outcome.peak_vram_mib = round(torch.cuda.max_memory_allocated(plan.device) / 2**20, 1)
        outcome.peak_memory_mib = outcome.peak_vram_mib
    if not plan.world.is_main:  # rank 0 writes the run's records
        return plan.run_dir.child(RECEIPT_FILE).uri
    record = TrainingRecord(facts=plan.facts, outcome=outcome)
    write_training_record(plan.run_dir, record)
    if outcome.status == "success" and plan.gate_follows:  # the gate stage composes it, with its decision
        return plan.run_dir.child(RECEIPT_FILE).uri
    return compose_receipt(plan.run_dir, record=record)
