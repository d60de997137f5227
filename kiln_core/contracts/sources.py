"""The training data of a pipeline spec as the run form shows it: one ``source`` whose ``kind`` says
which of three inputs the run learns from.

* ``corpus`` — off-policy, a JSONL corpus the teacher already scored (Kiln's ``dataset_path``);
* ``examples`` — off-policy, unscored examples the local teacher scores first;
* ``prompts`` — on-policy, prompts the student answers, with the sampling settings that only act there
  (``OnPolicySampling``: the same fields as ``OpdConfig``'s, with the same rules and descriptions).

One flat object (a ``kind`` dropdown plus one optional field per kind), not a union of three objects:
Prefect's default UI (V1) renders a ``oneOf`` as a raw JSON editor, while both of its UIs render a plain
enum and plain fields. The rules a union would carry are checked here instead: the field of the chosen
kind is required, another kind's field is refused (empty values count as not given, since a form sends
what it shows), and sampling settings belong to ``prompts``. ``PipelineSpec`` binds the chosen source
to its ``corpus`` / ``examples`` / ``prompts`` fields (``kiln_core.contracts.pipeline``).

Example:
    >>> TrainingData(kind="corpus", corpus="./scored.jsonl").path
    './scored.jsonl'
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_serializer, model_validator

from kiln_core.contracts.form_choices import POSITIVE_FIELDS, flat_choice_schema, mark_positive, normalize_flat_choice
from kiln_core.contracts.opd_config import (DEFAULT_SAMPLES_PER_PROMPT, SAMPLING_FIELDS, OpdConfig, StableOpdAuto,
                                            StableOpdManual, StableOpdOff)

SOURCE_KINDS = ("corpus", "examples", "prompts")

STABLE_OPD_MODES = (StableOpdOff, StableOpdAuto, StableOpdManual)


class _SamplingForm(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, title="Sampling (prompts only)")

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        # Fields, not JSON editors, in both Prefect UIs: Stable-OPD's choice as one flat object, and the
        # counts that must be above zero marked so (see OpdConfig's schema hook).
        schema = handler(core_schema)
        properties = handler.resolve_ref_schema(schema).get("properties", {})
        if "stable_opd" in properties:
            properties["stable_opd"] = flat_choice_schema(
                "mode", STABLE_OPD_MODES, title="Stable-OPD",
                description="Stable-OPD regularization: off, auto or manual; only off runs today. Kiln default: off.")
        for name in POSITIVE_FIELDS:
            if name in properties:
                mark_positive(properties[name])
        return schema

    @model_validator(mode="before")
    @classmethod
    def _flat_stable_opd(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("stable_opd"), dict):
            value = {**value, "stable_opd": normalize_flat_choice(value["stable_opd"], "mode", STABLE_OPD_MODES,
                                                                  where="stable_opd", default="off")}
        if isinstance(value, dict) and value.get("samples_per_prompt") == DEFAULT_SAMPLES_PER_PROMPT:
            value = {**value, "samples_per_prompt": None}  # Kiln's 4 is its auto-scaling: the form's empty
        return value

    def config_values(self) -> dict[str, Any]:
        """These settings as ``OpdConfig``'s fields (empty samples per prompt is Kiln's 4: auto-scaling)."""
        values = dict(self)
        if values["samples_per_prompt"] is None:
            values["samples_per_prompt"] = DEFAULT_SAMPLES_PER_PROMPT
        return values


# Kiln's samples_per_prompt defaults to 4 and reads 4 as "scale up for few prompts" (64 below 50 prompts), so
# a form showing 4 would not show what runs: the form shows it empty, with the rule in words.
_SAMPLES_PER_PROMPT = Field(
    default=None, ge=0, title="Samples Per Prompt",
    description="Rollouts per prompt. Empty: Kiln's auto-scaling, 64 per prompt below 50 prompts, 16 below 200, 4 "
    "from 200 (Kiln reads 4 the same way); another number is used as it is. The run's log says how many it used.")

# The sampling settings of OpdConfig, field for field (same types, rules, defaults and descriptions).
OnPolicySampling = create_model(
    "OnPolicySampling",
    __base__=_SamplingForm,
    __doc__="How the student's rollouts are sampled and weighted (on-policy prompts only).",
    **{name: (OpdConfig.model_fields[name].annotation, OpdConfig.model_fields[name]) for name in SAMPLING_FIELDS
       if name != "samples_per_prompt"},
    samples_per_prompt=(int | None, _SAMPLES_PER_PROMPT),
)


class TrainingData(BaseModel):
    """What the student learns from: a scored corpus or examples to score (off-policy), or prompts (on-policy)."""

    model_config = ConfigDict(extra="forbid", title="Training data")

    kind: Literal["corpus", "examples", "prompts"] = Field(
        default="corpus", title="Kind",
        description="corpus: a teacher-scored JSONL (off-policy); examples: unscored examples the local teacher "
        "scores first (off-policy); prompts: the student answers prompts and the teacher scores them (on-policy). "
        "Fill in the field of the same name.",
        json_schema_extra={"position": 0})
    corpus: str | None = Field(
        default=None,
        description="kind corpus: teacher-scored JSONL corpus (local path or fsspec URI: file://, s3://, memory://).",
        json_schema_extra={"position": 1})
    examples: str | None = Field(
        default=None,
        description="kind examples: unscored examples JSONL, scored by the teacher first (teacher kind local_dir or "
        "local_registry).",
        json_schema_extra={"position": 2})
    prompts: str | None = Field(
        default=None,
        description="kind prompts: prompts JSONL, one Kiln OpdPrompt per line (local path or fsspec URI).",
        json_schema_extra={"position": 3})
    sampling: OnPolicySampling | None = Field(  # type: ignore[valid-type]
        default=None, title="Sampling (prompts only)",
        description="kind prompts: how rollouts are sampled (samples per prompt, temperature, top-p, max tokens, "
        "...); empty = Kiln's defaults.",
        json_schema_extra={"position": 4})

    @model_validator(mode="before")
    @classmethod
    def _blank_is_not_given(cls, value: Any) -> Any:
        # A form sends every field it shows; a cleared text box arrives as "" or null.
        if isinstance(value, dict):
            value = {key: item for key, item in value.items()
                     if not (key in SOURCE_KINDS and (item is None or (isinstance(item, str) and not item.strip())))}
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> "TrainingData":
        if getattr(self, self.kind) is None:
            raise ValueError(f"`{self.kind}`: required when the training data is {self.kind} (source kind)")
        for other in SOURCE_KINDS:
            if other != self.kind and getattr(self, other) is not None:
                raise ValueError(f"`{other}`: the training data is {self.kind} (source kind); clear {other}, or "
                                 f"choose kind {other}")
        if self.kind != "prompts" and self.sampling is not None:
            if self.sampling != OnPolicySampling():
                raise ValueError(f"`sampling`: sampling settings act on-policy only (source kind prompts), not on "
                                 f"{self.kind}")
            self.sampling = None  # the untouched defaults a form may send along
        if self.kind == "prompts" and self.sampling is None:
            self.sampling = OnPolicySampling()
        return self

    @model_serializer(mode="wrap")
    def _only_what_is_given(self, handler) -> dict[str, Any]:
        # A dump names the chosen kind's field only (and sampling for prompts), as a person writes it.
        return {key: item for key, item in handler(self).items() if item is not None}

    @property
    def path(self) -> str:
        """The chosen kind's file."""
        return getattr(self, self.kind)
