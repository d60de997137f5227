"""Stage 1, ``manifest``: the teacher's pinned ``off_policy_manifest`` line (``kiln_core.engine.stages``)."""

from __future__ import annotations

from prefect import task

from kiln_core.contracts.pipeline import TeacherSource
from kiln_core.contracts.stage_refs import ManifestRef
from tasks.retry import retry_unless_rejected


@task(name="manifest", task_run_name="manifest-{teacher.kind}", retries=2, retry_delay_seconds=[2, 10],
      retry_condition_fn=retry_unless_rejected)
def fetch_manifest(teacher: TeacherSource, storage_root: str, max_top_k: int = 32) -> ManifestRef:
    """Fetch or compute the teacher's manifest line (a Kiln server outage is retried; an unknown alias is not).

    Example:
        ```python
        from prefect import flow
        from kiln_core.contracts.pipeline import TeacherSource
        from tasks.manifest import fetch_manifest

        @flow
        def pin_teacher():
            ref = fetch_manifest(TeacherSource(kind="kiln_server", alias="teacher-large@vllm"), "./kiln-data")
            return ref.identity_revision
        ```
    """
    from kiln_core.engine.stages import resolve_manifest

    return resolve_manifest(teacher, storage_root, max_top_k=max_top_k)
