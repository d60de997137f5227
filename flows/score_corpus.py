"""``score_corpus``: score unscored examples with a local teacher into a Kiln-admissible corpus."""


import hashlib
from typing import Any

from prefect import flow

from tasks.score import score_task


def _digest(uri: str) -> str:
    from kiln_core.storage import resolve

    return "sha256:" + hashlib.sha256(resolve(uri).read_bytes()).hexdigest()


@flow(name="score-corpus", flow_run_name="score-{examples}")
def score_corpus(
    examples: str,
    student: str,
    teacher_dir: str | None = None,
    teacher_alias: str | None = None,
    storage_root: str = "./kiln-data",
    top_k: int = 32,
    out: str | None = None,
) -> dict[str, Any]:
    """Score examples with a local teacher (directory or registry alias).

    Args:
        examples: Unscored examples JSONL (messages, teacher_response, optional trajectory).
        student: Student model directory (its tokenizer and masks pick the targets).
        teacher_dir: Local Hugging Face teacher directory.
        teacher_alias: Or a teacher registered in ``<storage_root>/teachers.json``.
        storage_root: Root for the registry and, without ``out``, for the scored corpus.
        top_k: Candidates per target.
        out: Where to write the corpus (default: content-addressed under ``<root>/scored/``).
    """
    from kiln_core.contracts.pipeline import SpecError, TeacherSource
    from kiln_core.engine.stages import resolve_manifest, scored_location
    from kiln_core.storage import localize_directory

    if (teacher_dir is None) == (teacher_alias is None):
        raise SpecError("give exactly one of teacher_dir or teacher_alias", "teacher_dir")

    student_dir = localize_directory(student)
    source = TeacherSource(kind="local_registry", alias=teacher_alias) if teacher_alias else TeacherSource(kind="local_dir", path=teacher_dir)
    manifest = resolve_manifest(source, storage_root, max_top_k=max(32, top_k))
    out_uri = out or scored_location(storage_root, _digest(examples), manifest.identity_revision, student_dir, top_k)
    scored = score_task(examples, out_uri, teacher_dir, teacher_alias, storage_root, student_dir, top_k)
    return scored.model_dump()
