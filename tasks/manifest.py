"""Stage 1, ``manifest``: the teacher's pinned ``off_policy_manifest`` line."""

from __future__ import annotations

from prefect import task

from kiln_core.contracts.pipeline import TeacherSource
from tasks.refs import ManifestRef


def resolve_manifest(teacher: TeacherSource, storage_root: str, *, max_top_k: int = 32) -> ManifestRef:
    """The exact manifest line for a teacher source (plain function; the task wraps it).

    Args:
        teacher: Kiln server alias, local registry alias, or local teacher directory.
        storage_root: Root holding the local registry (``<root>/teachers.json``).
        max_top_k: ``max_top_k`` for a local directory's identity.

    Returns:
        A ``ManifestRef`` whose ``manifest_line`` is byte-identical to the pinned line.
    """
    from kiln_core.contracts.identity import build_manifest_line, parse_manifest_line

    teacher_dir = None
    if teacher.kind == "kiln_server":
        from kiln_core.teachers.kiln_client import fetch_off_policy_manifest

        line = fetch_off_policy_manifest(teacher.alias, base_url=teacher.url)
    elif teacher.kind == "local_registry":
        from kiln_core.teachers.local_registry import get_local_teacher

        entry = get_local_teacher(storage_root, teacher.alias)
        line, teacher_dir = entry.off_policy_manifest, entry.teacher_dir
    else:
        from kiln_core.identity.local_teacher import local_teacher_identity

        teacher_dir = teacher.path
        line = build_manifest_line(local_teacher_identity(teacher.path, max_top_k=max_top_k))
    identity = parse_manifest_line(line).teacher_identity
    return ManifestRef(
        manifest_line=line,
        identity_revision=identity.identity_revision(),
        teacher=teacher.label(),
        source=teacher.kind,
        teacher_dir=teacher_dir,
    )


@task(name="manifest", task_run_name="manifest-{teacher.kind}", retries=2, retry_delay_seconds=[2, 10])
def fetch_manifest(teacher: TeacherSource, storage_root: str, max_top_k: int = 32) -> ManifestRef:
    """Fetch or compute the teacher's manifest line.

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
    return resolve_manifest(teacher, storage_root, max_top_k=max_top_k)
