"""Concurrent materialization drill: two runs admit the same corpus bytes into one root at once.

Each trial gives a fresh storage root to two admissions of the same JSONL bytes for the same student
(what two flow runs started together do in their ``admit`` stage) and requires:

* both admissions succeed;
* exactly one materialization is committed: ``corpora/<hex>/`` holding ``examples.parquet``,
  ``targets.parquet`` and ``admission.json`` — no ``variants/`` copy, no staging directory, no
  ``.incomplete`` sentinel left behind;
* both results name that same URI, carry the committed ``admission.json`` record, and their tables
  are identical to each other and to what ``read_materialization`` reads back.

Schedules (a seeded RNG picks one per trial after each has run once):

* ``threads`` — two threads released together by a barrier;
* ``threads-both-miss`` — both threads finish their lookup of an existing materialization before
  either writes (the interleaving of two runs that checked the cache at the same moment);
* ``threads-commit-race`` — both threads stage their files and then commit at the same moment;
* ``processes`` — two processes released together by a go-file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from drills import DrillReport, fresh_dir, subprocess_env, tiny_student, where

SCHEDULES = ("threads", "threads-both-miss", "threads-commit-race", "processes")
BARRIER_TIMEOUT_S = 20.0

_CHILD = r"""
import hashlib, json, os, sys, time
corpus, student, root, go = sys.argv[1:5]
from kiln_core.admission import admit_corpus
from kiln_core.tokenization import load_student_tokenizer
tokenizer = load_student_tokenizer(student)
print("READY", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
try:
    result = admit_corpus(corpus, student, top_k=16, out_root=root, student=tokenizer)
    tables = result.tables
    digest = hashlib.sha256()
    for name in sorted(tables.__dataclass_fields__):
        value = getattr(tables, name)  # arrays, and the prompt-list digest (a str or None)
        digest.update(name.encode()); digest.update(value.tobytes() if hasattr(value, "tobytes") else repr(value).encode())
    print("RESULT " + json.dumps({"uri": result.materialized, "reused": result.reused, "tables": digest.hexdigest(),
                                  "record": result.record.model_dump(mode="json") if result.record else None}), flush=True)
except BaseException as error:
    import traceback
    frame = traceback.extract_tb(error.__traceback__)[-1]
    place = frame.filename.split("/kiln_core/")[-1] + f":{frame.lineno} in {frame.name}"
    print("ERROR " + json.dumps(f"{type(error).__name__}: {error} @ kiln_core/{place}"), flush=True)
"""


def tables_digest(tables) -> str:
    digest = hashlib.sha256()
    for name in sorted(tables.__dataclass_fields__):
        digest.update(name.encode())
        value = getattr(tables, name)  # arrays, and the prompt-list digest (a str or None)
        digest.update(value.tobytes() if hasattr(value, "tobytes") else repr(value).encode())
    return digest.hexdigest()


@contextlib.contextmanager
def _patched(owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _barrier_wait(barrier: threading.Barrier) -> None:
    try:
        barrier.wait(BARRIER_TIMEOUT_S)
    except threading.BrokenBarrierError:
        pass  # the other admission never got here (it reused the first one's commit): carry on


def _two_threads(corpus: Path, student: Path, root: Path, schedule: str) -> list[dict[str, Any]]:
    from kiln_core import materialize, storage
    from kiln_core.admission import admit_corpus

    start = threading.Barrier(2)
    inner = threading.Barrier(2)
    outcomes: list[dict[str, Any]] = [{}, {}]

    def admit(index: int) -> None:
        try:
            _barrier_wait(start)
            result = admit_corpus(str(corpus), str(student), top_k=16, out_root=str(root))
            outcomes[index] = {"uri": result.materialized, "reused": result.reused, "tables": tables_digest(result.tables),
                               "record": result.record.model_dump(mode="json") if result.record else None}
        except BaseException as error:  # reported, never raised out of the thread
            outcomes[index] = {"error": f"{type(error).__name__}: {error} @ {where(error)}"}

    def after_lookup(original):
        def find(*args, **kwargs):
            found = original(*args, **kwargs)
            _barrier_wait(inner)
            return found
        return find

    def before_commit(original):
        def commit(self, data):
            if "/corpora/" in self.target.uri.replace(os.sep, "/"):
                _barrier_wait(inner)
            return original(self, data)
        return commit

    patch = contextlib.nullcontext()
    if schedule == "threads-both-miss":
        patch = _patched(materialize, "find_materialization", after_lookup)
    elif schedule == "threads-commit-race":
        patch = _patched(storage.StagedDirectory, "commit", before_commit)
    with patch:
        threads = [threading.Thread(target=admit, args=(i,), name=f"admit-{i}") for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    return outcomes


def _two_processes(corpus: Path, student: Path, root: Path, scratch: Path) -> list[dict[str, Any]]:
    go = scratch / f"go-{root.name}"
    processes = [subprocess.Popen([sys.executable, "-c", _CHILD, str(corpus), str(student), str(root), str(go)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), text=True)
                 for _ in range(2)]
    try:
        for process in processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if line.strip() != "READY":
                error = process.stderr.read()[-1500:] if process.stderr else ""
                raise RuntimeError(f"admission process did not start: {line!r} {error}")
        go.write_text("")
        outcomes = []
        for process in processes:
            out, err = process.communicate(timeout=300)
            lines = [line for line in out.splitlines() if line.startswith(("RESULT ", "ERROR "))]
            if not lines:
                outcomes.append({"error": f"no result (exit {process.returncode}): {err[-1500:]}"})
            elif lines[-1].startswith("ERROR "):
                outcomes.append({"error": json.loads(lines[-1][6:])})
            else:
                outcomes.append(json.loads(lines[-1][7:]))
        return outcomes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def check_root(root: Path, dataset_hex: str, outcomes: list[dict[str, Any]]) -> list[str]:
    """The invariants of the module docstring; returns the problems found."""
    from kiln_core.materialize import read_materialization

    problems = [f"admission {i} failed: {o['error']}" for i, o in enumerate(outcomes) if "error" in o]
    corpora = root / "corpora"
    entries = sorted(str(p.relative_to(corpora)) for p in corpora.rglob("*")) if corpora.exists() else []
    expected = [dataset_hex, f"{dataset_hex}/admission.json", f"{dataset_hex}/examples.parquet", f"{dataset_hex}/targets.parquet"]
    if entries != expected:
        committed = [e.removesuffix("/admission.json").replace(dataset_hex, "<hex>") for e in entries
                     if e.endswith("admission.json")]
        leftovers = [e.replace(dataset_hex, "<hex>") for e in entries if "incomplete" in e or e.startswith(".") or "/." in e]
        problems.append(f"corpora/ holds {len(committed)} committed materializations {committed} and "
                        f"{len(leftovers)} staging entries {leftovers[:4]}")
    if problems:
        return problems
    uri = str(corpora / dataset_hex)
    committed = read_materialization(uri)
    for index, outcome in enumerate(outcomes):
        if outcome["uri"] != uri:
            problems.append(f"admission {index} points at {outcome['uri']}, not {uri}")
        if outcome["record"] != committed.record.model_dump(mode="json"):
            problems.append(f"admission {index} returned a record other than the committed admission.json")
    digest = tables_digest(committed.tables)
    if {outcomes[0]["tables"], outcomes[1]["tables"]} != {digest}:
        problems.append("the two admissions' tables differ from each other or from the committed materialization")
    return problems


def run(*, workdir: Path, trials: int = 12, seed: int = 0, **_: Any) -> dict[str, Any]:
    """Run ``trials`` concurrent-admission trials; see the module docstring."""
    from kiln_core.canonical import sha256_hex
    from kiln_core.synthetic import synthesize_corpus

    report = DrillReport("concurrent-materialize", seed=seed)
    student = tiny_student(workdir)
    inputs = workdir / "inputs"
    inputs.mkdir(exist_ok=True)
    corpus = synthesize_corpus(student, inputs / "corpus.jsonl", n_examples=24, top_k=16, seed=7, trajectory_every=4)
    dataset_hex = sha256_hex(corpus.read_bytes())
    roots = fresh_dir(workdir, "roots")
    rng = random.Random(seed)
    for trial in range(trials):
        schedule = SCHEDULES[trial] if trial < len(SCHEDULES) else rng.choice(SCHEDULES)
        root = roots / f"trial-{trial:03d}"
        label = f"trial {trial} schedule={schedule}"
        started = time.perf_counter()
        try:
            if schedule == "processes":
                outcomes = _two_processes(corpus, student, root, roots)
            else:
                outcomes = _two_threads(corpus, student, root, schedule)
            report.bump("schedules", schedule)
            problems = check_root(root, dataset_hex, outcomes)
            reused = sum(1 for o in outcomes if o.get("reused"))
            report.bump("reused_by_second", str(reused))
            if problems:
                report.failed_trial(f"{label}: " + "; ".join(problems))
            else:
                report.passed_trial()
        except Exception as error:
            report.failed_trial(f"{label}: {type(error).__name__}: {error}", crash=True)
        report.count("trial_seconds_total", round(time.perf_counter() - started, 2))
    return report.finish()
