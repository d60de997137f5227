"""Stage 3, ``materialize``: bind the run to the committed, content-addressed tables, every byte verified.

Admission writes the materialization; this stage is where a run (possibly on another machine, after a
retry) binds to it: ``kiln_core.engine.stages.verify`` reads ``admission.json``, checks each Parquet
file's size and SHA-256 and re-checks the counts, so training never starts from a partial or altered
materialization. That check is the stage, so it is never served from a cache: a cached "verified" would
skip exactly what it promises.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_core.contracts.stage_refs import CorpusRef
from tasks.names import run_name


@task(
    name="materialize",
    task_run_name=run_name("materialize", "corpus", "dataset_sha256"),
    cache_policy=NO_CACHE,
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
