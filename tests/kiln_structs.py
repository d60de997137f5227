"""Kiln's checkpoint and receipt structs as strict pydantic models, written from Kiln's Rust source.

Independent of ``kiln_core``: each class transcribes one struct field by field, with serde's rules —
``deny_unknown_fields`` → ``extra="forbid"``; ``Option`` with ``skip_serializing_if`` → the key may be
absent; ``Option`` without it → the key must be present (null allowed); ``u64``/``usize`` → a
non-negative JSON integer (never ``1.0``); enums with ``rename_all = "kebab-case"`` → those strings.

Sources (github.com/ericflo/kiln): ``crates/kiln-train/src/checkpoint.rs`` (bf4a394),
``crates/kiln-train/src/opd.rs`` (00aac0f: ``OpdCheckpointLoopState``), ``crates/kiln-train/src/train_receipt.rs``
(``DataStatsReceipt``, ``TokenCountReceipt``, ``LoraGradNormAccumulator``, ``GradNormAccumulator``,
``TrainReceipt`` and nested receipts), ``crates/kiln-core/src/model_provenance.rs``
(``BaseWeightShardManifest``), ``crates/kiln-core/src/execution_provenance.rs``
(``ExecutionProvenanceV1``), ``crates/kiln-train/src/logit_source.rs`` (``LogitSourceCaps``).
``LengthInflationGuardrail`` (``diagnostics.rs``) has no public serde form; its struct field names are
used.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

U64 = Annotated[StrictInt, Field(ge=0, le=2**64 - 1)]
U32 = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
F64 = StrictFloat | StrictInt  # serde reads a JSON integer into an f64 field too


def _ieee_bits(value: Any) -> Any:
    # train_receipt.rs `mod f64_ieee_bits`: "0x" + exactly 16 hex digits, or a plain number.
    if isinstance(value, str):
        if not re.fullmatch(r"0x[0-9a-fA-F]{16}", value):
            raise ValueError("IEEE-754 f64 bits must be 0x followed by exactly 16 hex digits")
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise ValueError("expected IEEE-754 bits or a number")


F64Bits = Annotated[str | float | int, BeforeValidator(_ieee_bits)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# --- checkpoint.rs ---------------------------------------------------------------------------


class CheckpointFile(Strict):
    role: Literal["adapter-parameters", "optimizer-state", "reference-state", "ema-state",
                  "reward-normalization-state", "rng-state", "data-order", "loss-history"]
    size_bytes: U64
    sha256: StrictStr


class TrainingCheckpointProgress(Strict):
    global_step: U64
    total_steps: U64
    epoch_index: U64
    cursor_in_epoch: U64
    data_order: list[U64]


class TrainingCheckpointData(Strict):
    source_kind: StrictStr
    content_sha256: StrictStr
    item_count: U64


class TrainingCheckpointRngState(Strict):
    algorithm: StrictStr
    seed: U64
    position: U64
    state_file: StrictStr | None = None  # skip_serializing_if = Option::is_none


class TrainingCheckpointOptimizer(Strict):
    kind: StrictStr
    step: U64
    hyperparameters: Any
    state_file: StrictStr | None = None


class TrainingCheckpointScheduler(Strict):
    kind: StrictStr
    step: U64
    state: Any


class TrainingCheckpointPrecision(Strict):
    parameter_dtype: StrictStr
    optimizer_state_dtype: StrictStr
    activation_dtype: StrictStr
    gradient_dtype: StrictStr
    stochastic_rounding: Any


class TrainingCheckpointStateFiles(Strict):
    adapter_parameters: StrictStr
    optimizer_state: StrictStr | None = None
    reference_state: StrictStr | None = None
    ema_state: StrictStr | None = None
    reward_normalization_state: StrictStr | None = None
    loss_history: StrictStr | None = None


class TrainingCheckpointManifest(Strict):
    schema_version: U32
    manifest_type: StrictStr
    checkpoint_kind: Literal["resumable"]
    checkpoint_id: StrictStr
    training_kind: Literal["sft", "grpo", "opd", "capability-distillation"]
    adapter_name: StrictStr
    created_at: StrictStr
    effective_config: Any
    precision_policy: TrainingCheckpointPrecision
    progress: TrainingCheckpointProgress
    data: TrainingCheckpointData
    rng_states: dict[str, TrainingCheckpointRngState]
    optimizer: TrainingCheckpointOptimizer
    scheduler: TrainingCheckpointScheduler
    state_files: TrainingCheckpointStateFiles
    auxiliary_state: Any
    files: dict[str, CheckpointFile]


# --- train_receipt.rs (loop-state parts) ----------------------------------------------------------


class DataStatsReceipt(BaseModel):
    # No deny_unknown_fields on this struct; required fields are required.
    model_config = ConfigDict(extra="ignore", strict=True)
    examples_read: U64
    examples_filtered: U64
    examples_trained: U64
    groups_read: U64
    groups_filtered: U64
    groups_trained: U64
    completions_read: U64
    completions_trained: U64
    reward_groups_filtered: U64 = 0
    reward_groups_kept: U64 = 0
    reward_filter_sidecar: StrictStr | None = None
    sft_ingestion: Any = None


class TokenCountReceipt(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    action_tokens: U64
    env_tokens: U64
    env_tokens_before_warning_filter: U64 = 0
    env_tokens_after_warning_filter: U64 = 0
    warning_tokens_filtered: U64 = 0
    context_tokens: U64


class GradNormAccumulator(Strict):
    sample_count: U64
    sum: F64Bits
    min: F64Bits
    max: F64Bits


class LoraGradNormAccumulator(Strict):
    by_module: dict[str, GradNormAccumulator]


class LengthInflationGuardrail(Strict):
    consecutive_high_rep: U64
    consecutive_high_trunc: U64
    overlap_history: list[F64]
    entropy_gap_history: list[F64]
    consecutive_low_diversity: U64
    last_diversity: F64
    consecutive_low_self_play_kl: U64
    last_self_play_kl: F64
    last_decision: StrictStr | dict[str, Any]


class OpdCheckpointLoopState(Strict):
    schema_version: U32
    state_type: StrictStr
    global_step: U64
    epoch_index: U64
    cursor_in_epoch: U64
    loss_history: list[F64]
    last_loss: F64 | None = None
    data_stats: DataStatsReceipt
    token_counts: TokenCountReceipt
    run_env_ce: F64 | None = None
    lora_grad_norms: LoraGradNormAccumulator
    guardrail: LengthInflationGuardrail


# --- kiln-core provenance --------------------------------------------------------------------------


class BaseWeightShardIdentity(Strict):
    filename: StrictStr
    size_bytes: U64
    sha256: StrictStr


class BaseWeightShardManifest(Strict):
    schema_version: U32
    manifest_type: Literal["kiln.base-weight-shards.v1"]
    aggregate_algorithm: Literal["kiln.base-model-content.v1"]
    aggregate_sha256: StrictStr
    total_size_bytes: U64
    shards: list[BaseWeightShardIdentity]


class ProvenanceBackend(Strict):
    name: StrictStr
    device: StrictStr
    numerical_runtime_sha256: StrictStr


class ProvenanceBuild(Strict):
    package_version: StrictStr
    target: StrictStr
    executable_sha256: StrictStr
    git_commit: StrictStr | None = None
    source_tree_sha256: StrictStr | None = None
    source_dirty: StrictBool | None = None


class ProvenanceModel(Strict):
    model_config_sha256: StrictStr
    tokenizer_vocab_sha256: StrictStr
    tokenizer_config_sha256: StrictStr
    chat_template_sha256: StrictStr | None = None
    training_chat_template_sha256: StrictStr | None = None


class ProvenancePrecision(Strict):
    inference_dtype: StrictStr
    training_policy: StrictStr


class ProvenanceKernels(Strict):
    contract_type: Literal["kiln.kernel-contract.v1"]
    versions: dict[str, StrictStr]
    compiled_features: list[StrictStr]
    contract_sha256: StrictStr


class ProvenanceConfiguration(Strict):
    effective_server_config_sha256: StrictStr
    effective_environment_sha256: StrictStr


class ExecutionProvenanceV1(Strict):
    schema_version: U32
    provenance_type: Literal["kiln.execution-provenance.v1"]
    backend: ProvenanceBackend
    build: ProvenanceBuild
    model: ProvenanceModel
    precision: ProvenancePrecision
    kernels: ProvenanceKernels
    configuration: ProvenanceConfiguration
    provenance_sha256: StrictStr


class LogitSourceCaps(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    teacher_id: StrictStr
    vocab_size: U64
    max_top_k: U64
    supports_full_vocab: StrictBool
    supports_batched: StrictBool
    tokenizer_hash: StrictStr | None


# opd.rs `opd_checkpoint_auxiliary_state`: the keys Kiln writes, every one always present.
OPD_AUXILIARY_KEYS = {
    "loop_state_type", "model_config_sha256", "tokenizer_config_sha256", "chat_template_sha256",
    "base_model_weights_sha256", "base_weight_shard_manifest", "execution_provenance", "backend_runtime",
    "kiln_train_version", "prepared_source_indices", "prepared_source_order_sha256", "teacher_capabilities",
    "teacher_identity", "teacher_content_revision", "training_precision_policy",
    "use_chat_template_rollout_prefixes", "checkpoint_planning",
}

# opd.rs `opd_checkpoint_effective_config`: OpdConfig's serde keys without resume_checkpoint (and without
# sampler_segments/grad_checkpoint_segments when None), plus the two effective values.
OPD_EFFECTIVE_CONFIG_KEYS = {
    "training_mode", "objective", "loss", "top_k", "samples_per_prompt", "temperature", "top_p", "max_tokens",
    "rollout_prompt_rendering", "stable_opd", "discount", "clip_epsilon", "learning_rate", "lora_rank", "lora_alpha",
    "allow_high_lora_scale", "base_adapter", "output_name", "auto_load", "checkpoint_interval", "detect_anomaly",
    "seed", "optimizer", "echo", "epochs", "max_cost_usd", "effective_top_k", "effective_samples_per_prompt",
}


# --- train_receipt.rs TrainReceipt (no deny_unknown_fields: our extra fields are ignored by Kiln) ----


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class KilnSourceReceipt(Lenient):
    git_commit: StrictStr | None = None
    git_dirty: StrictBool | None = None
    git_source: StrictStr | None = None
    package_version: StrictStr
    env_config_hash: StrictStr | None = None


class ModelReceipt(Lenient):
    path: StrictStr | None = None
    config_hash: StrictStr | None = None
    base_weight_shard_manifest: BaseWeightShardManifest | None = None


class TokenizerReceipt(Lenient):
    config_hash: StrictStr | None = None
    tokenizer_config_hash: StrictStr | None = None
    chat_template_hash: StrictStr | None = None
    training_chat_template_hash: StrictStr | None = None


class AdapterFileReceipt(Lenient):
    path: StrictStr | None = None
    adapter_model_sha256: StrictStr | None = None
    adapter_model_bytes: U64 | None = None


class AdapterReceiptSet(Lenient):
    base: AdapterFileReceipt
    output: AdapterFileReceipt


class TrainingDataReceipt(Lenient):
    source: StrictStr
    path: StrictStr | None = None
    sha256: StrictStr | None = None


class HyperparameterReceipt(Lenient):
    mode: StrictStr
    rank: U64
    alpha: F64
    alpha_over_rank: F64 | None = None
    learning_rate: F64
    epochs: U64
    seed: U64 | None = None
    shuffle: StrictBool = False


class OpdReceipt(Lenient):
    training_mode: StrictStr
    objective: StrictStr
    loss_granularity: StrictStr
    teacher_id: StrictStr | None = None
    teacher_content_revision: StrictStr | None = None
    teacher_identity: dict[str, Any] | None = None
    top_k: U64 | None = None
    samples_per_prompt: U64
    action_tokens: U64
    env_tokens: U64
    echo_combined: StrictBool
    echo_lambda: F64 | None = None
    initial_opd_loss: F64 | None = None
    final_opd_loss: F64 | None = None


class EchoReceipt(Lenient):
    enabled: StrictBool
    lambda_: F64 | None = Field(default=None, alias="lambda")
    env_mask_mode: StrictStr | None = None
    warning_filter: StrictBool | None = None
    initial_env_ce: F64 | None = None
    final_env_ce: F64 | None = None
    dropped_reason: StrictStr | None = None


class HistogramBucket(Lenient):
    label: StrictStr
    min_inclusive: F64 | None = None
    max_inclusive: F64 | None = None
    count: U64


class RewardStatsReceipt(Lenient):
    count: U64
    mean: F64 | None = None
    stdev: F64 | None = None
    min: F64 | None = None
    max: F64 | None = None
    group_count: U64 = 0
    all_pass_group_count: U64 = 0
    all_fail_group_count: U64 = 0
    degenerate_group_count: U64 = 0
    group_variance_histogram: list[HistogramBucket]


class TrainingPhaseTimingsReceipt(Lenient):
    tokenize_ms: F64
    mask_build_ms: F64
    reference_forward_ms: F64
    policy_forward_ms: F64
    backward_ms: F64
    optimizer_ms: F64
    gpu_writer_wait_ms: F64 = 0.0
    gpu_writer_held_ms: F64 = 0.0
    gpu_writer_acquisitions: U64 = 0


class RuntimeReceipt(Lenient):
    wall_clock_ms: U64
    peak_vram_mib: U64 | None = None
    execution_provenance: ExecutionProvenanceV1 | None = None
    training_precision: TrainingCheckpointPrecision | None = None


class LoraDeltaNormSummary(Lenient):
    module: StrictStr
    pair_count: U64
    a_l2_mean: F64
    a_l2_max: F64
    b_l2_mean: F64
    b_l2_max: F64
    delta_l2_upper_bound_mean: F64
    delta_l2_upper_bound_max: F64


class LoraGradNormSummary(Lenient):
    module: StrictStr
    sample_count: U64
    min: F64
    mean: F64
    max: F64


class TrainReceipt(Lenient):
    schema_version: U32
    receipt_type: StrictStr
    adapter_name: StrictStr
    produced_at: StrictStr
    status: Literal["success", "failed"]
    failure_reason: StrictStr | None = None
    failure_message: StrictStr | None = None
    kiln: KilnSourceReceipt
    model: ModelReceipt
    tokenizer: TokenizerReceipt
    adapters: AdapterReceiptSet
    training_data: TrainingDataReceipt
    hyperparameters: HyperparameterReceipt
    grpo: dict[str, Any] | None = None
    opd: OpdReceipt | None = None
    echo: EchoReceipt
    no_policy_loss: StrictBool
    data: DataStatsReceipt
    rewards: RewardStatsReceipt
    token_counts: TokenCountReceipt
    phase_timings: TrainingPhaseTimingsReceipt | None = None
    runtime: RuntimeReceipt
    config_hashes: dict[str, Any] | None = None
    lora_delta_norms: list[LoraDeltaNormSummary]
    lora_grad_norms: list[LoraGradNormSummary] = Field(default_factory=list)
    adapter_smoke_test: dict[str, Any] | None = None
    config: Any
