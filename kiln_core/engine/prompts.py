"""On-policy runs in the engine: the prompts' data stage and their branch of the training stage.

A spec with ``prompts`` takes the same path as a corpus (``run_pipeline``): manifest → **prompts** →
plan → train → publish, with the same run directory ``<root>/runs/<adapter>/<run key>/``, resume
rule, publication and ``latest.json``. Only two steps differ, and both live here:

* ``check_prompts`` — the data stage (in place of fingerprint, admission and verification): read the
  prompt file, run Kiln's submit-time on-policy checks (``kiln_core.on_policy.submit.plan_on_policy``:
  the source rule and config rules, a local teacher whose vocabulary is the student's, every prompt
  renders and fits the context with ``max_tokens``, the effective top-K) and return a ``CorpusRef`` of
  kind ``prompts``. Its digest is Kiln's prompt-list digest, so the run key covers the prompts'
  content, not the file's bytes or place. Only the student's tokenizer is read;
* ``train_prompts`` — the training stage's branch: ``train_on_policy`` in this process with the
  teacher loaded from its local directory; rollouts and their teacher scores are stored under the run
  directory, so a retry resumes from the newest checkpoint and reads committed rollouts back. With the
  spec's ``vllm:`` block, a vLLM server samples the rollouts (the LoRA synced after every step) and/or
  one scores them (``vllm_backends``).

``write_inline_prompts`` (``kiln_core.on_policy.prompt_file``, re-exported here) turns a request's inline
prompts into the prompt file a spec names (``kiln-flows train``), content-addressed under ``<root>/prompts/``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kiln_core.contracts.opd_prompt import OpdPrompt, prompts_content_sha256
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.contracts.spec_blocks import VllmBackends
from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan
from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.on_policy.prompt_file import PROMPTS_DIR  # re-exported: where inline prompts are written

__all__ = ["PROMPTS_DIR", "check_prompts", "train_prompts", "write_inline_prompts"]

LOG = logging.getLogger(__name__)


def _binding(manifest: ManifestRef):
    """The pinned teacher as the submit checks see it: local when it has a model directory, else remote."""
    from kiln_core.on_policy.submit import TeacherBinding

    identity = manifest.teacher_identity
    kind = "local" if manifest.teacher_dir else "remote"
    return TeacherBinding(manifest.teacher, kind, identity, manifest.teacher_dir)


def check_prompts(prompts_uri: str, manifest: ManifestRef, settings: ResolvedSettings, student_dir: str, *,
                  storage_options: dict[str, Any] | None = None) -> CorpusRef:
    """Read a prompt file and apply every on-policy refusal that needs no model weights.

    Args:
        prompts_uri: JSONL of ``OpdPrompt`` lines (local path or fsspec URI).
        manifest: The pinned teacher (a local-registry alias or a local directory).
        settings: The run's settings (its on-policy config, and the top-K and samples per prompt resolved
            under the teacher's cap and from the prompt count).
        student_dir: Local student directory (its tokenizer and config are read).

    Returns:
        A ``CorpusRef`` with ``kind="prompts"``, Kiln's prompt-list digest, the effective top-K and
        samples per prompt.

    Raises:
        Rejection: a prompt-file rule (``invalid_json``, ``prompt_no_messages``, ``no_prompts``, … with its
            line), ``remote_teacher_on_policy``, ``teacher_vocab_mismatch``, ``training_will_not_fit``,
            ``top_k_unsupported``, or a config rule.

    Example:
        >>> ref = check_prompts("prompts.jsonl", manifest_ref, settings, "./student")  # doctest: +SKIP
        >>> ref.kind, ref.samples_per_prompt  # doctest: +SKIP
        ('prompts', 64)
    """
    from kiln_core.contracts.opd_config import OpdRequest
    from kiln_core.on_policy.prompt_file import read_prompt_file
    from kiln_core.on_policy.submit import plan_on_policy

    prompt_file = read_prompt_file(prompts_uri, storage_options)
    request = OpdRequest.model_construct(teacher=manifest.teacher, prompts=list(prompt_file.prompts),
                                         dataset_path=None, config=settings.config, post_eval=None)
    plan = plan_on_policy(request, teacher=_binding(manifest), student_dir=student_dir, top_k=settings.top_k,
                          samples_per_prompt=settings.samples_per_prompt)
    for warning in plan.warnings:
        LOG.warning("%s", warning)
    return CorpusRef(uri=prompt_file.uri, dataset_sha256="sha256:" + plan.content_sha256, source_uri=prompts_uri,
                     examples=len(prompt_file.prompts), action_tokens=0, env_tokens=0, effective_top_k=plan.top_k,
                     teacher_identity_revision=manifest.identity_revision, kind="prompts",
                     samples_per_prompt=plan.samples_per_prompt)


def write_inline_prompts(prompts: Sequence[OpdPrompt], storage_root: str) -> str:
    """Write a request's inline prompts as ``<root>/prompts/<digest>.jsonl`` (once; same prompts, same file).

    Each line is Kiln's re-serialization of one prompt, so reading the file back gives the same
    prompt-list digest as the inline list (``kiln_core.on_policy.prompt_file.write_prompt_file``).

    Example:
        >>> write_inline_prompts(request.prompts, "./kiln-data")  # doctest: +SKIP
        '/abs/kiln-data/prompts/3b1f….jsonl'
    """
    from kiln_core.on_policy.prompt_file import write_prompt_file

    return write_prompt_file(prompts, storage_root)


def train_prompts(plan: TrainPlan, prompts: CorpusRef, manifest: ManifestRef, student_dir: str, *,
                  on_progress: Callable[..., None] | None, should_cancel: Callable[[], bool],
                  on_step_committed: Callable[[int], None] | None, eval_watch=None):
    """Train the planned on-policy run here (``train_on_policy``, which takes ``plan`` whole: its ``resume`` a
    checkpoint basename or None); returns its ``OnPolicyTrainResult``.

    ``on_progress`` is called as ``(consumed candidates, total candidates, loss, rollout=OnPolicyProgress)``
    after each committed step: Kiln's progress fraction, plus rollouts/s and teacher tokens scored.
    ``eval_watch`` is the held-out watch (``HeldOutSlice``), as off-policy.

    Raises:
        Rejection: ``remote_teacher_on_policy`` (no local model directory); the trainer's refusals.
        EnvironmentFailure: ``corpus_changed`` when the prompt file no longer holds the planned prompts.
    """
    from kiln_core.on_policy.prompt_file import read_prompt_file
    from kiln_core.on_policy.teacher import TeacherSource
    from kiln_core.training.on_policy_trainer import train_on_policy

    loaded = read_prompt_file(prompts.uri).prompts
    if "sha256:" + prompts_content_sha256(loaded) != prompts.dataset_sha256:
        raise EnvironmentFailure("corpus_changed", f"{prompts.uri} changed since the run was planned "
                                 f"(expected {prompts.dataset_sha256})", file=prompts.uri)
    if not manifest.teacher_dir:
        raise Rejection("remote_teacher_on_policy", f"teacher {manifest.teacher!r} has no local model to score "
                        "rollouts with", field="teacher")
    identity = manifest.teacher_identity
    teacher = TeacherSource.local(manifest.teacher, identity, manifest.teacher_dir, device=plan.device,
                                  adapter_dir=manifest.adapter_dir)
    rollout_backend = None
    if plan.vllm is not None:
        teacher, rollout_backend = vllm_backends(plan.vllm, teacher, plan.run_uri, plan.adapter)

    def report(progress) -> None:
        if on_progress is not None:
            on_progress(progress.consumed_candidates, progress.total_candidates, progress.loss, rollout=progress)

    return train_on_policy(plan, loaded, student_dir=student_dir, teacher=teacher, should_cancel=should_cancel,
                           on_progress=report, on_step_committed=on_step_committed, handle_signals=False,
                           eval_watch=eval_watch, rollout_backend=rollout_backend)


def vllm_backends(options: VllmBackends, teacher, run_uri: str, adapter: str):
    """The spec's ``vllm:`` block as ``(teacher source, rollout backend factory or None)``; URLs are checked
    here, before any model loads.

    Raises:
        Rejection: ``invalid_option`` (plain HTTP to a non-loopback host, a URL with credentials).
    """
    from kiln_core.on_policy.vllm_rollouts import vllm_rollout_backend
    from kiln_core.on_policy.vllm_teacher import vllm_teacher_source
    from kiln_core.scoring.vllm import completions_url
    from kiln_core.storage import resolve

    if options.teacher_url:
        completions_url(options.teacher_url)
        teacher = vllm_teacher_source(teacher.alias, teacher.identity, options.teacher_url,
                                      timeout_s=options.timeout_seconds)
    if not options.rollouts_url:
        return teacher, None
    sync_dir = options.sync_dir
    if sync_dir is None:
        run = resolve(run_uri)
        if not run.is_local:
            raise Rejection("invalid_spec", "vllm.sync_dir is required when the run directory is not local "
                            f"({run_uri})", field="vllm.sync_dir")
        sync_dir = run.child("vllm-sync").path
    return teacher, vllm_rollout_backend(options.rollouts_url, sync_dir=sync_dir, timeout_s=options.timeout_seconds,
                                         name_prefix=adapter)
