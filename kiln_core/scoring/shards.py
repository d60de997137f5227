"""Scoring at size: a resumable set of scored shards and their index, instead of one file.

Kiln admits one corpus file of at most 64 MiB (Kiln's docs/OPD_TEACHER_JSONL.md), a few hundred examples at
K = 32. With ``shard_size`` the scored corpus is a directory ``OUT/``::

    OUT/shard-00000.jsonl, shard-00001.jsonl, ...   each a complete Kiln corpus: the manifest line, then rows
    OUT/index.json                                   kiln-flows.corpus-shards.v1, written last, atomically
    OUT/.kiln-flows-score/plan.json                  the inputs and the split (written before the first shard)
    OUT/.kiln-flows-score/shard-00000.json           one shard's completion record (written after the shard)

``kiln-flows admit OUT/`` (its ``*.jsonl`` files; hidden ones are never shards) and ``kiln-flows admit
OUT/index.json`` admit the same set.

**How examples are split** (``kiln_core.scoring.shard_plan``): before the teacher runs, every example
is tokenized and given an upper bound on the bytes of its scored row; shards are filled greedily in
example order under that bound, so a rerun makes the same split and no shard can exceed the size.
An example whose bound alone does not fit is refused (``row_exceeds_shard_size``, naming its line).

**Resume.** Each shard is scored in batches that start at the shard's first example, published
atomically (``AtomicFile``), then recorded in ``.kiln-flows-score/<shard>.json``: the digest of the
plan it belongs to, its bytes' digest and size, and where each token sequence it scored first sits in
it. A rerun into the same directory with the same inputs (``plan.json`` byte-identical) skips every
shard whose record and bytes agree and scores the rest; the set it ends with is byte-identical to an
uninterrupted run's. A rerun with other inputs (examples, teacher, student, K or size) is refused
(``scored_set_mismatch``), never mixed into the old set.

**Duplicates.** Admission refuses two different score rows for one exact token sequence, across shards
too (``shard_duplicate_conflict``), and batching may perturb the last bits of a score; so an example
repeating a sequence first seen in an earlier shard copies that shard's ``teacher_tokens`` bytes (read
back from the committed shard), and one repeating a sequence of its own shard copies them from the
shard being written, as for a single file.

**Parallel.** With a vLLM teacher, ``workers`` shards are scored at once (threads; each shard sends up
to ``batch_size`` requests at a time); a shard waiting for an earlier shard's rows of a duplicate waits
for that shard to commit. A local teacher holds one model in this process and scores one batch at a
time; its parallelism is the batch. The first error in shard order is the one raised. A flow can
instead score each shard in its own process (``kiln_core.scoring.shard_jobs``, one Ray task per shard):
``open_shard_set``, ``score_planned_shard`` per shard, ``finish_shard_set``, the steps this path runs.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any

from kiln_core.contracts.scored_set import ScoredShard, ScoreSetResult
from kiln_core.scoring.examples import ScoringError, ScoringExample, iter_examples
from kiln_core.scoring.requests import encode_requests
from kiln_core.scoring.shard_plan import (
    INDEX_NAME,
    KILN_MAX_SHARD_BYTES,
    MAX_LOGPROB_CHARS,
    PLAN_FORMAT,
    STATE_DIR,
    SetPlan,
    ShardPlan,
    check_existing_set,
    file_sha256,
    parse_shard_size,
    plan_set,
    row_size_bound,
    shard_dependencies,
)

__all__ = [
    "KILN_MAX_SHARD_BYTES", "MAX_LOGPROB_CHARS", "ScoreSetResult", "ScoredShard", "SetProgress",
    "check_out_directory", "finish_shard_set", "open_shard_set", "parse_shard_size", "row_size_bound",
    "score_planned_shard", "score_shard_set", "shard_dependencies",
]

RECORD_FORMAT = "kiln-flows.scored-shard.v1"


@dataclass(frozen=True)
class SetProgress:
    """Where a sharded scoring run stands; ``tokens_resumed`` were done by an earlier run."""

    shards_done: int
    shards_total: int
    tokens_done: int
    tokens_total: int
    tokens_resumed: int


# --- options --------------------------------------------------------------------------------------------


def check_out_directory(out_uri: str, storage_options: dict | None = None) -> None:
    """``--out`` must be a directory or absent when sharding (``out_not_directory``)."""
    from kiln_core.storage import resolve

    location = resolve(out_uri, storage_options)
    if location.exists() and not location.fs.isdir(location.path):
        raise ScoringError("out_not_directory", f"--out {location.uri} is a file; with --shard-size it names the "
                                                f"directory the shards and index.json are written into")


# --- the run ---------------------------------------------------------------------------------------------


@dataclass
class _ShardDone:
    plan: ShardPlan
    sha256: str
    size_bytes: int
    rows: dict[str, list[int]]
    """Sequence key (hex) → [offset, length] of its ``teacher_tokens`` in the shard, for keys scored here."""
    reused_rows: int
    resumed: bool


class _SetRun:
    """One sharded scoring run: the directory, the plan, the finished shards and the progress report."""

    def __init__(self, out, plan: SetPlan, binding, student, top_k, shard_size, batch_size, on_progress,
                 storage_options):
        self.out = out
        self.shard_size = shard_size
        self.plan = plan
        self.binding = binding
        self.student = student
        self.top_k = top_k
        self.batch_size = batch_size
        self.on_progress = on_progress
        self.storage_options = storage_options
        self.done: dict[int, _ShardDone] = {}
        self.committed = {shard.number: threading.Event() for shard in plan.shards}
        self.failed = threading.Event()
        self.lock = threading.Lock()  # the tokenizer, the progress counters and the callback
        self.tokens_total = sum(shard.action_tokens for shard in plan.shards)
        self.tokens_done = 0
        self.tokens_resumed = 0

    def shard_location(self, shard: ShardPlan):
        return self.out.child(shard.name)

    def record_location(self, shard: ShardPlan):
        return self.out.child(STATE_DIR, shard.name.removesuffix(".jsonl") + ".json")

    def report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(SetProgress(len(self.done), len(self.plan.shards), self.tokens_done,
                                         self.tokens_total, self.tokens_resumed))

    # --- what an earlier run finished

    def finished_earlier(self, shard: ShardPlan) -> _ShardDone | None:
        """The shard as an earlier run of this plan committed it, if its record and bytes agree."""
        record_location = self.record_location(shard)
        if not record_location.exists():
            return None
        try:
            record = json.loads(record_location.read_bytes())
        except ValueError:
            return None  # a record is written atomically; an unreadable one is simply not a finished shard
        if not isinstance(record, dict) or record.get("plan_sha256") != self.plan.plan_sha256:
            return None
        location = self.shard_location(shard)
        if not location.exists():
            return None
        data = location.read_bytes()
        if len(data) != record.get("size_bytes") or "sha256:" + hashlib.sha256(data).hexdigest() != record.get("sha256"):
            return None  # changed since: scored again (same inputs, so the same bytes)
        rows, reused = record.get("rows"), record.get("reused_rows")
        if not isinstance(rows, dict) or not isinstance(reused, int):
            return None
        return _ShardDone(shard, record["sha256"], record["size_bytes"], rows, reused, True)

    def take_earlier(self, shard: ShardPlan) -> bool:
        """Count ``shard`` as finished if an earlier run committed it (``finished_earlier``)."""
        earlier = self.finished_earlier(shard)
        if earlier is None:
            return False
        self.done[shard.number] = earlier
        self.committed[shard.number].set()
        self.tokens_done += shard.action_tokens
        return True

    def todo(self) -> list[ShardPlan]:
        """The shards left to score, in set order."""
        return [shard for shard in self.plan.shards if shard.number not in self.done]

    # --- scoring one shard

    def earlier_rows(self, shard: ShardPlan, keys: list[bytes]) -> dict[bytes, str]:
        """``teacher_tokens`` text of the sequences this shard repeats from earlier shards (waits for them)."""
        wanted = {key: self.plan.first_shard[key] for key in keys if self.plan.first_shard[key] < shard.number}
        rows: dict[bytes, str] = {}
        for key, number in wanted.items():
            while not self.committed[number].wait(timeout=0.5):
                if self.failed.is_set():
                    raise _Abandoned()
            done = self.done.get(number)
            if done is None:
                raise _Abandoned()  # that shard failed: the set cannot finish this time
            offset, length = done.rows[key.hex()]
            location = self.shard_location(done.plan)
            rows[key] = bytes(location.fs.cat_file(location.path, start=offset, end=offset + length)).decode("utf-8")
        return rows

    def score_shard(self, shard: ShardPlan, examples: list[ScoringExample], scorer) -> _ShardDone:
        from kiln_core.scoring.writer import CorpusWriter, TokenTexts, row_head, teacher_tokens_json

        keys = self.plan.keys[shard.first : shard.first + shard.count]
        earlier = self.earlier_rows(shard, keys)
        token_text = TokenTexts(self.student.tokenizer)
        here: dict[bytes, tuple[int, int]] = {}  # key → (offset, length) of its teacher_tokens in this shard
        reused = 0
        with CorpusWriter(self.shard_location(shard).uri, self.storage_options) as writer:
            writer.write_line(self.binding.manifest_line)
            for start in range(0, shard.count, self.batch_size):
                if self.failed.is_set():
                    raise _Abandoned()
                batch = examples[start : start + self.batch_size]
                batch_keys = keys[start : start + self.batch_size]
                with self.lock:  # a fast tokenizer is not safe to share across threads
                    requests = encode_requests(self.student, batch, self.binding.identity.max_model_len)
                fresh: dict[bytes, int] = {}
                for index, key in enumerate(batch_keys):
                    if key not in earlier and key not in here and key not in fresh:
                        fresh[key] = index
                scored = scorer.score([requests[i] for i in fresh.values()], self.top_k) if fresh else []
                with self.lock:
                    tokens_by_key = {key: teacher_tokens_json(rows, token_text) for key, rows in zip(fresh, scored)}
                for example, key in zip(batch, batch_keys):
                    head = row_head(example.record)
                    if key in tokens_by_key:
                        tokens = tokens_by_key.pop(key)
                    elif key in earlier:
                        tokens, reused = earlier[key], reused + 1
                    else:
                        offset, length = here[key]
                        tokens, reused = writer.read_back(offset, length).decode("utf-8"), reused + 1
                    offset = writer.write_line(head + tokens + "}")
                    here.setdefault(key, (offset + len(head.encode("utf-8")), len(tokens.encode("utf-8"))))
                with self.lock:
                    self.tokens_done += sum(int(r.positions.shape[0]) for r in requests)
                    self.report()
            if writer.bytes_written > self.shard_size:  # cannot happen: the plan bounds every row
                raise ScoringError("row_exceeds_shard_size", f"shard {shard.name} came to {writer.bytes_written} "
                                                             f"bytes, above the shard size {self.shard_size}")
            writer.commit()
        rows = {key.hex(): list(span) for key, span in here.items() if key not in earlier}
        done = _ShardDone(shard, writer.sha256, writer.bytes_written, rows, reused, False)
        self.write_record(done)
        return done

    def write_record(self, done: _ShardDone) -> None:
        from kiln_core.storage import write_bytes_atomic

        record = {"format": RECORD_FORMAT, "plan_sha256": self.plan.plan_sha256, "shard": done.plan.name,
                  "sha256": done.sha256, "size_bytes": done.size_bytes, "reused_rows": done.reused_rows,
                  "rows": done.rows}
        write_bytes_atomic(self.record_location(done.plan), json.dumps(record, sort_keys=True).encode("utf-8") + b"\n")

    def finish(self, done: _ShardDone) -> None:
        with self.lock:
            self.done[done.plan.number] = done
            self.report()
        self.committed[done.plan.number].set()


class _Abandoned(Exception):
    """A shard stopped because another one failed first (that failure is the one reported)."""


def score_shard_set(
    examples_uri: str,
    *,
    student,
    binding,
    load_scorer: Callable[[], Any],
    top_k: int,
    out_uri: str,
    shard_size: int,
    batch_size: int,
    workers: int = 1,
    on_progress: Callable[[SetProgress], None] | None = None,
    storage_options: dict | None = None,
) -> ScoreSetResult:
    """Score examples into a set of shards plus ``index.json`` in ``out_uri``, resuming an unfinished set.

    Called by ``kiln_core.scoring.score_examples`` once the options, the student and the teacher's
    identity have been checked; ``load_scorer`` is called only if some shard still needs scoring. The
    same three steps run a set whose shards are scored elsewhere, one task per shard (a flow on a Ray
    cluster): ``open_shard_set``, ``score_planned_shard`` for each of ``run.todo()``, ``finish_shard_set``.

    Raises:
        ScoringError: ``scored_set_mismatch`` when ``out_uri`` holds another run's set or foreign
            ``*.jsonl`` files, ``row_exceeds_shard_size``, or any scoring code.
    """
    run = open_shard_set(examples_uri, student=student, binding=binding, top_k=top_k, out_uri=out_uri,
                         shard_size=shard_size, batch_size=batch_size, on_progress=on_progress,
                         storage_options=storage_options)
    todo = run.todo()
    if not todo:
        run.report()
    else:
        scorer = load_scorer()
        run.report()  # after the teacher loaded: a rate and ETA measured from here are the scoring's own
        try:
            _score_all(run, todo, _shard_examples(examples_uri, run.plan, storage_options), scorer, workers)
        finally:
            if hasattr(scorer, "close"):
                scorer.close()
    return finish_shard_set(run)


def open_shard_set(examples_uri: str, *, student, binding, top_k: int, out_uri: str, shard_size: int,
                   batch_size: int, on_progress: Callable[[SetProgress], None] | None = None,
                   storage_options: dict | None = None) -> _SetRun:
    """Plan the split, refuse another run's directory, write ``plan.json`` and find the shards an earlier
    run finished: the run whose ``todo()`` shards are left to score.

    Raises:
        ScoringError: ``scored_set_mismatch`` or ``row_exceeds_shard_size`` (see ``score_shard_set``).
    """
    from kiln_core.storage import resolve, write_bytes_atomic

    out = resolve(out_uri, storage_options)
    inputs = {
        "examples_sha256": file_sha256(examples_uri, storage_options),
        "manifest_sha256": "sha256:" + hashlib.sha256(binding.manifest_line.encode("utf-8")).hexdigest(),
        "teacher_identity_revision": binding.identity.identity_revision(),
        "student": {k: v for k, v in student.identity().items() if k != "tokenizer_config_sha256"},
        "top_k": top_k,
        "shard_size": shard_size,
    }
    plan = plan_set(examples_uri, student, binding, top_k, shard_size, inputs, batch_size, storage_options)
    check_existing_set(out, plan, inputs)
    write_bytes_atomic(out.child(STATE_DIR, "plan.json"), plan.plan_json)

    run = _SetRun(out, plan, binding, student, top_k, shard_size, batch_size, on_progress, storage_options)
    for shard in plan.shards:
        run.take_earlier(shard)
    run.tokens_resumed = run.tokens_done
    return run


def finish_shard_set(run: _SetRun) -> ScoreSetResult:
    """Write ``index.json`` (last: the set is whole) once every shard of ``run`` is finished; the result."""
    from kiln_core.contracts.corpus_shards import INDEX_FORMAT, CorpusShardIndex, set_sha256
    from kiln_core.storage import write_bytes_atomic

    shards = [run.done[shard.number] for shard in run.plan.shards]
    index = CorpusShardIndex.model_validate({"format": INDEX_FORMAT, "shards": [
        {"uri": done.plan.name, "sha256": done.sha256, "size_bytes": done.size_bytes} for done in shards]})
    index_location = run.out.child(INDEX_NAME)
    write_bytes_atomic(index_location, index.model_dump_json(indent=2).encode("utf-8") + b"\n")
    return ScoreSetResult(
        out_uri=run.out.uri,
        index_uri=index_location.uri,
        set_sha256=set_sha256([done.sha256 for done in shards]),
        examples=sum(done.plan.count for done in shards),
        action_tokens=run.tokens_total,
        manifest_line=run.binding.manifest_line,
        identity_revision=run.binding.identity.identity_revision(),
        shard_size=run.shard_size,
        shards=[ScoredShard(uri=run.shard_location(done.plan).uri, sha256=done.sha256, size_bytes=done.size_bytes,
                            examples=done.plan.count, action_tokens=done.plan.action_tokens,
                            first_line=done.plan.first_line, resumed=done.resumed) for done in shards],
        resumed_shards=sum(done.resumed for done in shards),
        reused_rows=sum(done.reused_rows for done in shards if not done.resumed),
    )


def score_planned_shard(examples_uri: str, shard: ShardPlan, *, plan: SetPlan, student, binding, scorer,
                        top_k: int, out_uri: str, shard_size: int, batch_size: int,
                        storage_options: dict | None = None) -> _ShardDone:
    """Score one shard of ``plan`` on its own (in another process, e.g. a Ray worker), as ``score_shard_set``
    scores it: its shard file and completion record are written; the caller hands the result to
    ``run.finish`` of the run that planned it.

    The shards whose rows this one copies (``shard_dependencies``) must be committed already: they are read
    back from their records, as a resumed run reads them.

    Raises:
        ScoringError: ``scored_set_mismatch`` when such a shard is not committed (the directory changed
            underneath the run), or any scoring code.
    """
    from kiln_core.storage import resolve

    run = _SetRun(resolve(out_uri, storage_options), plan, binding, student, top_k, shard_size, batch_size, None,
                  storage_options)
    for number in sorted(shard_dependencies(plan, shard)):
        if not run.take_earlier(plan.shards[number]):
            raise ScoringError("scored_set_mismatch", f"{shard.name} repeats rows of {plan.shards[number].name}, "
                                                      f"which is not committed in {run.out.uri}")
    stream = iter_examples(examples_uri, storage_options)
    examples = list(islice(stream, shard.first, shard.first + shard.count))
    return run.score_shard(shard, examples, scorer)



def _score_all(run: _SetRun, todo: list[ShardPlan], examples: Iterator[tuple[ShardPlan, list]], scorer,
               workers: int) -> None:
    """Score the unfinished shards, ``workers`` at a time; raise the first failure in shard order."""
    wanted = {shard.number for shard in todo}
    if workers == 1:
        for shard, batch in examples:
            if shard.number in wanted:
                run.finish(run.score_shard(shard, batch, scorer))
        return
    futures: list[Future] = []
    slots = threading.BoundedSemaphore(workers * 2)  # shards read ahead and held in memory, at most

    def score(shard: ShardPlan, batch: list) -> None:
        try:
            run.finish(run.score_shard(shard, batch, scorer))
        except BaseException:
            run.failed.set()
            raise
        finally:
            slots.release()

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="score-shard") as pool:
        try:
            for shard, batch in examples:
                if shard.number not in wanted:
                    continue
                while not slots.acquire(timeout=0.5):
                    if run.failed.is_set():
                        break
                if run.failed.is_set():
                    break
                futures.append(pool.submit(score, shard, batch))
        except BaseException:  # Ctrl-C here: the running shards stop at their next batch
            run.failed.set()
            raise
    errors = [future.exception() for future in futures]
    first = next((error for error in errors if error is not None and not isinstance(error, _Abandoned)), None)
    if first is not None:
        raise first


def _shard_examples(examples_uri: str, plan: SetPlan, storage_options) -> Iterator[tuple[ShardPlan, list]]:
    """Each shard with its examples, reading the file once in order."""
    stream = iter_examples(examples_uri, storage_options)
    for shard in plan.shards:
        yield shard, list(islice(stream, shard.count))
