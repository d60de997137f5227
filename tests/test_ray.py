"""Training on a Ray cluster (a local Ray instance, CPU workers, gloo): the same run as torchrun and one process.

What a user depends on: ``kiln-flows train --ray local --workers 2`` trains the adapter ``--nproc 2`` trains,
byte for byte (same ranks, same hand-made gloo all-reduce, same rank-0 publishing), in the same run
directory name (the world size, not the engine, is part of the run key); ``--workers 1`` trains the
one-process adapter; the receipt says Ray, its version, the world size and the address; a worker killed
after a committed checkpoint makes Ray restart the group, which resumes from that checkpoint and ends
with the uninterrupted adapter; a run the cluster cannot place is refused before training.

Cost: each Ray worker group starts two interpreters that import torch and transformers (20-60 s on a busy
2-core runner) and a local Ray start takes a few seconds more, so one Ray instance serves the module's
runs after the first test (which starts and stops its own, as ``--ray local`` does). Every test leaves
Ray shut down (the ``ray_instance`` fixture and the first test check it).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import ray  # a missing Ray fails the module (CI installs .[test], which includes kiln-flows[ray])

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

EPOCHS = 25
STEPS = 8 * EPOCHS // 2  # two ranks, one candidate each per step


@pytest.fixture(scope="module")
def request_dir(tmp_path_factory, tiny_student) -> Path:
    """8 examples × 25 epochs, 2 per optimizer step with two ranks → 100 steps (long enough for a worker to be
    killed part-way), a checkpoint every 2."""
    from kiln_core.synthetic import synthesize_corpus

    directory = tmp_path_factory.mktemp("ray-request")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=8, top_k=16, seed=0)
    (directory / "teacher-manifest.jsonl").write_text((directory / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    config = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
              "learning_rate": 0.02, "checkpoint_interval": 2, "epochs": EPOCHS}
    (directory / "request.json").write_text(json.dumps({"dataset_path": "corpus.jsonl",
                                                        "teacher": "teacher-manifest.jsonl", "config": config}))
    return directory


def cli(capsys, request_dir: Path, student: Path, out: Path, *argv: str) -> tuple[int, dict]:
    from flows.cli import main

    code = main(["train", "--request", str(request_dir / "request.json"), "--student", str(student),
                 "--out", str(out), "--adapter", "demo", "--json", *argv])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1])


def adapter_bytes(result: dict) -> bytes:
    return (Path(result["adapter"]) / "adapter_model.safetensors").read_bytes()


def receipt(result: dict) -> dict:
    return json.loads(Path(result["receipt"]).read_text())


def test_one_worker_on_a_local_ray_trains_the_one_process_adapter(request_dir, tiny_student, tmp_path, capsys):
    assert not ray.is_initialized()
    code, on_ray = cli(capsys, request_dir, tiny_student, tmp_path / "ray", "--ray", "local", "--workers", "1")
    assert code == 0, on_ray
    assert not ray.is_initialized()  # `local` started Ray for the run and stopped it after
    code, here = cli(capsys, request_dir, tiny_student, tmp_path / "here")
    assert code == 0, here
    assert Path(on_ray["run"]).name == Path(here["run"]).name  # one worker is the one-process run
    assert adapter_bytes(on_ray) == adapter_bytes(here)
    assert on_ray["latest_checkpoint"] == here["latest_checkpoint"]
    assert receipt(on_ray)["distributed"] == {
        "world_size": 1, "backend": None, "strategy": "ddp", "sequences_per_step_per_rank": 1,
        "sequences_per_optimizer_step": 1, "engine": "ray", "ray_version": ray.__version__, "address": "local"}
    assert "distributed" not in receipt(here)


@pytest.fixture(scope="module")
def two_workers(ray_instance, request_dir, tiny_student, tmp_path_factory) -> dict:
    """An uninterrupted 2-worker Ray run through the CLI (the reference of the failure test)."""
    from flows.cli import main

    out = tmp_path_factory.mktemp("ray-two")
    argv = ["train", "--request", str(request_dir / "request.json"), "--student", str(tiny_student), "--out", str(out),
            "--adapter", "demo", "--json", "--ray", "local", "--workers", "2"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    result = json.loads(stdout.getvalue().strip().splitlines()[-1])
    assert code == 0, result
    return result


def test_two_ray_workers_train_the_torchrun_adapter_byte_for_byte(two_workers, request_dir, tiny_student, tmp_path,
                                                                   capsys):
    code, torchrun = cli(capsys, request_dir, tiny_student, tmp_path / "torchrun", "--nproc", "2")
    assert code == 0, torchrun
    assert Path(two_workers["run"]).name == Path(torchrun["run"]).name  # the world size decides the run, not the engine
    assert adapter_bytes(two_workers) == adapter_bytes(torchrun)
    assert two_workers["steps"] == torchrun["steps"] == STEPS
    assert two_workers["latest_checkpoint"] == torchrun["latest_checkpoint"] is not None
    on_ray, on_torchrun = receipt(two_workers), receipt(torchrun)
    assert on_ray["loss_history"] == on_torchrun["loss_history"]
    assert on_torchrun["distributed"] == {"world_size": 2, "backend": "gloo", "strategy": "ddp",
                                          "sequences_per_step_per_rank": 1, "sequences_per_optimizer_step": 2}
    assert on_ray["distributed"] == {**on_torchrun["distributed"], "engine": "ray", "ray_version": ray.__version__,
                                     "address": "local"}


def ray_train_workers() -> list:
    """The processes of Ray Train's workers (Ray titles them ``ray::RayTrainWorker…``), children of this
    process's local Ray instance."""
    import psutil

    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            pass
    return found


def test_a_killed_worker_is_restarted_by_ray_and_the_run_ends_with_the_uninterrupted_adapter(
        two_workers, request_dir, tiny_student, tmp_path):
    import signal

    from kiln_core.contracts.spec_blocks import RayOptions
    from kiln_core.engine import spec_from_request
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import latest_checkpoint
    from kiln_core.training.distributed.ray_launcher import launch_on_ray

    job = spec_from_request(str(request_dir / "request.json"), adapter="demo", student_dir=str(tiny_student),
                            out_root=str(tmp_path), nproc=2).job(device="cpu")
    killed: list[int] = []

    def kill_a_worker_once(step: int, total: int, loss: float) -> None:
        """Once a checkpoint is committed, SIGKILL one worker process, as an OOM killer or a lost node would.

        Rank 0 reports a step before that step's checkpoint is written, so the step number alone does not say a
        checkpoint is committed (CI once killed rank 0 while it wrote its first one): the run directory does.
        """
        if not killed and latest_checkpoint(resolve(job.plan.run_uri), job.plan.adapter) is not None:
            victims = ray_train_workers()
            assert len(victims) == 2, victims
            victims[-1].send_signal(signal.SIGKILL)
            killed.append(step)

    result = launch_on_ray(job, RayOptions(address="local", max_failures=1), on_progress=kill_a_worker_once)
    assert killed and killed[0] < result.total_steps, "the run ended before a worker could be killed"
    assert result.status == "success" and result.steps == result.total_steps == STEPS
    assert result.resumed_from is not None  # the group Ray restarted resumed from a committed checkpoint
    assert int(re.search(r"-step-(\d{8})\.", result.resumed_from).group(1)) >= 2
    restarted = (Path(result.adapter) / "adapter_model.safetensors").read_bytes()
    assert restarted == adapter_bytes(two_workers)
    assert json.loads(Path(result.receipt).read_text())["loss_history"] == receipt(two_workers)["loss_history"]


def test_more_workers_than_the_cluster_has_cpus_is_refused_before_training(ray_instance, request_dir, tiny_student,
                                                                           tmp_path, capsys):
    code, rejected = cli(capsys, request_dir, tiny_student, tmp_path, "--ray", "local", "--workers", "64")
    assert code == 2 and rejected["code"] == "ray_cluster_too_small"
    assert "64 Ray workers need 64 CPUs" in rejected["message"] and "the cluster has 2" in rejected["message"]
    assert rejected["field"] == "distributed.workers"
    assert not list(tmp_path.rglob("*.kiln-checkpoint")) and not list(tmp_path.rglob("adapter"))  # nothing trained


def test_a_cancelled_ray_run_stops_every_worker_at_a_step_boundary_after_a_checkpoint(ray_instance, request_dir,
                                                                                      tiny_student, tmp_path):
    from kiln_core.contracts.spec_blocks import RayOptions
    from kiln_core.engine import spec_from_request
    from kiln_core.training.checkpoint import latest_checkpoint
    from kiln_core.training.distributed.ray_launcher import launch_on_ray

    request = json.loads((request_dir / "request.json").read_text())
    request["config"]["epochs"] = 4 * EPOCHS  # 400 steps: far more than pass before the cancel reaches rank 0
    (tmp_path / "request.json").write_text(json.dumps({**request, "dataset_path": str(request_dir / "corpus.jsonl"),
                                                       "teacher": str(request_dir / "teacher-manifest.jsonl")}))
    job = spec_from_request(str(tmp_path / "request.json"), adapter="demo", student_dir=str(tiny_student),
                            out_root=str(tmp_path / "out"), nproc=2).job(device="cpu")
    seen: list[int] = []
    result = launch_on_ray(job, RayOptions(), on_progress=lambda step, total, loss: seen.append(step),
                           should_cancel=lambda: bool(seen))  # Prefect's "the flow run is cancelling", here
    assert result.status == "cancelled" and result.failure_reason == "cancelled"
    assert 1 <= result.steps < result.total_steps == 4 * STEPS
    assert seen == list(range(1, result.steps + 1))  # rank 0's progress lines all reached the driver, in order
    assert result.latest_checkpoint == latest_checkpoint(job.plan.run_uri, "demo") == (
        f"demo-checkpoint-step-{result.steps:08d}.kiln-checkpoint")


class TerminationSignal(BaseException):
    """The test's own stand-in for Prefect's: in a worker's run, SIGTERM raises a ``BaseException``."""


def test_a_ray_driver_stopped_by_a_signal_still_stops_its_ranks_after_a_checkpoint(ray_instance, request_dir,
                                                                                  tiny_student, tmp_path):
    """A worker cancelling a Ray run: the driver's termination signal reaches the ranks as a cancel, so
    rank 0 publishes a checkpoint and a ``cancelled`` receipt before the driver's exception goes on."""
    from kiln_core.contracts.spec_blocks import RayOptions
    from kiln_core.engine import spec_from_request
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import latest_checkpoint
    from kiln_core.training.distributed.ray_launcher import launch_on_ray

    request = json.loads((request_dir / "request.json").read_text())
    request["config"]["epochs"] = 4 * EPOCHS
    (tmp_path / "request.json").write_text(json.dumps({**request, "dataset_path": str(request_dir / "corpus.jsonl"),
                                                       "teacher": str(request_dir / "teacher-manifest.jsonl")}))
    job = spec_from_request(str(tmp_path / "request.json"), adapter="demo", student_dir=str(tiny_student),
                            out_root=str(tmp_path / "out"), nproc=2).job(device="cpu")

    def progress(step, total, loss):
        raise TerminationSignal("SIGTERM")

    with pytest.raises(TerminationSignal):
        launch_on_ray(job, RayOptions(), on_progress=progress)
    receipt = json.loads(resolve(job.plan.run_uri).child("train_receipt.json").read_text())
    assert (receipt["status"], receipt["failure_reason"]) == ("failed", "cancelled")
    assert latest_checkpoint(job.plan.run_uri, "demo") is not None
