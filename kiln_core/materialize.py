"""Content-addressed materialization of an admitted corpus.

Layout under a storage root (docs/storage.md)::

    corpora/<sha256 hex of the exact JSONL bytes>/
        examples.parquet   one row per example: line, input_ids, action/env positions, ECHO's |O|
        targets.parquet    one row per action target: example, position, teacher ids (int32 × K)
                           and logprobs (float32 × K)
        admission.json     written last: the commit

A corpus admitted for a second student (or another top-K, or by a kiln-flows whose masks differ:
the format version is part of the key) lands in ``corpora/<hex>/variants/<variant key>/``: the
tokenization differs, the source bytes do not. Readers treat a directory without ``admission.json``
as absent, never reuse one of another format version, and verify every file's size and SHA-256
against it before use.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from kiln_core import __version__
from kiln_core.canonical import kiln_compact_json, sha256_hex
from kiln_core.contracts.admission import COMMIT_FILE, FORMAT_VERSION, AdmissionRecord, FileDigest
from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.corpus import AdmissionResult, CorpusTables
from kiln_core.storage import Location, StagedDirectory, resolve

EXAMPLES_FILE = "examples.parquet"
TARGETS_FILE = "targets.parquet"


@dataclass
class Materialization:
    """A committed materialization; tables are read (and verified) on first access."""

    location: Location
    record: AdmissionRecord

    @property
    def uri(self) -> str:
        return self.location.uri

    def teacher_identity(self) -> TeacherIdentity | None:
        if self.record.manifest_line is None:
            return None
        return TeacherIdentity.model_validate(json.loads(self.record.manifest_line)["teacher_identity"])

    @cached_property
    def tables(self) -> CorpusTables:
        return _read_tables(self.location, self.record)


def variant_key(student_identity: dict[str, Any], effective_top_k: int) -> str:
    """A short digest of what, besides the bytes, decides the materialized tables."""
    payload = kiln_compact_json(
        {"format": FORMAT_VERSION, "student": dict(sorted(student_identity.items())), "top_k": effective_top_k}
    )
    return sha256_hex(payload.encode("utf-8"))[:16]


def corpus_location(root: str, dataset_hex: str, storage_options: dict | None = None) -> Location:
    return resolve(root, storage_options).child("corpora", dataset_hex)


def find_materialization(
    root: str,
    dataset_hex: str,
    student_identity: dict[str, Any],
    effective_top_k: int,
    storage_options: dict | None = None,
) -> Materialization | None:
    """The committed materialization of these bytes for this student and top-K, if there is one."""
    primary = corpus_location(root, dataset_hex, storage_options)
    for location in (primary, primary.child("variants", variant_key(student_identity, effective_top_k))):
        materialization = read_materialization_at(location)
        if (
            materialization is not None
            and materialization.record.student == student_identity
            and materialization.record.effective_top_k == effective_top_k
        ):
            return materialization
    return None


def read_materialization(uri: str, storage_options: dict | None = None) -> Materialization:
    """Open a committed materialization directory.

    Raises:
        FileNotFoundError: The directory has no ``admission.json`` (absent or uncommitted), or one
            written by a kiln-flows of another format version (re-admit the corpus).
    """
    location = resolve(uri, storage_options)
    materialization = read_materialization_at(location)
    if materialization is None:
        if location.child(COMMIT_FILE).exists():
            raise FileNotFoundError(
                f"{uri} was materialized by a kiln-flows with another format than {FORMAT_VERSION}; "
                f"admit the corpus again to materialize it for this version"
            )
        raise FileNotFoundError(f"{uri} is not a committed corpus materialization (no {COMMIT_FILE})")
    return materialization


def read_materialization_at(location: Location) -> Materialization | None:
    """The committed materialization at ``location``; None when absent or of another format version."""
    commit = location.child(COMMIT_FILE)
    if not commit.exists():
        return None
    data = commit.read_bytes()
    if json.loads(data).get("format_version") != FORMAT_VERSION:
        return None  # written by another kiln-flows: its masks are not this version's
    record = AdmissionRecord.model_validate_json(data)
    return Materialization(location=location, record=record)


def result_from_existing(materialization: Materialization):
    """An ``AdmissionResult`` for a materialization that already exists (no parsing, no tokenizing)."""
    record = materialization.record
    return AdmissionResult(
        dataset_sha256=record.dataset_sha256,
        source_uri=record.source_uri,
        examples=record.examples,
        action_tokens=record.action_tokens,
        env_tokens=record.env_tokens,
        observation_tokens=record.observation_tokens,
        effective_top_k=record.effective_top_k,
        teacher_identity=materialization.teacher_identity(),
        manifest_line=record.manifest_line,
        materialized=materialization.uri,
        reused=True,
        tables_loader=lambda: materialization.tables,
        record=record,
        parser="reused",
    )


def write_materialization(
    root: str,
    result: AdmissionResult,
    tables: CorpusTables,
    *,
    student,
    requested_top_k: int,
    manifest_line_number: int | None,
    pinned_identity: TeacherIdentity | None,
    storage_options: dict | None = None,
) -> Materialization:
    """Write the tables and commit them with ``admission.json``; fills ``result.materialized``."""
    dataset_hex = result.dataset_sha256.removeprefix("sha256:")
    identity = student.identity()
    primary = corpus_location(root, dataset_hex, storage_options)
    variant = primary.child("variants", variant_key(identity, result.effective_top_k))
    location = None
    for candidate in (primary, variant):
        if not candidate.child(COMMIT_FILE).exists():
            location = candidate
            break
        existing = read_materialization_at(candidate)  # None: another format version holds the slot
        if existing is not None and _same_variant(existing, identity, result.effective_top_k):
            return _adopt(result, existing)  # a concurrent writer committed this variant first
    if location is None:
        raise FileExistsError(f"{variant.uri} holds a different materialization under this variant key")

    payloads = {EXAMPLES_FILE: _examples_parquet(tables), TARGETS_FILE: _targets_parquet(tables)}
    record = AdmissionRecord(
        dataset_sha256=result.dataset_sha256,
        source_uri=result.source_uri,
        student=identity,
        requested_top_k=requested_top_k,
        effective_top_k=result.effective_top_k,
        examples=result.examples,
        action_tokens=result.action_tokens,
        env_tokens=result.env_tokens,
        env_tokens_in_warning_prefix=int(tables.env_in_warning_prefix.sum()),
        observation_tokens=result.observation_tokens,
        context_tokens=int(tables.input_ids.shape[0] - tables.action_positions.shape[0] - result.env_tokens),
        manifest_line_number=manifest_line_number,
        manifest_line=result.manifest_line,
        teacher_identity_revision=result.teacher_identity.identity_revision() if result.teacher_identity else None,
        pinned_identity_revision=pinned_identity.identity_revision() if pinned_identity else None,
        files={name: FileDigest(bytes=len(data), sha256=sha256_hex(data)) for name, data in payloads.items()},
        kiln_prompts_sha256=tables.kiln_prompts_sha256,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
        kiln_flows_version=__version__,
    )
    try:
        with StagedDirectory(location, commit_name=COMMIT_FILE, sentinel_text=result.dataset_sha256 + "\n") as staged:
            for name, data in payloads.items():
                staged.write(name, data)
            staged.commit(record.model_dump_json(indent=2).encode("utf-8"))
    except FileExistsError:
        # Another writer committed here first. Same variant: content addressing makes it ours too.
        # Another student's tables took the primary slot: this variant goes to its own directory.
        existing = read_materialization_at(location)
        if existing is not None and _same_variant(existing, identity, result.effective_top_k):
            return _adopt(result, existing)
        if location is variant:
            raise
        return write_materialization(root, result, tables, student=student, requested_top_k=requested_top_k,
                                     manifest_line_number=manifest_line_number, pinned_identity=pinned_identity,
                                     storage_options=storage_options)
    return _adopt(result, read_materialization_at(location))


def _same_variant(materialization: Materialization, student_identity: dict[str, Any], top_k: int) -> bool:
    return materialization.record.student == student_identity and materialization.record.effective_top_k == top_k


def _adopt(result: AdmissionResult, materialization: Materialization) -> Materialization:
    result.materialized, result.record = materialization.uri, materialization.record
    return materialization


def _examples_parquet(tables: CorpusTables) -> bytes:
    import pyarrow as pa

    def lists(values: np.ndarray, offsets: np.ndarray, arrow_type) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=arrow_type))

    table = pa.table(
        {
            "line": pa.array(tables.lines, type=pa.int64()),
            "input_ids": lists(tables.input_ids, tables.input_offsets, pa.int32()),
            "action_positions": lists(tables.action_positions, tables.action_offsets, pa.int32()),
            "env_positions": lists(tables.env_positions, tables.env_offsets, pa.int32()),
            "env_in_warning_prefix": lists(tables.env_in_warning_prefix, tables.env_offsets, pa.bool_()),
            "observation_tokens": pa.array(tables.observation_tokens, type=pa.int64()),
        }
    )
    return _parquet_bytes(table)


def _targets_parquet(tables: CorpusTables) -> bytes:
    import pyarrow as pa

    k = tables.top_k
    counts = np.diff(tables.action_offsets)
    table = pa.table(
        {
            "example": pa.array(np.repeat(np.arange(tables.num_examples, dtype=np.int32), counts)),
            "position": pa.array(tables.action_positions, type=pa.int32()),
            "teacher_ids": pa.FixedSizeListArray.from_arrays(pa.array(tables.teacher_ids.reshape(-1)), k),
            "teacher_logprobs": pa.FixedSizeListArray.from_arrays(pa.array(tables.teacher_logprobs.reshape(-1)), k),
        }
    )
    return _parquet_bytes(table)


def _parquet_bytes(table) -> bytes:
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    # Uncompressed: top-K logprobs barely compress, and admission throughput matters more than bytes.
    pq.write_table(table, sink, compression="none", use_dictionary=False)
    return sink.getvalue()


def _read_tables(location: Location, record: AdmissionRecord) -> CorpusTables:
    import pyarrow.parquet as pq

    payloads = {}
    for name, digest in record.files.items():
        data = location.child(name).read_bytes()
        if len(data) != digest.bytes or sha256_hex(data) != digest.sha256:
            raise ValueError(f"materialized file {location.child(name).uri} does not match admission.json (size or SHA-256)")
        payloads[name] = data
    examples = pq.read_table(io.BytesIO(payloads[EXAMPLES_FILE]))
    targets = pq.read_table(io.BytesIO(payloads[TARGETS_FILE]))

    def flat(column: str, dtype) -> tuple[np.ndarray, np.ndarray]:
        chunked = examples.column(column).combine_chunks()
        offsets = chunked.offsets.to_numpy().astype(np.int64)
        values = chunked.values.to_numpy(zero_copy_only=False).astype(dtype)
        return values, offsets - offsets[0]

    input_ids, input_offsets = flat("input_ids", np.int32)
    action_positions, action_offsets = flat("action_positions", np.int32)
    env_positions, env_offsets = flat("env_positions", np.int32)
    env_warning, _ = flat("env_in_warning_prefix", np.bool_)
    k = record.effective_top_k
    teacher_ids = targets.column("teacher_ids").combine_chunks().values.to_numpy().astype(np.int32).reshape(-1, k)
    teacher_logprobs = (
        targets.column("teacher_logprobs").combine_chunks().values.to_numpy().astype(np.float32).reshape(-1, k)
    )
    return CorpusTables(
        lines=examples.column("line").to_numpy().astype(np.int64),
        input_ids=input_ids,
        input_offsets=input_offsets,
        action_positions=action_positions,
        action_offsets=action_offsets,
        env_positions=env_positions,
        env_in_warning_prefix=env_warning,
        env_offsets=env_offsets,
        teacher_ids=teacher_ids,
        teacher_logprobs=teacher_logprobs,
        kiln_prompts_sha256=record.kiln_prompts_sha256,
        observation_tokens=examples.column("observation_tokens").to_numpy().astype(np.int64),
    )
