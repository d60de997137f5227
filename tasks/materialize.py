"""Stage 3, ``materialize``: open the committed, content-addressed tables and verify every byte.

Admission writes the materialization; this stage is where a run (possibly on another machine, after a
retry) binds to it: it reads ``admission.json``, checks each Parquet file's size and SHA-256, and
re-checks the counts, so training never starts from a partial or altered materialization.
"""

from __future__ import annotations

from prefect import task

from tasks.cache import DigestCachePolicy
from tasks.refs import CorpusRef


def verify(corpus: CorpusRef, storage_options: dict | None = None) -> CorpusRef:
    """Verify a committed materialization against its record (plain function)."""
    from kiln_core.materialize import read_materialization

    materialization = read_materialization(corpus.uri, storage_options)
    record = materialization.record
    if record.dataset_sha256 != corpus.dataset_sha256:
        raise ValueError(f"{corpus.uri} holds {record.dataset_sha256}, expected {corpus.dataset_sha256}")
    tables = materialization.tables  # reading verifies sizes and SHA-256 of every file
    if tables.num_examples != record.examples or tables.action_positions.shape[0] != record.action_tokens:
        raise ValueError(f"{corpus.uri}: tables disagree with admission.json counts")
    return corpus.model_copy(update={"examples": record.examples, "action_tokens": record.action_tokens})


@task(
    name="materialize",
    task_run_name="materialize-{corpus.dataset_sha256}",
    cache_policy=DigestCachePolicy(version="kiln-flows-materialize-v2", inputs=("corpus",)),
    persist_result=True,
    result_serializer="json",
)
def materialize_task(corpus: CorpusRef, storage_options: dict | None = None) -> CorpusRef:
    """Bind the run to the verified materialization of the admitted corpus.

    Example:
        ```python
        corpus_ref = materialize_task(admit_task(...))
        print(corpus_ref.uri)  # <root>/corpora/<sha256 hex>
        ```
    """
    return verify(corpus, storage_options)
