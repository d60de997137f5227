"""The edges of a ``torchrun`` run that need no second process: what a rank says when it cannot start, how
a rejection crosses from rank 0 back to the launching process with its code, how progress lines are
relayed, and how a multi-node ``--request`` is refused before any launch.

What a user depends on: a rejected run launched with ``--nproc 2`` reads exactly as a one-process
rejection (same error class, code, line or file, exit 2); a rank started with the wrong arguments
exits 2 with one line; progress never reports a half-written line. The runs themselves are in
``test_distributed.py``.
"""

from __future__ import annotations

import json
import sys

import pytest

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.engine import worker
from kiln_core.engine.run_request import PreparedRequest, prepare_train_request
from kiln_core.errors import AdmissionError, Rejection
from kiln_core.training.checkpoint import CheckpointError, ResumeError
from kiln_core.training.distributed import launcher
from kiln_core.training.distributed.world import World


@pytest.mark.parametrize("argv", [[], ["--job", "job.json", "--request", "request.json"]])
def test_a_rank_needs_exactly_one_of_job_or_request(argv, capsys):
    assert worker.main(argv) == 2
    assert "give exactly one of --job or --request" in capsys.readouterr().err


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


def test_a_multi_node_request_is_checked_before_any_launch(tmp_path, tiny_student):
    from kiln_core.synthetic import synthesize_corpus

    synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=2, top_k=16, seed=8)
    (tmp_path / "manifest.jsonl").write_text((tmp_path / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "manifest.jsonl",
                                   "config": {"training_mode": "off_policy", "top_k": 16, "learnign_rate": 1e-3}}))
    with pytest.raises(Rejection) as caught:
        prepare_train_request(str(request), adapter="demo", student_dir=str(tiny_student), out_root=str(tmp_path))
    assert caught.value.code == "invalid_request" and "learnign_rate" in str(caught.value)

    warnings: list[str] = []
    prepared = prepare_train_request(str(request), adapter="demo", student_dir=str(tiny_student),
                                     out_root=str(tmp_path), kiln_lenient=True, on_warning=warnings.append)
    assert prepared == PreparedRequest(str(request), "demo", str(tiny_student), str(tmp_path), None, True)
    assert len(warnings) == 1 and "learnign_rate" in warnings[0]
