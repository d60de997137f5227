"""The small values tasks hand each other: URIs, ``sha256:`` digests and counts, never data."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Ref(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ManifestRef(_Ref):
    """The teacher's pinned manifest line and where it came from."""

    manifest_line: str
    identity_revision: str
    teacher: str
    source: str
    teacher_dir: str | None = None


class InputsRef(_Ref):
    """Digests of the run's inputs: they key the caches and the run's output location."""

    corpus_uri: str
    dataset_sha256: str
    student_dir: str
    student_digest: str
    effective_top_k: int


class CorpusRef(_Ref):
    """A committed, content-addressed corpus materialization."""

    uri: str
    dataset_sha256: str
    source_uri: str
    examples: int
    action_tokens: int
    env_tokens: int
    effective_top_k: int
    teacher_identity_revision: str | None
    reused: bool = False


class TrainRef(_Ref):
    """Where a training run's outputs live and how it ended."""

    run_uri: str
    status: str
    adapter_uri: str | None
    receipt_uri: str
    latest_checkpoint: str | None
    final_loss: float | None
    steps: int
    loss_history: list[float] = []
    failure_reason: str | None = None


class PublishRef(_Ref):
    """The published result of a pipeline run."""

    adapter_uri: str
    receipt_uri: str
    receipt_sha256: str
    latest_uri: str
    checkpoints: list[str]
