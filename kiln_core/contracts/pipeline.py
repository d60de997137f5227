"""``PipelineSpec``: one declarative description of an OPD distillation run.

It is the single parameter of the ``opd_distill`` flow, so the Prefect UI renders it as the run form
(field descriptions become help text, ``Literal`` fields become dropdowns), and it loads from a YAML
file for ``kiln-flows run pipeline.yaml``. ``kiln-flows train`` builds one from a Kiln request file,
and both hand it to the engine (``kiln_core.engine``). Validation happens before any work: an invalid
spec fails with the offending field named (``SpecError``, a ``Rejection``). A hand-written spec's
``config:`` refuses unknown keys (a typo such as ``lora_rnak`` would otherwise train with the
default); Kiln request files keep Kiln's ignore-unknown behaviour (``OpdRequest``).

Two views of the same spec. The form's: the training data is one ``source`` (a scored ``corpus``,
``examples`` to score, or on-policy ``prompts`` with their sampling settings), and the config shows
neither ``training_mode`` (the source decides it) nor the sampling settings. The file's: ``corpus:``
or ``examples:`` at the top level and every config field, as before. Both validate to the same spec
and effective config; a dump is the form's view. Rules a JSON schema can carry in plain words (ranges,
enums, lengths) are in the schema, so the form refuses them inline; the adapter-name rule is not (a
``pattern`` would be shown to the user as a regular expression) and is refused by the run's first task.

Secrets never belong here: S3 credentials come from the environment or a Prefect block
(``storage_block``), never from a field of this model.

Example:
    >>> spec = PipelineSpec.model_validate({
    ...     "teacher": {"kind": "local_dir", "path": "./teacher"},
    ...     "corpus": "./teacher-data.jsonl",
    ...     "student": "./student",
    ...     "adapter": "offline-distilled",
    ... })
    >>> spec.config.training_mode
    'off_policy'
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from kiln_core.contracts.eval_watch import EvalWatch
from kiln_core.contracts.form_choices import (complete_for_form, config_from_form, require_numbers,
                                             spec_form_schema)
from kiln_core.contracts.names import NAME_RULE, is_valid_name
from kiln_core.contracts.opd_config import SAMPLING_FIELDS, OpdConfig
from kiln_core.contracts.quality_gate import QualityGate
from kiln_core.contracts.recipe_record import RecipeRecord
from kiln_core.contracts.sources import OnPolicySampling, TrainingData
from kiln_core.contracts.spec_blocks import DistributedOptions, RunOptions, TeacherSource, VllmBackends
from kiln_core.contracts.unknown_keys import UnknownKey, find_unknown_keys
from kiln_core.contracts.post_eval.config import PostEvalConfig
from kiln_core.errors import Rejection
from kiln_core.storage import is_local_uri


class SpecError(Rejection, ValueError):
    """An invalid pipeline spec; the message names the field (code ``invalid_spec`` unless given)."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_spec",
                 file: str | None = None) -> None:
        super().__init__(code, message, field=field, file=file)

    def __str__(self) -> str:
        return self.message


def _default_config() -> OpdConfig:
    return OpdConfig(training_mode="off_policy")


class PipelineSpec(BaseModel):
    """A Kiln-compatible distillation run: teacher → corpus (or prompts, on-policy) → student → adapter."""

    model_config = ConfigDict(extra="forbid", title="PipelineSpec", json_schema_extra=spec_form_schema)

    teacher: TeacherSource = Field(
        default_factory=lambda: TeacherSource(kind="local_registry", alias="teacher"),
        description="The teacher whose identity the corpus manifest must match.",
        json_schema_extra={"position": 0},
    )
    source: TrainingData | SkipJsonSchema[None] = Field(
        default=None,
        title="Training data",
        description="What the student learns from: a scored corpus or examples to score (off-policy), or prompts "
        "(on-policy); the kind decides the training mode.",
        json_schema_extra={"position": 1},
    )
    # The same choice as two plain fields, for YAML specs and Kiln request files; the form shows `source`.
    # Dumps carry `source` only, so a dumped spec validates against the form's schema.
    corpus: SkipJsonSchema[str | None] = Field(
        default=None, exclude=True,
        description="Teacher-scored JSONL corpus (local path or fsspec URI: file://, s3://, memory://).",
    )
    examples: SkipJsonSchema[str | None] = Field(
        default=None, exclude=True,
        description="Unscored examples JSONL to score with a local teacher first (instead of `corpus`).",
    )
    prompts: SkipJsonSchema[str | None] = Field(
        default=None, exclude=True,
        description="On-policy prompts: a JSONL of Kiln OpdPrompt objects ({messages, teacher_extra_messages?, "
        "trajectory?}), local path or fsspec URI, instead of `corpus`/`examples`; the student samples its own "
        "answers and a local teacher scores them (`config.training_mode` on_policy).",
    )
    student: str = Field(
        description="Student model directory (config.json, fast tokenizer, weights) or fsspec URI of one.",
        json_schema_extra={"position": 3},
    )
    storage_root: str = Field(
        default="./kiln-data",
        description="Where corpora, checkpoints, adapters and receipts are published (path or fsspec URI). "
        "Default: ./kiln-data.",
        json_schema_extra={"position": 4},
    )
    adapter: str = Field(
        description=f"Output adapter name: {NAME_RULE}.",
        # Only the length in the schema: a JSON-schema `pattern` would make both UIs answer a bad name with
        # "does not match '<regular expression>'". The rule itself is checked by the run's first task, which
        # refuses the run in the words of the description (`spec.adapter: 'x y' must be 1-128 characters…`).
        json_schema_extra={"position": 5, "minLength": 1, "maxLength": 128},
    )
    config: OpdConfig = Field(
        default_factory=_default_config,
        description="Kiln's training config (OpdConfig): loss, top-K, optimizer, LoRA rank and alpha, epochs, "
        "checkpoints, seed; every field shows Kiln's default.",
        json_schema_extra={"position": 6},
    )
    options: RunOptions = Field(default_factory=RunOptions, description="How the pipeline runs: retries, refresh, "
                                "progress and cancellation intervals, storage credentials.",
                                json_schema_extra={"position": 7})
    distributed: DistributedOptions | None = Field(
        default=None,
        title="Distributed training",
        description="Train on several processes with torch.distributed: on this machine (torchrun: nproc, "
        "backend) or on a Ray cluster (engine ray: address, workers); empty = one process.",
        json_schema_extra={"position": 8},
    )
    post_eval: PostEvalConfig | None = Field(
        default=None,
        title="Promotion gate (Kiln post_eval)",
        description="Kiln's post-training eval (suite, data_scope, generation, min_accuracy, include_baseline). "
        "With min_accuracy, only a promoted adapter moves runs/ADAPTER/latest.json; a losing one is renamed "
        "ADAPTER.failed (docs/post-eval.md).",
        json_schema_extra={"position": 9},
    )
    quality_gate: QualityGate | None = Field(
        default=None,
        title="Quality gate (held-out metrics)",
        description="Optional second gate: thresholds on the adapter's held-out distillation metrics "
        "(reverse KL, top-1 agreement, teacher-token NLL).",
        json_schema_extra={"position": 10},
    )
    eval: EvalWatch | None = Field(
        default=None,
        title="Held-out watch during training",
        description="Optional held-out watch during training: score a held-out slice every N steps, warn on "
        "divergence, optionally stop (docs/eval-watch.md). Off by default.",
        json_schema_extra={"position": 11},
    )

    vllm: VllmBackends | None = Field(
        default=None,
        title="vLLM servers (on-policy)",
        description="On-policy only: sample rollouts and/or score them on vLLM servers instead of the training "
        "process (rollouts_url, teacher_url, sync_dir). Empty = both local.",
        json_schema_extra={"position": 12},
    )

    recipe: SkipJsonSchema[RecipeRecord | None] = Field(
        default=None, exclude=True,
        description="Set by the recipe commands and flows (distill self/merge/pump, recipe run), never by hand: "
        "recorded in the run's receipt as its `recipe` block and in Kiln's receipt.json beside the adapter.",
    )
    ignored_request_keys: SkipJsonSchema[tuple[str, ...]] = Field(
        default=(), exclude=True,
        description="Set by `kiln-flows train --kiln-lenient`, never by hand: the unknown request keys it ignored, "
        "recorded in the run's receipt.",
    )

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        # The run form's schema: every number field is required, so a number a form could not read (and
        # left out) is refused under its field instead of running with the default (form_choices).
        schema = handler(core_schema)
        require_numbers(handler.resolve_ref_schema(schema), handler.resolve_ref_schema)
        return schema

    @field_validator("config", mode="before")
    @classmethod
    def _no_unknown_config_keys(cls, value: Any) -> Any:
        # The form's optimizer and Stable-OPD are flat objects (every branch's settings, empty ones null).
        value = config_from_form(value)
        # A typo in a hand-written spec must not train with the default and publish.
        unknown = unknown_config_keys(value)
        if unknown:
            raise ValueError(unknown[0].describe())
        if isinstance(value, dict) and "training_mode" not in value:
            # The form does not show training_mode (the source decides it); a pipeline trains off-policy.
            value = {**value, "training_mode": "off_policy"}
        return value

    @model_validator(mode="before")
    @classmethod
    def _training_mode_from_the_data(cls, value: Any) -> Any:
        """The training mode follows the training data. The form's ``source.kind`` decides it outright: the
        form does not show ``config.training_mode``, so a value stored with a deployment's defaults (``serve
        --spec``) must not pin it. A YAML ``prompts:`` spec whose config does not say otherwise trains
        on-policy (Kiln's default ``training_mode``); one that says off_policy is refused below."""
        if not isinstance(value, dict):
            return value
        source = value.get("source")
        source_kind = source.get("kind", "corpus") if isinstance(source, dict) else getattr(source, "kind", None)
        config = value.get("config")
        if source_kind is not None:
            mode = "on_policy" if source_kind == "prompts" else "off_policy"
            if config is None:
                return {**value, "config": {"training_mode": mode}}
            if isinstance(config, dict):
                return {**value, "config": {**config, "training_mode": mode}}
            if isinstance(config, OpdConfig):
                return {**value, "config": config.model_copy(update={"training_mode": mode})}
            return value
        if value.get("prompts") is None:
            return value
        if config is None:
            return {**value, "config": OpdConfig()}
        if isinstance(config, dict) and "training_mode" not in config:
            return {**value, "config": {**config, "training_mode": "on_policy"}}
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "PipelineSpec":
        self._bind_source()
        sources = [name for name in ("corpus", "examples", "prompts") if getattr(self, name) is not None]
        if len(sources) != 1:
            given = f"got {' and '.join(f'`{name}`' for name in sources)}" if sources else "got none"
            raise ValueError("give exactly one of `corpus` (already scored), `examples` (to score first) or "
                             f"`prompts` (on-policy); {given}")
        if self.prompts is not None:
            return self._on_policy_consistent()
        if self.vllm is not None:
            raise ValueError("`vllm`: vLLM rollout and teacher servers are for on-policy `prompts` only; a corpus "
                             "is already scored")
        if self.examples is not None and self.teacher.kind not in ("local_dir", "local_registry"):
            raise ValueError("`examples` needs a local teacher to score with (teacher.kind local_dir or local_registry)")
        if not is_valid_name(self.adapter):
            raise ValueError(f"`adapter`: {self.adapter!r} must be {NAME_RULE}")
        if self.config.training_mode != "off_policy":
            raise ValueError("`config.training_mode` must be off_policy for a JSONL corpus")
        from kiln_core.contracts.opd_config import ConfigError
        from kiln_core.contracts.opd_submit import validate_for_offline_training

        try:
            validate_for_offline_training(self.config)
        except ConfigError as error:
            field = error.field if error.field and error.field.startswith("config") else f"config.{error.field or ''}".rstrip(".")
            raise ValueError(f"`{field}`: {error.message}") from None
        self._check_gates()
        return self

    def form_defaults(self) -> dict[str, Any]:
        """This spec as a deployment's default parameters (``kiln-flows serve --spec``): the form's view
        without what the form's training-data choice decides. ``config.training_mode`` follows
        ``source.kind``, and the sampling settings live in ``source.sampling`` (prompts); left in the
        config, these hidden values would ride along with every run from the form, whichever kind is
        chosen. An off-policy spec keeps a sampling field it sets (``samples_per_prompt`` repeats examples).

        Example:
            >>> spec = PipelineSpec(corpus="c.jsonl", student="s", adapter="a")
            >>> "training_mode" in spec.form_defaults()["config"]
            False
        """
        data = self.model_dump(mode="json", by_alias=True)
        config = data["config"]
        config.pop("training_mode", None)
        defaults = OpdConfig().model_dump(mode="json", by_alias=True)
        for name in SAMPLING_FIELDS:
            if (self.source is not None and self.source.kind == "prompts") or config.get(name) == defaults[name]:
                config.pop(name, None)
        # Every field the form requires (its numbers), so a Quick run's parameters pass the server's check.
        return complete_for_form(data, PipelineSpec.model_json_schema(by_alias=True))

    def _check_gates(self) -> None:
        """Kiln's submit-time ``post_eval`` rules, and the watch's one-process rule, before any work."""
        from kiln_core.contracts.post_eval.config import validate_post_eval_config
        from kiln_core.contracts.post_eval.errors import PostEvalRejection

        try:
            validate_post_eval_config(self.post_eval, None)  # the installed-suite check needs storage: engine
        except PostEvalRejection as error:
            raise ValueError(f"`{error.field}`: {error.message}") from None
        if self.eval is not None and self.distributed is not None and (
                self.distributed.world_size > 1 or self.distributed.engine == "ray"):
            raise ValueError("`eval`: held-out evaluation during training runs in a single process; "
                             "remove `distributed` or the `eval` block")

    def _bind_source(self) -> None:
        """Fill ``corpus``/``examples``/``prompts`` from ``source`` (the form), or ``source`` from them (YAML,
        requests). A prompts source's sampling settings become the config's (the form keeps them apart)."""
        given = [name for name in ("corpus", "examples", "prompts") if getattr(self, name) is not None]
        if self.source is None:
            if len(given) == 1 and self.prompts is not None:
                sampling = {name: getattr(self.config, name) for name in SAMPLING_FIELDS}
                self.source = TrainingData(kind="prompts", prompts=self.prompts, sampling=OnPolicySampling(**sampling))
            elif len(given) == 1:
                self.source = TrainingData(kind=given[0], **{given[0]: getattr(self, given[0])})
            return
        if given:
            raise ValueError("`source`: give the training data once, as `source` or as `corpus`/`examples`/`prompts`")
        setattr(self, self.source.kind, self.source.path)
        if self.source.kind == "prompts":
            self.config = self.config.model_copy(update=self.source.sampling.config_values())

    def _on_policy_consistent(self) -> "PipelineSpec":
        """The rules of a ``prompts`` spec that need no file: mode, one process, Kiln's config rules. The
        teacher (local, the student's vocabulary) and the prompts are checked by the engine's prompt stage
        (``kiln_core.engine.prompts``), with Kiln's codes."""
        from kiln_core.contracts.opd_config import ConfigError
        from kiln_core.contracts.opd_submit import validate_config_rules
        from kiln_core.contracts.settings import check_one_process

        if not is_valid_name(self.adapter):
            raise ValueError(f"`adapter`: {self.adapter!r} must be {NAME_RULE}")
        if self.config.training_mode != "on_policy":
            raise ValueError("`config.training_mode` must be on_policy for `prompts` (off_policy trains from a "
                             "teacher-scored `corpus`)")
        if self.distributed is not None:
            try:
                check_one_process(ray=self.distributed.engine == "ray", field="distributed.engine")
                check_one_process(world_size=self.distributed.nproc, field="distributed.nproc")
            except ConfigError as error:
                raise ValueError(f"`{error.field}`: {error.message}") from None
        self._check_gates()  # `eval` and `quality_gate` measure against a held-out corpus, as off-policy
        if self.vllm is not None and self.vllm.rollouts_url and self.vllm.sync_dir is None \
                and not is_local_uri(self.storage_root):
            raise ValueError("`vllm.sync_dir`: required when storage_root is not local (the vLLM server reads "
                             "the LoRA from a local directory)")
        try:
            validate_config_rules(self.config, pre_scored=False)
        except ConfigError as error:
            field = error.field if error.field and error.field.startswith("config") else f"config.{error.field or ''}".rstrip(".")
            raise ValueError(f"`{field}`: {error.message}") from None
        return self


def unknown_config_keys(value: Any) -> list[UnknownKey]:
    """The keys of a ``config`` mapping that no ``OpdConfig`` field (or nested block) knows, with their path
    (``config.lora_rnak``, ``config.echo.lamda``) and the closest field: the request's rule
    (``kiln_core.contracts.opd_config.unknown_request_keys``), with the same message. Unlike a request, a
    spec refuses ``grad_checkpoint_segments`` too: Kiln never reads it, so writing it in a spec is a mistake.

    Example:
        >>> [key.describe() for key in unknown_config_keys({"lora_rnak": 8})]
        ["`config.lora_rnak`: unknown key (not a field of Kiln's OpdConfig); did you mean `lora_rank`?"]
    """
    return find_unknown_keys(value, OpdConfig, prefix="config.", owners={OpdConfig: "Kiln's OpdConfig"})


_RULE_CODES = {"adapter": "invalid_adapter_name", "distributed.strategy": "unsupported_strategy",
               "distributed.address": "invalid_ray_address"}


def parse_spec(value: Any, *, file: str | None = None) -> PipelineSpec:
    """Validate a spec from a dict, naming the first invalid field.

    Raises:
        SpecError: With the dotted field path, e.g. ``config.top_k: Input should be ...``.
    """
    if isinstance(value, PipelineSpec):
        return value
    try:
        return PipelineSpec.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(_field_path(first["loc"]))
        message = first["msg"].removeprefix("Value error, ")
        if message.startswith("`"):  # a rule that names its own field, relative to where it ran
            named = message[1:message.index("`", 1)]
            field = named if not where or named.startswith(where) else f"{where}.{named}"
            rest = message[len(named) + 2:]
            # one code for one rule, whether a request, a spec, the CLI or the training stage breaks it
            code = _RULE_CODES.get(field, "invalid_spec")
            raise SpecError(f"invalid pipeline spec: `{field}`{rest}", field, code=code, file=file) from None
        raise SpecError(f"invalid pipeline spec: `{where or 'spec'}`: {message}", where or None, file=file) from None


def _field_path(loc: tuple) -> list[str]:
    """A validation error's location as field names: pydantic's union markers and the discriminator
    tag that follows one (``source.tagged-union[...].corpus.examples`` → ``source.examples``) are dropped."""
    parts: list[str] = []
    skip_tag = False
    for part in map(str, loc):
        if part.startswith("tagged-union["):
            skip_tag = True
        elif part.startswith(("function-after[", "function-before[", "function-wrap[")):
            continue  # the label of a union member with validators (`TrainingData | None`)
        elif skip_tag:
            skip_tag = False
        else:
            parts.append(part)
    return parts
