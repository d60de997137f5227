"""Stage 3, ``materialize``: bind the run to the committed, content-addressed tables, every byte verified.

Admission writes the materialization; this stage is where a run (possibly on another machine, after a
retry) binds to it: ``kiln_core.engine.stages.verify`` reads ``admission.json``, checks each Parquet
file's size and SHA-256 and re-checks the counts, so training never starts from a partial or altered
materialization.
"""

from __future__ import annotations

from prefect import task

from kiln_core.contracts.stage_refs import CorpusRef
from tasks.cache import DigestCachePolicy
from tasks.names import run_name


@task(
    name="materialize",
    task_run_name=run_name("materialize", "corpus", "dataset_sha256"),
    # v4: results are refs of kiln_core.contracts.stage_refs (they were kiln_core.engine.refs); see ADMIT_CACHE
    cache_policy=DigestCachePolicy(version="kiln-flows-materialize-v4", inputs=("corpus",)),
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
    from kiln_core.engine.stages import verify

    return verify(corpus, storage_options)
