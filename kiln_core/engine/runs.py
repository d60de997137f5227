"""Where a run lives and where it resumes from: one rule for the CLI and the pipeline.

A run's directory is ``<root>/runs/<adapter>/<run key>/``: the run key is a digest of everything that
decides what training produces (corpus bytes, effective top-K, teacher identity revision, student
weights, the run's settings with its world size, a base adapter's weights digest), so a retry — in the
same process, from the UI, on new infrastructure, or ``kiln-flows train`` run again — finds the same
directory, while new data (or a re-published base adapter) for the same adapter name gets a new one.
``<root>/runs/<adapter>/latest.json`` points at the newest published run of that adapter
(``kiln_core.engine.publish``). When the config leaves ``seed`` null it is derived from the run key
(``ResolvedSettings.seed_for``), so every attempt of a run draws the same one.

Resuming:

* ``resume="latest"`` (the pipeline, every attempt): the newest committed checkpoint, if any;
* a basename (``kiln-flows train --resume-checkpoint``): that checkpoint, looked up in this run's
  directory first and else in the adapter's other runs — resuming there lets the trainer report
  exactly which part of the run's identity differs (Kiln's resume checks);
* ``resume=None`` (``kiln-flows train`` without ``--resume-checkpoint``): a fresh run, refused with
  ``resume_required`` naming the newest checkpoint when this run's directory already holds some.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

from kiln_core.contracts.pipeline import PipelineSpec
from kiln_core.contracts.receipt import RECEIPT_FILE
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.contracts.stage_refs import CorpusRef, HeldOutRef, ManifestRef, TrainPlan, TrainRef
from kiln_core.engine.base_adapter import plan_base_adapter
from kiln_core.errors import Rejection
from kiln_core.storage import Location, list_children, resolve
from kiln_core.contracts.base_adapter import BaseAdapter

RUNS_DIR = "runs"  # <root>/runs/<adapter>/ holds the runs and latest.json (kiln_core.contracts.latest)
ADAPTER_DIR = "adapter"


class ResumeRequired(Rejection):
    """A fresh run whose directory already holds checkpoints (code ``resume_required``).

    Attributes:
        newest: Basename of the newest committed checkpoint — what to pass to ``--resume-checkpoint``.
        run_uri: The run's directory.
    """

    def __init__(self, run_uri: str, newest: str) -> None:
        super().__init__("resume_required", f"run directory {run_uri} already holds checkpoints; the newest is "
                         f"{newest}. Resume from it (or use a new adapter name)", field="resume_checkpoint")
        self.newest = newest
        self.run_uri = run_uri


def adapter_root(storage_root: str, adapter: str) -> Location:
    """``<root>/runs/<adapter>``: the adapter's runs and its ``latest.json``."""
    return resolve(storage_root).child(RUNS_DIR, adapter)


def run_key(corpus: CorpusRef, manifest: ManifestRef, student_weights_sha256: str, config_json: dict[str, Any]) -> str:
    """A short digest of everything that decides what a training run produces."""
    from kiln_core.canonical import canonical_json_bytes

    payload = {
        "dataset_sha256": corpus.dataset_sha256,
        "effective_top_k": corpus.effective_top_k,
        "teacher_identity_revision": manifest.identity_revision,
        "student_weights_sha256": student_weights_sha256,
        "config": config_json,
    }
    return hashlib.sha256(canonical_json_bytes(payload)).hexdigest()[:16]


def plan_run(spec: PipelineSpec, settings: ResolvedSettings, corpus: CorpusRef, manifest: ManifestRef,
             student_dir: str, *, resume: str | None = "latest", device: str | None = None,
             precision: str | None = None, gradient_checkpointing: bool = False,
             base_adapter: BaseAdapter | None = None, held_out: HeldOutRef | None = None,
             claim: Callable[[Location], None] | None = None, gate_follows: bool = False) -> TrainPlan:
    """The run directory, the seed and the resume point of a spec whose settings are resolved.

    ``base_adapter`` is the spec's resolved ``config.base_adapter`` when the caller already has it
    (``prepare`` resolves it before admission); otherwise it is resolved here. ``held_out`` is the spec's
    ``eval:`` corpus as ``prepare`` admitted it (required with ``spec.eval``). ``claim`` is called with
    the run directory as soon as it is known, before the resume rule looks inside it (``run_pipeline``
    takes the run lock there: another live run's checkpoints are not a reason to ask for a resume).
    ``gate_follows``: the spec asks for a gate (``kiln_core.engine.gate.has_gate``), which composes the receipt
    of a successful run once it decided.

    Raises:
        ResumeRequired: ``resume`` is None and the run directory already holds committed checkpoints.
        CheckpointError: ``resume`` is a basename that is not a checkpoint name of this adapter.
        BaseAdapterError: ``base_adapter_missing``/``base_adapter_mismatch`` (``kiln_core.engine.base_adapter``).
        RunInProgress: raised by ``claim`` (``kiln_core.engine.run_lock``) when another live run holds the run key.
    """
    from kiln_core.identity.hashing import base_model_sha256

    if base_adapter is None:
        base_adapter = plan_base_adapter(settings.config, spec.storage_root, settings.lora_targets)
    decides = settings.run_key_config()
    if base_adapter is not None:
        # The warm start's content, not just its name: a base adapter re-published under the same name
        # is another run (and on-policy, other rollouts).
        decides["base_adapter_sha256"] = base_adapter.adapter_model_sha256
    key = run_key(corpus, manifest, base_model_sha256(student_dir), decides)
    run = adapter_root(spec.storage_root, spec.adapter).child(key)
    if claim is not None:
        claim(run)
    if resume is None:
        newest = newest_checkpoint(run, spec.adapter)
        if newest is not None and finished_run(run, spec.adapter) is None:
            raise ResumeRequired(run.uri, newest)
    elif resume != "latest":
        run, resume = _resume_location(run, spec.storage_root, spec.adapter, resume)
    distributed = spec.distributed
    return TrainPlan(run_uri=run.uri, inputs_key=key, adapter=spec.adapter, settings=settings,
                     seed=settings.seed_for(key), resume=resume, backend=distributed.backend if distributed else "auto",
                     ray=distributed.ray_options() if distributed else None, device=device, precision=precision,
                     gradient_checkpointing=gradient_checkpointing, eval_watch=spec.eval, held_out=held_out,
                     base_adapter=base_adapter, vllm=spec.vllm, recipe=spec.recipe,
                     ignored_request_keys=spec.ignored_request_keys, gate_follows=gate_follows,
                     max_training_hours=spec.options.max_training_hours)


def check_lora_rank(config: OpdConfig, student_dir: str) -> None:
    """Refuse a LoRA rank the student cannot hold, from its ``config.json`` alone (no weights load).

    Every projection LoRA adapts (``kiln_core.training.lora_targets``) has the hidden size on one
    side, so its update has rank at most ``hidden_size``: a larger ``lora_rank`` adds parameters that can never add
    capacity, at the cost of memory and step time (rank 100000 on a hidden size of 64: 26 s a step). Kiln's own
    range (any positive rank) is kept wherever the model is wide enough; a config without a hidden size is not
    checked, and one that cannot be read is left to the stage that reads the student (its own codes).

    Raises:
        ConfigError: ``lora_rank_exceeds_model``, field ``config.lora_rank``, naming the largest rank that runs.
    """
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.identity.hashing import IdentityHashError, config_value, read_model_config

    try:
        _, model_config = read_model_config(student_dir)
        hidden = next((value for key in ("hidden_size", "n_embd", "d_model")
                       if (value := config_value(model_config, key)) is not None), None)
    except IdentityHashError:
        return
    if hidden is not None and config.lora_rank > hidden:
        raise ConfigError(f"lora_rank {config.lora_rank} is above the student's hidden size {hidden}: each adapted "
                          f"projection has {hidden} on one side, so no LoRA update can have a rank above {hidden}; "
                          f"use lora_rank {hidden} or less", "config.lora_rank", code="lora_rank_exceeds_model")


def check_resume_name(value: str, storage_root: str, adapter: str) -> str:
    """Refuse a resume checkpoint that is not one of ``adapter``'s names (before any work); an absolute
    local path must lie directly in one of the adapter's run directories."""
    from kiln_core.training.checkpoint import CheckpointError, check_resume_basename

    runs = adapter_root(storage_root, adapter)
    if runs.is_local and os.path.isabs(value):
        parent = os.path.dirname(os.path.normpath(value))
        if os.path.dirname(parent) != os.path.normpath(runs.path):
            raise CheckpointError("invalid_checkpoint_name",
                                  f"resume checkpoint {value!r} is not in a run directory of {runs.uri}")
        return check_resume_basename(value, resolve(parent), adapter)
    return check_resume_basename(value, runs, adapter)


def _resume_location(run: Location, storage_root: str, adapter: str, value: str) -> tuple[Location, str]:
    """The run directory holding the requested checkpoint, and its basename."""
    from kiln_core.training.checkpoint import committed_checkpoints

    name = check_resume_name(value, storage_root, adapter)
    if os.path.isabs(value) and run.is_local:
        return resolve(os.path.dirname(os.path.normpath(value))), name
    if any(basename == name for _, basename in committed_checkpoints(run, adapter)):
        return run, name
    runs = adapter_root(storage_root, adapter)
    holders = [runs.child(key) for key in list_children(runs) if not key.startswith(".") and key != run.path.rsplit("/", 1)[-1]
               and any(basename == name for _, basename in committed_checkpoints(runs.child(key), adapter))]
    # In another run of this adapter: resuming there makes the trainer name what differs. Not found
    # anywhere: the trainer reports it missing from this run's directory.
    return (holders[0] if len(holders) == 1 else run), name


def newest_checkpoint(run: Location | str, adapter: str) -> str | None:
    """Basename of the newest committed checkpoint in ``run``, or None."""
    from kiln_core.training.checkpoint import latest_checkpoint

    return latest_checkpoint(run if isinstance(run, Location) else resolve(run), adapter)


def finished_run(run: Location, adapter: str) -> TrainRef | None:
    """A run whose adapter is committed and whose training succeeded is finished: it is not trained again. Its
    training record says so (``kiln_core.training.receipt``; the receipt may still be to compose, after the
    gate), or — a run trained before the record existed — its successful receipt.

    Raises:
        ReceiptError: ``receipt_invalid`` — a successful receipt or a training record that does not parse.
    """
    from kiln_core.training.receipt import read_receipt, read_training_record, receipt_status

    adapter_dir = run.child(ADAPTER_DIR)
    if not adapter_dir.child("adapter_config.json").exists():
        return None
    record = read_training_record(run)
    if record is not None:
        outcome, facts = record.outcome, record.facts
        if outcome.status != "success":
            return None
        final_loss, steps, total = (outcome.loss_history[-1] if outcome.loss_history else None, outcome.global_step,
                                    facts.total_steps)
        history = outcome.loss_history
    elif receipt_status(run) == "success":
        receipt = read_receipt(run)
        final_loss, steps, total = receipt.opd.final_opd_loss, receipt.data.examples_trained, receipt.data.total_steps
        history = receipt.loss_history
    else:
        return None
    return TrainRef(run_uri=run.uri, status="success", adapter_uri=adapter_dir.uri, receipt_uri=run.child(RECEIPT_FILE).uri,
                    latest_checkpoint=newest_checkpoint(run, adapter), final_loss=final_loss, steps=steps,
                    total_steps=total, loss_history=list(history), reused=True)


def cancelled_run(run: Location, adapter: str) -> TrainRef:
    """How a run that was stopped by an exception it recorded (a termination signal in a worker's run)
    ended, read back from its ``cancelled`` receipt and its newest committed checkpoint.

    Raises:
        ReceiptError: ``receipt_missing``/``receipt_invalid`` — training wrote no readable receipt.
    """
    from kiln_core.training.receipt import read_receipt

    receipt = read_receipt(run)
    return TrainRef(run_uri=run.uri, status="cancelled", adapter_uri=None, receipt_uri=run.child(RECEIPT_FILE).uri,
                    latest_checkpoint=newest_checkpoint(run, adapter), final_loss=receipt.opd.final_opd_loss,
                    steps=receipt.data.examples_trained, total_steps=receipt.data.total_steps,
                    loss_history=list(receipt.loss_history), failure_reason=receipt.failure_reason,
                    failure_message=receipt.failure_message)
