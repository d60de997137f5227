"""``training_record.json``: what the trainer knows when a run ends — its facts and what it produced.

Rank 0 writes it whatever the run's status (``kiln_core.training.receipt``); the one composer of
``train_receipt.json`` builds the receipt from it and from the gate's decision, in the trainer's process or in
another one (the flow's gate task after a ``torchrun`` or Ray job). A successful record with a committed adapter
is a finished training (``kiln_core.engine.runs.finished_run``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.contracts.eval_curve import EvalCurve, StopRule
from kiln_core.contracts.outcomes import PublishGuardRecord
from kiln_core.contracts.receipt import DistributedReceipt, LoraDeltaNormSummary, LoraGradNormSummary, ShardingReceipt
from kiln_core.contracts.recipe_record import RecipeRecord
from kiln_core.contracts.settings import ResolvedSettings

__all__ = ["TRAINING_DATA_SOURCE", "TRAINING_RECORD_FILE", "RunFacts", "RunOutcome", "TrainingRecord"]

TRAINING_RECORD_FILE = "training_record.json"
TRAINING_DATA_SOURCE = "jsonl_off_policy_opd_teacher"
"""The receipt's ``training_data.source`` of a teacher-scored JSONL corpus."""


class RunFacts(BaseModel):
    """What is fixed before the first step: inputs, identities and the run's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter_name: str
    student_dir: str
    student_identity: dict[str, str | None]
    shard_manifest: dict[str, Any]
    execution_provenance: dict[str, Any]
    precision_policy: dict[str, Any]
    dataset_path: str | None
    """The corpus path as given; None for inline on-policy prompts."""
    dataset_sha256: str
    """``sha256:`` of the corpus bytes, or of the prompt list (on-policy)."""
    settings: ResolvedSettings
    """The run's settings (its LoRA targets resolved): the receipt's ``config``, hyperparameters, top-K, samples
    per prompt and loss, and the digest of Kiln's effective config, all read from here."""
    seed: int
    teacher_alias: str
    teacher_identity: dict[str, Any] | None
    teacher_identity_revision: str | None
    teacher_content_revision: str
    examples_read: int
    candidates_per_epoch: int
    total_steps: int
    device: str
    library_versions: dict[str, str]
    distributed: DistributedReceipt | None = None
    training_data_source: str = TRAINING_DATA_SOURCE
    """The receipt's ``training_data.source``: a JSONL corpus, or ``inline_opd_prompts`` (on-policy)."""
    examples_filtered: int = 0
    """Prompts dropped at tokenization (on-policy)."""
    base_adapter: dict[str, Any] | None = None
    """The warm start's receipt ``adapters.base`` (``{path, adapter_model_sha256, adapter_model_bytes}``), or None."""
    recipe: RecipeRecord | None = None
    """The recipe that trained the adapter (``TrainPlan.recipe``): the receipt's ``recipe``, and Kiln's
    ``receipt.json`` beside the adapter."""
    ignored_request_keys: tuple[str, ...] = ()
    """Unknown request keys ``--kiln-lenient`` ignored (``TrainPlan.ignored_request_keys``)."""


class RunOutcome(BaseModel):
    """What the run produced (filled in as it goes; every assignment is validated into its record type)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    status: Literal["success", "failed"] = "failed"
    failure_reason: str | None = None
    failure_message: str | None = None
    adapter_uri: str | None = None
    adapter_sha256: str | None = None
    adapter_bytes: int | None = None
    global_step: int = 0
    loss_history: list[float] = Field(default_factory=list)
    token_counts: dict[str, int] = Field(default_factory=dict)
    final_env_ce: float | None = None
    lora_grad_norms: list[LoraGradNormSummary] = Field(default_factory=list)
    lora_delta_norms: list[LoraDeltaNormSummary] = Field(default_factory=list)
    phase_timings_ms: dict[str, float] = Field(default_factory=dict)
    wall_clock_ms: float = 0.0
    peak_memory_mib: float | None = None
    peak_rss_mib: float | None = None
    peak_vram_mib: float | None = None
    resumed_from: str | None = None
    stop_reason: StopRule | None = None
    """Ours: the held-out watch rule that stopped the run (``diverged``, ``stalled``, ``flat``)."""
    eval_curve: EvalCurve | None = None
    """Ours: the held-out curve of a watched run."""
    rollout_backend: str | None = None
    """Ours, on-policy: what sampled the rollouts (``local``: the training process; ``vllm``)."""
    teacher_backend: str | None = None
    """Ours, on-policy: what scored them (``local``; ``vllm``)."""
    publish_guard: PublishGuardRecord | None = None
    """Ours: the publish guard's verdict (``kiln_core.training.publish_guard``), once it ran or was turned off."""
    sharding: ShardingReceipt | None = None
    """Ours, ``strategy: fsdp``: rank 0's view of the sharded base weights (the receipt's ``distributed.fsdp``)."""


class TrainingRecord(BaseModel):
    """``training_record.json``: the run's facts and its outcome."""

    model_config = ConfigDict(extra="forbid")

    facts: RunFacts
    outcome: RunOutcome
