"""The ``.kiln-checkpoint`` file contracts: Kiln's manifest and loop state, and our extension file.

Every model mirrors a Kiln struct field by field (``crates/kiln-train/src/checkpoint.rs``
``TrainingCheckpointManifest`` and its nested records; ``opd.rs`` ``OpdCheckpointLoopState``;
``train_receipt.rs`` ``DataStatsReceipt``/``TokenCountReceipt``/``LoraGradNormAccumulator``;
``diagnostics.rs`` ``LengthInflationGuardrail``). Kiln parses them with ``deny_unknown_fields``, so
these models forbid unknown keys too, and an ``Option`` Kiln skips when ``None`` is left out here
(``_omit_none``) while one Kiln writes as ``null`` stays ``null``.

What kiln-flows needs beyond Kiln — Python/NumPy/torch generator states of every rank, the world
size, ``sequences_per_step``, the tail-loss extension — lives in ``kiln_flows_state.json``
(``KilnFlowsState``). The manifest declares it in ``files`` with role ``rng-state``, so Kiln's loader
checks its size and digest like any artifact and ignores its content; it is never named by
``rng_states`` or ``state_files``, which Kiln compares exactly (Kiln's crates/kiln-train/src/opd.rs).
"""

from __future__ import annotations

import math
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from kiln_core.contracts.eval_curve import EvalCurve
from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.errors import Rejection

MANIFEST_TYPE = "kiln.training-checkpoint.v1"
LOOP_STATE_TYPE = "kiln.opd-loop-state.v1"
EXTENSION_FORMAT = "kiln-flows.checkpoint-state.v1"
OFF_POLICY_SOURCE_KIND = "inline-off-policy-opd-candidate-order-v1"
ON_POLICY_SOURCE_KIND = "inline-on-policy-opd-candidate-order-v1"
LORA_INIT_ALGORITHM = "kiln.seeded-lora-init.v1"
ROLLOUT_ALGORITHM = "kiln.opd-rollout-candidate.v1"
MANIFEST_FILE = "checkpoint_manifest.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
LOOP_STATE_FILE = "opd_loop_state.json"
EXTENSION_FILE = "kiln_flows_state.json"
SUFFIX = ".kiln-checkpoint"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_ARTIFACTS = 64
FILE_ROLES = ("adapter-parameters", "optimizer-state", "reference-state", "ema-state", "reward-normalization-state",
              "rng-state", "data-order", "loss-history")


class CheckpointError(Rejection):
    """A checkpoint that cannot be written or loaded; ``code`` is stable, the message names the file."""

    def __init__(self, code: str, message: str, *, file: str | None = None) -> None:
        super().__init__(code, message, file=file)

    def __str__(self) -> str:
        return self.message


class ResumeError(CheckpointError):
    """A valid checkpoint whose identity differs from the run asking to resume from it."""


def _omit_none(value: Any) -> bool:
    return value is None


class _Kiln(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------
# checkpoint_manifest.json


class CheckpointFile(_Kiln):
    role: Literal["adapter-parameters", "optimizer-state", "reference-state", "ema-state",
                  "reward-normalization-state", "rng-state", "data-order", "loss-history"]
    size_bytes: int = Field(ge=0)
    sha256: str
    """Lowercase, unprefixed SHA-256 of the exact bytes."""


class Precision(_Kiln):
    parameter_dtype: str
    optimizer_state_dtype: str
    activation_dtype: str
    gradient_dtype: str
    stochastic_rounding: dict[str, Any]


class Progress(_Kiln):
    global_step: int = Field(ge=0)
    """Committed optimizer steps."""
    total_steps: int = Field(ge=0)
    """OPD: candidates per epoch × epochs (a candidate count)."""
    epoch_index: int = Field(ge=0)
    """Epoch of the next candidate."""
    cursor_in_epoch: int = Field(ge=0)
    """Index into ``data_order`` of the next candidate."""
    data_order: list[int]


class DataBinding(_Kiln):
    source_kind: str
    content_sha256: str
    """Raw hex SHA-256 of the prompt list (``kiln_core.kiln_prompts.kiln_prompts_sha256``)."""
    item_count: int = Field(ge=0)


class RngStream(_Kiln):
    algorithm: str
    seed: int = Field(ge=0, le=2**64 - 1)
    position: int = Field(ge=0, le=2**64 - 1)
    state_file: str | None = Field(default=None, exclude_if=_omit_none)


class OptimizerRecord(_Kiln):
    kind: str
    step: int = Field(ge=0)
    hyperparameters: dict[str, Any]
    state_file: str | None = Field(default=None, exclude_if=_omit_none)


class SchedulerRecord(_Kiln):
    kind: str
    step: int = Field(ge=0)
    state: dict[str, Any]


class StateFiles(_Kiln):
    adapter_parameters: str
    optimizer_state: str | None = Field(default=None, exclude_if=_omit_none)
    reference_state: str | None = Field(default=None, exclude_if=_omit_none)
    ema_state: str | None = Field(default=None, exclude_if=_omit_none)
    reward_normalization_state: str | None = Field(default=None, exclude_if=_omit_none)
    loss_history: str | None = Field(default=None, exclude_if=_omit_none)


class CheckpointManifest(_Kiln):
    schema_version: int
    manifest_type: str
    checkpoint_kind: Literal["resumable"]
    checkpoint_id: str
    training_kind: Literal["sft", "grpo", "opd", "capability-distillation"]
    adapter_name: str
    created_at: str
    effective_config: dict[str, Any]
    precision_policy: Precision
    progress: Progress
    data: DataBinding
    rng_states: dict[str, RngStream]
    optimizer: OptimizerRecord
    scheduler: SchedulerRecord
    state_files: StateFiles
    auxiliary_state: dict[str, Any]
    files: dict[str, CheckpointFile]


# ---------------------------------------------------------------------------------------------
# opd_loop_state.json


class DataStats(_Kiln):
    """``DataStatsReceipt``; OPD fills the ``examples_*`` counters, the GRPO ones stay 0."""

    examples_read: int = Field(ge=0)
    examples_filtered: int = Field(ge=0)
    examples_trained: int = Field(ge=0)
    """Kiln's OPD sets it to ``global_step`` (one candidate per optimizer step)."""
    groups_read: int = 0
    groups_filtered: int = 0
    groups_trained: int = 0
    completions_read: int = 0
    completions_trained: int = 0
    reward_groups_filtered: int = 0
    reward_groups_kept: int = 0


class TokenCounts(_Kiln):
    """``TokenCountReceipt``: running totals over every trained candidate."""

    action_tokens: int = Field(default=0, ge=0)
    env_tokens: int = Field(default=0, ge=0)
    env_tokens_before_warning_filter: int = Field(default=0, ge=0)
    env_tokens_after_warning_filter: int = Field(default=0, ge=0)
    warning_tokens_filtered: int = Field(default=0, ge=0)
    context_tokens: int = Field(default=0, ge=0)


def f64_bits(value: float) -> str:
    """``"0x"`` + 16 lowercase hex digits of the IEEE-754 bits (``train_receipt.rs`` ``f64_ieee_bits``)."""
    return "0x%016x" % struct.unpack("<Q", struct.pack("<d", value))[0]


def _from_f64_bits(value: Any) -> float:
    if isinstance(value, str):
        if not value.startswith("0x") or len(value) != 18:
            raise ValueError("IEEE-754 f64 bits must be 0x followed by exactly 16 hex digits")
        value = struct.unpack("<d", struct.pack("<Q", int(value[2:], 16)))[0]
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("expected IEEE-754 f64 bits or a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError("gradient-norm accumulator values must be finite")
    return value


class GradNormStats(_Kiln):
    """``GradNormAccumulator``: count, sum, min and max of one module's per-step gradient norms."""

    sample_count: int = Field(default=0, ge=0)
    sum: float = 0.0
    min: float = 0.0
    max: float = 0.0

    @field_validator("sum", "min", "max", mode="before")
    @classmethod
    def _bits(cls, value: Any) -> float:
        return _from_f64_bits(value)

    @field_serializer("sum", "min", "max")
    def _as_bits(self, value: float) -> str:
        return f64_bits(value)

    def observe(self, norm: float) -> "GradNormStats":
        if self.sample_count == 0:
            return GradNormStats(sample_count=1, sum=norm, min=norm, max=norm)
        return GradNormStats(sample_count=self.sample_count + 1, sum=self.sum + norm, min=min(self.min, norm),
                             max=max(self.max, norm))


class LoraGradNorms(_Kiln):
    """``LoraGradNormAccumulator``: per LoRA module (``q_proj``, ...), the norms of every step."""

    by_module: dict[str, GradNormStats] = Field(default_factory=dict)

    def observe(self, norms: dict[str, float]) -> "LoraGradNorms":
        """Add one step: each module's norm rounded to f32 first, as Kiln's ``observe`` does."""
        by_module = dict(self.by_module)
        for module, norm in norms.items():
            value = struct.unpack("<f", struct.pack("<f", norm))[0] if math.isfinite(norm) else norm
            if math.isfinite(value):
                by_module[module] = by_module.get(module, GradNormStats()).observe(value)
        return LoraGradNorms(by_module=dict(sorted(by_module.items())))

    def summaries(self) -> list[dict[str, Any]]:
        """``LoraGradNormAccumulator::finish``: ``{module, sample_count, min, mean, max}`` per module."""
        return [{"module": name, "sample_count": s.sample_count, "min": s.min,
                 "mean": s.sum / max(s.sample_count, 1), "max": s.max} for name, s in self.by_module.items()]


class Guardrail(_Kiln):
    """``LengthInflationGuardrail`` in its initial state. kiln-flows does not run Kiln's length-inflation guardrail
    (it only logs in Kiln); field names are the struct's, the serde form of Kiln's version that
    derives it is not public (``diagnostics.rs``)."""

    consecutive_high_rep: int = 0
    consecutive_high_trunc: int = 0
    overlap_history: list[float] = Field(default_factory=list)
    entropy_gap_history: list[float] = Field(default_factory=list)
    consecutive_low_diversity: int = 0
    last_diversity: float = 0.0
    consecutive_low_self_play_kl: int = 0
    last_self_play_kl: float = 0.0
    last_decision: str = "Ok"


class OpdLoopState(_Kiln):
    """``kiln.opd-loop-state.v1``; ``epoch_index``/``cursor_in_epoch`` name the NEXT candidate."""

    schema_version: int = 1
    state_type: str = LOOP_STATE_TYPE
    global_step: int = Field(ge=0)
    epoch_index: int = Field(ge=0)
    cursor_in_epoch: int = Field(ge=0)
    loss_history: list[float]
    last_loss: float | None = None
    data_stats: DataStats
    token_counts: TokenCounts
    run_env_ce: float | None = None
    """The last ECHO env cross-entropy that fired, or null."""
    lora_grad_norms: LoraGradNorms = Field(default_factory=LoraGradNorms)
    guardrail: Guardrail = Field(default_factory=Guardrail)


# ---------------------------------------------------------------------------------------------
# kiln_flows_state.json (ours)


class GeneratorState(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    algorithm: str
    state_base64: str
    sha256: str


class RankRngState(BaseModel):
    """Every generator one process has: torch CPU and each CUDA device, Python, NumPy."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    torch_cpu: GeneratorState
    torch_cuda: list[GeneratorState]
    python_random: GeneratorState
    numpy: GeneratorState


class DataCursor(BaseModel):
    """Where in a set of shards the next candidate comes from (``kiln_core.corpus_set``).

    Kiln's loop state counts candidates over one file (``epoch_index``, ``cursor_in_epoch``); a corpus
    given as shards also needs the shard and the row in it. Once every candidate is trained the
    cursor points at the start of the epoch after the last one (``epoch`` equals the run's epochs).

    Attributes:
        set_sha256: The set digest (``kiln_core.contracts.corpus_shards.set_sha256``).
        epoch: 0-based epoch of the next candidate.
        shard: 0-based position of its shard in the set.
        shard_sha256: That shard's ``sha256:`` digest.
        row: 0-based example row in the shard (file order of its examples).
        sample: Which of the example's ``samples_per_prompt`` repeats it is (0-based).
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    set_sha256: str
    epoch: int = Field(ge=0)
    shard: int = Field(ge=0)
    shard_sha256: str
    row: int = Field(ge=0)
    sample: int = Field(ge=0)


class KilnFlowsState(BaseModel):
    """``kiln_flows_state.json``: the state of a kiln-flows run that Kiln's format has no field for.

    Attributes:
        world_size: Processes that wrote the checkpoint; each optimizer step takes
            ``world_size × sequences_per_step`` candidates, so a resume needs the same number.
        strategy: ``ddp`` or ``fsdp``, for people: both write the same files (the LoRA is replicated
            under either), so a checkpoint of one resumes under the other.
        sequences_per_step: Candidates per rank per optimizer step (our extension; Kiln: 1).
        loss: The loss actually trained, by its own name (the manifest's effective config names the tail
            bucket as the Kiln loss it extends). Before issue 31 the forward-KL and cross-entropy losses were
            recorded as ``teacher_top_k``; a resume still accepts that record for them.
        rank_rng: Every rank's generator states, rank 0 first.
        eval_curve: The held-out curve so far of a watched run (``kiln_core.training.watch``); absent
            otherwise, so an unwatched run writes the same file as before the watch existed.
        data_cursor: The next candidate's shard and row when the corpus is a set of shards; absent
            for one corpus file.
        lr_schedule: The learning-rate schedule (our extension); absent for a constant rate.
        pack_sequences: True for a run that packs each step's sequences (our extension); absent otherwise.
        lora_targets: The layers the LoRA adapts when they are not Kiln's seven projections; absent otherwise.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    format: Literal["kiln-flows.checkpoint-state.v1"] = EXTENSION_FORMAT
    kiln_flows_version: str
    world_size: int = Field(ge=1)
    backend: str | None
    strategy: Literal["ddp", "fsdp"] = "ddp"
    sequences_per_step: int = Field(ge=1)
    optimizer_steps_total: int = Field(ge=1)
    loss: Literal["teacher_top_k", "teacher_top_k_tail", "teacher_token_ce", "teacher_top_k_forward",
                  "teacher_top_k_tail_forward"]
    rank_rng: list[RankRngState]
    eval_curve: EvalCurve | None = Field(default=None, exclude_if=_omit_none)
    data_cursor: DataCursor | None = Field(default=None, exclude_if=_omit_none)
    lr_schedule: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)
    """The config's learning-rate schedule (``LrSchedule``), which the resumed steps must follow too; absent for
    Kiln's constant rate, so such a run writes the same file as before schedules existed."""
    pack_sequences: bool | None = Field(default=None, exclude_if=_omit_none)
    """True when a step's sequences were trained packed into one forward pass (``config.pack_sequences``): the same
    loss, other float rounding, so a resume must pack too; absent when they were trained one after another."""
    lora_targets: LoraTargets | None = Field(default=None, exclude_if=_omit_none)
    """The student's LoRA targets (``kiln_core.training.lora_targets``) when they differ from Kiln's seven
    projections (Phi-3's fused ``qkv_proj``, a mixture of experts' tensors); absent for Kiln's, so a Llama or Qwen
    run writes the same file as before targets were resolved from the model."""
