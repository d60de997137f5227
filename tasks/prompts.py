"""The on-policy data stage, ``prompts``: ``kiln_core.engine.prompts.check_prompts`` as a task.

It reads the prompt file and applies Kiln's submit-time on-policy checks (teacher, vocabulary, prompt
lengths, top-K) before training starts; a rejected prompt file is never retried, a storage failure is.
Rollouts, teacher scoring and the optimizer steps all run later, in the ``train`` task (on the training
work pool when ``options.train_deployment`` names one).
"""

from __future__ import annotations

from prefect import task

from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef
from tasks.retry import retry_unless_rejected


@task(name="prompts", task_run_name="prompts-{manifest.teacher}", retries=2, retry_delay_seconds=[2, 10],
      retry_condition_fn=retry_unless_rejected)
def check_prompts_task(prompts_uri: str, manifest: ManifestRef, settings: ResolvedSettings,
                       student_dir: str) -> CorpusRef:
    """Check an on-policy prompt file against the teacher and the student.

    Example:
        ```python
        prompts = check_prompts_task("s3://bucket/prompts.jsonl", manifest_ref, settings, "./student")
        ```
    """
    from kiln_core.engine.prompts import check_prompts

    return check_prompts(prompts_uri, manifest, settings, student_dir)
