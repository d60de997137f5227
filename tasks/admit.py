"""Stage 2, ``admit``: fingerprint the inputs, then admit the corpus once per (bytes, student, top-K).

The admission task is cached by ``DigestCachePolicy`` over the dataset digest, the student's
tokenizer identity, the effective top-K and the pinned teacher revision, with persisted JSON results
and separate key storage under the storage root, so re-running on unchanged bytes skips admission. The
cache is a hint (``tasks.cache.run_cached``): a cached ``CorpusRef`` is reused only while its
materialization verifies; a missing one is admitted again, a damaged one set aside and admitted again
(``replace_damaged``). Underneath, kiln_core's materialization is content-addressed too: even without
Prefect's cache record an admitted corpus is found and reused, never re-parsed. A rejected corpus is never
retried.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_core.contracts.stage_refs import CorpusRef, InputsRef, ManifestRef
from tasks.cache import DigestCachePolicy
from tasks.names import run_name

ADMIT_CACHE = DigestCachePolicy(
    # v4: results live beside the cache records under the storage root (``cache_options``); a v3 record
    # names a result in some Prefect home (and a ref class of kiln_core.engine.refs, now contracts.stage_refs).
    version="kiln-flows-admit-v4",
    inputs=("dataset_sha256", "student_digest", "effective_top_k", "pinned_revision", "storage_root"),
)


@task(name="fingerprint", task_run_name=run_name("fingerprint", "corpus_uri"), cache_policy=NO_CACHE)
def fingerprint_inputs(corpus_uri: str, student_dir: str, top_k: int, storage_options: dict | None = None) -> InputsRef:
    """Digest the run's inputs (always runs, never from a cache, not even on a flow retry with results
    persisted: it is what decides whether anything else must)."""
    from kiln_core.engine.stages import fingerprint

    return fingerprint(corpus_uri, student_dir, top_k, storage_options)


@task(name="admit", task_run_name=run_name("admit", "dataset_sha256"), cache_policy=ADMIT_CACHE, persist_result=True,
      result_serializer="json")
def admit_task(
    inputs: InputsRef,
    dataset_sha256: str,
    student_digest: str,
    effective_top_k: int,
    pinned_revision: str | None,
    storage_root: str,
    manifest: ManifestRef,
    kiln_strict: bool = False,
    storage_options: dict | None = None,
    replace_damaged: bool = False,
) -> CorpusRef:
    """Admit the corpus under every Kiln rule and materialize it under its SHA-256.

    The digest arguments are what the cache key is made of; ``inputs`` carries them too.
    ``replace_damaged``: a committed materialization of these bytes that no longer verifies is set aside
    and written again (``run_cached`` asks for it when a cached result's materialization is damaged).

    Example:
        ```python
        inputs = fingerprint_inputs(corpus, student, 32)
        corpus_ref = admit_task(inputs, inputs.dataset_sha256, inputs.student_digest, inputs.effective_top_k,
                                manifest.identity_revision, "./kiln-data", manifest)
        ```
    """
    from kiln_core.engine.stages import admit

    return admit(inputs, manifest, storage_root, kiln_strict=kiln_strict, storage_options=storage_options,
                 replace_damaged=replace_damaged)
