"""``validate_corpus``: admission only — the verdict on a corpus, as a table artifact.

Nothing is materialized. A rejected corpus ends the run as Failed with the rule, line and message in
both the state message and the artifact, so a scheduled validation shows red in the UI.
"""


from typing import Any

from prefect import flow, task
from prefect.states import Failed

from tasks.artifacts import artifact_key, table_rows
from tasks.names import run_name


def verdict_of(corpus: str, student: str, top_k: int, teacher_manifest: str | None, kiln_strict: bool) -> dict[str, Any]:
    """Admit without materializing; the verdict as a flat dict (plain function)."""
    from kiln_core.admission import admit_corpus
    from kiln_core.errors import Rejection

    pinned = None
    try:
        if teacher_manifest:
            from kiln_core.teachers.local_registry import read_manifest_file

            pinned = read_manifest_file(teacher_manifest)
        result = admit_corpus(corpus, student, top_k=top_k, pinned_manifest=pinned, kiln_strict=kiln_strict)
    except Rejection as error:  # the corpus, the student or the pinned manifest: the verdict says which
        return {"corpus": corpus, **error.to_json()}
    return {"corpus": corpus, **result.to_json()}


@task(name="admit-only", task_run_name=run_name("admit-only", "corpus"))
def admission_verdict(corpus: str, student: str, top_k: int, teacher_manifest: str | None, kiln_strict: bool) -> dict[str, Any]:
    """The admission verdict for one corpus (no output written)."""
    return verdict_of(corpus, student, top_k, teacher_manifest, kiln_strict)


def shard_set_verdict(corpus: str, student: str, top_k: int, teacher_manifest: str | None, kiln_strict: bool,
                      concurrency: int) -> dict[str, Any]:
    """Admit a set of shards without materializing, one mapped task per shard; the verdict as a flat dict."""
    from kiln_core.errors import Rejection
    from tasks.admit_shards import admit_set_with_tasks

    try:
        pinned = None
        if teacher_manifest:
            from kiln_core.teachers.local_registry import read_manifest_file

            pinned = read_manifest_file(teacher_manifest)
        result = admit_set_with_tasks(corpus, student, top_k=top_k, pinned_manifest=pinned, kiln_strict=kiln_strict,
                                      concurrency=concurrency)
    except Rejection as error:
        return {"corpus": corpus, **error.to_json()}
    return {"corpus": corpus, "status": "admitted", "set_sha256": result.set_sha256,
            "effective_top_k": result.effective_top_k, **result.totals()}


@flow(name="validate-corpus", flow_run_name="validate-{corpus}")
def validate_corpus(
    corpus: str,
    student: str,
    top_k: int = 32,
    teacher_manifest: str | None = None,
    kiln_strict: bool = False,
    shard_concurrency: int = 4,
):
    """Check a teacher-scored corpus against every Kiln admission rule and show the verdict.

    Args:
        corpus: JSONL corpus path or fsspec URI; or a set of shards (a directory of ``*.jsonl`` files or a
            ``kiln-flows.corpus-shards.v1`` index), each shard checked in its own task.
        student: Student model directory.
        top_k: Requested top-K (resolved to 32 or 16).
        teacher_manifest: File holding the registered teacher's manifest line (optional pin).
        kiln_strict: Accept only Kiln's vLLM teacher protocol.
        shard_concurrency: For a set of shards, how many shard tasks run at once.
    """
    from kiln_core.admission.shards import is_shard_set

    shard_set = is_shard_set(corpus)
    if shard_set:
        verdict = shard_set_verdict(corpus, student, top_k, teacher_manifest, kiln_strict, shard_concurrency)
    else:
        verdict = admission_verdict(corpus, student, top_k, teacher_manifest, kiln_strict)
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        table_rows(verdict), key=artifact_key("verdict", corpus.rsplit("/", 1)[-1]),
        description=f"admission verdict for {corpus}",
    )
    if verdict["status"] == "rejected":
        shard = f"{verdict['file']} " if shard_set and verdict.get("file") else ""  # which shard of a set
        return Failed(message=f"[{verdict['code']}] {shard}line {verdict['line']}: {verdict['message']}", data=verdict)
    return verdict
