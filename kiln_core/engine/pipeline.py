"""``run_pipeline``: the one path from a ``PipelineSpec`` to a published adapter.

    manifest → settings → (score) → fingerprint → admit → verify → plan → train → (gate) → publish
    manifest → settings → prompts → plan → train → (gate) → publish            (on-policy: ``spec.prompts``)

The run's settings (``ResolvedSettings``: effective top-K under the teacher's cap, learning rate, samples per
prompt, loss, world size and strategy, LoRA targets) are resolved once, right after the teacher's manifest
pins the cap, and every later stage reads them: admission, the held-out corpora, the run key, the trainers.

Every run that trained successfully gets ``replay.jsonl`` beside its adapter, the prompts it trained on
(``kiln_core.engine.replay_log``), so every published adapter can be a ``distill merge`` source.

The gate runs when the spec has ``post_eval`` or ``quality_gate`` (``kiln_core.engine.gate``): only
an adapter it promotes (or an informational eval's) is published to ``latest.json``. The run's
``train_receipt.json`` is written once (``kiln_core.training.receipt.compose_receipt``): by the trainer when
nothing follows training, else by the gate stage once it decided; ``latest.json`` then pins its digest. The held-out
watch (``eval``) and both gates work the same for both sources; their overlap rules compare the
held-out data with a corpus's examples or with the prompts (``kiln_core.engine.gate.training_data``).

One run per run key at a time: ``run_pipeline`` holds the run lock (``kiln_core.engine.run_lock``) from
the moment the run directory is known until it returns or raises; a second identical run waits
(``wait_for_lock``) or fails with ``run_in_progress`` (exit 3) naming the holder.

``kiln-flows train`` runs it with ``LocalStages`` (plain function calls); the ``opd_distill`` flow runs
the very same function with stages that are Prefect tasks (``tasks.stages.PrefectStages``: retries,
caching, artifacts), so the order, the run directory, the resume rule and ``latest.json`` cannot
drift between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.contracts.pipeline import PipelineSpec, TeacherSource
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.contracts.stage_refs import (CorpusRef, GateRef, HeldOutRef, InputsRef, ManifestRef, PipelineResult,
                                            PublishRef, TrainPlan, TrainRef)
import kiln_core.engine.stages as stages
from kiln_core.engine.publish import publish
from kiln_core.engine.replay_log import write_replay_log
from kiln_core.engine.gate import check_gate_inputs, has_gate, run_gate, training_data
from kiln_core.engine.run_lock import RunLock
from kiln_core.engine.runs import check_lora_rank, plan_run
from kiln_core.engine.training import distributed_job, train, training_settings


class Stages(Protocol):
    """What ``run_pipeline`` calls, stage by stage; each takes and returns small refs."""

    def manifest(self, teacher: TeacherSource, storage_root: str, max_top_k: int) -> ManifestRef: ...

    def score(self, spec: PipelineSpec, manifest: ManifestRef, student_dir: str) -> str: ...

    def fingerprint(self, corpus_uri: str, student_dir: str, top_k: int) -> InputsRef:
        """Digest the corpus and the student; ``top_k`` is the run's effective one (``ResolvedSettings.top_k``)."""

    def admit(self, inputs: InputsRef, manifest: ManifestRef, spec: PipelineSpec) -> CorpusRef: ...

    def verify(self, corpus: CorpusRef) -> CorpusRef: ...

    def prompts(self, spec: PipelineSpec, manifest: ManifestRef, settings: ResolvedSettings,
                student_dir: str) -> CorpusRef:
        """The on-policy data stage (``kiln_core.engine.prompts.check_prompts``)."""

    def train(self, plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str) -> TrainRef: ...

    def gate(self, trained: TrainRef, spec: PipelineSpec, ready: "PreparedRun") -> GateRef:
        """Evaluate a successful run's adapter (``post_eval``, ``quality_gate``) and act on the outcome."""

    def publish(self, trained: TrainRef, spec: PipelineSpec) -> PublishRef: ...

    def ended(self, trained: TrainRef, spec: PipelineSpec) -> None:
        """Called when nothing is published (training did not succeed, or a gate held the adapter back)."""


class LocalStages:
    """The stages as plain calls in this process (``kiln-flows train``).

    Args:
        on_progress: ``(step, total_steps, loss)`` after each committed training step; on-policy runs
            call it as ``(consumed candidates, total candidates, loss, rollout=OnPolicyProgress)``.
        should_cancel: Polled at each step boundary.
        on_step_committed: Called with the step number once a step (and its checkpoint, when due) is
            committed (``train_opd``'s hook: tests and drills stop a run there).
        handle_signals: Ctrl-C/SIGTERM stop training at the next step boundary.
        on_train_start: Called with the effective settings line (``training_settings``) before training.
    """

    def __init__(self, *, on_progress: Callable[[int, int, float], None] | None = None,
                 should_cancel: Callable[[], bool] | None = None,
                 on_step_committed: Callable[[int], None] | None = None, handle_signals: bool = True,
                 on_train_start: Callable[[str], None] | None = None) -> None:
        self.on_progress, self.should_cancel, self.handle_signals = on_progress, should_cancel, handle_signals
        self.on_step_committed, self.on_train_start = on_step_committed, on_train_start
        self.plan: TrainPlan | None = None
        """The plan being trained, once training starts: where a run stopped at once can be resumed from."""

    def manifest(self, teacher: TeacherSource, storage_root: str, max_top_k: int) -> ManifestRef:
        return stages.resolve_manifest(teacher, storage_root, max_top_k=max_top_k)

    def score(self, spec: PipelineSpec, manifest: ManifestRef, student_dir: str) -> str:
        return stages.score(**stages.score_arguments(spec, manifest, student_dir)).uri

    def fingerprint(self, corpus_uri: str, student_dir: str, top_k: int) -> InputsRef:
        return stages.fingerprint(corpus_uri, student_dir, top_k)

    def admit(self, inputs: InputsRef, manifest: ManifestRef, spec: PipelineSpec) -> CorpusRef:
        return stages.admit(inputs, manifest, spec.storage_root, kiln_strict=spec.options.kiln_strict,
                            workers=spec.options.admit_workers)

    def verify(self, corpus: CorpusRef) -> CorpusRef:
        return stages.verify(corpus)

    def prompts(self, spec: PipelineSpec, manifest: ManifestRef, settings: ResolvedSettings,
                student_dir: str) -> CorpusRef:
        from kiln_core.engine.prompts import check_prompts

        return check_prompts(spec.prompts, manifest, settings, student_dir)

    def train(self, plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str) -> TrainRef:
        self.plan = plan
        if self.on_train_start is not None:
            self.on_train_start(training_settings(plan))
        return train(plan, corpus, manifest, student_dir, on_progress=self.on_progress,
                     should_cancel=self.should_cancel, on_step_committed=self.on_step_committed,
                     handle_signals=self.handle_signals)

    def gate(self, trained: TrainRef, spec: PipelineSpec, ready: "PreparedRun") -> GateRef:
        return gate_stage(trained, spec, ready)

    def publish(self, trained: TrainRef, spec: PipelineSpec) -> PublishRef:
        return publish(trained, spec.storage_root, spec.adapter)

    def ended(self, trained: TrainRef, spec: PipelineSpec) -> None:
        return None


@dataclass(frozen=True)
class PreparedRun:
    """A spec whose teacher is pinned, corpus admitted and verified, and run planned: ready to train."""

    spec: PipelineSpec
    manifest: ManifestRef
    corpus: CorpusRef
    plan: TrainPlan
    student_dir: str
    gate_corpus: HeldOutRef | None = None
    """The quality gate's corpus, admitted with the run (``check_gate_inputs``); the gate reads it back."""


def prepare(spec: PipelineSpec, stages_: Stages | None = None, *, resume: str | None = "latest",
            device: str | None = None, precision: str | None = None,
            gradient_checkpointing: bool = False, claim: Callable | None = None) -> PreparedRun:
    """Every stage before training: manifest, the run's settings, then (score), fingerprint, admit, verify — or,
    for ``prompts``, the on-policy prompt checks — then plan (``claim``: called with the run directory,
    ``plan_run``)."""
    from kiln_core.storage import localize_directory
    from kiln_core.storage_root import check_storage_root

    from kiln_core.engine.base_adapter import plan_base_adapter
    from kiln_core.identity.model_files import check_model_files
    from kiln_core.training.lora_targets import resolve_lora_targets

    stages_ = stages_ or LocalStages()
    check_storage_root(spec.storage_root, field="storage_root")  # written where it says, or refused now
    student_dir = localize_directory(spec.student)
    check_model_files(student_dir, role="student")  # a truncated shard is refused before any work
    check_lora_rank(spec.config, student_dir)  # from config.json: a rank the student cannot hold never trains
    lora_targets = resolve_lora_targets(student_dir)  # from config.json: a model with nothing to adapt is refused now
    base_adapter = plan_base_adapter(spec.config, spec.storage_root, lora_targets)  # before any admission work
    manifest = stages_.manifest(spec.teacher, spec.storage_root, max(32, spec.config.top_k))
    settings = resolve_settings(spec, manifest, lora_targets)
    if spec.prompts is not None:  # the one place the source decides the path: the data stage
        corpus = stages_.prompts(spec, manifest, settings, student_dir)
    else:
        corpus_uri = spec.corpus if spec.examples is None else stages_.score(spec, manifest, student_dir)
        inputs = stages_.fingerprint(corpus_uri, student_dir, settings.top_k)
        corpus = stages_.verify(stages_.admit(inputs, manifest, spec))
    gate_corpus = check_gate_inputs(spec, settings, corpus, manifest, student_dir)  # Kiln checks post_eval overlap here
    held_out = admit_held_out(spec, settings, corpus, manifest, student_dir)
    plan = plan_run(spec, settings, corpus, manifest, student_dir, resume=resume, device=device, precision=precision,
                    gradient_checkpointing=gradient_checkpointing, base_adapter=base_adapter, held_out=held_out,
                    claim=claim, gate_follows=has_gate(spec))
    return PreparedRun(spec=spec, manifest=manifest, corpus=corpus, plan=plan, student_dir=student_dir,
                       gate_corpus=gate_corpus)


def prepare_job(spec: PipelineSpec, stages_: Stages | None = None, *, resume: str | None = "latest",
                device: str | None = None, precision: str | None = None, gradient_checkpointing: bool = False):
    """Every stage before training (``prepare``), then the ``DistributedJob`` the ranks of the spec's world
    execute, for ranks started elsewhere (torchrun on every node of a multi-node run) instead of by
    ``run_pipeline``'s train stage.

    Raises:
        Rejection: what ``prepare`` and ``distributed_job`` refuse; ``unsupported`` for on-policy prompts,
            which train in one process.
    """
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.engine.runs import newest_checkpoint

    ready = prepare(spec, stages_, resume=resume, device=device, precision=precision,
                    gradient_checkpointing=gradient_checkpointing)
    if ready.corpus.kind == "prompts":
        raise ConfigError("on-policy training runs in one process: there is no job for other ranks", "prompts",
                          code="unsupported")
    plan = ready.plan
    if plan.resume == "latest":  # the ranks take a checkpoint basename or None
        plan = plan.model_copy(update={"resume": newest_checkpoint(plan.run_uri, plan.adapter)})
    return distributed_job(plan, ready.corpus, ready.manifest, ready.student_dir)


def resolve_settings(spec: PipelineSpec, manifest: ManifestRef, lora_targets: LoraTargets) -> ResolvedSettings:
    """The run's settings, resolved once from the spec and the pinned teacher, before any data stage.

    Off-policy, the corpus is already scored: its cap is the requested top-K itself (Kiln's pre-scored rule).
    On-policy, the teacher scores the student's samples, so its ``min(max_top_k, vocab_size)`` caps the top-K,
    and Kiln's default samples per prompt scale with the request's prompt count (every prompt counted).

    Raises:
        ConfigError: ``top_k_unsupported`` — no supported top-K fits under the request and the teacher's cap.
        Rejection: the prompt file cannot be read (its code and line).
    """
    distributed = spec.distributed
    placement = dict(world_size=distributed.world_size if distributed else 1,
                     strategy=distributed.strategy if distributed else "ddp", lora_targets=lora_targets)
    if spec.prompts is None:
        return ResolvedSettings.resolve(spec.config, adapter=spec.adapter, **placement)
    from kiln_core.on_policy.prompt_file import read_prompt_file
    from kiln_core.on_policy.submit import teacher_top_k_cap

    return ResolvedSettings.resolve(spec.config, adapter=spec.adapter,
                                    teacher_cap=teacher_top_k_cap(manifest.teacher_identity),
                                    prompt_count=len(read_prompt_file(spec.prompts).prompts), **placement)


def admit_held_out(spec: PipelineSpec, settings: ResolvedSettings, corpus: CorpusRef, manifest: ManifestRef,
                   student_dir: str) -> HeldOutRef | None:
    """The held-out watch's corpus (``spec.eval``), admitted once for the run at its effective top-K: refused
    here, not after the model loads, and materialized under the storage root for training to load
    (``TrainPlan.held_out``); None without a watch.

    Raises:
        Rejection: any admission or held-out rule (``identity_mismatch``, ``eval_train_overlap``, …),
            ``eval_watch_empty``.
    """
    if spec.eval is None:
        return None
    from kiln_core.training.watch import HeldOutSlice

    held_out = HeldOutSlice.admit(spec.eval, student_dir, top_k=settings.top_k,
                                  teacher_manifest=manifest.manifest_line, out_root=spec.storage_root,
                                  **training_data(corpus, spec.config))
    held_out.record()  # a slice without an action token is refused now
    return held_out.ref()


def run_pipeline(spec: PipelineSpec, stages_: Stages | None = None, *, resume: str | None = "latest",
                 device: str | None = None, precision: str | None = None,
                 gradient_checkpointing: bool = False, wait_for_lock: float = 0.0) -> PipelineResult:
    """Validate, admit, plan, train and publish one spec; returns how it ended.

    Args:
        spec: What to train and where (``PipelineSpec``; ``kiln-flows train`` builds one from a Kiln
            request file with ``kiln_core.engine.request``).
        stages_: How each stage runs (default ``LocalStages()``: plain calls).
        resume: ``"latest"`` (every pipeline attempt), a checkpoint basename, or None (fresh; refused
            with ``resume_required`` when the run already has checkpoints).
        device, precision, gradient_checkpointing: Training options (defaults: CUDA when available,
            bf16 on CUDA and fp32 on CPU, off).
        wait_for_lock: Seconds to wait when another live run holds this run key (default: fail at once).

    Returns:
        ``PipelineResult``: status ``success`` (published, ``latest`` set), ``failed`` or ``cancelled``.

    Raises:
        Rejection: bad input at any stage (spec, teacher, corpus, student, resume checkpoint): exit 2.
        EnvironmentFailure: storage or network failed: exit 3.
        RunInProgress: another live run holds the run key (``run_in_progress``, exit 3).

    Example:
        >>> from kiln_core.contracts.spec_file import load_spec
        >>> result = run_pipeline(load_spec("pipeline.yaml"))  # doctest: +SKIP
        >>> result.status, result.latest  # doctest: +SKIP
        ('success', '/abs/kiln-data/runs/demo/latest.json')
    """
    stages_ = stages_ or LocalStages()
    lock = RunLock(wait_seconds=wait_for_lock)
    try:
        ready = prepare(spec, stages_, resume=resume, device=device, precision=precision,
                        gradient_checkpointing=gradient_checkpointing, claim=lock.acquire)
        trained = stages_.train(ready.plan, ready.corpus, ready.manifest, ready.student_dir)
        write_replay_log(trained, ready.corpus)  # the prompts beside the adapter, for distill merge; before the gate
        gated = stages_.gate(trained, spec, ready) if trained.status == "success" and has_gate(spec) else None
        if gated is not None:  # a renamed run: its adapter and receipt are where the gate left them
            trained = trained.model_copy(update={"run_uri": gated.run_uri, "receipt_uri": gated.receipt_uri,
                                                 "adapter_uri": gated.adapter_uri})
        publishing = trained.status == "success" and (gated is None or gated.publish)
        published = stages_.publish(trained, spec) if publishing else None
        if published is None:
            stages_.ended(trained, spec)
    finally:
        lock.release()
    return PipelineResult(
        status=trained.status, adapter=trained.adapter_uri, receipt=trained.receipt_uri, run=trained.run_uri,
        latest_checkpoint=trained.latest_checkpoint, final_loss=trained.final_loss,
        loss_history=trained.loss_history, steps=trained.steps, total_steps=trained.total_steps,
        dataset_sha256=ready.corpus.dataset_sha256,
        latest=published.latest_uri if published else None, checkpoints=published.checkpoints if published else [],
        failure_reason=trained.failure_reason, failure_message=trained.failure_message, reused=trained.reused,
        gate=gated.summary() if gated is not None else None)


def gate_stage(trained: TrainRef, spec: PipelineSpec, ready: PreparedRun, *, device: str | None = None) -> GateRef:
    """``run_gate`` with what the prepared run knows (seed, teacher, training data, device)."""
    return run_gate(trained, spec, ready.manifest, ready.student_dir, seed=ready.plan.seed,
                    training=ready.corpus, device=device or ready.plan.device, gate_corpus=ready.gate_corpus)
