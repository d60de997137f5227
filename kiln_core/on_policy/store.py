"""The rollout store: every candidate's rollout and teacher scores, content-addressed, committed once.

A candidate is named by what decides its tokens: the run (``run_key``, a digest the trainer derives
from the effective config, the prompt digest, the student, the teacher and the adapter name), its
place in the schedule (epoch, cursor), the optimizer step it was sampled at and its seed. The key is
``sha256`` of the canonical JSON of those fields. Each candidate is one directory under
``<root>/<run_key>/<key>/``: ``rollout.parquet`` (one row: the rollout prefix, the sampled ids, the
teacher prefix when asymmetric, the teacher's ``[A, K]`` ids and logprobs) and the commit file
``rollout.json`` written last (``kiln_core.storage.StagedDirectory``). Empty rollouts (EOS first)
are stored too: a retry consumes them without sampling again.

So a retry (after a crash, or Prefect re-running the task) looks the key up before sampling: a
committed candidate is reused exactly as stored — never re-sampled, never re-scored — and a finished
run can be audited token by token (``RolloutStore.audit``). When two writers race, the first commit
stands and the other reads it back.

``Rollout.training_example()`` returns the same ``TrainingExample`` an admitted off-policy example
gives (``kiln_core.corpus``), so ``to_torch()`` feeds the same loss code.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from kiln_core.canonical import canonical_sha256, strip_sha256_prefix
from kiln_core.corpus import TrainingExample
from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.on_policy.prepare import CandidateSequences, PreparedPrompt, candidate_sequences, check_target_pairs
from kiln_core.storage import Location, StagedDirectory, list_children, resolve

__all__ = ["Rollout", "RolloutKey", "RolloutStore", "rollout_run_key"]

ROLLOUT_SCHEMA = "kiln-flows.opd-rollout.v1"
KEY_SCHEMA = "kiln-flows.opd-rollout-key.v1"
RUN_SCHEMA = "kiln-flows.opd-rollout-run.v1"
PARQUET_FILE = "rollout.parquet"
COMMIT_FILE = "rollout.json"


def rollout_run_key(identity: Mapping[str, Any]) -> str:
    """Hex digest naming one training run's rollouts (canonical JSON of ``identity``, domain-separated).

    Example:
        >>> len(rollout_run_key({"effective_config": {}, "data_sha256": "ab"}))
        64
    """
    return strip_sha256_prefix(canonical_sha256({"schema": RUN_SCHEMA, "identity": dict(identity)}))


@dataclass(frozen=True)
class RolloutKey:
    """What decides one candidate's tokens; its ``digest()`` is the storage key."""

    run_key: str
    epoch: int
    cursor: int
    global_step: int
    seed: int

    def digest(self) -> str:
        """Hex SHA-256 of the key's canonical JSON."""
        return strip_sha256_prefix(canonical_sha256({"schema": KEY_SCHEMA, "run": self.run_key, "epoch": self.epoch,
                                                     "cursor": self.cursor, "global_step": self.global_step,
                                                     "seed": self.seed}))


@dataclass(frozen=True)
class Rollout:
    """One committed candidate.

    Attributes:
        key: Its key.
        source_index: The prompt's index in the request.
        sample_index: The sample of that prompt.
        rollout_prefix: ``int32`` tokens the student sampled after.
        sampled_ids: ``int32`` sampled tokens (EOS excluded); empty when the student stopped at once.
        teacher_prefix: ``int32`` teacher-only prompt, or None when the teacher scored the student's sequence.
        teacher_ids: ``int32 [A, K]`` teacher top-K ids per sampled token.
        teacher_logprobs: ``float32 [A, K]`` their logprobs.
        metadata: Audit fields the trainer adds (``policy_sha256``, ``teacher_revision``, ...).
    """

    key: RolloutKey
    source_index: int
    sample_index: int
    rollout_prefix: np.ndarray
    sampled_ids: np.ndarray
    teacher_prefix: np.ndarray | None
    teacher_ids: np.ndarray
    teacher_logprobs: np.ndarray
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """True when nothing was sampled: the candidate is consumed without an update."""
        return self.sampled_ids.shape[0] == 0

    @property
    def top_k(self) -> int:
        return int(self.teacher_ids.shape[1])

    def sequences(self) -> CandidateSequences:
        """The student's and the teacher's sequences and paired targets."""
        prompt = PreparedPrompt(self.source_index, self.rollout_prefix, np.zeros(0, np.int32), self.rollout_prefix,
                                self.teacher_prefix)
        return candidate_sequences(prompt, self.sampled_ids)

    def training_example(self) -> TrainingExample:
        """The loss inputs, shaped like an admitted off-policy example (``index`` = cursor, ``line`` = prompt + 1).

        Raises:
            ValueError: the rollout is empty (it trains nothing).
        """
        sequences = self.sequences()
        return TrainingExample(
            index=self.key.cursor, line=self.source_index + 1,
            input_ids=sequences.student_ids, action_positions=sequences.student_positions,
            env_positions=np.zeros(0, np.int32), env_in_warning_prefix=np.zeros(0, bool),
            teacher_ids=self.teacher_ids, teacher_logprobs=self.teacher_logprobs,
        )


class RolloutStore:
    """Rollouts of any number of runs under one root (local path or fsspec URI).

    Example:
        >>> store = RolloutStore("s3://bucket/runs/my-adapter/rollouts")  # doctest: +SKIP
        >>> store.get(key) or store.put(sample_and_score(key))  # doctest: +SKIP
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = resolve(root, storage_options)

    def location(self, key: RolloutKey) -> Location:
        return self.root.child(key.run_key, key.digest())

    def get(self, key: RolloutKey) -> Rollout | None:
        """The committed rollout for ``key``, or None when none is committed.

        Raises:
            Rejection: ``corrupt_rollout`` when a committed rollout does not verify.
            EnvironmentFailure: ``storage_unavailable`` when the store cannot be read.
        """
        location = self.location(key)
        try:
            record = json.loads(location.child(COMMIT_FILE).read_bytes())
        except FileNotFoundError:
            return None  # never committed (staging leftovers are invisible)
        except (OSError, ValueError) as error:
            raise _storage_or_corrupt(location, error) from None
        try:
            payload = location.child(PARQUET_FILE).read_bytes()
        except FileNotFoundError:
            raise Rejection("corrupt_rollout", f"rollout {location.uri} is committed without {PARQUET_FILE}",
                            file=location.uri) from None
        except OSError as error:
            raise _storage_or_corrupt(location, error) from None
        return _decode(location, key, record, payload)

    def put(self, rollout: Rollout) -> Rollout:
        """Commit ``rollout`` unless its key is already committed; returns the committed rollout.

        Raises:
            EnvironmentFailure: ``storage_unavailable`` when the store cannot be written.
        """
        _check_shapes(rollout)
        payload = _parquet_bytes(rollout)
        record = {
            "schema": ROLLOUT_SCHEMA, "key": rollout.key.digest(), "run_key": rollout.key.run_key,
            "epoch": rollout.key.epoch, "cursor": rollout.key.cursor, "global_step": rollout.key.global_step,
            "seed": rollout.key.seed, "source_index": rollout.source_index, "sample_index": rollout.sample_index,
            "sampled_tokens": int(rollout.sampled_ids.shape[0]), "top_k": rollout.top_k,
            "parquet_sha256": hashlib.sha256(payload).hexdigest(), "parquet_bytes": len(payload),
            "metadata": rollout.metadata,
        }
        location = self.location(rollout.key)
        try:
            with StagedDirectory(location, commit_name=COMMIT_FILE, sentinel_text=record["key"] + "\n") as staged:
                staged.write(PARQUET_FILE, payload)
                staged.commit(json.dumps(record, sort_keys=True, indent=1).encode("utf-8"))
        except FileExistsError:
            pass  # committed by an earlier attempt or a concurrent writer: that one stands
        except OSError as error:
            raise EnvironmentFailure("storage_unavailable", f"cannot write rollout {location.uri}: {error}") from None
        stored = self.get(rollout.key)
        if stored is None:
            raise EnvironmentFailure("storage_unavailable",
                                     f"rollout {location.uri} was committed but does not read back")
        return stored

    def audit(self, run_key: str) -> list[Rollout]:
        """Every committed rollout of a run, in schedule order (epoch, cursor)."""
        rollouts = []
        for name in list_children(self.root.child(run_key)):
            if name.startswith("."):
                continue  # a local staging directory
            location = self.root.child(run_key, name)
            try:
                record = json.loads(location.child(COMMIT_FILE).read_bytes())
            except FileNotFoundError:
                continue  # an uncommitted object-store prefix
            except (OSError, ValueError) as error:
                raise _storage_or_corrupt(location, error) from None
            key = RolloutKey(run_key, int(record["epoch"]), int(record["cursor"]), int(record["global_step"]),
                             int(record["seed"]))
            rollout = self.get(key)
            if rollout is None or key.digest() != name:
                raise Rejection("corrupt_rollout", f"{location.uri} is not stored under its own key", file=location.uri)
            rollouts.append(rollout)
        return sorted(rollouts, key=lambda r: (r.key.epoch, r.key.cursor))


def _check_shapes(rollout: Rollout) -> None:
    tokens = rollout.sampled_ids.shape[0]
    if rollout.teacher_ids.ndim != 2 or rollout.teacher_ids.shape != rollout.teacher_logprobs.shape \
            or rollout.teacher_ids.shape[0] != tokens:
        raise ValueError(f"teacher rows {rollout.teacher_ids.shape}/{rollout.teacher_logprobs.shape} do not match "
                         f"{tokens} sampled tokens")


def _parquet_bytes(rollout: Rollout) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = rollout.top_k

    def ids(values: np.ndarray | None) -> pa.Array:
        return pa.array([None if values is None else np.asarray(values, np.int32)], type=pa.list_(pa.int32()))

    def rows(values: np.ndarray, arrow_type) -> pa.Array:
        flat = pa.array(values.reshape(-1), type=arrow_type)
        return pa.array([pa.FixedSizeListArray.from_arrays(flat, k)], type=pa.list_(pa.list_(arrow_type, k)))

    table = pa.table({
        "rollout_prefix": ids(rollout.rollout_prefix),
        "sampled_ids": ids(rollout.sampled_ids),
        "teacher_prefix": ids(rollout.teacher_prefix),
        "teacher_ids": rows(np.asarray(rollout.teacher_ids, np.int32), pa.int32()),
        "teacher_logprobs": rows(np.asarray(rollout.teacher_logprobs, np.float32), pa.float32()),
    })
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="none", use_dictionary=False)
    return sink.getvalue()


def _decode(location: Location, key: RolloutKey, record: dict[str, Any], payload: bytes) -> Rollout:
    import pyarrow.parquet as pq

    def corrupt(why: str) -> Rejection:
        return Rejection("corrupt_rollout", f"rollout {location.uri} {why}", file=location.uri)

    if record.get("schema") != ROLLOUT_SCHEMA or record.get("key") != key.digest():
        raise corrupt(f"is not a {ROLLOUT_SCHEMA} record for key {key.digest()}")
    if hashlib.sha256(payload).hexdigest() != record.get("parquet_sha256"):
        raise corrupt(f"{PARQUET_FILE} does not match the digest its commit file records")
    row = pq.read_table(io.BytesIO(payload)).to_pylist()[0]
    k = int(record["top_k"])

    def matrix(values: list, dtype) -> np.ndarray:
        return np.asarray(values, dtype=dtype).reshape(-1, k)

    rollout = Rollout(
        key=key, source_index=int(record["source_index"]), sample_index=int(record["sample_index"]),
        rollout_prefix=np.asarray(row["rollout_prefix"], np.int32),
        sampled_ids=np.asarray(row["sampled_ids"], np.int32),
        teacher_prefix=None if row["teacher_prefix"] is None else np.asarray(row["teacher_prefix"], np.int32),
        teacher_ids=matrix(row["teacher_ids"], np.int32), teacher_logprobs=matrix(row["teacher_logprobs"], np.float32),
        metadata=dict(record.get("metadata") or {}),
    )
    try:
        _check_shapes(rollout)
        if not rollout.empty:
            check_target_pairs(rollout.sequences())
    except (ValueError, Rejection) as error:
        raise corrupt(str(error)) from None
    return rollout


def _storage_or_corrupt(location: Location, error: Exception) -> Exception:
    if isinstance(error, OSError):
        return EnvironmentFailure("storage_unavailable", f"cannot read rollout {location.uri}: {error}")
    return Rejection("corrupt_rollout", f"rollout {location.uri} has an unreadable commit file: {error}",
                     file=location.uri)
