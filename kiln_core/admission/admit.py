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
from dataclasses import dataclass
from typing import Any, Callable

from kiln_core.admission.records import ParsedCorpus, parse_corpus
from kiln_core.admission.rules import check_examples
from kiln_core.admission.source import read_corpus
from kiln_core.contracts.identity import (
    ManifestError,
    OffPolicyManifest,
    TeacherIdentity,
    parse_manifest_line,
    parse_manifest_object,
)
from kiln_core.corpus import CorpusTables
from kiln_core.errors import AdmissionError
from kiln_core.kiln_prompts import kiln_prompts_sha256
from kiln_core.tokenization import (
    EncodedConversation,
    StudentTokenizer,
    TokenizationError,
    encode_conversations,
    load_student_tokenizer,
)

SUPPORTED_TOP_K = (32, 16)


@dataclass
class AdmissionResult:
    """An admitted corpus.

    Attributes:
        dataset_sha256: ``sha256:`` digest of the exact file bytes.
        source_uri: Where the corpus was read from.
        examples: Number of examples (the manifest does not count).
        action_tokens: Reverse-KL targets over all examples.
        env_tokens: ECHO observation targets over all examples (before the warning filter).
        effective_top_k: The resolved K (16 or 32).
        teacher_identity: The manifest's identity, or None for a corpus without a manifest.
        manifest_line: The exact manifest line, or None.
        materialized: URI of the committed materialization, or None when validating only.
        reused: True when an existing materialization was returned without redoing work.
        tables: The admitted corpus (loaded lazily from the materialization when reused).
        record: The ``admission.json`` contents when materialized.
    """

    dataset_sha256: str
    source_uri: str
    examples: int
    action_tokens: int
    env_tokens: int
    effective_top_k: int
    teacher_identity: TeacherIdentity | None
    manifest_line: str | None
    materialized: str | None
    reused: bool
    tables_loader: Callable[[], CorpusTables]
    record: Any = None
    parser: str = "exact"

    @property
    def tables(self) -> CorpusTables:
        return self.tables_loader()

    def to_json(self) -> dict[str, Any]:
        """The CLI's ``admitted`` object."""
        return {
            "status": "admitted",
            "dataset_sha256": self.dataset_sha256,
            "examples": self.examples,
            "action_tokens": self.action_tokens,
            "env_tokens": self.env_tokens,
            "effective_top_k": self.effective_top_k,
            "materialized": self.materialized,
        }


def resolve_top_k(requested: int) -> int:
    """Kiln's top-K resolution for a pre-scored corpus: the first of (32, 16) that is ≤ ``requested``.

    Raises:
        AdmissionError: ``top_k_unsupported`` when ``requested`` is below 16.

    Example:
        >>> resolve_top_k(20)
        16
    """
    if isinstance(requested, bool) or not isinstance(requested, int) or requested <= 0:
        raise AdmissionError("top_k_unsupported", None, f"OPD top_k must be > 0, got {requested!r}")
    for size in SUPPORTED_TOP_K:
        if size <= requested:
            return size
    raise AdmissionError(
        "top_k_unsupported",
        None,
        f"OPD top_k {requested} is not executable with source cap {requested}: "
        f"KT kernels require one of {{16, 32}}",
    )


def admit_corpus(
    corpus_uri: str,
    student_dir: str,
    *,
    top_k: int = 32,
    pinned_manifest: str | None = None,
    kiln_strict: bool = False,
    out_root: str | None = None,
    storage_options: dict | None = None,
    student: StudentTokenizer | None = None,
) -> AdmissionResult:
    """Admit a teacher-scored JSONL corpus for a student, or reject it with one ``AdmissionError``.

    Args:
        corpus_uri: Local path or fsspec URI of the JSONL corpus.
        student_dir: The student's model directory (``config.json`` + fast tokenizer + chat template).
        top_k: Requested top-K; resolved to 32 or 16.
        pinned_manifest: The registered teacher's manifest line; when given, the corpus manifest's
            whole identity must equal it.
        kiln_strict: Accept only Kiln's vLLM protocol in the manifest.
        out_root: Storage root to materialize under (``<root>/corpora/<hex>/``); None validates only.
        storage_options: fsspec options for reading the corpus and writing the materialization.
        student: An already loaded student tokenizer (saves reloading it).

    Returns:
        The ``AdmissionResult``.

    Raises:
        AdmissionError: The first rule the corpus breaks.

    Example:
        >>> result = admit_corpus("teacher-data.jsonl", "./student", out_root="./kiln-data")  # doctest: +SKIP
        >>> result.examples, result.effective_top_k  # doctest: +SKIP
        (128, 32)
    """
    from kiln_core import materialize

    effective_top_k = resolve_top_k(top_k)
    pinned = _parse_pinned(pinned_manifest, kiln_strict)
    corpus = read_corpus(corpus_uri, storage_options)
    student = student or _load_student(student_dir)

    if out_root is not None:
        existing = materialize.find_materialization(
            out_root, corpus.sha256_hex, student.identity(), effective_top_k, storage_options
        )
        if existing is not None:
            _check_binding(existing.teacher_identity(), pinned, student, effective_top_k, line=existing.record.manifest_line_number)
            return materialize.result_from_existing(existing)

    parsed = parse_corpus(corpus.data)
    manifest = _check_manifest_records(parsed, kiln_strict)
    if parsed.num_examples == 0:
        raise AdmissionError("no_examples", None, "the corpus has no examples after the manifest")
    if manifest is None and parsed.numeric_logits:
        raise AdmissionError(
            "manifest_missing",
            None,
            "the corpus contains numeric teacher logits but has no canonical "
            "kiln.off-policy-distillation-manifest.v1 first record",
        )
    manifest_line_number = parsed.manifest_records[0][0] if parsed.manifest_records else None
    identity = manifest.teacher_identity if manifest else None
    _check_binding(identity, pinned, student, effective_top_k, line=manifest_line_number)

    encoded, tokenization_errors = _encode(student, parsed)
    tables = check_examples(
        parsed, encoded, tokenization_errors, top_k=effective_top_k, vocab_size=student.vocab_size
    )
    tables = dataclasses.replace(tables, kiln_prompts_sha256=kiln_prompts_sha256(corpus.data))
    manifest_line = parsed.manifest_records[0][1] if manifest else None
    result = AdmissionResult(
        dataset_sha256=corpus.dataset_sha256,
        source_uri=corpus.uri,
        examples=tables.num_examples,
        action_tokens=int(tables.action_positions.shape[0]),
        env_tokens=int(tables.env_positions.shape[0]),
        effective_top_k=effective_top_k,
        teacher_identity=identity,
        manifest_line=manifest_line,
        materialized=None,
        reused=False,
        tables_loader=lambda: tables,
        parser=parsed.parser,
    )
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


def _load_student(student_dir: str) -> StudentTokenizer:
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
        code = "manifest_not_canonical" if error.kind == "not_canonical" else "manifest_invalid"
        raise AdmissionError(code, None, f"the pinned teacher manifest is unusable: {error}") from None


def _check_manifest_records(parsed: ParsedCorpus, kiln_strict: bool) -> OffPolicyManifest | None:
    """Manifest rules: at most one, before every example, strict, byte-identical to its canonical form."""
    manifest = None
    for number, raw, value in parsed.manifest_records:
        if manifest is not None or (parsed.first_example_line is not None and parsed.first_example_line < number):
            raise AdmissionError(
                "manifest_not_first", number, "off-policy distillation manifest must be the first non-empty JSONL record"
            )
        repeated = _repeated_keys(value)
        if repeated:
            raise AdmissionError("manifest_invalid", number, f"manifest field `{repeated}` is given more than once")
        try:
            manifest = parse_manifest_object(value, kiln_strict=kiln_strict)
        except ManifestError as error:
            raise AdmissionError("manifest_invalid", number, str(error)) from None
        if manifest.canonical_json() != raw:
            raise AdmissionError(
                "manifest_not_canonical",
                number,
                f"off-policy distillation manifest on line {number} is not canonical compact JSON",
            )
    return manifest


def _repeated_keys(value) -> str | None:
    """The first key given twice anywhere in a decoded manifest (serde denies duplicate fields)."""
    if isinstance(value, dict):
        duplicates = sorted(getattr(value, "duplicates", ()))
        if duplicates:
            return duplicates[0]
        for child in value.values():
            found = _repeated_keys(child)
            if found:
                return found
    return None


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
    import numpy as np

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
