"""``PipelineSpec``: one declarative description of an OPD distillation run.

It is the single parameter of the ``opd_distill`` flow, so the Prefect UI renders it as the run form
(field descriptions become help text, ``Literal`` fields become dropdowns), and it loads from a YAML
file for ``kiln-flows run pipeline.yaml``. Validation happens before any work: an invalid spec fails
with the offending field named.

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

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln_core.contracts.opd_config import OpdConfig

_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class SpecError(ValueError):
    """An invalid pipeline spec; the message names the field."""


class TeacherSource(BaseModel):
    """Where the teacher's identity comes from."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"title": "Teacher"})

    kind: Literal["kiln_server", "local_registry", "local_dir"] = Field(
        default="local_registry",
        description="kiln_server: fetch the manifest from a running Kiln server; local_registry: a teacher "
        "registered with `kiln-flows teachers register`; local_dir: a Hugging Face teacher directory.",
        json_schema_extra={"position": 0},
    )
    alias: str | None = Field(
        default=None,
        description="Teacher alias (kiln_server and local_registry).",
        json_schema_extra={"position": 1},
    )
    url: str = Field(
        default="http://127.0.0.1:8420",
        description="Kiln server base URL (kiln_server only).",
        json_schema_extra={"position": 2},
    )
    path: str | None = Field(
        default=None,
        description="Teacher model directory (local_dir only).",
        json_schema_extra={"position": 3},
    )

    @model_validator(mode="after")
    def _fields_for_kind(self) -> "TeacherSource":
        if self.kind in ("kiln_server", "local_registry") and not self.alias:
            raise ValueError(f"`alias` is required when `kind` is {self.kind}")
        if self.kind == "local_dir" and not self.path:
            raise ValueError("`path` is required when `kind` is local_dir")
        return self

    def label(self) -> str:
        """A short name for run names and receipts."""
        return self.alias or Path(self.path or "teacher").name


def _default_config() -> OpdConfig:
    return OpdConfig(training_mode="off_policy")


class RunOptions(BaseModel):
    """How the pipeline runs (not what it trains)."""

    model_config = ConfigDict(extra="forbid")

    refresh: bool = Field(
        default=False, description="Re-admit and re-materialize even when this exact corpus was admitted before."
    )
    train_retries: int = Field(
        default=2, ge=0, le=10, description="Retries of the training stage; each resumes from the newest checkpoint."
    )
    kiln_strict: bool = Field(default=False, description="Accept only Kiln's vLLM teacher protocol in the manifest.")
    storage_block: str | None = Field(
        default=None,
        description="Optional Prefect Secret block slug (`secret/<name>`) holding fsspec options per protocol, "
        "e.g. {\"s3\": {\"key\": ..., \"secret\": ...}}; credentials never go in the spec itself.",
    )
    progress_every_seconds: float = Field(
        default=5.0, gt=0, description="How often the training progress artifact is updated."
    )
    cancel_poll_seconds: float = Field(
        default=2.0, gt=0, description="How often training checks whether the flow run is being cancelled."
    )
    train_deployment: str | None = Field(
        default=None,
        description="Run training as this deployment of the `kiln-train` flow (e.g. `kiln-train/gpu`) on its "
        "work pool, instead of in this flow run.",
    )


class DistributedOptions(BaseModel):
    """Data-parallel training on several processes of one machine (``torch.distributed``, via torchrun).

    Each optimizer step takes ``nproc × config.sequences_per_step`` consecutive candidates (rank r
    trains the r-th block of them) and the LoRA gradients are summed across ranks, so the result
    equals a one-process run with ``sequences_per_step × nproc``. Checkpoints resume only with the
    same ``nproc``. Storage must be reachable from every process (not ``memory://``).
    """

    model_config = ConfigDict(extra="forbid")

    nproc: int = Field(default=1, ge=1, le=1024, description="Processes (ranks) on the training machine; 1 = no torchrun.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed backend: auto = gloo on CPU, nccl on CUDA (one GPU per rank)."
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="ddp: the LoRA adapter is replicated and its gradients all-reduced. fsdp is not implemented yet.",
    )

    @field_validator("strategy")
    @classmethod
    def _implemented(cls, value: str) -> str:
        # Where FSDP would plug in: kiln_core/training/distributed/world.py (module docstring).
        if value == "fsdp":
            raise ValueError("fsdp is not implemented; use ddp")
        return value


class PipelineSpec(BaseModel):
    """A Kiln-compatible offline distillation run: teacher → corpus → student → adapter."""

    model_config = ConfigDict(extra="forbid", title="PipelineSpec")

    teacher: TeacherSource = Field(
        default_factory=lambda: TeacherSource(kind="local_registry", alias="teacher"),
        description="The teacher whose identity the corpus manifest must match.",
        json_schema_extra={"position": 0},
    )
    corpus: str | None = Field(
        default=None,
        description="Teacher-scored JSONL corpus (local path or fsspec URI: file://, s3://, memory://).",
        json_schema_extra={"position": 1},
    )
    examples: str | None = Field(
        default=None,
        description="Unscored examples JSONL to score with a local teacher first (instead of `corpus`).",
        json_schema_extra={"position": 2},
    )
    student: str = Field(
        description="Student model directory (config.json, fast tokenizer, weights) or fsspec URI of one.",
        json_schema_extra={"position": 3},
    )
    storage_root: str = Field(
        default="./kiln-data",
        description="Where corpora, checkpoints, adapters and receipts are published (path or fsspec URI).",
        json_schema_extra={"position": 4},
    )
    adapter: str = Field(
        description="Output adapter name (letters, digits, '.', '_', '-').",
        json_schema_extra={"position": 5},
    )
    config: OpdConfig = Field(
        default_factory=_default_config,
        description="Kiln's OpdConfig: top_k, optimizer, LoRA rank/alpha, epochs, checkpoint_interval, ECHO, seed.",
        json_schema_extra={"position": 6},
    )
    options: RunOptions = Field(default_factory=RunOptions, json_schema_extra={"position": 7})
    distributed: DistributedOptions | None = Field(
        default=None,
        description="Optional: train on several processes with torch.distributed (nproc, backend).",
        json_schema_extra={"position": 8},
    )

    @model_validator(mode="after")
    def _consistent(self) -> "PipelineSpec":
        if (self.corpus is None) == (self.examples is None):
            raise ValueError("give exactly one of `corpus` (already scored) or `examples` (to score first)")
        if self.examples is not None and self.teacher.kind == "kiln_server":
            raise ValueError("`examples` needs a local teacher to score with (teacher.kind local_dir or local_registry)")
        if not _ADAPTER_NAME.fullmatch(self.adapter):
            raise ValueError("`adapter` must be 1-128 letters, digits, '.', '_' or '-' and start with a letter or digit")
        if self.config.training_mode != "off_policy":
            raise ValueError("`config.training_mode` must be off_policy for a JSONL corpus")
        from kiln_core.contracts.opd_config import ConfigError, validate_for_offline_training

        try:
            validate_for_offline_training(self.config)
        except ConfigError as error:
            field = error.field if error.field and error.field.startswith("config") else f"config.{error.field or ''}".rstrip(".")
            raise ValueError(f"`{field}`: {error.message}") from None
        return self


def parse_spec(value: Any) -> PipelineSpec:
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
        where = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if not where and message.startswith("`"):  # a cross-field rule names its own field
            raise SpecError(f"invalid pipeline spec: {message}") from None
        raise SpecError(f"invalid pipeline spec: `{where or 'spec'}`: {message}") from None


def load_spec(path: str) -> PipelineSpec:
    """Load a ``PipelineSpec`` from a YAML (or JSON) file; relative paths stay relative to the CWD."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            value = yaml.safe_load(handle)
    except OSError as error:
        raise SpecError(f"cannot read pipeline spec {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"pipeline spec {path} is not valid YAML: {error}") from None
    if not isinstance(value, dict):
        raise SpecError(f"pipeline spec {path} must be a mapping")
    return parse_spec(value)
