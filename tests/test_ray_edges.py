"""The edges of a Ray run that need no Ray worker: the spec's ``distributed`` block with ``engine: ray``, the CLI
flags, and every bad input refused before training — Ray not installed, fsdp on CPU, a cluster too small,
an unreachable address (an environment failure, exit 3, in bounded time), a local storage root with a
cluster address — plus the driver's mailbox and how rank 0's outcome is read back.

What a user depends on: each refusal names its rule (a stable code) and the place (field), exits 2 (3 for
an unreachable cluster) and leaves nothing half-written; a torchrun spec, plan and receipt read exactly
as before Ray existed. The runs themselves are in ``test_ray.py``.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.contracts.spec_blocks import DistributedOptions, RayOptions
from kiln_core.errors import EXIT_FAILED, EXIT_REJECTED
from kiln_core.training.distributed import ray_launcher
from kiln_core.training.distributed.ray_launcher import RayFailure

BASE = {"teacher": {"kind": "local_dir", "path": "./teacher"}, "corpus": "c.jsonl", "student": "s", "adapter": "a"}


def parse(distributed: dict):
    from flows.spec import parse_spec

    return parse_spec({**BASE, "distributed": distributed})


# ---------------------------------------------------------------------------------------------
# The spec block


def test_a_ray_block_reads_with_its_defaults_and_a_torchrun_block_reads_as_before():
    spec = parse({"engine": "ray", "workers": 2})
    assert (spec.distributed.world_size, spec.distributed.ray_options()) == (2, RayOptions())
    assert RayOptions() == RayOptions(address="local", gpus_per_worker=0, max_failures=3)
    given = parse({"engine": "ray", "workers": 8, "address": "ray://head:10001", "gpus_per_worker": 1,
                   "max_failures": 0}).distributed
    assert given.ray_options() == RayOptions(address="ray://head:10001", gpus_per_worker=1, max_failures=0)
    torchrun = parse({"nproc": 4}).distributed
    assert torchrun.model_dump() == {"nproc": 4, "backend": "auto", "strategy": "ddp"}  # no Ray key appears
    assert (torchrun.world_size, torchrun.ray_options()) == (4, None)


@pytest.mark.parametrize(("block", "message"), [
    ({"engine": "ray"}, "`distributed.workers`: required for engine ray"),
    ({"engine": "ray", "workers": 2, "nproc": 2}, "`distributed.nproc`: engine ray counts ranks with `workers`"),
    ({"workers": 2}, "`distributed.workers`: only for engine ray"),
    ({"nproc": 2, "address": "auto"}, "`distributed.address`: only for engine ray"),
    ({"engine": "ray", "workers": 2, "strategy": "fsdp"},
     "`distributed.strategy`: fsdp shards the student across GPUs and is refused on CPU"),
    ({"engine": "ray", "workers": 1, "gpus_per_worker": 1, "strategy": "fsdp"},
     "`distributed.strategy`: fsdp shards the student across two or more ranks; with one there is nothing to shard"),
    ({"engine": "ray", "workers": 2, "backend": "nccl"}, "`distributed.backend`: nccl needs GPUs"),
    ({"engine": "ray", "workers": 2, "address": "http://head:8265"}, "must be local, auto, ray://host:port"),
    ({"engine": "ray", "workers": 2, "address": "ray://user:secret@head:10001"}, "credentials do not go in the address"),
    ({"engine": "ray", "workers": 2, "address": "ray://:10001"}, "names no host"),
    ({"engine": "ray", "workers": 0}, "distributed.workers"),
    ({"engine": "ray", "workers": 2, "max_failures": -1}, "distributed.max_failures"),
    ({"engine": "spark", "workers": 2}, "distributed.engine"),
], ids=lambda value: json.dumps(value) if isinstance(value, dict) else "")
def test_a_bad_ray_block_is_refused_naming_the_field(block, message):
    from flows.spec import SpecError

    with pytest.raises(SpecError) as caught:
        parse(block)
    assert message in caught.value.message
    assert "secret" not in caught.value.message


def test_on_policy_and_the_held_out_watch_stay_off_ray():
    from flows.spec import SpecError, parse_spec

    with pytest.raises(SpecError, match="`eval`: held-out evaluation during training runs in a single process"):
        parse_spec({**BASE, "distributed": {"engine": "ray", "workers": 1},
                    "eval": {"corpus": "held.jsonl", "every_steps": 2}})
    prompts = {**BASE, "corpus": None, "prompts": "p.jsonl", "config": {"training_mode": "on_policy"}}
    with pytest.raises(SpecError, match="`distributed.engine`: on-policy training runs in one process, not on Ray"):
        parse_spec({**prompts, "distributed": {"engine": "ray", "workers": 1}})


def test_the_plan_carries_the_ray_block_and_a_torchrun_plan_reads_as_before():
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.contracts.stage_refs import TrainPlan

    config = OpdConfig(training_mode="off_policy", top_k=16, seed=3)
    torchrun = TrainPlan.for_config(config, "runs/demo/k1", "demo", nproc=2)
    assert "ray" not in json.loads(torchrun.model_dump_json())
    on_ray = TrainPlan.for_config(config, "runs/demo/k1", "demo", nproc=2, ray=RayOptions(address="auto", max_failures=1))
    assert TrainPlan.model_validate_json(on_ray.model_dump_json()) == on_ray
    assert json.loads(on_ray.model_dump_json())["ray"] == {"address": "auto", "gpus_per_worker": 0, "max_failures": 1}


def test_a_torchrun_receipt_block_has_no_ray_fields():
    from kiln_core.contracts.receipt import DistributedReceipt

    common = dict(world_size=2, backend="gloo", strategy="ddp", sequences_per_step_per_rank=1, sequences_per_optimizer_step=2)
    assert DistributedReceipt(**common).model_dump() == common
    on_ray = DistributedReceipt(**common, engine="ray", ray_version="2.60.0", address="ray://head:10001").model_dump()
    assert on_ray == {**common, "engine": "ray", "ray_version": "2.60.0", "address": "ray://head:10001"}


# ---------------------------------------------------------------------------------------------
# The CLI flags (refused before any admission)


@pytest.fixture
def request_file(tmp_path):
    (tmp_path / "manifest.jsonl").write_text("{}\n")
    (tmp_path / "request.json").write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "manifest.jsonl",
                                                       "config": {"training_mode": "off_policy", "top_k": 16}}))
    return tmp_path / "request.json"


@pytest.mark.parametrize(("argv", "field", "message"), [
    (["--workers", "2"], "distributed.workers", "--workers needs --ray ADDRESS"),
    (["--max-failures", "1"], "distributed.max_failures", "--max-failures needs --ray ADDRESS"),
    (["--ray", "local", "--workers", "2", "--nproc", "2"], "nproc", "--nproc 2 and --ray do not go together"),
    (["--ray", "ray://u:p@head:10001", "--workers", "2"], None, "credentials do not go in the address"),
])
def test_ray_flags_that_do_not_fit_are_refused_before_anything_runs(argv, field, message, request_file, tmp_path, capsys):
    from flows.cli import main

    code = main(["train", "--request", str(request_file), "--adapter", "demo", "--student", str(tmp_path / "student"),
                 "--out", str(tmp_path / "out"), "--json", *argv])
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == EXIT_REJECTED and message in error["message"], error
    if field is not None:
        assert error["field"] == field
    assert not (tmp_path / "out" / "runs").exists()


def test_the_resume_command_of_a_ray_run_repeats_its_ray_flags():
    from flows.commands.train import add_arguments, resume_command
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--request", "r.json", "--adapter", "demo", "--student", "s", "--ray", "auto",
                              "--workers", "4", "--gpus-per-worker", "0.5", "--max-failures", "2"])
    command = resume_command(args, "demo-checkpoint-step-00000002.kiln-checkpoint")
    assert "--ray auto --workers 4 --gpus-per-worker 0.5 --max-failures 2 --resume-checkpoint" in command


# ---------------------------------------------------------------------------------------------
# Refusals of the launcher


def test_ray_not_installed_is_a_rejection_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ConfigError) as caught:
        ray_launcher.import_ray()
    assert caught.value.code == "ray_package_missing" and caught.value.exit_code == EXIT_REJECTED
    assert "pip install 'kiln-flows[ray]'" in caught.value.message and caught.value.field == "distributed.engine"


def test_the_engine_refuses_a_ray_plan_without_ray_before_anything_else(monkeypatch, tmp_path):
    from kiln_core.engine import training

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError) as caught:
        training._launch_on_ray(None, None, None, str(tmp_path), None, lambda: False)  # nothing else is looked at
    assert caught.value.code == "ray_package_missing"


def test_a_cluster_too_small_is_refused_naming_the_numbers():
    ray_launcher.check_capacity({"CPU": 8.0, "GPU": 4.0}, 4, 1)  # fits
    with pytest.raises(ConfigError) as caught:
        ray_launcher.check_capacity({"CPU": 2.0}, 3, 0)
    assert (caught.value.code, caught.value.field) == ("ray_cluster_too_small", "distributed.workers")
    assert "3 Ray workers need 3 CPUs, but the cluster has 2" in caught.value.message
    with pytest.raises(ConfigError) as caught:
        ray_launcher.check_capacity({"CPU": 16.0, "GPU": 4.0}, 8, 1)
    assert caught.value.field == "distributed.gpus_per_worker"
    assert "need 8 GPUs, but the cluster has 4" in caught.value.message


@pytest.mark.parametrize("address", ["auto", "ray://head:10001", "10.0.0.5:6379"])
def test_a_local_storage_root_with_a_cluster_address_is_refused(address):
    options = RayOptions(address=address)
    ray_launcher.check_cluster_storage(options, "s3://bucket/kiln/corpus", "gs://bucket/kiln/runs/demo/k1")
    for local in ("/data/kiln/runs/demo/k1", "file:///data/kiln", "kiln-data/runs"):
        with pytest.raises(ConfigError) as caught:
            ray_launcher.check_cluster_storage(options, "s3://bucket/corpus", local)
        assert caught.value.code == "unshared_storage" and caught.value.field == "storage_root"
        assert address in caught.value.message and "shared by every node" in caught.value.message
    ray_launcher.check_cluster_storage(RayOptions(address="local"), "/data/kiln/corpus", "/data/kiln/runs")
    with pytest.raises(ConfigError, match="per-process memory"):
        ray_launcher.check_cluster_storage(RayOptions(address="local"), "memory://kiln/runs")


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("form", ["ray://127.0.0.1:{port}", "127.0.0.1:{port}", "RAY_ADDRESS"])
def test_an_unreachable_cluster_is_an_environment_failure_in_bounded_time(form, monkeypatch):
    address = form.format(port=_closed_port())
    if form == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
        address = "auto"
    import ray

    started = time.monotonic()
    with pytest.raises(RayFailure) as caught:
        with ray_launcher.ray_session(RayOptions(address=address), 1, timeout=5):
            pytest.fail("connected to a closed port")
    assert time.monotonic() - started < 60
    assert caught.value.code == "ray_cluster_unreachable" and caught.value.exit_code == EXIT_FAILED
    assert caught.value.retryable and "no Ray cluster answers at" in caught.value.message
    assert not ray.is_initialized()


def test_a_refused_connection_is_an_environment_failure(monkeypatch):
    class Refusing:
        def init(self, **_):
            raise ConnectionError("Could not find any running Ray instance")

    with pytest.raises(RayFailure) as caught:
        ray_launcher._init(Refusing(), {"address": "auto"}, "auto")
    assert caught.value.code == "ray_cluster_unreachable" and "Could not find any running Ray instance" in caught.value.message


# ---------------------------------------------------------------------------------------------
# Between the driver and rank 0


def test_the_mailbox_counts_attempts_and_hands_progress_over_once():
    box = ray_launcher._Mailbox()
    assert [box.start_attempt(), box.start_attempt()] == [0, 1]
    box.progress(1, 4, 2.5)
    box.progress(2, 4, 2.25)
    assert box.take_progress() == [(1, 4, 2.5), (2, 4, 2.25)] and box.take_progress() == []
    assert not box.cancelled()
    box.request_cancel()
    assert box.cancelled() and box.outcome() is None


def test_rank_0s_rejection_reaches_the_driver_as_the_same_rejection_and_a_crash_as_a_failure():
    from kiln_core.training.checkpoint import ResumeError

    error = ResumeError("resume_world_size", "the checkpoint was written by world size 1")
    with pytest.raises(ResumeError) as caught:
        ray_launcher._outcome_result({"kind": "rejected", "error": "ResumeError", "payload": error.to_json()})
    assert caught.value.to_json() == error.to_json()
    with pytest.raises(RayFailure, match="rank 0 failed: RuntimeError: boom") as failed:
        ray_launcher._outcome_result({"kind": "error", "message": "RuntimeError: boom"})
    assert failed.value.code == "ray_run_failed"


def test_importing_the_engine_and_the_cli_does_not_import_ray():
    import subprocess

    code = ("import sys, flows.cli, flows.commands.train, kiln_core.engine.training, "
            "kiln_core.training.distributed.ray_launcher, kiln_core.training.distributed.ray_worker; print(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


# --- the worker's resume point (no Ray needed: one process is a World of one) ------------------------------


def test_a_restarted_worker_group_resumes_from_the_newest_committed_checkpoint(tiny_student, tmp_path):
    """Attempt 0 keeps the plan's resume point; a group Ray restarted takes the newest checkpoint whose
    manifest is committed, and none when there is none."""
    from kiln_core.contracts.checkpoint import MANIFEST_FILE
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan
    from kiln_core.synthetic import synthetic_identity
    from kiln_core.training.checkpoint import checkpoint_basename
    from kiln_core.training.distributed.launcher import DistributedJob
    from kiln_core.training.distributed.ray_worker import _resume_point
    from kiln_core.training.distributed.world import World

    run_dir = tmp_path / "run"
    plan = TrainPlan.for_config(OpdConfig.model_validate({"training_mode": "off_policy", "top_k": 16}), str(run_dir),
                                "demo")
    identity = synthetic_identity(tiny_student)
    corpus = CorpusRef(uri=str(tmp_path / "corpora" / "ab"), dataset_sha256="sha256:" + "0" * 64, source_uri="c.jsonl",
                       examples=4, action_tokens=8, env_tokens=0, effective_top_k=16, teacher_identity_revision=None)
    manifest = ManifestRef(manifest_line=build_manifest_line(identity), identity_revision="r", teacher="t",
                           source="manifest_file")
    job = DistributedJob(plan=plan, corpus=corpus, manifest=manifest, student_dir="student")
    world = World()

    assert _resume_point(job, world, attempt=1).plan.resume == plan.resume  # nothing committed yet
    for step, committed in ((2, True), (4, True), (6, False)):  # step 6: written, its manifest not yet
        directory = run_dir / checkpoint_basename("demo", step)
        directory.mkdir(parents=True)
        if committed:
            (directory / MANIFEST_FILE).write_text("{}")
    assert _resume_point(job, world, attempt=0).plan.resume == plan.resume
    assert _resume_point(job, world, attempt=1).plan.resume == checkpoint_basename("demo", 4)
    assert _resume_point(job, world, attempt=3).plan.resume == checkpoint_basename("demo", 4)
