"""The admission workflow, file to verdict, in the order Kiln applies its rules.

1. Resolve the requested top-K (32, 16, or reject).
2. File rules: exists, regular, ≤ 64 MiB, UTF-8; hash the exact bytes.
3. If this exact corpus is already materialized for this student and top-K, return it.
4. Parse every line (JSON, objects, example shapes, manifest position and canonical form).
5. Corpus rules: at least one example, a manifest whenever numeric logits are present, the pinned
   identity, the student's vocab size and the identity's ``max_top_k``.
6. Tokenize every example in one batch and apply the per-example rules.
7. Materialize (when an output root is given) with ``admission.json`` written last.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from kiln_core import materialize
from kiln_core.admission.parsed import ParsedCorpus
from kiln_core.admission.records import parse_corpus
from kiln_core.admission.rules import check_examples
from kiln_core.admission.source import read_corpus
from kiln_core.contracts.opd_config import ConfigError, resolve_top_k
from kiln_core.contracts.identity import ManifestError, TeacherIdentity, check_protocol, parse_manifest_line
from kiln_core.corpus import AdmissionResult
from kiln_core.errors import AdmissionError
from kiln_core.tokenization import (
    EncodedConversation,
    StudentTokenizer,
    TokenizationError,
    encode_conversations,
    load_student_tokenizer,
)

__all__ = ["AdmissionResult", "admit_corpus", "load_admission_student"]


def admit_corpus(
    corpus_uri: str,
    student_dir: str,
    *,
    top_k: int = 32,
    effective_top_k: int | None = None,
    pinned_manifest: str | None = None,
    kiln_strict: bool = False,
    out_root: str | None = None,
    storage_options: dict | None = None,
    student: StudentTokenizer | None = None,
    before_commit: Callable[[], None] | None = None,
) -> AdmissionResult:
    """Admit a teacher-scored JSONL corpus for a student, or reject it with one ``AdmissionError``.

    Args:
        corpus_uri: Local path or fsspec URI of the JSONL corpus.
        student_dir: The student's model directory (``config.json`` + fast tokenizer + chat template).
        top_k: Requested top-K; resolved to 32 or 16.
        effective_top_k: A run's effective top-K, already resolved (``ResolvedSettings.top_k``): taken as it
            is, and ``top_k`` is not resolved again.
        pinned_manifest: The registered teacher's manifest line; when given, the corpus manifest's
            whole identity must equal it.
        kiln_strict: Accept only Kiln's vLLM protocol in the manifest.
        out_root: Storage root to materialize under (``<root>/corpora/<hex>/``); None validates only.
        storage_options: fsspec options for reading the corpus and writing the materialization.
        student: An already loaded student tokenizer (saves reloading it).
        before_commit: The caller's own rules for this corpus (e.g. the held-out ones), run once the
            corpus is admitted and before anything is written under ``out_root``: what they raise
            leaves no materialization behind.

    Returns:
        The ``AdmissionResult``.

    Raises:
        AdmissionError: The first rule the corpus breaks.

    Example:
        >>> result = admit_corpus("teacher-data.jsonl", "./student", out_root="./kiln-data")  # doctest: +SKIP
        >>> result.examples, result.effective_top_k  # doctest: +SKIP
        (128, 32)
    """
    if effective_top_k is None:
        try:
            effective_top_k = resolve_top_k(top_k)
        except ConfigError as error:  # admission reports every refusal as one AdmissionError (a file-level rule)
            raise AdmissionError("top_k_unsupported", None, error.message) from None
    pinned = _parse_pinned(pinned_manifest, kiln_strict)
    corpus = read_corpus(corpus_uri, storage_options)
    student = student or load_admission_student(student_dir)

    if out_root is not None:
        existing = materialize.find_materialization(
            out_root, corpus.sha256_hex, student.identity(), effective_top_k, storage_options
        )
        if existing is not None:
            identity, line = existing.teacher_identity(), existing.record.manifest_line_number
            if identity is not None:
                _check_protocol(identity, kiln_strict, line)
            _check_binding(identity, pinned, student, effective_top_k, line=line)
            if before_commit is not None:
                before_commit()
            return materialize.result_from_existing(existing)

    parsed = parse_corpus(corpus.data, kiln_strict=kiln_strict)
    manifest = parsed.manifest
    if parsed.num_examples == 0:
        raise AdmissionError("no_examples", None, "the corpus has no examples after the manifest")
    if manifest is None and parsed.numeric_logits:
        raise AdmissionError(
            "manifest_missing",
            None,
            "the corpus contains numeric teacher logits but has no canonical "
            "kiln.off-policy-distillation-manifest.v1 first record",
        )
    manifest_line_number = parsed.manifest_line_number
    identity = manifest.teacher_identity if manifest else None
    _check_binding(identity, pinned, student, effective_top_k, line=manifest_line_number)

    encoded, tokenization_errors = _encode(student, parsed)
    tables = check_examples(
        parsed, encoded, tokenization_errors, top_k=effective_top_k, vocab_size=student.vocab_size
    )
    tables = dataclasses.replace(tables, kiln_prompts_sha256=parsed.kiln_prompts_sha256)
    manifest_line = parsed.manifest_records[0][1] if manifest else None
    result = AdmissionResult(
        dataset_sha256=corpus.dataset_sha256,
        source_uri=corpus.uri,
        examples=tables.num_examples,
        action_tokens=int(tables.action_positions.shape[0]),
        env_tokens=tables.env_tokens(),
        observation_tokens=int(tables.observation_tokens.sum()),
        effective_top_k=effective_top_k,
        teacher_identity=identity,
        manifest_line=manifest_line,
        materialized=None,
        reused=False,
        tables_loader=lambda: tables,
        parser=parsed.parser,
    )
    if before_commit is not None:
        before_commit()
    if out_root is not None:
        materialize.write_materialization(
            out_root,
            result,
            tables,
            student=student,
            requested_top_k=top_k,
            manifest_line_number=manifest_line_number,
            pinned_identity=pinned,
            storage_options=storage_options,
        )
    return result


def load_admission_student(student_dir: str) -> StudentTokenizer:
    """The student's tokenizer; an unusable directory is an ``AdmissionError`` (``invalid_record``)."""
    try:
        return load_student_tokenizer(student_dir)
    except TokenizationError as error:
        # A broken student is the caller's input error, not the corpus's; it still names the place.
        raise AdmissionError("invalid_record", None, f"student {student_dir}: {error}") from None


def _parse_pinned(pinned_manifest: str | None, kiln_strict: bool) -> TeacherIdentity | None:
    if pinned_manifest is None:
        return None
    line = pinned_manifest[:-1] if pinned_manifest.endswith("\n") else pinned_manifest
    try:
        return parse_manifest_line(line.rstrip("\r"), kiln_strict=kiln_strict).teacher_identity
    except ManifestError as error:
        raise AdmissionError(error.code, None, f"the pinned teacher manifest is unusable: {error.message}") from None


def _check_protocol(identity: TeacherIdentity, kiln_strict: bool, line: int | None) -> None:
    try:
        check_protocol(identity, kiln_strict=kiln_strict)
    except ManifestError as error:
        raise AdmissionError("manifest_invalid", line, error.message) from None


def _check_binding(
    identity: TeacherIdentity | None,
    pinned: TeacherIdentity | None,
    student: StudentTokenizer,
    effective_top_k: int,
    *,
    line: int | None,
) -> None:
    if identity is None:
        return
    if pinned is not None and identity != pinned:
        differing = [
            name
            for name in TeacherIdentity.model_fields
            if getattr(identity, name) != getattr(pinned, name)
        ]
        raise AdmissionError(
            "identity_mismatch",
            line,
            f"manifest declares teacher revision {identity.identity_revision()}, but it does not match the pinned "
            f"registered teacher revision {pinned.identity_revision()} (differing fields: "
            f"{', '.join(name.rstrip('_') for name in differing)})",
        )
    if identity.vocab_size != student.vocab_size:
        raise AdmissionError(
            "vocab_size_mismatch",
            line,
            f"teacher identity vocab_size {identity.vocab_size} does not match the student's vocab_size "
            f"{student.vocab_size}",
        )
    if identity.max_top_k < effective_top_k:
        raise AdmissionError(
            "top_k_exceeds_identity",
            line,
            f"effective top_k {effective_top_k} exceeds the teacher identity's max_top_k {identity.max_top_k}",
        )


def _encode(student: StudentTokenizer, parsed: ParsedCorpus) -> tuple[list[EncodedConversation], dict[int, str]]:
    """Tokenize every example in one batch; on a failure, find each failing example individually."""
    try:
        return encode_conversations(student, parsed.conversations), {}
    except TokenizationError:
        pass
    empty = EncodedConversation(
        input_ids=np.zeros(0, np.int32),
        action_positions=np.zeros(0, np.int32),
        env_positions=np.zeros(0, np.int32),
        env_in_warning_prefix=np.zeros(0, bool),
    )
    encoded, errors = [], {}
    for i, conversation in enumerate(parsed.conversations):
        try:
            encoded.append(encode_conversations(student, [conversation])[0])
        except TokenizationError as error:
            encoded.append(empty)
            errors[i] = str(error)
    return encoded, errors
