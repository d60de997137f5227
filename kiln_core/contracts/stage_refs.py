"""The small values stages hand each other: URIs, ``sha256:`` digests and counts, never data.

They are what the Prefect tasks return (persisted as JSON), what ``kiln-flows train`` prints, and
what a training deployment receives as parameters, so every field is JSON-able.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln_core.contracts.base_adapter import BaseAdapter
from kiln_core.contracts.eval_watch import EvalWatch
from kiln_core.contracts.identity import TeacherIdentity, parse_manifest_line
from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.contracts.outcomes import PostEvalRecord, QualityGateRecord
from kiln_core.contracts.recipe_record import RecipeRecord
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.contracts.spec_blocks import RayOptions, VllmBackends


class _Ref(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ManifestRef(_Ref):
    """The teacher's pinned manifest line and where it came from."""

    manifest_line: str
    identity_revision: str
    teacher: str
    source: str
    teacher_dir: str | None = None
    adapter_dir: str | None = Field(default=None, exclude_if=lambda value: value is None)
    """A registered LoRA teacher's pinned adapter directory (``teacher_dir`` is then its base); absent from
    the JSON of every other teacher."""

    @cached_property
    def teacher_identity(self) -> TeacherIdentity:
        """The pinned ``TeacherIdentity``, parsed from ``manifest_line`` once per ref (not a field: the line
        is the one source of truth, and a task result or parameter carries only the line)."""
        return parse_manifest_line(self.manifest_line).teacher_identity


class InputsRef(_Ref):
    """Digests of the run's inputs: they key the caches and the run's output location."""

    corpus_uri: str
    dataset_sha256: str
    student_dir: str
    student_digest: str
    effective_top_k: int


class ScoredRef(_Ref):
    """A scored corpus and the digest of its bytes."""

    uri: str
    sha256: str
    examples: int
    reused: bool


class CorpusRef(_Ref):
    """A committed, content-addressed corpus materialization — with ``kind="shard_set"`` a set of shards
    each materialized on its own (``uri`` is the committed set record, ``dataset_sha256`` the set digest,
    ``source_uri`` the shard directory or index) — or, with ``kind="prompts"``, an on-policy prompt file
    checked against the teacher and the student (``kiln_core.engine.prompts``).

    For prompts, ``uri`` is the prompt file, ``dataset_sha256`` Kiln's prompt-list digest
    (``sha256:`` + ``prompts_content_sha256``), ``examples`` the prompt count and the token counts 0
    (the tokens are sampled during training).
    """

    uri: str
    dataset_sha256: str
    source_uri: str
    examples: int
    action_tokens: int
    env_tokens: int
    effective_top_k: int
    teacher_identity_revision: str | None
    reused: bool = False
    kind: Literal["corpus", "shard_set", "prompts"] = "corpus"
    samples_per_prompt: int | None = None
    """Effective samples per prompt of an on-policy run (Kiln's auto-scaling applied); None for a corpus."""


class HeldOutRef(_Ref):
    """A held-out corpus — the watch's (``eval:``) or the quality gate's — admitted once when the run is
    prepared, the held-out rules applied, and materialized content-addressed under the storage root like a
    training corpus: training and the gate read the tables back from ``uri`` instead of admitting it again."""

    uri: str
    """The committed materialization (``<root>/corpora/<hex>/``)."""
    corpus_sha256: str
    """``sha256:`` of the held-out JSONL bytes."""
    examples: int
    action_tokens: int


class TrainPlan(_Ref):
    """Everything the training stage needs besides the corpus and the teacher, planned once by the engine
    (``kiln_core.engine.runs.plan_run``): where, with what settings, how — typed, frozen, and exactly
    round-tripped through JSON (``model_dump_json`` → ``model_validate_json``), which is how a Prefect
    task, a ``torchrun`` rank or any other worker receives it.

    ``settings`` are the run's effective values (``ResolvedSettings``), resolved before any data stage;
    the plan adds where the run lives, its seed and how it runs. ``resume`` is ``"latest"`` (resume from
    the newest committed checkpoint of ``run_uri``, if any: every retry of a pipeline run), a checkpoint
    basename (``kiln-flows train --resume-checkpoint``), or None (a fresh run; the planner has made sure
    there is nothing to resume). The trainers (``train_opd``, ``train_on_policy``) take the plan whole once
    the training stage has turned ``"latest"`` into a basename or None.
    """

    run_uri: str
    inputs_key: str
    """The run key of these inputs; ``run_uri`` ends with another one only when an explicit resume
    checkpoint lives in another run of the adapter (the trainer then reports what differs)."""
    adapter: str
    settings: ResolvedSettings
    """The effective top-K, learning rate, samples per prompt, loss, world size and strategy, LoRA targets,
    and the request's config as the run records it."""
    seed: int
    """The run's seed: the config's, else the one its run key gives (``ResolvedSettings.seed_for``)."""
    resume: str | None = "latest"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    device: Literal["cpu", "cuda"] | None = None
    precision: Literal["fp32", "bf16"] | None = None
    gradient_checkpointing: bool = False
    eval_watch: EvalWatch | None = None
    """The spec's ``eval:`` block when the run is watched; not part of the run's identity, since a
    watched run trains the same bytes."""
    held_out: HeldOutRef | None = None
    """The watch's corpus as the engine admitted it (set exactly when ``eval_watch`` is)."""
    vllm: VllmBackends | None = None
    """The spec's ``vllm:`` block of an on-policy run using vLLM servers; not part of the run's identity:
    committed rollouts are reused whichever backend sampled them."""
    base_adapter: BaseAdapter | None = None
    """The resolved ``config.base_adapter``: the directory and weights digest the run warm-starts from;
    its digest is part of the run key."""
    max_training_hours: float | None = None
    """The time bound (``kiln_core.training.time_bound``): a run projected, after its first steps, to train longer
    is refused (``training_too_long``); None: no bound. Not part of the run's identity (the spec's
    ``options.max_training_hours``)."""
    ray: RayOptions | None = Field(default=None, exclude_if=lambda value: value is None)
    """Train on a Ray cluster (``distributed: {engine: ray}``) with ``settings.world_size`` workers; None:
    torchrun or this process. Not part of the run's identity (the world size is); absent from the JSON of
    other plans."""
    recipe: RecipeRecord | None = Field(default=None, exclude_if=lambda value: value is None)
    """The recipe that trains the adapter (``PipelineSpec.recipe``): known before training, recorded in the
    receipt and in Kiln's ``receipt.json`` beside the adapter."""
    ignored_request_keys: tuple[str, ...] = Field(default=(), exclude_if=lambda value: not value)
    """Unknown request keys ``--kiln-lenient`` ignored (``PipelineSpec.ignored_request_keys``), for the receipt."""
    gate_follows: bool = Field(default=False, exclude_if=lambda value: not value)
    """A gate decides about the adapter after training (``post_eval``, ``quality_gate``): the trainer leaves the
    receipt of a successful run to the gate stage (``kiln_core.training.receipt``)."""

    @model_validator(mode="after")
    def _watch_has_its_corpus(self) -> "TrainPlan":
        if (self.eval_watch is None) != (self.held_out is None):
            raise ValueError("eval_watch and held_out go together: a watched run's held-out corpus is admitted "
                             "when the run is planned")
        return self

    @classmethod
    def for_config(cls, config: OpdConfig, run_uri: str, adapter: str, *, top_k: int | None = None,
                   samples_per_prompt: int | None = None, resume: str | None = None, nproc: int = 1,
                   strategy: Literal["ddp", "fsdp"] = "ddp", lora_targets: LoraTargets | None = None,
                   **options: Any) -> TrainPlan:
        """The plan of a direct call of the trainers (a benchmark, a notebook, a test) that has no spec for the
        engine to plan from: the settings are resolved from ``config`` by the rules the engine uses
        (``ResolvedSettings.resolve``); pass ``top_k`` and ``samples_per_prompt`` where a teacher's cap or an
        on-policy prompt count decides them. The run key is the last component of ``run_uri`` (a null seed is
        derived from it, as the engine derives it); ``options`` are the other fields (device, base_adapter, …).

        Example:
            >>> plan = TrainPlan.for_config(config, "kiln-data/runs/demo/k1", "demo", device="cpu")  # doctest: +SKIP
            >>> train_opd(plan, tables, dataset_sha256=sha, dataset_path="c.jsonl", student_dir="student",
            ...           teacher_alias="tiny")  # doctest: +SKIP
        """
        settings = ResolvedSettings.resolve(config, adapter=adapter, world_size=nproc, strategy=strategy,
                                            lora_targets=lora_targets)
        given = {name: value for name, value in (("top_k", top_k), ("samples_per_prompt", samples_per_prompt))
                 if value is not None}
        settings = settings.model_copy(update=given)
        key = run_uri.rstrip("/").rsplit("/", 1)[-1]
        return cls(run_uri=run_uri, inputs_key=key, adapter=adapter, settings=settings, seed=settings.seed_for(key),
                   resume=resume, **options)

    @property
    def run_key(self) -> str:
        return self.run_uri.rstrip("/").rsplit("/", 1)[-1]


class TrainRef(_Ref):
    """Where a training run's outputs live and how it ended."""

    run_uri: str
    status: str
    adapter_uri: str | None
    receipt_uri: str
    latest_checkpoint: str | None
    final_loss: float | None
    steps: int
    total_steps: int | None = None
    loss_history: list[float] = []
    failure_reason: str | None = None
    failure_message: str | None = None
    resumed_from: str | None = None
    reused: bool = False
    """True when the run had already finished (committed adapter and successful receipt)."""


class GateRef(_Ref):
    """How the gate stage (``kiln_core.engine.gate``) judged a trained adapter, and where it is now."""

    outcome: str | None
    """``promoted | kept | regression | demoted | inconclusive | error``; None when nothing gated
    (an informational ``post_eval`` without ``min_accuracy``)."""
    verdict: str | None
    publish: bool
    """Whether the publish stage moves ``latest.json``: promoted, or nothing gated."""
    run_uri: str
    """The run directory now (``<adapter>.failed`` when a losing adapter was renamed)."""
    receipt_uri: str
    adapter_uri: str | None
    post_eval: PostEvalRecord | None = None
    """The receipt's ``post_eval`` block (Kiln's field names)."""
    quality_gate: QualityGateRecord | None = None
    """The receipt's ``quality_gate`` block (ours)."""
    reused: bool = False
    """True when an earlier attempt already decided (the outcome is read back from the receipt)."""

    def summary(self) -> dict[str, Any]:
        """The ``gate`` object of ``kiln-flows train/run --json``."""
        def block(record: BaseModel | None) -> dict[str, Any] | None:
            return record.model_dump(mode="json") if record is not None else None

        return {"outcome": self.outcome, "verdict": self.verdict, "promoted": self.outcome == "promoted",
                "post_eval": block(self.post_eval), "quality_gate": block(self.quality_gate)}


class PublishRef(_Ref):
    """The published result of a pipeline run."""

    adapter_uri: str
    receipt_uri: str
    receipt_sha256: str
    latest_uri: str
    checkpoints: list[str]


class PipelineResult(_Ref):
    """What one pass of the pipeline produced (``run_pipeline``); ``summary()`` is what the CLI prints."""

    status: str
    adapter: str | None
    receipt: str
    run: str
    latest_checkpoint: str | None
    final_loss: float | None
    loss_history: list[float]
    steps: int
    total_steps: int | None = None
    dataset_sha256: str
    latest: str | None = None
    checkpoints: list[str] = []
    failure_reason: str | None = None
    failure_message: str | None = None
    reused: bool = False
    gate: dict[str, Any] | None = None
    """``GateRef.summary()`` when the spec has ``post_eval`` or ``quality_gate`` and training succeeded."""

    @property
    def held_back(self) -> bool:
        """Trained, but a gate kept the adapter from becoming the active one (``latest.json`` not moved)."""
        return self.status == "success" and self.gate is not None and self.gate["outcome"] not in (None, "promoted",
                                                                                                     "kept")

    def summary(self) -> dict[str, Any]:
        """The JSON summary of ``kiln-flows run``/``train --json`` and of the ``opd_distill`` flow.

        A run that did not succeed also carries the error contract's ``code`` and ``message`` (its
        ``failure_reason`` and ``failure_message``: ``cancelled``, ``training_diverged``, ``nan_loss``, …), as every
        other outcome that is not a success does (docs/errors.md)."""
        summary = self.model_dump(mode="json")
        if self.status != "success":
            summary["code"] = self.failure_reason or self.status
            summary["message"] = self.failure_message or self.status
        return summary
