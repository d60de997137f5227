"""The edges of a ``torchrun`` run that need no second process: what a rank says when it cannot start, how
a rejection crosses from rank 0 back to the launching process with its code, how progress lines are
relayed, what a rank does with a job it cannot read or one planned for another world size, and how a
multi-node job (``kiln-flows train --write-job``) is refused before any launch.

What a user depends on: a rejected run launched with ``--nproc 2`` reads exactly as a one-process
rejection (same error class, code, line or file, exit 2); a rank started with the wrong arguments
exits 2 with one line; progress never reports a half-written line; a rank never trains a job planned
for another number of ranks. The runs themselves are in
``test_distributed.py``.
"""

from __future__ import annotations

import json
import sys

import pytest

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.engine import spec_from_request
from kiln_core.errors import AdmissionError, Rejection
from kiln_core.training.checkpoint import CheckpointError, ResumeError
from kiln_core.training.distributed import launcher, worker
from kiln_core.training.distributed.world import World


def test_a_rank_needs_a_job_and_takes_no_request(capsys):
    with pytest.raises(SystemExit) as exited:
        worker.main([])
    assert exited.value.code == 2 and "--job" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # a request is the engine's to read: one door trains it
        worker.main(["--job", "job.json", "--request", "request.json"])
    assert exited.value.code == 2 and "unrecognized arguments: --request" in capsys.readouterr().err


def test_a_job_that_cannot_be_read_is_a_rejection_on_rank_0(tmp_path, capsys):
    result = tmp_path / "result.json"
    assert worker.main(["--job", str(tmp_path / "missing.json"), "--result", str(result)]) == 2
    (tmp_path / "not-a-job.json").write_text('{"plan": {}}')
    outcome = json.loads(result.read_text())
    assert (outcome["kind"], outcome["payload"]["code"], outcome["payload"]["field"]) == ("rejected", "invalid_job", "job")
    assert worker.main(["--job", str(tmp_path / "not-a-job.json"), "--result", str(result)]) == 2
    assert "is not a kiln-flows distributed job" in json.loads(result.read_text())["payload"]["message"]
    assert "rank 0: ConfigError" in capsys.readouterr().err


@pytest.mark.parametrize("error", [
    AdmissionError("invalid_json", 7, "line 7 is not JSON"),
    ConfigError("OPD top_k must be > 0", "config.top_k", code="invalid_config"),
    CheckpointError("checkpoint_file_digest", "adapter.safetensors does not match", file="adapter.safetensors"),
    ResumeError("resume_mismatch", "the checkpoint belongs to another corpus"),
], ids=lambda error: type(error).__name__)
def test_a_rejection_on_rank_0_reaches_the_launcher_as_the_same_rejection(error, tmp_path, capsys):
    result = tmp_path / "result.json"
    assert worker._report(World(rank=0, size=2), str(result), error) == 2
    outcome = json.loads(result.read_text())
    assert outcome["kind"] == "rejected"
    rebuilt = launcher._rebuild_rejection(outcome["error"], outcome["payload"])
    assert type(rebuilt) is type(error) and isinstance(rebuilt, Rejection)
    assert rebuilt.to_json() == error.to_json()  # code, message and the place (line, field or file)
    assert f"rank 0: {type(error).__name__}" in capsys.readouterr().err


def test_a_crash_on_rank_0_is_an_error_outcome_and_other_ranks_write_nothing(tmp_path):
    result = tmp_path / "result.json"
    assert worker._report(World(rank=1, size=2), str(result), RuntimeError("boom")) == 1
    assert not result.exists()  # only rank 0 speaks for the run
    assert worker._report(World(rank=0, size=2), str(result), RuntimeError("boom")) == 1
    assert json.loads(result.read_text()) == {"kind": "error", "message": "RuntimeError: boom"}


def test_progress_is_relayed_line_by_line_and_a_half_written_line_waits(tmp_path):
    progress = tmp_path / "progress.jsonl"
    write = worker._progress_writer(str(progress))
    write(1, 4, 2.5)
    write(2, 4, 2.25)
    with progress.open("a") as handle:
        handle.write('{"step": 3, "tot')  # rank 0 is still writing this one
    seen: list[tuple[int, int, float]] = []
    count = launcher._relay_progress(progress, 0, lambda *step: seen.append(step))
    assert (count, seen) == (2, [(1, 4, 2.5), (2, 4, 2.25)])
    with progress.open("a") as handle:
        handle.write('al": 4, "loss": 2.0}\n')
    assert launcher._relay_progress(progress, count, lambda *step: seen.append(step)) == 3
    assert seen[-1] == (3, 4, 2.0)


def test_the_launch_command_runs_this_python_under_torchrun():
    command = launcher.torchrun_command(2, ["--job", "job.json"])
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[command.index("--nproc-per-node") + 1] == "2"
    assert command[-4:] == ["-m", launcher.WORKER_MODULE, "--job", "job.json"]
    with pytest.raises(ValueError, match="two or more processes"):
        launcher.launch(None, 1)


def test_a_multi_node_request_is_checked_before_any_job_is_made(tmp_path, tiny_student):
    from kiln_core.synthetic import synthesize_corpus

    synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=2, top_k=16, seed=8)
    (tmp_path / "manifest.jsonl").write_text((tmp_path / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "manifest.jsonl",
                                   "config": {"training_mode": "off_policy", "top_k": 16, "learnign_rate": 1e-3}}))
    with pytest.raises(Rejection) as caught:
        spec_from_request(str(request), adapter="demo", student_dir=str(tiny_student), out_root=str(tmp_path), nproc=2)
    assert caught.value.code == "invalid_request" and "learnign_rate" in str(caught.value)

    run = spec_from_request(str(request), adapter="demo", student_dir=str(tiny_student), out_root=str(tmp_path),
                            nproc=2, kiln_lenient=True)
    assert len(run.warnings) == 1 and "learnign_rate" in run.warnings[0]
    job = run.job(device="cpu")  # admitted and planned for two ranks; the plan carries the ignored key to the receipt
    assert (job.plan.settings.world_size, job.plan.ignored_request_keys) == (2, ("config.learnign_rate",))
    assert launcher.DistributedJob.model_validate_json(job.model_dump_json()) == job


def test_a_rank_refuses_a_job_planned_for_another_world_size(tmp_path, tiny_student):
    from kiln_core.synthetic import synthesize_corpus

    synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=2, top_k=16, seed=8)
    (tmp_path / "manifest.jsonl").write_text((tmp_path / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "manifest.jsonl",
                                   "config": {"training_mode": "off_policy", "top_k": 16}}))
    job = spec_from_request(str(request), adapter="demo", student_dir=str(tiny_student), out_root=str(tmp_path),
                            nproc=4).job(device="cpu")
    with pytest.raises(ConfigError) as caught:
        worker.check_world(job, World(rank=0, size=2))
    assert (caught.value.code, caught.value.field) == ("unsupported", "nproc")
    assert "planned for 4 ranks but torchrun started 2" in caught.value.message
    worker.check_world(job, World(rank=3, size=4))
