"""The stages before training, as plain functions: teacher manifest, scoring, fingerprint, admission,
verification of the materialization.

Each takes and returns small refs (``kiln_core.contracts.stage_refs``). ``run_pipeline`` calls them in order;
the Prefect tasks in ``tasks/`` wrap them one to one and add retries, caching and artifacts.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kiln_core.contracts.pipeline import PipelineSpec, TeacherSource
from kiln_core.contracts.stage_refs import CorpusRef, InputsRef, ManifestRef, ScoredRef
from kiln_core.errors import AdmissionError, EnvironmentFailure, Rejection


class TeacherSourceError(Rejection, ValueError):
    """A teacher source that cannot give a manifest (a manifest file that cannot be read)."""


def resolve_manifest(teacher: TeacherSource, storage_root: str, *, max_top_k: int = 32) -> ManifestRef:
    """The exact manifest line for a teacher source.

    Args:
        teacher: Kiln server alias, local registry alias, local teacher directory, or manifest file.
        storage_root: Root holding the local registry (``<root>/teachers.json``).
        max_top_k: ``max_top_k`` for a local directory's identity.

    Returns:
        A ``ManifestRef`` whose ``manifest_line`` is byte-identical to the pinned line.

    Example:
        >>> ref = resolve_manifest(TeacherSource(kind="manifest_file", path="teacher.jsonl"), ".")  # doctest: +SKIP
        >>> ref.identity_revision[:7]  # doctest: +SKIP
        'sha256:'
    """
    from kiln_core.contracts.identity import build_manifest_line, parse_manifest_line

    teacher_dir = adapter_dir = None
    if teacher.kind == "kiln_server":
        from kiln_core.teachers.kiln_client import fetch_off_policy_manifest

        line = fetch_off_policy_manifest(teacher.alias, base_url=teacher.url)
    elif teacher.kind == "local_registry":
        from kiln_core.teachers.local_registry import get_local_teacher

        entry = get_local_teacher(storage_root, teacher.alias)
        line, teacher_dir, adapter_dir = entry.off_policy_manifest, entry.teacher_dir, entry.adapter_dir
        if adapter_dir is not None:  # a LoRA teacher is pinned at registration, refused at use if rewritten
            from kiln_core.teachers.lora_teacher import check_pinned_adapter

            check_pinned_adapter(teacher.alias, parse_manifest_line(line).teacher_identity, adapter_dir)
    elif teacher.kind == "manifest_file":
        from kiln_core.teachers.local_registry import read_manifest_file

        try:
            line = read_manifest_file(teacher.path)
        except OSError as error:
            raise TeacherSourceError("bad_manifest_file", f"teacher manifest file {teacher.path}: "
                                     f"{error.strerror or error}", field="teacher", file=teacher.path) from None
    else:
        from kiln_core.identity.local_teacher import local_teacher_identity

        teacher_dir = teacher.path
        line = build_manifest_line(local_teacher_identity(teacher.path, max_top_k=max_top_k))
    identity = parse_manifest_line(line).teacher_identity
    return ManifestRef(manifest_line=line, identity_revision=identity.identity_revision(), teacher=teacher.label(),
                       source=teacher.kind, teacher_dir=teacher_dir, adapter_dir=adapter_dir)


def fingerprint(corpus_uri: str, student_dir: str, top_k: int, storage_options: dict | None = None) -> InputsRef:
    """Digest the corpus bytes and the student's tokenizer identity; ``top_k`` is the run's effective top-K
    (``ResolvedSettings.top_k``), which admission uses as it is.

    The corpus is read under admission's file-level rules, so a missing, unreadable or oversized
    corpus is the same ``AdmissionError`` here as in ``kiln-flows admit`` (exit 2), before any cache
    lookup; a student directory that cannot be loaded is a ``TokenizationError``.
    """
    from kiln_core.admission.source import read_corpus
    from kiln_core.canonical import kiln_compact_json
    from kiln_core.tokenization import load_student_tokenizer

    from kiln_core.admission.shard_sources import is_shard_set, shard_set_digest
    from kiln_core.storage import resolve

    if is_shard_set(corpus_uri, storage_options):  # a directory or index of shards: the set digest
        dataset_sha256, _ = shard_set_digest(corpus_uri, storage_options)
        corpus_uri = resolve(corpus_uri, storage_options).uri
    else:
        corpus = read_corpus(corpus_uri, storage_options)
        corpus_uri, dataset_sha256 = corpus.uri, "sha256:" + corpus.sha256_hex
    identity = load_student_tokenizer(student_dir).identity()
    student_digest = "sha256:" + hashlib.sha256(kiln_compact_json(dict(sorted(identity.items()))).encode()).hexdigest()
    return InputsRef(corpus_uri=corpus_uri, dataset_sha256=dataset_sha256, student_dir=student_dir,
                     student_digest=student_digest, effective_top_k=top_k)


def admit(inputs: InputsRef, manifest: ManifestRef, storage_root: str, *, kiln_strict: bool = False,
          storage_options: dict | None = None, workers: int = 1, replace_damaged: bool = False) -> CorpusRef:
    """Admit the corpus against the pinned manifest and materialize it under ``storage_root`` (a set of
    shards: ``admit_set``, ``workers`` shards at once).

    ``replace_damaged``: a committed materialization of these bytes whose files no longer match its record
    is set aside (``set_aside_damaged``) and written again, instead of being reused as it is.

    Raises:
        AdmissionError: the corpus breaks a rule; an ``identity_mismatch`` against a local-registry
            alias also says which field differs and how to score with the alias.
    """
    from kiln_core.admission import admit_corpus
    from kiln_core.admission.shard_sources import is_shard_set

    if is_shard_set(inputs.corpus_uri, storage_options):
        return admit_set(inputs, manifest, storage_root, kiln_strict=kiln_strict, storage_options=storage_options,
                         workers=workers)
    if replace_damaged:
        set_aside_damaged(inputs, storage_root, storage_options)
    try:
        result = admit_corpus(inputs.corpus_uri, inputs.student_dir, effective_top_k=inputs.effective_top_k,
                              pinned_manifest=manifest.manifest_line, kiln_strict=kiln_strict, out_root=storage_root,
                              storage_options=storage_options)
    except AdmissionError as error:
        if error.code == "identity_mismatch" and manifest.source == "local_registry":
            raise _mismatch_with_hint(error, inputs.corpus_uri, manifest, storage_options) from None
        raise
    if result.dataset_sha256 != inputs.dataset_sha256:
        raise EnvironmentFailure("corpus_changed", f"{inputs.corpus_uri} changed while the run was starting "
                                 f"({inputs.dataset_sha256} → {result.dataset_sha256})", file=inputs.corpus_uri)
    return CorpusRef(
        uri=result.materialized, dataset_sha256=result.dataset_sha256, source_uri=result.source_uri,
        examples=result.examples, action_tokens=result.action_tokens, env_tokens=result.env_tokens,
        effective_top_k=result.effective_top_k,
        teacher_identity_revision=result.teacher_identity.identity_revision() if result.teacher_identity else None,
        reused=result.reused,
    )


def admit_set(inputs: InputsRef, manifest: ManifestRef, storage_root: str, *, kiln_strict: bool = False,
              storage_options: dict | None = None, workers: int = 1) -> CorpusRef:
    """Admit a set of shards against the pinned manifest: every shard materialized under its own digest,
    then the set record (``kiln_core.admission.shards.admit_shard_set``).

    Raises:
        AdmissionError: the set or one of its shards breaks a rule (the shard named in ``file``).
    """
    from kiln_core.admission.shards import admit_shard_set

    result = admit_shard_set(inputs.corpus_uri, inputs.student_dir, top_k=inputs.effective_top_k,
                             pinned_manifest=manifest.manifest_line, kiln_strict=kiln_strict, out_root=storage_root,
                             storage_options=storage_options, workers=workers)
    return set_ref(result, inputs)


def set_ref(result: Any, inputs: InputsRef) -> CorpusRef:
    """The ``CorpusRef`` of an admitted set (``ShardSetResult``), checked against the digest the run started with.

    Raises:
        EnvironmentFailure: ``corpus_changed``: a shard changed since the inputs were digested.
    """
    if result.set_sha256 != inputs.dataset_sha256:
        raise EnvironmentFailure("corpus_changed", f"{inputs.corpus_uri} changed while the run was starting "
                                 f"({inputs.dataset_sha256} → {result.set_sha256})", file=inputs.corpus_uri)
    totals = result.totals()
    return CorpusRef(
        uri=result.record_uri, dataset_sha256=result.set_sha256, source_uri=inputs.corpus_uri,
        examples=totals["examples"], action_tokens=totals["action_tokens"], env_tokens=totals["env_tokens"],
        effective_top_k=result.effective_top_k, teacher_identity_revision=result.shards[0].teacher_identity_revision,
        reused=all(shard.reused for shard in result.shards), kind="shard_set",
    )


def _mismatch_with_hint(error: AdmissionError, corpus_uri: str, manifest: ManifestRef,
                        storage_options: dict | None) -> AdmissionError:
    """The identity mismatch, with each differing field's two values and the fix: a corpus scored from
    the teacher's directory carries the directory's served_model_id, not the registered alias."""
    import json

    from kiln_core.contracts.identity import TeacherIdentity
    from kiln_core.storage import resolve

    try:
        with resolve(corpus_uri, storage_options).fs.open(resolve(corpus_uri, storage_options).path, "rb") as handle:
            corpus_identity = json.loads(handle.readline())["teacher_identity"]
        pinned = json.loads(manifest.manifest_line)["teacher_identity"]
    except (OSError, ValueError, KeyError, TypeError):
        return error
    fields = [name.rstrip("_") for name in TeacherIdentity.model_fields]
    differing = [f"{name}: corpus {corpus_identity.get(name)!r}, registered {pinned.get(name)!r}"
                 for name in fields if corpus_identity.get(name) != pinned.get(name)]
    hint = ""
    if any(item.startswith("served_model_id:") for item in differing):
        hint = (f" — the corpus was scored under another name; score it with the registered alias "
                f"(`kiln-flows score … --teacher {manifest.teacher}`) so it carries the registered identity")
    return AdmissionError("identity_mismatch", error.line,
                          f"the corpus's teacher does not match the registered teacher {manifest.teacher!r} "
                          f"({'; '.join(differing)}){hint}")


class MaterializationMismatch(EnvironmentFailure):
    """A committed materialization whose files or counts disagree with its record (storage damage)."""


def verify(corpus: CorpusRef, storage_options: dict | None = None) -> CorpusRef:
    """Verify a committed materialization against its record: digests of every file, and the counts (a
    set: every shard's, one shard in memory at a time).

    Raises:
        MaterializationMismatch: ``materialization_mismatch``: missing, uncommitted, or a file or count that
            disagrees with the record.
    """
    from kiln_core.materialize import read_materialization

    if corpus.kind == "shard_set":
        return _verify_set(corpus, storage_options)

    try:
        materialization = read_materialization(corpus.uri, storage_options)
        record = materialization.record
        if record.dataset_sha256 != corpus.dataset_sha256:
            raise ValueError(f"it holds {record.dataset_sha256}, expected {corpus.dataset_sha256}")
        tables = materialization.tables  # reading verifies sizes and SHA-256 of every file
    except (OSError, ValueError) as error:  # missing, uncommitted or damaged: storage, not the input
        raise MaterializationMismatch("materialization_mismatch", f"{corpus.uri}: {error}", file=corpus.uri) from None
    if tables.num_examples != record.examples or tables.action_positions.shape[0] != record.action_tokens:
        raise MaterializationMismatch("materialization_mismatch", f"{corpus.uri}: tables disagree with "
                                      "admission.json counts", file=corpus.uri)
    return corpus.model_copy(update={"examples": record.examples, "action_tokens": record.action_tokens})


def _verify_set(corpus: CorpusRef, storage_options: dict | None) -> CorpusRef:
    from kiln_core.corpus_set import ShardedCorpus

    try:
        shards = ShardedCorpus.open(corpus.uri, storage_options)
        if shards.record.set_sha256 != corpus.dataset_sha256:
            raise ValueError(f"it records {shards.record.set_sha256}, expected {corpus.dataset_sha256}")
        action_tokens = sum(int(tables.action_positions.shape[0]) for tables in shards.shards())
    except (OSError, ValueError) as error:  # a missing or damaged shard materialization
        raise MaterializationMismatch("materialization_mismatch", f"set record {corpus.uri}: {error}",
                                      file=corpus.uri) from None
    if action_tokens != shards.record.totals.action_tokens:
        raise MaterializationMismatch("materialization_mismatch", f"{corpus.uri}: the shards' tables disagree "
                                      "with the set record's counts", file=corpus.uri)
    return corpus.model_copy(update={"examples": shards.num_examples, "action_tokens": action_tokens})


def set_aside_damaged(inputs: InputsRef, storage_root: str, storage_options: dict | None = None) -> str | None:
    """Move a committed materialization of ``inputs``' bytes for this student and top-K whose files no longer
    match its record out of the way (``.<name>.damaged-<token>`` beside it), so admission writes it again
    instead of reusing it. Returns where it went, or None when there is none or it verifies.

    The damaged directory is kept, not deleted: storage damage is worth a look, and another reader may hold it.
    """
    import secrets

    from kiln_core.admission.admit import load_admission_student
    from kiln_core.materialize import find_materialization
    from kiln_core.storage import move_aside

    identity = load_admission_student(inputs.student_dir).identity()
    existing = find_materialization(storage_root, inputs.dataset_sha256.removeprefix("sha256:"), identity,
                                    inputs.effective_top_k, storage_options)
    if existing is None:
        return None
    try:
        existing.tables  # reading verifies sizes and SHA-256 of every file
        return None
    except (OSError, ValueError):
        name = existing.location.uri.rstrip("/").rsplit("/", 1)[-1]
        return move_aside(existing.location, f".{name}.damaged-{secrets.token_hex(4)}").uri


def stale_reason(ref: ScoredRef | CorpusRef, storage_options: dict | None = None) -> str | None:
    """Why an earlier stage result no longer describes storage, or None when it still does: its artifact
    (a scored corpus or set of shards, a materialization) exists and has the digest the result records.
    What a cached result is checked against before it is reused (``tasks.cache.run_cached``).

    Example:
        >>> stale_reason(scored_ref)  # doctest: +SKIP
        '/abs/kiln-data/scored/e87e7601d0ea79e67f7f5afd.jsonl does not exist'
    """
    from kiln_core.admission.shard_sources import is_shard_set, shard_set_digest
    from kiln_core.storage import resolve

    if isinstance(ref, CorpusRef):
        try:
            verify(ref, storage_options)
        except MaterializationMismatch as error:
            return error.message
        return None
    location = resolve(ref.uri, storage_options)
    if not location.exists():
        return f"{location.uri} does not exist"
    if is_shard_set(ref.uri, storage_options):
        try:
            digest, _ = shard_set_digest(ref.uri, storage_options)
        except AdmissionError as error:
            return f"{location.uri}: {error.message}"
    else:
        digest = "sha256:" + hashlib.sha256(location.read_bytes()).hexdigest()
    return None if digest == ref.sha256 else f"{location.uri} holds {digest}, the result records {ref.sha256}"


# ---------------------------------------------------------------------------------------------
# Scoring unscored examples first (PipelineSpec.examples)


def scored_location(storage_root: str, examples_sha256: str, identity_revision: str, student_dir: str,
                    top_k: int, shard_size: int | None = None) -> str:
    """``<root>/scored/<key>.jsonl`` (with ``shard_size``: the directory ``<root>/scored/<key>/``), keyed by
    what decides the scored bytes."""
    from kiln_core.storage import resolve
    from kiln_core.tokenization import load_student_tokenizer

    identity = load_student_tokenizer(student_dir).identity()
    key_parts = [examples_sha256, identity_revision, identity["tokenizer_vocab_sha256"],
                 identity["chat_template_sha256"], str(top_k)]
    if shard_size is not None:
        key_parts.append(f"shards:{shard_size}")
    key = hashlib.sha256("|".join(key_parts).encode()).hexdigest()[:24]
    return resolve(storage_root).child("scored", key if shard_size is not None else f"{key}.jsonl").uri


def score(examples_uri: str, out_uri: str, *, teacher_dir: str | None, teacher_alias: str | None, registry_root: str,
          student_dir: str, top_k: int, shard_size: int | str | None = None, replace: bool = False) -> ScoredRef:
    """Score unless ``out_uri`` already holds the scored corpus (``replace``: score again over it).

    With ``shard_size``, ``out_uri`` is a directory of shards (``kiln_core.scoring.shards``): a rerun resumes
    it, scoring only unfinished shards (a shard whose bytes differ from its record counts as unfinished),
    and the ref names its ``index.json`` and set digest.
    """
    from kiln_core.scoring import score_examples
    from kiln_core.storage import resolve

    if shard_size is not None:
        result = score_examples(examples_uri, teacher_dir=teacher_dir if teacher_alias is None else None,
                                teacher_alias=teacher_alias, registry_root=registry_root, student_dir=student_dir,
                                top_k=top_k, out_uri=out_uri, shard_size=shard_size)
        return ScoredRef(uri=result.index_uri, sha256=result.set_sha256, examples=result.examples,
                         reused=result.resumed_shards == len(result.shards))
    out = resolve(out_uri)
    if out.exists() and not replace:
        data = out.read_bytes()
        return ScoredRef(uri=out.uri, sha256="sha256:" + hashlib.sha256(data).hexdigest(),
                         examples=max(data.count(b"\n") - 1, 0), reused=True)
    result = score_examples(examples_uri, teacher_dir=teacher_dir if teacher_alias is None else None,
                            teacher_alias=teacher_alias, registry_root=registry_root, student_dir=student_dir,
                            top_k=top_k, out_uri=out.uri)
    return ScoredRef(uri=result.out_uri, sha256=result.sha256, examples=result.examples, reused=False)


def score_arguments(spec: PipelineSpec, manifest: ManifestRef, student_dir: str) -> dict[str, Any]:
    """The arguments of ``score`` for a spec's ``examples`` (its output location included)."""
    from kiln_core.storage import resolve

    digest = "sha256:" + hashlib.sha256(resolve(spec.examples).read_bytes()).hexdigest()
    out_uri = scored_location(spec.storage_root, digest, manifest.identity_revision, student_dir, spec.config.top_k)
    return {"examples_uri": spec.examples, "out_uri": out_uri, "teacher_dir": spec.teacher.path,
            "teacher_alias": spec.teacher.alias if spec.teacher.kind == "local_registry" else None,
            "registry_root": spec.storage_root, "student_dir": student_dir, "top_k": spec.config.top_k}

