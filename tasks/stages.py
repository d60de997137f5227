"""``PrefectStages``: the engine's stages as Prefect tasks, for ``run_pipeline`` inside a flow.

``kiln_core.engine.run_pipeline`` decides the order; this class only says how each stage runs here:
as a task with its retries, cache policy and artifacts, and training either in this flow run or on a
training deployment (``options.train_deployment``, e.g. a GPU work pool). With a Ray spec, a set of
shards is admitted on the Ray cluster (``tasks.ray_fan_out``); the connection made for it is kept for the
train stage and closed when the stages are (``with PrefectStages(spec) as stages``).
"""

from __future__ import annotations

from contextlib import ExitStack

from kiln_core.contracts.pipeline import PipelineSpec, TeacherSource
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.contracts.stage_refs import CorpusRef, GateRef, InputsRef, ManifestRef, PublishRef, TrainPlan, TrainRef
from kiln_core.engine.training import training_settings
from kiln_core.wording import counted


def _log():
    from prefect import get_run_logger

    return get_run_logger()


class PrefectStages:
    """Each stage of ``run_pipeline`` as the Prefect task of the same name, each logging where it
    starts and what it found, so the flow run's log reads as the story of the run."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec
        self._cluster = ExitStack()  # the Ray session the shard admission opened, if any

    def __enter__(self) -> "PrefectStages":
        return self

    def __exit__(self, *exc_info) -> None:
        self._cluster.close()  # a `local` Ray instance stops here, after training used it too

    def manifest(self, teacher: TeacherSource, storage_root: str, max_top_k: int) -> ManifestRef:
        from tasks.manifest import fetch_manifest

        # Names in quotes: a teacher directory is often called "teacher" ("pinning teacher teacher" said nothing)
        _log().info("manifest: pinning the %s teacher %r", teacher.kind, teacher.path or teacher.alias)
        manifest = fetch_manifest(teacher, storage_root, max_top_k)
        _log().info("manifest: teacher %r pinned at identity revision %s", manifest.teacher, manifest.identity_revision)
        return manifest

    def score(self, spec: PipelineSpec, manifest: ManifestRef, student_dir: str) -> str:
        from kiln_core.engine.stages import score_arguments
        from tasks.cache import run_cached
        from tasks.score import score_task

        _log().info("score: scoring %s with teacher %r", spec.examples, manifest.teacher)
        scored, state = run_cached(score_task, score_arguments(spec, manifest, student_dir),
                                   storage_root=spec.storage_root, recompute={"replace": True})
        how = ("reused (Prefect cache, verified)" if state.name == "Cached"
               else "reused (already scored)" if scored.reused else "scored")
        _log().info("score: %d examples %s at %s", scored.examples, how, scored.uri)
        return scored.uri

    def fingerprint(self, corpus_uri: str, student_dir: str, top_k: int) -> InputsRef:
        from tasks.admit import fingerprint_inputs

        inputs = fingerprint_inputs(corpus_uri, student_dir, top_k)
        _log().info("fingerprint: corpus %s is %s (top-K %d)", corpus_uri, inputs.dataset_sha256, inputs.effective_top_k)
        return inputs

    def admit(self, inputs: InputsRef, manifest: ManifestRef, spec: PipelineSpec) -> CorpusRef:
        from kiln_core.admission.shard_sources import is_shard_set
        from tasks.admit import admit_task
        from tasks.cache import run_cached

        if is_shard_set(inputs.corpus_uri):
            return self._admit_set(inputs, manifest, spec)
        _log().info("admit: checking %s against every Kiln admission rule", inputs.dataset_sha256)
        arguments = dict(inputs=inputs, dataset_sha256=inputs.dataset_sha256, student_digest=inputs.student_digest,
                         effective_top_k=inputs.effective_top_k, pinned_revision=manifest.identity_revision,
                         storage_root=spec.storage_root, manifest=manifest, kiln_strict=spec.options.kiln_strict)
        corpus, state = run_cached(admit_task, arguments, storage_root=spec.storage_root,
                                   refresh=spec.options.refresh, recompute={"replace_damaged": True})
        how = ("reused (Prefect cache, verified)" if state.name == "Cached"
               else "reused (already materialized)" if corpus.reused else "written")
        _log().info("admit: %d examples, %d action tokens admitted; materialization %s", corpus.examples,
                    corpus.action_tokens, how)
        return corpus

    def _admit_set(self, inputs: InputsRef, manifest: ManifestRef, spec: PipelineSpec) -> CorpusRef:
        """A set of shards: one mapped ``admit-shard`` task per shard, ``options.admit_workers`` at once."""
        from kiln_core.engine.stages import set_ref
        from tasks.admit_shards import admit_set_with_tasks
        from tasks.ray_fan_out import plan_fan_out

        fan_out = plan_fan_out(spec.distributed, inputs.corpus_uri, spec.storage_root, spec.student)
        if fan_out.reason:
            _log().info("admit: shards admitted on this machine: %s", fan_out.reason)
        _log().info("admit: checking set %s shard by shard against every Kiln admission rule%s", inputs.dataset_sha256,
                    f" on the Ray cluster at {fan_out.ray.address}" if fan_out.ray else "")
        arguments = dict(top_k=inputs.effective_top_k, pinned_manifest=manifest.manifest_line,
                         kiln_strict=spec.options.kiln_strict, out_root=spec.storage_root,
                         concurrency=spec.options.admit_workers)
        if fan_out.ray is None:
            result = admit_set_with_tasks(inputs.corpus_uri, inputs.student_dir, **arguments)
        else:
            with self._ray_task_runner(fan_out.ray) as runner:
                result = admit_set_with_tasks(inputs.corpus_uri, inputs.student_dir, task_runner=runner,
                                              worker_student=fan_out.worker_student, **arguments)
            workers = sorted({shard.worker for shard in result.shards if shard.worker})
            _log().info("admit: shards admitted on Ray by %d worker process(es): %s", len(workers), ", ".join(workers))
        corpus = set_ref(result, inputs)
        reused = sum(shard.reused for shard in result.shards)
        _log().info("admit: %d shards (%d already materialized), %d examples, %d action tokens admitted; set record %s",
                    len(result.shards), reused, corpus.examples, corpus.action_tokens, corpus.uri)
        return corpus

    def _ray_task_runner(self, options):
        """prefect-ray's task runner on the run's cluster, joined once for the flow run (``ray_session``: a
        ``local`` instance is started here and stopped when the stages close, after training used it)."""
        from kiln_core.training.distributed.ray_launcher import ray_session
        from tasks.ray_fan_out import prefect_worker_env, ray_task_runner

        runner = ray_task_runner(options)  # prefect-ray missing: refused before Ray starts
        self._cluster.enter_context(ray_session(options, self.spec.distributed.world_size,
                                                worker_env=prefect_worker_env(options)))
        return runner

    def verify(self, corpus: CorpusRef) -> CorpusRef:
        from tasks.materialize import materialize_task

        corpus = materialize_task(corpus)
        _log().info("materialize: %s verified (%d examples, %d action tokens)", corpus.uri, corpus.examples,
                    corpus.action_tokens)
        return corpus

    def prompts(self, spec: PipelineSpec, manifest: ManifestRef, settings: ResolvedSettings,
                student_dir: str) -> CorpusRef:
        from prefect import get_run_logger

        from tasks.prompts import check_prompts_task

        prompts = check_prompts_task(spec.prompts, manifest, settings, student_dir)
        get_run_logger().info("prompts %s: %s, %s per prompt, top-K %d", prompts.dataset_sha256,
                              counted(prompts.examples, "prompt"), counted(prompts.samples_per_prompt, "sample"),
                              prompts.effective_top_k)
        return prompts

    def train(self, plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str) -> TrainRef:
        options = self.spec.options
        _log().info("train: %s in %s (resume: %s)", plan.adapter, plan.run_uri, plan.resume or "fresh")
        _log().info("train: %s", training_settings(plan))
        if options.train_deployment:
            trained = self._train_on_pool(plan, corpus, manifest)
        else:
            from tasks.train import train_task

            state = train_task.with_options(retries=options.train_retries)(
                plan, corpus, manifest, student_dir, options.progress_every_seconds, options.cancel_poll_seconds,
                return_state=True)
            if state.is_cancelled():  # the flow run's cancellation stopped training: its receipt says how far
                from kiln_core.engine.runs import cancelled_run
                from kiln_core.storage import resolve

                trained = cancelled_run(resolve(plan.run_uri), plan.adapter)
            else:
                trained = state.result()  # a failed task raises its error, as a direct call does
        loss = "n/a" if trained.final_loss is None else f"{trained.final_loss:.4f}"
        _log().info("train: %s after %d steps, final loss %s%s", trained.status, trained.steps, loss,
                    " (already finished: reused)" if trained.reused else "")
        return trained

    def _train_on_pool(self, plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef) -> TrainRef:
        """Hand training to the ``kiln-train`` deployment named in the spec (e.g. on a GPU pool)."""
        from prefect.runtime import flow_run

        from tasks.dispatch import dispatch_training

        options = self.spec.options
        parameters = {
            "plan": plan.model_dump(mode="json"),
            "corpus": corpus.model_dump(mode="json"),
            "manifest": manifest.model_dump(mode="json"),
            "student_dir": self.spec.student,  # the GPU worker localizes it itself: local paths are per machine
            "progress_every_seconds": options.progress_every_seconds,
            "cancel_poll_seconds": options.cancel_poll_seconds,
            "retries": options.train_retries,
        }
        return dispatch_training(options.train_deployment, parent_run_id=str(flow_run.get_id()),
                                 run_key=plan.run_key, parameters=parameters)

    def gate(self, trained: TrainRef, spec: PipelineSpec, ready) -> GateRef:
        from tasks.gate import gate_task

        return gate_task(trained, spec, ready.manifest, ready.student_dir, ready.plan.seed,
                         ready.corpus, ready.plan.device, ready.gate_corpus)

    def publish(self, trained: TrainRef, spec: PipelineSpec) -> PublishRef:
        from tasks.publish import publish_task

        published = publish_task(trained, spec.storage_root, spec.adapter)
        _log().info("publish: adapter %s, receipt %s (status %s), latest.json %s", published.adapter_uri,
                    published.receipt_uri, trained.status, published.latest_uri)
        return published

    def ended(self, trained: TrainRef, spec: PipelineSpec) -> None:
        from tasks.publish import record_artifacts

        # The reason is the run's final line (flows.run_log.fail_run); said here too, it would be told twice.
        _log().warning("publish: nothing published (training %s); receipt %s",
                       "was cancelled" if trained.status == "cancelled" else trained.status, trained.receipt_uri)
        record_artifacts(trained, spec.adapter, None)
