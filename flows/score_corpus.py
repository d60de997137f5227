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
    shard_size: int | str | None = None,
) -> dict[str, Any]:
    """Score examples with a local teacher (directory or registry alias).

    With ``shard_size`` the scored corpus is a set of shards of at most that size (``64MiB``, ``500KiB`` or
    bytes; at most 64 MiB) plus ``index.json`` in a directory; a rerun resumes it shard by shard, and the
    result's ``uri`` names the index (what ``kiln-flows admit`` and ``validate_corpus`` take).

    Args:
        examples: Unscored examples JSONL (messages, teacher_response, optional trajectory).
        student: Student model directory (its tokenizer and masks pick the targets).
        teacher_dir: Local Hugging Face teacher directory.
        teacher_alias: Or a teacher registered in ``<storage_root>/teachers.json``.
        storage_root: Root for the registry and, without ``out``, for the scored corpus.
        top_k: Candidates per target.
        out: Where to write the corpus (default: content-addressed under ``<root>/scored/``); with
            ``shard_size``, a directory.
        shard_size: Shard the output (see above); None writes one file.
    """
    from kiln_core.contracts.pipeline import SpecError, TeacherSource
    from kiln_core.engine.stages import resolve_manifest, scored_location
    from kiln_core.scoring.shards import parse_shard_size
    from kiln_core.storage import localize_directory

    if (teacher_dir is None) == (teacher_alias is None):
        raise SpecError("give exactly one of teacher_dir or teacher_alias", "teacher_dir")
    if shard_size is not None:
        shard_size = parse_shard_size(shard_size)  # a bad size is refused before anything is read

    student_dir = localize_directory(student)
    source = TeacherSource(kind="local_registry", alias=teacher_alias) if teacher_alias else TeacherSource(kind="local_dir", path=teacher_dir)
    manifest = resolve_manifest(source, storage_root, max_top_k=max(32, top_k))
    out_uri = out or scored_location(storage_root, _digest(examples), manifest.identity_revision, student_dir, top_k,
                                     shard_size)
    scored = score_task(examples, out_uri, teacher_dir, teacher_alias, storage_root, student_dir, top_k, shard_size)
    return scored.model_dump()
