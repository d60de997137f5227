"""What a recipe run records about itself: the ``recipe`` block of ``train_receipt.json`` and Kiln's ``receipt.json``.

A recipe (``distill self``, ``distill merge``, ``distill pump``, or an ``opd`` step of a recipe file) trains
through the same engine path as any other run; what it adds is the story of where its teacher signal came
from. ``RecipeRecord`` carries that story into the run's ``train_receipt.json`` (our key ``recipe``) and into
Kiln's legacy per-adapter receipt (``AdapterReceipt``, ``<adapter>/receipt.json``), whose fields follow
Kiln's ``crates/kiln-train/src/receipt.rs`` (``AdapterReceipt``, ``TeacherDescriptor``,
``PromptSourceDescriptor``, ``DiagnosticSummary``) and ``training_queue.rs`` (``registered_teacher_descriptor``:
the per-recipe descriptor values).

Example:
    >>> record = RecipeRecord(kind="distill_self", mode="conciseness", name="terse",
    ...     teacher=TeacherDescriptor(alias="self-terse:Conciseness", model_id="self-terse:Conciseness"),
    ...     request={"name": "terse", "mode": "conciseness"})
    >>> record.teacher.model_version_hash is None
    True
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RECIPE_KINDS = ("opd", "distill_self", "distill_merge", "distill_pump")
"""Kiln's ``source_kind`` values for the recipes kiln-flows runs."""

LEGACY_RECEIPT_FILE = "receipt.json"
"""Kiln's per-adapter receipt, beside the adapter's weights (``AdapterReceipt::write_to_adapter_dir``)."""


class TeacherDescriptor(BaseModel):
    """Kiln's ``TeacherDescriptor``: who taught the adapter.

    Per recipe (``training_queue.rs`` · ``registered_teacher_descriptor``): self ``self-<name>:<Mode>`` for alias and model id, no hash and no
    identity; merge ``merge-multi:<name>``, likewise; pump and opd the registered alias, the identity's
    ``served_model_id``, ``sha256:<content revision>`` and the full identity.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    alias: str
    model_id: str
    model_version_hash: str | None = None
    identity: dict[str, Any] | None = None


class RecipeSource(BaseModel):
    """One LoRA that taught part of a ``distill merge`` student, pinned when the merge was admitted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter: str
    """The source adapter's name."""
    weight: float
    """The request's weight (Kiln: checked against the source's share of replay rows, never used in the loss)."""
    weights_sha256: str
    """The LoRA weights digest (``kiln.teacher-identity.v1`` ``adapter.weights_sha256``)."""
    config_sha256: str
    """SHA-256 of the source's ``adapter_config.json`` bytes."""
    prompts: int
    """Prompts read from the source's replay log (each scored only by this source)."""
    identity_revision: str | None = None
    """``sha256:`` revision of the source's teacher identity (the base model wearing this LoRA)."""
    rows: int | None = None
    """Training rows taken from this source: its ``prompts`` under Kiln's sampling contract; the rows drawn
    under kiln-flows' weighted sampling (``sampling.method == "weighted"``)."""


class RecipeRecord(BaseModel):
    """The ``recipe`` block of ``train_receipt.json``: which recipe trained the adapter, and from what teacher."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["opd", "distill_self", "distill_merge", "distill_pump"]
    """Kiln's ``source_kind``."""
    mode: str | None = None
    """self: ``ground_truth_conditioning`` | ``conciseness`` | ``document_as_pi``; pump: ``examples`` |
    ``domain`` | ``wide``; none for merge and opd."""
    name: str
    """The adapter the recipe produces (the request's ``name``)."""
    teacher: TeacherDescriptor
    """Kiln's descriptor of the teacher (per recipe, as Kiln fills it)."""
    teacher_identity_revision: str | None = None
    """The ``sha256:`` identity revision of the teacher that actually scored the corpus (self: the bare base
    model or the pinned LoRA teacher; pump: the registered teacher); none for merge (see ``sources``)."""
    teacher_identity: dict[str, Any] | None = None
    """Ours: that teacher's whole ``kiln.teacher-identity.v1`` (its ``adapter`` digests included when it wears a
    LoRA), for self, whose Kiln descriptor carries no identity (pump and opd: the descriptor's ``identity``)."""
    sources: list[RecipeSource] = Field(default_factory=list)
    """Merge only: every source LoRA, in request order."""
    request: dict[str, Any]
    """The whole request as JSON (Kiln's ``hyperparameters``)."""
    sampling: dict[str, Any] | None = None
    """Merge only: how the training rows were taken from the sources: ``{"method": "kiln_contract",
    "rollout_budget"}`` (every replay prompt once per epoch, Kiln's contract checked) or ``{"method":
    "weighted", "rollout_budget", "seed"}`` (kiln-flows' opt-in weighted draw; ``sources[].rows`` says how
    many rows each source gave)."""
    recipe: str | None = None
    """The recipe file's ``name`` when the run was a step of a recipe."""
    step: int | None = None
    """The step's 0-based index in that recipe."""


class PromptSourceDescriptor(BaseModel):
    """Kiln's ``PromptSourceDescriptor``: the prompts an adapter was trained on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    manifest_hash: str
    count: int


class AdapterReceipt(BaseModel):
    """Kiln's legacy ``receipt.json`` (``AdapterReceipt``, schema version 1), written beside a recipe's adapter.

    ``seed`` is the train receipt's; ``hyperparameters`` is the whole request; ``post_eval`` maps a suite to its
    score once a gate ran (empty before).
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    adapter: str
    produced_at: str
    kiln_version: str
    kernel_versions: dict[str, str] = Field(default_factory=dict)
    seed: int
    source_kind: str
    teacher: TeacherDescriptor | None = None
    prompts: PromptSourceDescriptor | None = None
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    diagnostic_summary: dict[str, Any] = Field(default_factory=dict)
    post_eval: dict[str, float] = Field(default_factory=dict)
