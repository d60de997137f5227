"""``TrainReceipt``: the typed ``train_receipt.json`` contract, written and read through one model.

Field names and shapes are Kiln's (``crates/kiln-train/src/train_receipt.rs`` ``TrainReceipt`` and
its nested receipts; ``opd.rs`` ``write_opd_train_receipt`` fills the OPD ones). Options Kiln skips
when ``None`` are left out here too. kiln-flows' own facts are kept as extra fields, each marked
"ours" below; Kiln's reader has no ``deny_unknown_fields`` on these structs, so they never stop it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.contracts.checkpoint import TokenCounts
from kiln_core.contracts.eval_curve import EvalCurve, StopRule
from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.contracts.outcomes import GateDecision, PostEvalRecord, PublishGuardRecord, QualityGateRecord
from kiln_core.contracts.recipe_record import RecipeRecord

RECEIPT_FILE = "train_receipt.json"
FAILURE_REASONS = ("data_schema_error", "adapter_load_failed", "zero_groups", "zero_action_tokens", "zero_env_tokens",
                   "cancelled", "unsupported_loss_config", "nan_loss", "oom", "shape_mismatch", "unsafe_lora_scale",
                   "base_adapter_missing", "training_error")


def _omit_none(value: Any) -> bool:
    return value is None


class _Receipt(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class KilnSourceReceipt(_Receipt):
    git_commit: str | None = None
    git_dirty: bool | None = None
    git_source: str | None = None
    package_version: str
    env_config_hash: str | None = Field(default=None, exclude_if=_omit_none)
    implementation: str = "kiln-flows"
    """Ours: which program wrote the receipt."""


class ModelReceipt(_Receipt):
    path: str | None
    config_hash: str | None
    base_weight_shard_manifest: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)


class TokenizerReceipt(_Receipt):
    config_hash: str | None
    tokenizer_config_hash: str | None = Field(default=None, exclude_if=_omit_none)
    chat_template_hash: str | None = Field(default=None, exclude_if=_omit_none)
    training_chat_template_hash: str | None = Field(default=None, exclude_if=_omit_none)
    vocab_hash: str | None = Field(default=None, exclude_if=_omit_none)
    """Ours: ``tokenizer_vocab_sha256``."""


class AdapterFileReceipt(_Receipt):
    path: str | None = None
    adapter_model_sha256: str | None = None
    adapter_model_bytes: int | None = None


class AdapterReceiptSet(_Receipt):
    base: AdapterFileReceipt = Field(default_factory=AdapterFileReceipt)
    output: AdapterFileReceipt = Field(default_factory=AdapterFileReceipt)


class TrainingDataReceipt(_Receipt):
    source: str
    path: str | None
    sha256: str | None


class HyperparameterReceipt(_Receipt):
    mode: str = "opd"
    rank: int
    alpha: float
    alpha_over_rank: float | None
    learning_rate: float
    epochs: int
    seed: int | None
    shuffle: bool = False
    optimizer: str
    """Ours: the optimizer kind."""
    sequences_per_step: int = 1
    """Ours: candidates per optimizer step per process."""
    lora_targets: LoraTargets | None = Field(default=None, exclude_if=_omit_none)
    """Ours: the layers the LoRA adapts, resolved from the student (``kiln_core.training.lora_targets``)."""


class OpdReceipt(_Receipt):
    training_mode: str
    objective: str
    loss_granularity: str
    teacher_id: str | None
    teacher_content_revision: str | None = Field(default=None, exclude_if=_omit_none)
    teacher_identity: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)
    top_k: int | None
    samples_per_prompt: int
    action_tokens: int
    env_tokens: int
    echo_combined: bool
    echo_lambda: float | None
    initial_opd_loss: float | None = None
    final_opd_loss: float | None
    loss: str
    """Ours: the loss trained (``teacher_top_k_tail`` is our extension of ``teacher_top_k``)."""
    teacher_identity_revision: str | None = None
    """Ours: ``sha256:`` of the teacher identity (what ``GET /v1/teachers`` lists)."""
    rollout_backend: str | None = Field(default=None, exclude_if=_omit_none)
    """Ours, on-policy only: what sampled the rollouts: ``local`` (the training process) or ``vllm``."""
    teacher_backend: str | None = Field(default=None, exclude_if=_omit_none)
    """Ours, on-policy only: what scored the rollouts: ``local`` or ``vllm``."""


class EchoReceipt(_Receipt):
    enabled: bool
    """Whether the env-CE term fired, not whether it was requested."""
    lambda_: float | None = Field(default=None, alias="lambda")
    env_mask_mode: str | None = None
    warning_filter: bool | None = None
    initial_env_ce: float | None = None
    final_env_ce: float | None = None
    dropped_reason: str | None = Field(default=None, exclude_if=_omit_none)
    configured: bool = False
    """Ours: whether the request configured ECHO at all."""


class DataReceipt(_Receipt):
    examples_read: int = 0
    examples_filtered: int = 0
    examples_trained: int = 0
    groups_read: int = 0
    groups_filtered: int = 0
    groups_trained: int = 0
    completions_read: int = 0
    completions_trained: int = 0
    reward_groups_filtered: int = 0
    reward_groups_kept: int = 0
    candidates_per_epoch: int | None = None
    """Ours."""
    total_steps: int | None = None
    """Ours: optimizer steps of the whole run (on-policy: its candidates, an upper bound, since an
    empty rollout consumes a candidate without a step)."""
    resumed_from_checkpoint: str | None = None
    """Ours: the checkpoint this process resumed from."""


class HistogramBucket(_Receipt):
    label: str
    min_inclusive: float | None
    max_inclusive: float | None
    count: int = 0


def _empty_histogram() -> list[HistogramBucket]:
    specs = [("zero", 0.0, 0.0), ("tiny", 2.2250738585072014e-308, 1e-6), ("low", 1e-6, 0.01), ("medium", 0.01, 0.25),
             ("high", 0.25, 1.0), ("extreme", 1.0, None)]
    return [HistogramBucket(label=label, min_inclusive=low, max_inclusive=high) for label, low, high in specs]


class RewardStatsReceipt(_Receipt):
    """GRPO rewards; empty for OPD (Kiln's ``RewardStatsReceipt::default``)."""

    count: int = 0
    mean: float | None = None
    stdev: float | None = None
    min: float | None = None
    max: float | None = None
    group_count: int = 0
    all_pass_group_count: int = 0
    all_fail_group_count: int = 0
    degenerate_group_count: int = 0
    group_variance_histogram: list[HistogramBucket] = Field(default_factory=_empty_histogram)


class PhaseTimingsReceipt(_Receipt):
    """Kiln's phases; kiln-flows tokenizes and builds masks at admission, has no reference forward and
    no server GPU writer, so those stay 0."""

    tokenize_ms: float = 0.0
    mask_build_ms: float = 0.0
    reference_forward_ms: float = 0.0
    policy_forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    gpu_writer_wait_ms: float = 0.0
    gpu_writer_held_ms: float = 0.0
    gpu_writer_acquisitions: int = 0


class RuntimeReceipt(_Receipt):
    wall_clock_ms: int
    peak_vram_mib: int | None = None
    execution_provenance: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)
    training_precision: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)
    device: str
    """Ours."""
    peak_memory_mib: float | None = None
    """Ours: CUDA max allocated on a GPU run, else the process's peak RSS."""
    peak_rss_mib: float | None = None
    """Ours."""


class ConfigHashesReceipt(_Receipt):
    model_config_hash: str | None = None
    tokenizer_config_hash: str | None = None
    chat_template_hash: str | None = None
    training_chat_template_hash: str | None = None
    kiln_env_config_hash: str | None = None
    effective_config: str | None = None
    """Ours: ``canonical_sha256`` of the checkpoint ``effective_config``."""


class LoraDeltaNormSummary(_Receipt):
    module: str
    pair_count: int
    a_l2_mean: float
    a_l2_max: float
    b_l2_mean: float
    b_l2_max: float
    delta_l2_upper_bound_mean: float
    delta_l2_upper_bound_max: float


class LoraGradNormSummary(_Receipt):
    module: str
    sample_count: int
    min: float
    mean: float
    max: float


class ShardingReceipt(_Receipt):
    """Ours, ``strategy: fsdp``: what FSDP sharded, as rank 0 saw it (parameter element counts)."""

    sharded_modules: int
    """FSDP units: every decoder layer, plus the decoder itself (embeddings, final norm)."""
    sharded_parameters: int
    """Base weight elements split across the ranks (the whole model's count)."""
    sharded_parameters_on_rank_0: int
    """Of those, the elements rank 0 held: about ``sharded_parameters / world_size``."""
    replicated_parameters: int
    """Elements every rank holds whole: the LoRA parameters and the LM head."""


class DistributedReceipt(_Receipt):
    """Ours: present only for a multi-process run (or any run on Ray); runtime figures above are rank 0's."""

    world_size: int
    backend: str | None
    strategy: str
    """``ddp`` or ``fsdp`` (``kiln_core.training.distributed.fsdp``)."""
    sequences_per_step_per_rank: int
    sequences_per_optimizer_step: int
    engine: str | None = Field(default=None, exclude_if=_omit_none)
    """``ray`` when a Ray cluster started the ranks; absent for torchrun (its receipts are unchanged)."""
    ray_version: str | None = Field(default=None, exclude_if=_omit_none)
    address: str | None = Field(default=None, exclude_if=_omit_none)
    """The Ray cluster address as the run was given it (``local``, ``auto``, ``ray://host:port``); never
    credentials (the spec refuses a ``user:password@`` part)."""
    fsdp: ShardingReceipt | None = Field(default=None, exclude_if=_omit_none)
    """What FSDP sharded (``strategy: fsdp`` only; absent for ddp, whose receipts are unchanged)."""


class TrainReceipt(_Receipt):
    """``train_receipt.json``: what one OPD training run did (Kiln's ``TrainReceipt`` plus ours)."""

    schema_version: Literal[1] = 1
    receipt_type: Literal["kiln_train_receipt"] = "kiln_train_receipt"
    adapter_name: str
    produced_at: str
    status: Literal["success", "failed"]
    failure_reason: str | None = None
    failure_message: str | None = Field(default=None, exclude_if=_omit_none)
    kiln: KilnSourceReceipt
    model: ModelReceipt
    tokenizer: TokenizerReceipt
    adapters: AdapterReceiptSet
    training_data: TrainingDataReceipt
    hyperparameters: HyperparameterReceipt
    grpo: None = None
    opd: OpdReceipt
    echo: EchoReceipt
    no_policy_loss: bool = False
    data: DataReceipt
    rewards: RewardStatsReceipt = Field(default_factory=RewardStatsReceipt)
    token_counts: TokenCounts
    phase_timings: PhaseTimingsReceipt = Field(default_factory=PhaseTimingsReceipt)
    runtime: RuntimeReceipt
    config_hashes: ConfigHashesReceipt
    lora_delta_norms: list[LoraDeltaNormSummary] = Field(default_factory=list)
    lora_grad_norms: list[LoraGradNormSummary] = Field(default_factory=list)
    config: OpdConfig
    """The request's config as the run recorded it, with the effective top-K, samples per prompt and seed
    (``ResolvedSettings.receipt_config``)."""
    loss_history: list[float] = Field(default_factory=list)
    """Ours: one loss per committed optimizer step, over the whole run."""
    phase_timings_ms: dict[str, float] = Field(default_factory=dict)
    """Ours: this process's wall time per phase (setup, data, forward, backward, optimizer, ...)."""
    library_versions: dict[str, str] = Field(default_factory=dict)
    """Ours."""
    distributed: DistributedReceipt | None = Field(default=None, exclude_if=_omit_none)
    stop_reason: StopRule | None = Field(default=None, exclude_if=_omit_none)
    """Ours: the held-out watch rule that stopped the run (then ``failure_reason`` is ``training_error``:
    Kiln's ``failure_reason`` enum has no value for it)."""
    eval_curve: EvalCurve | None = Field(default=None, exclude_if=_omit_none)
    """Ours: the held-out curve of a watched run (``kiln_core.training.eval_curve``)."""
    gate_outcome: str | None = Field(default=None, exclude_if=_omit_none)
    """Ours (Kiln keeps it on the training job): the gate's outcome, the stronger of ``post_eval`` and
    ``quality_gate`` when both ran (``kiln_core.engine.gate``)."""
    post_eval: PostEvalRecord | None = Field(default=None, exclude_if=_omit_none)
    """Ours: the post-training eval and its gate evidence (``kiln_core.engine.fate.post_eval_receipt_block``)."""
    quality_gate: QualityGateRecord | None = Field(default=None, exclude_if=_omit_none)
    """Ours: the distillation-metrics gate (thresholds, base and distilled metrics, outcome)."""
    ignored_request_keys: list[str] | None = Field(default=None, exclude_if=_omit_none)
    """Ours: unknown keys of the request (dotted paths) that ``--kiln-lenient`` ignored, as Kiln does."""
    recipe: RecipeRecord | None = Field(default=None, exclude_if=_omit_none)
    """Ours: the recipe that trained the adapter (``kiln_core.contracts.recipe_record.RecipeRecord``): kind, mode,
    Kiln's teacher descriptor, merge sources, the whole request, and the recipe file and step it ran in."""
    publish_guard: PublishGuardRecord | None = Field(default=None, exclude_if=_omit_none)
    """Ours: whether the publish guard ran (``enabled``), its ``verdict`` (``passed``, ``tripped``, ``off``) and
    each rule's measured values and thresholds (``kiln_core.training.publish_guard``)."""


def gate_decision(receipt: TrainReceipt) -> GateDecision | None:
    """The gate's decision a receipt records, or None when no gate decided (``gate_outcome`` and ``post_eval``
    absent: an ungated run, or one whose gate has not run yet)."""
    if receipt.gate_outcome is None and receipt.post_eval is None and receipt.quality_gate is None:
        return None
    verdict = ((receipt.post_eval.post_eval_verdict if receipt.post_eval is not None else None)
               or (receipt.quality_gate.verdict if receipt.quality_gate is not None else None))
    return GateDecision(outcome=receipt.gate_outcome, verdict=verdict, post_eval=receipt.post_eval,
                        quality_gate=receipt.quality_gate)


def encode_receipt(receipt: TrainReceipt) -> bytes:
    """The bytes of ``train_receipt.json``: pretty JSON (two-space indent), no trailing newline, no NaN.

    The one encoder, used by the one writer of the file (``kiln_core.training.receipt.compose_receipt``).
    """
    return json.dumps(receipt.model_dump(mode="json", by_alias=True), indent=2, allow_nan=False).encode("utf-8")
