"""The ``opd_distill`` flow admits a set of shards on the run's Ray cluster (prefect-ray's task runner).

What a user depends on: with ``distributed: {engine: ray}`` in the spec, every ``admit-shard`` task runs
in a Ray worker process, not in the flow's process; the run admits what the thread path admits (the same
set digest, each shard materialized under its own digest, an unchanged shard reused by the next run) and
trains on it; a bad shard is rejected through Ray with the rule, the shard and the line, and nothing is
recorded for the set.

With ``address: local`` the flow starts one Ray instance for the run when it admits the shards, trains on
it (``ray_session`` uses a session already open) and stops it when the run ends.

Cost: two local Ray starts (the rejection test's own, then ``ray_instance`` for the training test's two
runs), three tiny shards, one 1-worker Ray training.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import ray  # a missing Ray fails the module (CI installs .[test], which includes kiln-flows[ray])

from shard_support import write_file, write_set

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

CUTS = (2, 2, 2)
CONFIG = {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "seed": 5, "lora_rank": 4, "lora_alpha": 8.0,
          "learning_rate": 5e-3, "checkpoint_interval": 3}


@pytest.fixture(scope="module")
def corpus_lines(tiny_student, tmp_path_factory) -> list[str]:
    from kiln_core.synthetic import synthesize_corpus

    path = synthesize_corpus(tiny_student, tmp_path_factory.mktemp("whole") / "whole.jsonl", n_examples=sum(CUTS),
                             top_k=16, seed=3)
    return path.read_text(encoding="utf-8").splitlines()


def ray_spec(shards: Path, root: Path, student: Path):
    from kiln_core.contracts.pipeline import parse_spec

    first_line = next(shards.glob("*.jsonl")).read_text().splitlines()[0]  # every shard's manifest line
    manifest = write_file(root.parent / f"{root.name}-manifest.jsonl", [first_line])
    return parse_spec({"teacher": {"kind": "manifest_file", "path": str(manifest)}, "corpus": str(shards),
                       "student": str(student), "storage_root": str(root), "adapter": "fan-out", "config": CONFIG,
                       "options": {"admit_workers": 2, "train_retries": 0},
                       "distributed": {"engine": "ray", "address": "local", "workers": 1}})


class AdmittedSets:
    """Every set the flow admits with tasks, as ``admit_set_with_tasks`` returned it (a spy in this process)."""

    def __init__(self, monkeypatch) -> None:
        import tasks.admit_shards

        self.results, self.runners = [], []
        real = tasks.admit_shards.admit_set_with_tasks

        def spy(*args, **kwargs):
            self.runners.append(type(kwargs.get("task_runner")).__name__)
            result = real(*args, **kwargs)
            self.results.append(result)
            return result

        monkeypatch.setattr(tasks.admit_shards, "admit_set_with_tasks", spy)


def ran_elsewhere(worker: str) -> bool:
    """A ``host:pid`` that is not this process (the flow's own task runner runs tasks on threads here;
    the worker may be gone by now: Ray stops idle workers)."""
    return int(worker.rsplit(":", 1)[1]) != os.getpid()


def test_a_bad_shard_is_rejected_through_ray_naming_shard_and_line(prefect_harness, tiny_student, corpus_lines,
                                                                  tmp_path, monkeypatch):
    """First in the module, before ``ray_instance``: the flow starts its own ``local`` instance for the
    shard admission (once) and stops it when the run ends."""
    from flows.opd_distill import opd_distill
    from kiln_core.errors import AdmissionError

    assert not ray.is_initialized()
    starts = []
    real_init = ray.init
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: starts.append(kwargs) or real_init(*args, **kwargs))

    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    lines = (shards / "part-01.jsonl").read_text().splitlines()
    write_file(shards / "part-01.jsonl", [lines[0], lines[1], lines[2][: len(lines[2]) // 2]])  # line 3 cut short
    admitted = AdmittedSets(monkeypatch)

    state = opd_distill(ray_spec(shards, tmp_path / "root", tiny_student), return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, AdmissionError), error
    assert (error.code, error.file, error.line) == ("invalid_json", "part-01.jsonl", 3)
    assert "part-01.jsonl line 3" in state.message
    assert admitted.runners == ["RayTaskRunner"]
    assert len(starts) == 1 and not ray.is_initialized()  # one local instance for the run, stopped at its end
    assert not (tmp_path / "root" / "corpora" / "sets").exists()  # no set record for a rejected set
    assert not (tmp_path / "root" / "runs").exists()  # nothing trained


def test_the_flow_admits_every_shard_on_ray_and_trains(prefect_harness, ray_instance, tiny_student, corpus_lines,
                                                       tmp_path, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.opd_distill import opd_distill
    from kiln_core.admission.shards import admit_shard_set
    from kiln_core.contracts.corpus_shards import set_sha256

    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    spec = ray_spec(shards, tmp_path / "root", tiny_student)
    admitted = AdmittedSets(monkeypatch)

    state = opd_distill(spec, return_state=True)
    assert state.is_completed(), f"{state.type}: {state.message}"
    summary = state.result()
    digests = ["sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(shards.glob("*.jsonl"))]
    assert summary["status"] == "success" and summary["dataset_sha256"] == set_sha256(digests)
    assert ray.is_initialized()  # the flow used the module's instance and left it open
    trained_on = json.loads(Path(summary["receipt"]).read_text())["distributed"]
    assert (trained_on["engine"], trained_on["world_size"]) == ("ray", 1)

    [result] = admitted.results
    assert admitted.runners == ["RayTaskRunner"]
    assert [shard.name for shard in result.shards] == ["part-00.jsonl", "part-01.jsonl", "part-02.jsonl"]
    assert all(ran_elsewhere(shard.worker) for shard in result.shards), [s.worker for s in result.shards]
    assert not any(shard.reused for shard in result.shards)
    with get_client(sync_client=True) as client:
        flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        runs = client.read_task_runs(flow_run_filter=flow_run)
    shard_runs = sorted((run.name, run.state.type.value) for run in runs if run.name.startswith("admit-shard"))
    assert [state_type for _, state_type in shard_runs] == ["COMPLETED"] * 3, shard_runs

    # What the thread path (here: the engine in this process) admits: the same digests and materializations.
    here = admit_shard_set(str(shards), str(tiny_student), top_k=16, out_root=str(tmp_path / "here"))
    assert [(s.dataset_sha256, s.examples, s.action_tokens) for s in here.shards] == \
        [(s.dataset_sha256, s.examples, s.action_tokens) for s in result.shards]
    assert [Path(s.materialized).name for s in here.shards] == [Path(s.materialized).name for s in result.shards]
    assert all(Path(s.materialized, "admission.json").is_file() for s in result.shards)

    # A second run of the same spec: Ray workers find every shard committed and reuse it.
    again = opd_distill(spec, return_state=True)
    assert again.is_completed(), f"{again.type}: {again.message}"
    assert again.result()["dataset_sha256"] == summary["dataset_sha256"]
    assert all(shard.reused and ran_elsewhere(shard.worker) for shard in admitted.results[1].shards)


# --- scoring: one ``score-shard`` task per shard on Ray (score_corpus(..., ray_address=...)) ---------------

# The tiny models' six examples at 40,000-byte shards: [1, 2], [3], [4, 5, 6]; example 6 repeats example 1,
# so shard 2 copies shard 0's rows and is started only once shard 0 is committed (see test_score_shards.py).
SCORE_SHARD_SIZE = 40_000


class ScoredSets:
    """Every set ``score_corpus`` scores on Ray, with the workers that scored its shards (a spy here)."""

    def __init__(self, monkeypatch) -> None:
        import tasks.score_shards

        self.results, self.workers = [], []
        real = tasks.score_shards.score_set_with_tasks

        def spy(*args, **kwargs):
            result, workers = real(*args, **kwargs)
            self.results.append(result)
            self.workers.append(workers)
            return result, workers

        monkeypatch.setattr(tasks.score_shards, "score_set_with_tasks", spy)


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (the scoring plan and shard records included) by relative path."""
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


def test_score_corpus_scores_each_shard_on_ray_byte_for_byte_as_the_thread_path(
        prefect_harness, ray_instance, tiny_teacher, tiny_student, tmp_path, monkeypatch, capsys):
    from test_scoring import EXAMPLES, TOP_K, write_jsonl

    from flows.score_corpus import score_corpus

    examples = write_jsonl(tmp_path / "examples.jsonl", EXAMPLES)

    def score(out: Path, **ray) -> dict:
        return score_corpus(str(examples), str(tiny_student), teacher_dir=str(tiny_teacher),
                            storage_root=str(tmp_path / "root"), top_k=TOP_K, out=str(out),
                            shard_size=SCORE_SHARD_SIZE, **ray)

    threads = score(tmp_path / "threads")
    scored = ScoredSets(monkeypatch)
    on_ray = score(tmp_path / "ray", ray_address="local")

    assert ray.is_initialized()  # the flow used the module's instance and left it open
    assert files_of(tmp_path / "ray") == files_of(tmp_path / "threads")  # shards, records, plan and index
    assert (on_ray["sha256"], on_ray["examples"], on_ray["reused"]) == (threads["sha256"], len(EXAMPLES), False)
    assert on_ray["uri"] == str(tmp_path / "ray" / "index.json")
    [result], [workers] = scored.results, scored.workers
    assert [Path(shard.uri).name for shard in result.shards] == \
        ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    assert len(workers) == 3 and all(ran_elsewhere(worker) for worker in workers), workers

    # Resume, through ``kiln-flows score --ray`` (which runs this flow): a run that lost its last shard
    # scores only that one on Ray (copying shard 0's rows from its committed file), ending with the same bytes.
    from flows.cli import main

    (tmp_path / "ray" / "shard-00002.jsonl").unlink()
    (tmp_path / "ray" / "index.json").unlink()
    code = main(["score", str(examples), "--teacher", str(tiny_teacher), "--student", str(tiny_student), "--top-k",
                 str(TOP_K), "--out", str(tmp_path / "ray"), "--shard-size", str(SCORE_SHARD_SIZE), "--ray", "local",
                 "--json"])
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and files_of(tmp_path / "ray") == files_of(tmp_path / "threads")
    assert again["sha256"] == threads["sha256"] and again["reused"] is False
    assert scored.results[1].resumed_shards == 2 and len(scored.workers[1]) == 1
    assert ran_elsewhere(scored.workers[1][0])
