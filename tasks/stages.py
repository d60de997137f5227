"""``PrefectStages``: the engine's stages as Prefect tasks, for ``run_pipeline`` inside a flow.

``kiln_core.engine.run_pipeline`` decides the order; this class only says how each stage runs here:
as a task with its retries, cache policy and artifacts, and training either in this flow run or on a
training deployment (``options.train_deployment``, e.g. a GPU work pool).
"""

from __future__ import annotations

from kiln_core.contracts.pipeline import PipelineSpec, TeacherSource
from kiln_core.engine.refs import CorpusRef, InputsRef, ManifestRef, PublishRef, TrainPlan, TrainRef


class PrefectStages:
    """Each stage of ``run_pipeline`` as the Prefect task of the same name."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec

    def manifest(self, teacher: TeacherSource, storage_root: str, max_top_k: int) -> ManifestRef:
        from tasks.manifest import fetch_manifest

        return fetch_manifest(teacher, storage_root, max_top_k)

    def score(self, spec: PipelineSpec, manifest: ManifestRef, student_dir: str) -> str:
        from kiln_core.engine.stages import score_arguments
        from tasks.score import score_task

        return score_task(**score_arguments(spec, manifest, student_dir)).uri

    def fingerprint(self, corpus_uri: str, student_dir: str, top_k: int) -> InputsRef:
        from tasks.admit import fingerprint_inputs

        return fingerprint_inputs(corpus_uri, student_dir, top_k)

    def admit(self, inputs: InputsRef, manifest: ManifestRef, spec: PipelineSpec) -> CorpusRef:
        from tasks.admit import admit_task, cache_options

        admit = admit_task.with_options(**cache_options(spec.storage_root, spec.options.refresh))
        return admit(inputs, inputs.dataset_sha256, inputs.student_digest, inputs.effective_top_k,
                     manifest.identity_revision, spec.storage_root, manifest, spec.options.kiln_strict)

    def verify(self, corpus: CorpusRef) -> CorpusRef:
        from prefect import get_run_logger

        from tasks.materialize import materialize_task

        corpus = materialize_task(corpus)
        get_run_logger().info("corpus %s: %d examples, %d action tokens", corpus.dataset_sha256, corpus.examples,
                              corpus.action_tokens)
        return corpus

    def prompts(self, spec: PipelineSpec, manifest: ManifestRef, student_dir: str) -> CorpusRef:
        from prefect import get_run_logger

        from tasks.prompts import check_prompts_task

        prompts = check_prompts_task(spec.prompts, manifest, spec.config, student_dir)
        get_run_logger().info("prompts %s: %d prompts, %d samples per prompt, top-K %d", prompts.dataset_sha256,
                              prompts.examples, prompts.samples_per_prompt, prompts.effective_top_k)
        return prompts

    def train(self, plan: TrainPlan, corpus: CorpusRef, manifest: ManifestRef, student_dir: str) -> TrainRef:
        options = self.spec.options
        if options.train_deployment:
            return self._train_on_pool(plan, corpus, manifest)
        from tasks.train import train_task

        return train_task.with_options(retries=options.train_retries)(
            plan, corpus, manifest, student_dir, options.progress_every_seconds, options.cancel_poll_seconds)

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

    def publish(self, trained: TrainRef, spec: PipelineSpec) -> PublishRef:
        from tasks.publish import publish_task

        return publish_task(trained, spec.storage_root, spec.adapter)

    def ended(self, trained: TrainRef, spec: PipelineSpec) -> None:
        from tasks.publish import record_artifacts

        record_artifacts(trained, spec.adapter, None)
