"""``OpdRequest`` and ``OpdConfig``: the OPD training request, its defaults and its submit-time rules.

Field names, defaults and rejection messages follow Kiln's crates/kiln-train/src/opd.rs.
Parsing is strict where serde is strict (an integer field refuses ``4.0`` and ``"4"``, a bool refuses
``1``), and the optimizer block denies unknown keys as Kiln's does.

The models themselves ignore unknown fields, as Kiln's serde structs do (``crates/kiln-train/src/opd.rs``:
``OpdRequest`` and ``OpdConfig`` have no ``deny_unknown_fields``). A request read through
``parse_opd_request`` refuses them (``invalid_request``, naming the key and the closest field), because a
typo such as ``learnign_rate`` would otherwise train at the default and publish; ``kiln_lenient=True``
(``kiln-flows train --kiln-lenient``) keeps Kiln's behaviour. ``grad_checkpoint_segments`` is a Kiln field
that Kiln ignores on input (``skip_deserializing``): never refused, always ignored.

The nested blocks (optimizer, Stable-OPD, ECHO) live in ``kiln_core.contracts.opd_blocks`` and are
re-exported here.

Kiln parses every wire value and rejects the unsupported ones at submit time with a specific message;
``kiln_core.contracts.opd_submit`` applies those rejections, so parsing ``"objective": "cross_entropy"``
succeeds and validation then says why it cannot run.

Extension (docs/architecture.md, decision 5): ``sequences_per_step`` (default 1 = Kiln) accumulates gradients over
that many consecutive candidates per optimizer step. It is part of the effective config, and therefore
of the checkpoint identity.

Extension: ``publish_guard`` (default on; ``kiln_core.training.publish_guard``) refuses to publish a run
whose weights or loss diverged. It decides only whether the result is published, so it is left out of
the effective config and of the run key: the same run, re-run with the guard off, resumes from the
checkpoint the tripped guard kept and publishes it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln_core.contracts.opd_blocks import (  # noqa: F401 - re-exported: the config's blocks import from here
    AdamWOptimizer,
    EchoConfig,
    LrSchedule,
    MuonOptimizer,
    Optimizer,
    SgdOptimizer,
    StableOpd,
    StableOpdAuto,
    StableOpdManual,
    StableOpdOff,
)
from kiln_core.contracts.form_choices import POSITIVE_FIELDS, flat_choice_schema, mark_positive
from kiln_core.contracts.opd_prompt import OpdPrompt
from kiln_core.contracts.unknown_keys import UnknownKey, find_unknown_keys

from kiln_core.errors import Rejection

__all__ = [
    "ConfigError",
    "MuonOptimizer",
    "AdamWOptimizer",
    "SgdOptimizer",
    "EchoConfig",
    "OpdConfig",
    "OpdRequest",
    "parse_opd_config",
    "parse_opd_request",
    "unknown_request_keys",
    "resolve_top_k",
    "resolve_learning_rate",
    "effective_samples_per_prompt",
    "PRESETS",
    "SAMPLING_FIELDS",
]

SUPPORTED_TOP_K = (32, 16)  # Kiln's KT kernels, largest first (opd.rs · resolve_opd_top_k)
DEFAULT_SAMPLES_PER_PROMPT = 4
U64_MAX = 2**64 - 1
# Kiln fields that Kiln never reads from a request (serde ``skip_deserializing``): ignored, never refused.
KILN_IGNORED_ON_INPUT = ("config.grad_checkpoint_segments",)


class ConfigError(Rejection, ValueError):
    """A request or config that Kiln would refuse at submit time.

    Attributes:
        message: The rejection message (Kiln's wording where Kiln has one).
        field: Dotted path of the offending field (``config.top_k``), or None for request-level rules.
        code: Stable machine-readable code for the CLI's rejection JSON.
    """

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_config") -> None:
        super().__init__(code, message, field=field)

    def __str__(self) -> str:
        return self.message


# ---------------------------------------------------------------------------------------------
# OpdConfig / OpdRequest


# Extension (issue 14): named recipes measured by bench/distill_quality.py. A preset fills in the fields
# a config leaves unset; fields given explicitly win. No preset is ever applied by default, so a Kiln
# request keeps Kiln's loss and defaults.
# On-policy sampling settings: they act only when the student samples rollouts from prompts. The run
# form shows them in the pipeline spec's `prompts` source, not among the config fields.
SAMPLING_FIELDS = ("samples_per_prompt", "temperature", "top_p", "max_tokens", "sampler_segments",
                   "rollout_prompt_rendering", "discount", "clip_epsilon", "stable_opd")

PRESETS: dict[str, dict[str, Any]] = {
    # Best on all three held-out metrics, per step and per second, of Kiln's loss, tail, SFT, forward
    # and tail+forward on SmolLM2-135M's half-depth student (bench/distill_quality.py; figures in bench/README.md).
    # A cosine decay beat the constant 1e-3 at equal training time (15 min: 49.5 % held-out top-1 against 46.8 %);
    # the decay spans the run's own steps, so it fits any run length. Peaks of 2e-3 / 1.5e-3 / 1.35e-3 / 1.2e-3
    # over a 12-epoch plan: 51.2 / 50.6 / 50.7 / 49.9 % top-1 and 2.05x / 2.01x / 1.98x / 1.99x the teacher's NLL.
    "quality": {
        "training_mode": "off_policy",
        "loss": "teacher_top_k_forward",
        "optimizer": {"kind": "adam_w"},
        "learning_rate": 1.35e-3,
        "lr_schedule": {"kind": "cosine", "warmup_steps": 20, "final_lr_ratio": 0.1},
        "lora_rank": 16,
        "lora_alpha": 32.0,
    },
}


class OpdConfig(BaseModel):
    """Kiln's ``OpdConfig`` (``crates/kiln-train/src/opd.rs``), every field with Kiln's default, plus
    ``sequences_per_step``.

    Example:
        >>> OpdConfig.model_validate({"training_mode": "off_policy"}).top_k
        32
    """

    # extra="ignore": see the module docstring (Kiln accepts and ignores unknown config fields).
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, use_attribute_docstrings=True,
                              title="Training config (Kiln OpdConfig)",
                              json_schema_extra={"description": "Kiln's OpdConfig: every field with Kiln's default."})

    training_mode: Literal["on_policy", "off_policy"] = "on_policy"
    """off_policy trains on a teacher-scored corpus; on_policy samples rollouts from prompts. Kiln default: on_policy (a pipeline spec defaults to off_policy)."""
    objective: Literal["reverse_kl", "cross_entropy"] = "reverse_kl"
    """Training objective; only reverse_kl runs (Kiln refuses cross_entropy at submit). Kiln default: reverse_kl."""
    loss: Literal["sampled_token", "teacher_top_k", "full_vocab", "teacher_top_k_tail", "teacher_token_ce",
                  "teacher_top_k_forward", "teacher_top_k_tail_forward"] = "teacher_top_k"
    """Per-token loss: teacher_top_k is Kiln's reverse KL over the teacher's top-K; the _tail, _forward and teacher_token_ce values are opt-in kiln-flows extensions (kiln_core.loss). Kiln default: teacher_top_k."""
    top_k: int = Field(default=32, ge=0)
    """Teacher tokens per position the loss compares (count); Kiln runs 16 or 32 (16-31 become 16, 32 and more become 32). Kiln default: 32."""
    samples_per_prompt: int = Field(default=DEFAULT_SAMPLES_PER_PROMPT, ge=0)
    """On-policy: rollouts per prompt (the default 4 scales up for few prompts); off-policy: 4 means each example once, n repeats it n times. Kiln default: 4."""
    temperature: float = 1.0
    """On-policy sampling temperature (unitless; no effect off-policy). Kiln default: 1.0."""
    top_p: float = 0.9
    """On-policy nucleus-sampling probability mass, 0 to 1 (no effect off-policy). Kiln default: 0.9."""
    max_tokens: int = Field(default=7168, ge=1)
    """On-policy: most tokens one rollout may generate (no effect off-policy). Kiln default: 7168."""
    sampler_segments: int | None = Field(default=None, ge=0)
    """On-policy: segments the sampler splits a rollout into (count; empty = Kiln's choice, 0 is refused). Kiln default: empty."""
    rollout_prompt_rendering: Literal["legacy_action_boundary", "chat_template"] = "legacy_action_boundary"
    """On-policy: how a prompt is rendered before sampling (no effect off-policy). Kiln default: legacy_action_boundary."""
    stable_opd: StableOpd = Field(default_factory=StableOpdOff, title="Stable-OPD")
    """Stable-OPD regularization: off, auto or manual; only off runs today. Kiln default: off."""
    discount: float = 0.0
    """On-policy advantage discount (unitless); only 0 runs today. Kiln default: 0."""
    clip_epsilon: float = 0.0
    """On-policy importance-ratio clipping (unitless); only 0 runs today. Kiln default: 0."""
    learning_rate: float | None = None
    """Optimizer step size; empty uses the optimizer's default (muon 2e-3, adam_w and sgd 1e-5). Kiln default: empty."""
    lora_rank: int = Field(default=16, ge=1)
    """LoRA rank r: the inner size of the adapter's low-rank matrices (count). Kiln default: 16."""
    lora_alpha: float = 32.0
    """LoRA alpha: updates are scaled by alpha/rank, refused above 2 unless allow_high_lora_scale. Kiln default: 32."""
    allow_high_lora_scale: bool = False
    """Train even when lora_alpha/lora_rank is above 2. Kiln default: false."""
    base_adapter: str | None = None
    """Warm start from this adapter's weights (a published adapter name, or an adapter directory); fresh optimizer. Kiln default: empty."""
    output_name: str | None = None
    """Kiln's name for the trained adapter; a pipeline run uses its adapter field instead. Kiln default: empty."""
    auto_load: bool = True
    """Kiln server: load the adapter once trained (recorded; no effect in kiln-flows). Kiln default: true."""
    checkpoint_interval: int | None = Field(default=25, ge=0)
    """Save an exact, resumable checkpoint every this many optimizer steps; empty disables, 0 is refused. Kiln default: 25."""
    resume_checkpoint: str | None = None
    """Checkpoint to resume from; pipeline runs resume from their newest checkpoint by themselves. Kiln default: empty."""
    detect_anomaly: bool = False
    """Run with torch autograd anomaly detection (slow; for tracing NaN losses). Kiln default: false."""
    seed: int | None = Field(default=None, ge=0, le=U64_MAX)
    """Random seed of the LoRA init and sampling, 0 to 2^64-1; empty derives one from the run's inputs (recorded in the receipt). Kiln default: empty."""
    optimizer: Optimizer = Field(default_factory=MuonOptimizer)
    """Optimizer and its settings: muon, adam_w or sgd. Kiln default: muon."""
    echo: EchoConfig | None = Field(default=None, title="ECHO")
    """ECHO: add an environment cross-entropy term on observation tokens; empty = off. Kiln default: off."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the corpus (count). Kiln default: 1."""
    max_cost_usd: float | None = None
    """Cost budget in US dollars; not enforced for OPD, so only empty runs. Kiln default: empty."""
    sequences_per_step: int = Field(default=1, ge=1)
    """kiln-flows extension: sequences per optimizer step (gradient accumulation, mean of their losses). Default 1, as Kiln."""
    pack_sequences: bool = False
    """kiln-flows extension: train a step's sequences_per_step sequences in one forward pass, packed end to end without padding (each sees only itself); the same loss, more tokens per second. Default: off (one after another)."""
    preset: Literal["quality"] | None = None
    """kiln-flows extension: a named recipe (quality) that fills in the fields this config leaves unset. Default: none."""
    lr_schedule: LrSchedule | None = Field(default=None, title="Learning-rate schedule")
    """kiln-flows extension: warm-up and linear or cosine decay of learning_rate over the run's steps; empty = constant, as Kiln."""
    publish_guard: bool = True
    """kiln-flows extension: refuse to publish a run whose weights or loss diverged (failed with training_diverged, checkpoints kept); false publishes it anyway. Default: on."""

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        # This JSON schema exists for one reader, the Prefect UI's run form. There the training mode follows
        # the pipeline spec's source and the sampling settings sit in its on-policy source, so neither is
        # listed among the config fields. Parsing is untouched: every field is accepted as before.
        schema = handler(core_schema)
        properties = handler.resolve_ref_schema(schema).get("properties", {})
        for name in ("training_mode", *SAMPLING_FIELDS):
            properties.pop(name, None)
        # Prefect's V1 form cannot type an exponent (its number box drops the e); say how to type a small rate.
        learning_rate = properties.get("learning_rate")
        if learning_rate is not None:
            learning_rate["description"] += " Prefect's V1 form takes no exponent: type 0.00001 there, not 1e-5."
        properties["optimizer"] = flat_choice_schema(
            "kind", (MuonOptimizer, AdamWOptimizer, SgdOptimizer), title="Optimizer",
            description="Optimizer and its settings: muon (Kiln's default), adam_w or sgd. Fill in only the chosen "
            "optimizer's settings; empty ones take Kiln's defaults.")
        for name in POSITIVE_FIELDS:  # Kiln refuses 0 at submit; the form refuses it inline
            if name in properties:
                mark_positive(properties[name])
        return schema

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            if data["preset"] not in PRESETS:
                raise ValueError(f"unknown preset {data['preset']!r}; available: {', '.join(sorted(PRESETS))}")
            return {**PRESETS[data["preset"]], **data}
        return data


class OpdRequest(BaseModel):
    """Kiln's ``OpdRequest`` body (``crates/kiln-train/src/opd.rs``). The model ignores unknown fields, as Kiln does;
    ``parse_opd_request`` refuses them unless asked to be lenient."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    teacher: str
    prompts: list[OpdPrompt] = Field(default_factory=list)
    """On-policy prompts (Kiln's ``OpdPrompt``); ``null`` is refused as serde refuses it."""
    dataset_path: str | None = None
    config: OpdConfig = Field(default_factory=OpdConfig)
    post_eval: dict[str, Any] | None = None

    @field_validator("dataset_path")
    @classmethod
    def _blank_is_absent(cls, value: str | None) -> str | None:
        # Kiln trims dataset_path and treats a blank one as absent.
        if value is None or not value.strip():
            return None
        return value.strip()


def _first_error(error: ValidationError, prefix: str) -> ConfigError:
    first = error.errors()[0]
    path = ".".join(str(part) for part in first["loc"] if not str(part).startswith("function-"))
    where = f"{prefix}.{path}" if prefix and path else (path or prefix)
    return ConfigError(f"invalid OPD {where or 'request'}: {first['msg']}", where or None)


def parse_opd_config(value: Any) -> OpdConfig:
    """Validate a decoded ``config`` object; a pydantic failure becomes one ``ConfigError``.

    Example:
        >>> parse_opd_config({"optimizer": {"kind": "sgd"}}).optimizer.kind
        'sgd'
    """
    try:
        return OpdConfig.model_validate(value)
    except ValidationError as error:
        raise _first_error(error, "config") from None


def unknown_request_keys(value: Any) -> list[UnknownKey]:
    """Every key of a decoded request that Kiln's ``OpdRequest`` (top level) and ``OpdConfig`` (``config``,
    its ``echo`` and ``stable_opd`` blocks, the optimizer) do not know, in document order.

    Example:
        >>> [key.describe() for key in unknown_request_keys({"teacher": "t", "config": {"learnign_rate": 1}})]
        ["`config.learnign_rate`: unknown key (not a field of Kiln's OpdConfig); did you mean `learning_rate`?"]
    """
    return find_unknown_keys(value, OpdRequest, owners={OpdRequest: "Kiln's OpdRequest", OpdConfig: "Kiln's OpdConfig"},
                             tolerated=KILN_IGNORED_ON_INPUT)


def parse_opd_request(value: Any, *, kiln_lenient: bool = False) -> OpdRequest:
    """Validate a decoded ``OpdRequest`` object; a pydantic failure becomes one ``ConfigError``.

    Args:
        value: The decoded request.
        kiln_lenient: Ignore unknown keys as Kiln does (the caller reports ``unknown_request_keys``);
            keys Kiln refuses too (inside the optimizer block) are refused either way.

    Raises:
        ConfigError: ``invalid_request`` naming the first unknown key and the closest field, or the first
            field pydantic refuses.
    """
    for unknown in unknown_request_keys(value):
        if not kiln_lenient or unknown.kiln_refuses:
            raise ConfigError(f"invalid OPD request: {unknown.describe()}", unknown.path, code="invalid_request")
    try:
        return OpdRequest.model_validate(value)
    except ValidationError as error:
        raise _first_error(error, "") from None


# ---------------------------------------------------------------------------------------------
# Resolution rules


def resolve_top_k(requested: int, source_cap: int | None = None) -> int:
    """Kiln's ``resolve_opd_top_k(requested, source_cap)``: the largest of ``SUPPORTED_TOP_K`` that is
    at most both the requested K and what the teacher source can serve. The one top-K rule: the
    request checks, admission (``--top-k``), the on-policy teacher binding and the plan all call it.

    Args:
        requested: The request's ``config.top_k``.
        source_cap: What the teacher source serves: ``min(max_top_k, vocab_size)`` of a pinned teacher;
            None for a pre-scored corpus, whose cap is the requested K itself.

    Returns:
        32 or 16.

    Raises:
        ConfigError: ``invalid_config`` for a K that is not a positive integer ("OPD top_k must be > 0");
            ``top_k_unsupported`` when no supported size fits under the request and the cap.

    Example:
        >>> resolve_top_k(20), resolve_top_k(64), resolve_top_k(64, source_cap=20)
        (16, 32, 16)
    """
    if isinstance(requested, bool) or not isinstance(requested, int) or requested <= 0:
        raise ConfigError("OPD top_k must be > 0", "config.top_k")
    cap = requested if source_cap is None else source_cap
    for size in SUPPORTED_TOP_K:
        if size <= requested and size <= cap:
            return size
    raise ConfigError(
        f"OPD top_k {requested} is not executable with source cap {cap}: OPD teacher_top_k has no "
        f"executable support size: requested {requested}, source cap {cap}, KT kernels require one of "
        "{16, 32}",
        "config.top_k",
        code="top_k_unsupported",
    )


def default_learning_rate(optimizer_kind: str) -> float:
    """Kiln's OPD default: Muon 2e-3, AdamW/SGD 1e-5."""
    return 2e-3 if optimizer_kind == "muon" else 1e-5


def resolve_learning_rate(config: OpdConfig) -> float:
    """The learning rate the trainer uses: the explicit value, else the optimizer's default.

    Example:
        >>> resolve_learning_rate(OpdConfig(optimizer={"kind": "adam_w"}))
        1e-05
    """
    if config.learning_rate is not None:
        return float(config.learning_rate)
    return default_learning_rate(config.optimizer.kind)


def effective_samples_per_prompt(config: OpdConfig, prompt_count: int | None = None) -> int:
    """Candidates per example per epoch.

    Off-policy: the default 4 means 1 (each example once); any other value n repeats it n times.
    On-policy: the default 4 auto-scales to 64 below 50 prompts, 16 below 200, else 4, counting every
    prompt of the request before any is dropped (``opd.rs`` · ``opd_train_to_with_checkpoint_root_and_runtime``).

    Example:
        >>> effective_samples_per_prompt(OpdConfig(training_mode="off_policy"))
        1
    """
    n = config.samples_per_prompt
    if n != DEFAULT_SAMPLES_PER_PROMPT:
        return n
    if config.training_mode == "off_policy":
        return 1
    if prompt_count is None:
        return n
    return 64 if prompt_count < 50 else 16 if prompt_count < 200 else 4


def drop_unused_step_extensions(data: dict[str, Any]) -> dict[str, Any]:
    """Remove, in place, the step extensions a dumped config leaves at Kiln's behaviour (``lr_schedule`` empty: a
    constant rate; ``pack_sequences`` off: one sequence after another), so the run key of such a config
    (``ResolvedSettings.run_key_config``) is what it was before the extensions existed. Returns ``data``."""
    if data.get("lr_schedule") is None:
        data.pop("lr_schedule", None)
    if not data.get("pack_sequences"):
        data.pop("pack_sequences", None)
    return data

