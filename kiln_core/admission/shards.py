"""Admission of a corpus given as an ordered set of shards: a directory of ``*.jsonl`` files or an index.

Kiln admits one JSONL file of at most 64 MiB (Kiln's docs/OPD_TEACHER_JSONL.md); a real distillation set is
many such files. Each shard here is admitted exactly as a single file is (``admit_corpus``: Kiln's
verdict for that file, materialized under its own digest, so an unchanged shard is reused and a new
shard is the only one admitted). On top, the set's own rules (codes in ``kiln_core.errors.SHARD_SET_CODES``):

1. The set (``kiln_core.admission.shard_sources``): a directory's ``*.jsonl`` files (not hidden ones) in
   byte order of their names, or the entries of a ``kiln-flows.corpus-shards.v1`` index in its order; at least one shard
   (``shard_set_empty``); index entries stay inside the index's directory and no shard is a symlink
   (``shard_path_unsafe``); every indexed shard exists (``shard_missing``) and its bytes match the
   index (``shard_digest_mismatch``).
2. Every shard: its own verdict, every ``ADMISSION_CODES`` rule, the shard named in the error's ``file``.
3. Across shards: the manifest line is byte-identical to the first shard's (``shard_identity_mismatch``),
   and the same exact token sequence carries the same teacher rows wherever it appears
   (``shard_duplicate_conflict``: the cross-shard form of ``conflicting_duplicate_row`` in ``rules.py``).

When several things are wrong the reported one is the first in set order: everything about shard 0,
then shard 1, ... — with one worker or many. Only when every rule passes is the set record
(``corpora/sets/<set hex>/<variant key>.json``, ``kiln_core.contracts.corpus_shards``) written, last and
atomically; a rejected set leaves no set record (a shard materialization already committed stays: it is
content-addressed and valid on its own, and the next admission reuses it).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln_core import __version__, materialize
from kiln_core.admission.admit import admit_corpus, load_admission_student
from kiln_core.admission.shard_sources import ShardSource, build_index, check_against_index, is_shard_set, list_shards
from kiln_core.contracts.corpus_shards import CorpusSetRecord, SetShard, SetTotals, set_sha256
from kiln_core.errors import AdmissionError
from kiln_core.storage import Location, resolve, write_bytes_atomic
from kiln_core.tokenization import StudentTokenizer

__all__ = [
    "ShardSource", "ShardJob", "ShardOutcome", "ShardSetResult", "is_shard_set", "list_shards", "plan_shard_set",
    "admit_shard", "admit_shard_set", "finish_shard_set", "set_record_location", "build_index",
]


@dataclass
class ShardOutcome:
    """One admitted shard, small enough to come back from a worker process.

    ``sequence_keys``/``row_keys`` are 128-bit digests per example (as two ``uint64``) of its token
    sequence and of its teacher rows (ids and f32 logprob bits): what the cross-shard duplicate rule
    compares, without shipping the tables between processes.
    """

    index: int
    name: str
    dataset_sha256: str
    examples: int
    action_tokens: int
    env_tokens: int
    observation_tokens: int
    effective_top_k: int
    manifest_line: str | None
    teacher_identity_revision: str | None
    materialized: str | None
    reused: bool
    lines: np.ndarray = field(repr=False)
    sequence_keys: np.ndarray = field(repr=False)
    row_keys: np.ndarray = field(repr=False)
    worker: str | None = None
    """``host:pid`` of the process that admitted the shard (this one, a pool process or a Ray worker): the
    flow's log says where its shards went. Not part of the verdict or the set record."""

    def to_json(self) -> dict[str, Any]:
        return {
            "shard": self.name,
            "dataset_sha256": self.dataset_sha256,
            "examples": self.examples,
            "action_tokens": self.action_tokens,
            "env_tokens": self.env_tokens,
            "observation_tokens": self.observation_tokens,
            "reused": self.reused,
            "materialized": self.materialized,
        }


@dataclass
class ShardSetResult:
    """An admitted set of shards.

    Attributes:
        set_sha256: The digest over the ordered shard digests (``kiln_core.contracts.corpus_shards``).
        shards: Every shard's outcome, in set order.
        effective_top_k: The resolved K (16 or 32).
        manifest_line: The manifest line every shard carries, or None.
        record_uri: URI of the committed set record, or None when validating only.
    """

    set_sha256: str
    shards: list[ShardOutcome]
    effective_top_k: int
    manifest_line: str | None
    record_uri: str | None
    record: CorpusSetRecord | None = None

    def totals(self) -> dict[str, int]:
        return {
            "shards": len(self.shards),
            "examples": sum(s.examples for s in self.shards),
            "action_tokens": sum(s.action_tokens for s in self.shards),
            "env_tokens": sum(s.env_tokens for s in self.shards),
            "observation_tokens": sum(s.observation_tokens for s in self.shards),
        }

    def to_json(self) -> dict[str, Any]:
        """The CLI's ``admitted`` object for a set."""
        totals = self.totals()
        totals["reused_shards"] = sum(s.reused for s in self.shards)
        return {
            "status": "admitted",
            "set_sha256": self.set_sha256,
            "effective_top_k": self.effective_top_k,
            "shards": [s.to_json() for s in self.shards],
            "totals": totals,
            "set_record": self.record_uri,
        }


# --- one shard (in this process or a worker) ---------------------------------------------------------


@dataclass(frozen=True)
class ShardJob:
    """Everything one shard's admission needs, picklable for a worker process (or a mapped task)."""

    index: int
    shard: ShardSource
    student_dir: str
    top_k: int
    pinned_manifest: str | None
    kiln_strict: bool
    out_root: str | None
    storage_options: dict | None

    @property
    def name(self) -> str:
        """The shard's name in errors and task-run names."""
        return self.shard.name


# A worker process's tokenizer, loaded on its first shard. Worker processes live for one set, so this never
# outlives the student directory it was read from; in this process the caller's tokenizer is passed instead.
_WORKER_STUDENTS: dict[str, StudentTokenizer] = {}


def admit_shard(job: ShardJob, student: StudentTokenizer | None = None) -> ShardOutcome:
    """Check a shard against the index, admit it as a single file, and summarize it for the set."""
    shard = job.shard
    try:
        if job.shard.expected_sha256 is not None:
            check_against_index(shard, job.storage_options)
        if student is None:
            student = _WORKER_STUDENTS.get(job.student_dir)
        if student is None:
            student = _WORKER_STUDENTS.setdefault(job.student_dir, load_admission_student(job.student_dir))
        result = admit_corpus(shard.uri, job.student_dir, top_k=job.top_k, pinned_manifest=job.pinned_manifest,
                              kiln_strict=job.kiln_strict, out_root=job.out_root,
                              storage_options=job.storage_options, student=student)
    except AdmissionError as error:
        if error.file is None:
            error.file = shard.name  # Kiln's verdict for this file, naming which file of the set it is
        raise
    if shard.expected_sha256 is not None and result.dataset_sha256 != shard.expected_sha256:
        # Read once for the check and once to admit: a shard rewritten in between is caught here.
        raise AdmissionError("shard_digest_mismatch", None, f"shard {shard.name} changed while it was admitted: "
                             f"now {result.dataset_sha256}, the index says {shard.expected_sha256}", file=shard.name)
    lines, sequence_keys, row_keys = _duplicate_keys(result.tables)
    identity = result.teacher_identity
    return ShardOutcome(
        index=job.index, name=shard.name, dataset_sha256=result.dataset_sha256, examples=result.examples,
        action_tokens=result.action_tokens, env_tokens=result.env_tokens,
        observation_tokens=result.observation_tokens, effective_top_k=result.effective_top_k,
        manifest_line=result.manifest_line,
        teacher_identity_revision=identity.identity_revision() if identity is not None else None,
        materialized=result.materialized, reused=result.reused,
        lines=lines, sequence_keys=sequence_keys, row_keys=row_keys,
        worker=f"{socket.gethostname()}:{os.getpid()}",
    )


def _duplicate_keys(tables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per example: its line, a digest of its token sequence, a digest of its teacher rows.

    Mirrors ``rules._mark_conflicts``: Kiln keys scored rows by the full token sequence, so two examples
    with the same ``input_ids`` must carry the same rows (teacher ids and the f32 bits of the logprobs).
    """
    n = tables.num_examples
    sequence_keys = np.zeros((n, 2), dtype=np.uint64)
    row_keys = np.zeros((n, 2), dtype=np.uint64)
    bits = np.ascontiguousarray(tables.teacher_logprobs).view(np.uint32)
    ids = np.ascontiguousarray(tables.teacher_ids)
    for i in range(n):
        tokens = tables.input_ids[int(tables.input_offsets[i]) : int(tables.input_offsets[i + 1])]
        a0, a1 = int(tables.action_offsets[i]), int(tables.action_offsets[i + 1])
        sequence = hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int32).tobytes(), digest_size=16)
        rows = hashlib.blake2b(ids[a0:a1].tobytes(), digest_size=16)
        rows.update(bits[a0:a1].tobytes())
        sequence_keys[i] = np.frombuffer(sequence.digest(), dtype=np.uint64)
        row_keys[i] = np.frombuffer(rows.digest(), dtype=np.uint64)
    return np.asarray(tables.lines, dtype=np.int64).copy(), sequence_keys, row_keys


# --- the set ---------------------------------------------------------------------------------------------


def admit_shard_set(
    uri: str,
    student_dir: str,
    *,
    top_k: int = 32,
    pinned_manifest: str | None = None,
    kiln_strict: bool = False,
    out_root: str | None = None,
    storage_options: dict | None = None,
    workers: int = 1,
) -> ShardSetResult:
    """Admit a directory of shards or an index of shards, or reject the set with one ``AdmissionError``.

    Args:
        uri: A directory (its ``*.jsonl`` files) or a ``kiln-flows.corpus-shards.v1`` index; local or fsspec.
        student_dir: The student's model directory.
        top_k: Requested top-K; resolved to 32 or 16.
        pinned_manifest: The registered teacher's manifest line; every shard's identity must equal it.
        kiln_strict: Accept only Kiln's vLLM protocol in the manifests.
        out_root: Storage root to materialize under; None validates only (no set record).
        storage_options: fsspec options for reading the shards and writing under ``out_root``.
        workers: Shards admitted at once, each in its own process (1: in this process).

    Returns:
        The ``ShardSetResult``.

    Raises:
        AdmissionError: The first rule the set breaks, in set order (the shard named in ``file``).

    Example:
        >>> result = admit_shard_set("./corpus/", "./student", out_root="./kiln-data", workers=4)  # doctest: +SKIP
        >>> result.set_sha256[:7], len(result.shards)  # doctest: +SKIP
        ('sha256:', 16)
    """
    if workers < 1:
        raise ValueError("workers must be at least 1")
    shards, jobs, student = plan_shard_set(uri, student_dir, top_k=top_k, pinned_manifest=pinned_manifest,
                                           kiln_strict=kiln_strict, out_root=out_root,
                                           storage_options=storage_options)
    outcomes = _run_jobs(jobs, workers, student, storage_options, out_root)
    return finish_shard_set(shards, outcomes, student, out_root=out_root, storage_options=storage_options)


def plan_shard_set(uri: str, student_dir: str, *, top_k: int = 32, pinned_manifest: str | None = None,
                   kiln_strict: bool = False, out_root: str | None = None, storage_options: dict | None = None,
                   ) -> tuple[list[ShardSource], list[ShardJob], StudentTokenizer]:
    """The set's shards, one ``ShardJob`` per shard, and the loaded student (arguments as ``admit_shard_set``).

    Raises:
        AdmissionError: The set itself is refused (``shard_set_empty``, ``shard_index_invalid``,
            ``shard_path_unsafe``) or the student directory is unusable.
    """
    shards = list_shards(uri, storage_options)
    student = load_admission_student(student_dir)
    jobs = [ShardJob(i, shard, student_dir, top_k, pinned_manifest, kiln_strict, out_root, storage_options)
            for i, shard in enumerate(shards)]
    return shards, jobs, student


def finish_shard_set(shards: list[ShardSource], outcomes: dict[int, ShardOutcome | BaseException],
                     student: StudentTokenizer, *, out_root: str | None = None,
                     storage_options: dict | None = None) -> ShardSetResult:
    """The set's verdict from every shard's outcome (however they were run), and its record, written last.

    Args:
        shards: The set, in order (``list_shards``).
        outcomes: Shard index → its ``ShardOutcome`` or the error its admission raised; shards after the
            first failing one may be absent.
        student: The student every shard was admitted for.
        out_root: Storage root for the set record; None validates only.
        storage_options: fsspec options for ``out_root``.

    Raises:
        AdmissionError: The first problem in set order.
    """
    _check_across_shards(shards, outcomes)
    admitted: list[ShardOutcome] = [outcomes[i] for i in range(len(shards))]  # every one admitted by now
    result = ShardSetResult(
        set_sha256=set_sha256([s.dataset_sha256 for s in admitted]),
        shards=admitted,
        effective_top_k=admitted[0].effective_top_k,
        manifest_line=admitted[0].manifest_line,
        record_uri=None,
    )
    if out_root is not None:
        _commit_set_record(result, out_root, student, storage_options)
    return result


def _run_jobs(jobs: list[ShardJob], workers: int, student: StudentTokenizer, storage_options: dict | None,
              out_root: str | None) -> dict[int, ShardOutcome | BaseException]:
    """Every shard's outcome or error, up to the first failing shard in set order (later ones may be absent)."""
    in_memory = any(u is not None and u.startswith("memory://") for u in (out_root, *(j.shard.uri for j in jobs)))
    if workers == 1 or len(jobs) == 1 or in_memory:  # memory:// lives in this process alone
        outcomes: dict[int, ShardOutcome | BaseException] = {}
        for job in jobs:
            try:
                outcomes[job.index] = admit_shard(job, student)
            except Exception as error:  # noqa: BLE001 - reported in set order by the caller
                outcomes[job.index] = error
                break
        return outcomes
    # spawn, not fork: the parent may hold tokenizer and storage threads that a fork would copy mid-use.
    context = multiprocessing.get_context("spawn")
    outcomes = {}
    first_failure = len(jobs)
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context) as pool:
        futures = {pool.submit(admit_shard, job): job.index for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            index = futures[future]
            if future.cancelled():
                continue
            error = future.exception()
            if error is None:
                outcomes[index] = future.result()
                continue
            outcomes[index] = error
            if index < first_failure:
                first_failure = index
                for other, other_index in futures.items():
                    if other_index > index:
                        other.cancel()  # shards after the failing one no longer matter
    return outcomes


def _check_across_shards(shards: list[ShardSource], outcomes: dict[int, ShardOutcome | BaseException]) -> None:
    """Raise the first problem in set order: a shard's own error, or its identity or duplicate conflict."""
    duplicate = _first_duplicate_conflict([o for o in outcomes.values() if isinstance(o, ShardOutcome)])
    first: ShardOutcome | None = None
    for i, shard in enumerate(shards):
        outcome = outcomes.get(i)
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is None:  # only shards after a failing one go unadmitted, and that one raised above
            raise RuntimeError(f"shard {shard.name} was not admitted")
        if first is None:
            first = outcome
        elif outcome.manifest_line != first.manifest_line:
            raise AdmissionError(
                "shard_identity_mismatch", 1 if outcome.manifest_line is not None else None,
                f"shard {outcome.name} does not pin the same teacher as shard {first.name}: their manifest lines "
                f"differ ({_manifest_summary(outcome)} vs {_manifest_summary(first)}); every shard must carry "
                f"the first shard's manifest line byte for byte", file=outcome.name)
        if duplicate is not None and duplicate[0] == i:
            _, line, earlier_name, earlier_line = duplicate
            raise AdmissionError(
                "shard_duplicate_conflict", line,
                f"the example on line {line} of shard {shard.name} has the same exact token sequence as line "
                f"{earlier_line} of shard {earlier_name} but different teacher rows (ids or logprobs)",
                file=shard.name)


def _manifest_summary(outcome: ShardOutcome) -> str:
    if outcome.manifest_line is None:
        return "no manifest"
    if outcome.teacher_identity_revision is None:
        return "a manifest"
    return f"teacher revision {outcome.teacher_identity_revision}"


def _first_duplicate_conflict(outcomes: list[ShardOutcome]) -> tuple[int, int, str, int] | None:
    """``(shard index, line, earlier shard name, earlier line)`` of the first conflicting example in set order.

    Examples are sorted by token-sequence digest, then set position; in each group of equal sequences
    every example's rows must equal the group's first (earliest) example's, as within one file.
    """
    outcomes = sorted(outcomes, key=lambda o: o.index)
    if not outcomes or sum(o.examples for o in outcomes) == 0:
        return None
    sequence = np.concatenate([o.sequence_keys for o in outcomes])
    rows = np.concatenate([o.row_keys for o in outcomes])
    shard = np.concatenate([np.full(o.examples, k, dtype=np.int64) for k, o in enumerate(outcomes)])
    lines = np.concatenate([o.lines for o in outcomes])
    position = np.arange(sequence.shape[0])
    order = np.lexsort((position, sequence[:, 1], sequence[:, 0]))
    sorted_sequence = sequence[order]
    starts = np.ones(order.shape[0], dtype=bool)
    starts[1:] = (sorted_sequence[1:] != sorted_sequence[:-1]).any(axis=1)
    group_first = order[np.maximum.accumulate(np.where(starts, np.arange(order.shape[0]), 0))]
    conflicting = (rows[order] != rows[group_first]).any(axis=1)
    if not conflicting.any():
        return None
    later = order[conflicting]
    earliest = int(later[np.argmin(later)])
    earlier = int(group_first[np.flatnonzero(order == earliest)[0]])
    return (outcomes[shard[earliest]].index, int(lines[earliest]), outcomes[shard[earlier]].name,
            int(lines[earlier]))


# --- the set record ----------------------------------------------------------------------------------------


def set_record_location(root: str, set_digest: str, student_identity: dict[str, Any], effective_top_k: int,
                        storage_options: dict | None = None) -> Location:
    """Where the set record of ``set_digest`` for this student and top-K lives under ``root``."""
    key = materialize.variant_key(student_identity, effective_top_k)
    return resolve(root, storage_options).child("corpora", "sets", set_digest.removeprefix("sha256:"), key + ".json")


def _commit_set_record(result: ShardSetResult, out_root: str, student: StudentTokenizer,
                       storage_options: dict | None) -> None:
    """Write the set record last, atomically; the same set admitted again writes the same bytes."""
    root_uri = resolve(out_root, storage_options).uri.rstrip("/") + "/"
    totals = result.totals()
    record = CorpusSetRecord(
        set_sha256=result.set_sha256,
        student=student.identity(),
        effective_top_k=result.effective_top_k,
        manifest_line=result.manifest_line,
        teacher_identity_revision=result.shards[0].teacher_identity_revision,
        shards=[SetShard(dataset_sha256=s.dataset_sha256, materialized=s.materialized.removeprefix(root_uri),
                         examples=s.examples, action_tokens=s.action_tokens, env_tokens=s.env_tokens,
                         observation_tokens=s.observation_tokens) for s in result.shards],
        totals=SetTotals(**totals),
        kiln_flows_version=__version__,
    )
    location = set_record_location(out_root, result.set_sha256, record.student, result.effective_top_k,
                                   storage_options)
    data = record.model_dump_json(indent=2).encode("utf-8") + b"\n"
    if not (location.exists() and location.read_bytes() == data):
        write_bytes_atomic(location, data)
    result.record_uri, result.record = location.uri, record
