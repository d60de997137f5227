"""Stage 2, ``admit``: fingerprint the inputs, then admit the corpus once per (bytes, student, top-K).

The admission task is cached by ``DigestCachePolicy`` over the dataset digest, the student's
tokenizer identity, the effective top-K and the pinned teacher revision, with persisted JSON results
and separate key storage, so re-running on unchanged bytes skips admission. Underneath, kiln_core's
materialization is content-addressed too: even without Prefect's cache record an admitted corpus is
found and reused, never re-parsed.
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import task

from tasks.cache import DigestCachePolicy
from tasks.refs import CorpusRef, InputsRef

ADMIT_CACHE = DigestCachePolicy(
    version="kiln-flows-admit-v2",  # v2: admission format kiln-flows.admission.v2 (Kiln's masks)
    inputs=("dataset_sha256", "student_digest", "effective_top_k", "pinned_revision", "storage_root"),
)


def fingerprint(corpus_uri: str, student_dir: str, top_k: int, storage_options: dict | None = None) -> InputsRef:
    """Digest the corpus bytes (streamed) and the student's tokenizer identity."""
    from kiln_core.admission import resolve_top_k
    from kiln_core.canonical import kiln_compact_json
    from kiln_core.storage import resolve
    from kiln_core.tokenization import load_student_tokenizer

    location = resolve(corpus_uri, storage_options)
    digest = hashlib.sha256()
    with location.fs.open(location.path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
    identity = load_student_tokenizer(student_dir).identity()
    student_digest = "sha256:" + hashlib.sha256(kiln_compact_json(dict(sorted(identity.items()))).encode()).hexdigest()
    return InputsRef(
        corpus_uri=location.uri,
        dataset_sha256="sha256:" + digest.hexdigest(),
        student_dir=student_dir,
        student_digest=student_digest,
        effective_top_k=resolve_top_k(top_k),
    )


@task(name="fingerprint", task_run_name="fingerprint-{corpus_uri}")
def fingerprint_inputs(corpus_uri: str, student_dir: str, top_k: int, storage_options: dict | None = None) -> InputsRef:
    """Digest the run's inputs (always runs: it is what decides whether anything else must)."""
    return fingerprint(corpus_uri, student_dir, top_k, storage_options)


def admit(
    inputs: InputsRef,
    storage_root: str,
    pinned_manifest: str | None,
    *,
    kiln_strict: bool = False,
    storage_options: dict | None = None,
) -> CorpusRef:
    """Admit and materialize (plain function; the task wraps it)."""
    from kiln_core.admission import admit_corpus

    result = admit_corpus(
        inputs.corpus_uri,
        inputs.student_dir,
        top_k=inputs.effective_top_k,
        pinned_manifest=pinned_manifest,
        kiln_strict=kiln_strict,
        out_root=storage_root,
        storage_options=storage_options,
    )
    if result.dataset_sha256 != inputs.dataset_sha256:
        raise RuntimeError(
            f"{inputs.corpus_uri} changed while the run was starting ({inputs.dataset_sha256} → {result.dataset_sha256})"
        )
    return CorpusRef(
        uri=result.materialized,
        dataset_sha256=result.dataset_sha256,
        source_uri=result.source_uri,
        examples=result.examples,
        action_tokens=result.action_tokens,
        env_tokens=result.env_tokens,
        effective_top_k=result.effective_top_k,
        teacher_identity_revision=result.teacher_identity.identity_revision() if result.teacher_identity else None,
        reused=result.reused,
    )


@task(name="admit", task_run_name="admit-{dataset_sha256}", cache_policy=ADMIT_CACHE, persist_result=True,
      result_serializer="json")
def admit_task(
    inputs: InputsRef,
    dataset_sha256: str,
    student_digest: str,
    effective_top_k: int,
    pinned_revision: str | None,
    storage_root: str,
    pinned_manifest: str | None,
    kiln_strict: bool = False,
    storage_options: dict | None = None,
) -> CorpusRef:
    """Admit the corpus under every Kiln rule and materialize it under its SHA-256.

    The digest arguments are what the cache key is made of; ``inputs`` carries them too.

    Example:
        ```python
        inputs = fingerprint_inputs(corpus, student, 32)
        corpus_ref = admit_task(inputs, inputs.dataset_sha256, inputs.student_digest, inputs.effective_top_k,
                                manifest.identity_revision, "./kiln-data", manifest.manifest_line)
        ```
    """
    return admit(inputs, storage_root, pinned_manifest, kiln_strict=kiln_strict, storage_options=storage_options)


def cache_options(storage_root: str, refresh: bool) -> dict[str, Any]:
    """Task options that store cache records apart from results, under a local storage root."""
    from kiln_core.storage import resolve

    options: dict[str, Any] = {"refresh_cache": refresh}
    location = resolve(storage_root)
    if location.is_local:
        options["cache_policy"] = ADMIT_CACHE.configure(key_storage=f"{location.path}/prefect/cache-keys")
    return options
