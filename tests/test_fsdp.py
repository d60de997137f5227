"""``strategy: fsdp``: the student's base weights sharded across the ranks (FSDP2), on CPU below the front refusal.

What a user depends on: an fsdp run trains the adapter a ddp run of the same world size trains, byte for byte
on CPU (the all-gathers reassemble the exact weights and the same kernels run on them; the LoRA stays
replicated and its gradients are all-reduced by the same hand-made collective); the base weights really are
sharded (the receipt's ``distributed.fsdp`` block: rank 0 holds half of every sharded weight with two ranks);
an fsdp run stopped after a checkpoint resumes to the same adapter, and so does a ddp checkpoint resumed under
fsdp (the strategy is not part of the run's identity); fsdp on CPU and fsdp with one rank are refused before
any training, naming ``distributed.strategy`` with code ``unsupported_strategy``.

The launches go through the real launcher and worker (``launch`` of the engine's ``DistributedJob``) with the
plan's ``device: cpu``: the training stage would refuse that job (CPU), so the tests call the launcher below
it, which is how the fsdp code path runs at all without GPUs. Cost: four 2-rank torchrun launches (~15-30 s
each on a busy 2-core runner: two interpreters importing torch and transformers); everything else is in
process and cheap.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

ADAPTER = "fsdp"
# 5 examples × 3 epochs = 15 candidates, 2 per step with two ranks → 8 steps (the last one rank idle);
# checkpoints after steps 2, 4 and 6.
CONFIG = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
          "learning_rate": 0.02, "checkpoint_interval": 2, "epochs": 3}
STEP_4 = f"{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint"


@pytest.fixture(scope="module")
def request_dir(tmp_path_factory, tiny_student) -> Path:
    from kiln_core.synthetic import synthesize_corpus

    directory = tmp_path_factory.mktemp("fsdp-request")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=5, top_k=16, seed=0)
    (directory / "teacher-manifest.jsonl").write_text((directory / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    (directory / "request.json").write_text(json.dumps({"dataset_path": "corpus.jsonl",
                                                        "teacher": "teacher-manifest.jsonl", "config": CONFIG}))
    return directory


@pytest.fixture(scope="module")
def prepared(request_dir, tiny_student, tmp_path_factory):
    """The engine's run of ``--nproc 2 --strategy fsdp --device cpu``: admitted and planned, not trained."""
    from kiln_core.engine.pipeline import prepare
    from kiln_core.engine.request import spec_from_request

    out = tmp_path_factory.mktemp("fsdp-out")
    run = spec_from_request(str(request_dir / "request.json"), adapter=ADAPTER, student_dir=str(tiny_student),
                            out_root=str(out), nproc=2, strategy="fsdp")
    return prepare(run.spec, resume=None, device="cpu")


def launch_two_ranks(prepared, run_dir: Path, strategy: str, resume: str | None = None):
    """Rank 0's ``TrainResult`` of the prepared job with ``strategy``, trained into ``run_dir`` by 2 gloo ranks."""
    from kiln_core.training.distributed.launcher import DistributedJob, launch

    settings = prepared.plan.settings.model_copy(update={"strategy": strategy})
    plan = prepared.plan.model_copy(update={"run_uri": str(run_dir), "settings": settings, "resume": resume})
    job = DistributedJob(plan=plan, corpus=prepared.corpus, manifest=prepared.manifest,
                         student_dir=prepared.student_dir)
    return launch(job, 2, forward_signals=False, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """One uninterrupted 2-rank run per strategy, on the same plan."""
    root = tmp_path_factory.mktemp("fsdp-runs")
    return {strategy: (root / strategy, launch_two_ranks(prepared, root / strategy, strategy))
            for strategy in ("ddp", "fsdp")}


def adapter_bytes(run_dir: Path) -> bytes:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


def receipt(run_dir: Path) -> dict:
    return json.loads((run_dir / "train_receipt.json").read_text())


# ---------------------------------------------------------------------------------------------


def test_the_prepared_plan_carries_the_strategy_and_the_run_key_ignores_it(prepared, request_dir, tiny_student,
                                                                          tmp_path):
    from kiln_core.engine.pipeline import prepare
    from kiln_core.engine.request import spec_from_request

    assert (prepared.plan.settings.strategy, prepared.plan.settings.world_size) == ("fsdp", 2)
    ddp = spec_from_request(str(request_dir / "request.json"), adapter=ADAPTER, student_dir=str(tiny_student),
                            out_root=str(tmp_path), nproc=2)
    assert prepare(ddp.spec, resume=None, device="cpu").plan.inputs_key == prepared.plan.inputs_key


def test_fsdp_trains_the_ddp_adapter_byte_for_byte_with_the_base_weights_sharded(runs, tiny_student):
    (ddp_dir, ddp), (fsdp_dir, fsdp) = runs["ddp"], runs["fsdp"]
    assert (fsdp.status, fsdp.world_size, fsdp.steps) == ("success", 2, 8)
    assert adapter_bytes(fsdp_dir) == adapter_bytes(ddp_dir)
    assert fsdp.loss_history == ddp.loss_history
    assert (fsdp_dir / "adapter" / "adapter_config.json").read_bytes() == (ddp_dir / "adapter" / "adapter_config.json").read_bytes()

    config = json.loads((tiny_student / "config.json").read_text())
    distributed = receipt(fsdp_dir)["distributed"]
    assert (distributed["world_size"], distributed["backend"], distributed["strategy"]) == (2, "gloo", "fsdp")
    sharding = distributed["fsdp"]
    assert sharding["sharded_modules"] == config["num_hidden_layers"] + 1  # every decoder layer + the decoder
    # rank 0 holds half of every sharded weight: the sharding happened, it is not a no-op wrapper
    assert sharding["sharded_parameters"] > 0
    assert sharding["sharded_parameters_on_rank_0"] * 2 == sharding["sharded_parameters"]
    head = config["vocab_size"] * config["hidden_size"]  # the LM head stays whole, with the LoRA
    assert head < sharding["replicated_parameters"] < sharding["sharded_parameters"]
    assert "fsdp" not in receipt(ddp_dir)["distributed"]  # a ddp receipt is unchanged

    for run_dir, strategy in ((fsdp_dir, "fsdp"), (ddp_dir, "ddp")):
        extension = json.loads((run_dir / STEP_4 / "kiln_flows_state.json").read_text())
        assert (extension["world_size"], extension["strategy"]) == (2, strategy)


def stopped_after_step_4(run_dir: Path, into: Path) -> Path:
    """What a run stopped after step 5 leaves: its checkpoints up to step 4, no adapter, no receipt."""
    into.mkdir()
    for step in (2, 4):
        name = f"{ADAPTER}-checkpoint-step-{step:08d}.kiln-checkpoint"
        shutil.copytree(run_dir / name, into / name)
    return into


def test_a_stopped_fsdp_run_resumes_under_fsdp_to_the_uninterrupted_adapter(runs, prepared, tmp_path):
    # One launch (each costs two fresh interpreters): the fsdp checkpoint's files are the ddp checkpoint's but
    # for the recorded strategy (checked above), so a ddp checkpoint resumes under fsdp by the same path.
    fsdp_dir, fsdp = runs["fsdp"]
    resumed_dir = stopped_after_step_4(fsdp_dir, tmp_path / "from-fsdp")
    resumed = launch_two_ranks(prepared, resumed_dir, "fsdp", resume=STEP_4)
    assert (resumed.status, resumed.resumed_from) == ("success", STEP_4)
    assert adapter_bytes(resumed_dir) == adapter_bytes(fsdp_dir)
    assert resumed.loss_history == fsdp.loss_history


# ---- refusals, before any training


def cli(capsys, request_dir: Path, student: Path, out: Path, *argv: str) -> tuple[int, dict]:
    from flows.cli import main

    code = main(["train", "--request", str(request_dir / "request.json"), "--student", str(student),
                 "--out", str(out), "--adapter", ADAPTER, "--json", *argv])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [
    ["--nproc", "2", "--strategy", "fsdp", "--device", "cpu"],  # torchrun: the resolved device is CPU
    ["--strategy", "fsdp"],  # one process: nothing to shard
    ["--ray", "local", "--workers", "2", "--strategy", "fsdp"],  # Ray without GPUs per worker: CPU
], ids=["torchrun-cpu", "one-process", "ray-cpu"])
def test_the_cli_refuses_fsdp_on_cpu_or_with_one_rank_with_exit_2_naming_the_field(argv, request_dir, tiny_student,
                                                                                  tmp_path, capsys):
    out = tmp_path / "out"
    code, rejected = cli(capsys, request_dir, tiny_student, out, *argv)
    assert code == 2, rejected
    assert (rejected["code"], rejected["field"]) == ("unsupported_strategy", "distributed.strategy")
    assert not list(out.glob("runs/*/*/*.kiln-checkpoint")) and not list(out.glob("runs/*/*/train_receipt.json"))


def test_the_training_stage_refuses_an_fsdp_plan_on_cpu_before_any_launch(prepared, tmp_path):
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.contracts.spec_blocks import RayOptions
    from kiln_core.engine.training import train

    run_dir = tmp_path / "run"
    plans = [prepared.plan.model_copy(update={"run_uri": str(run_dir)}),  # torchrun, device cpu
             prepared.plan.model_copy(update={"run_uri": str(run_dir), "device": None,  # Ray, 0 GPUs per worker
                                              "ray": RayOptions(gpus_per_worker=0)}),
             prepared.plan.model_copy(update={"run_uri": str(run_dir),  # one process
                                              "settings": prepared.plan.settings.model_copy(update={"world_size": 1})})]
    for plan in plans:
        with pytest.raises(ConfigError) as caught:
            train(plan, prepared.corpus, prepared.manifest, prepared.student_dir, handle_signals=False)
        assert (caught.value.code, caught.value.field) == ("unsupported_strategy", "distributed.strategy")
    assert not run_dir.exists()


def test_a_multi_node_job_refuses_fsdp_on_cpu(request_dir, tiny_student, tmp_path):
    # the job for torchrun by hand on every node (kiln-flows train --write-job --strategy fsdp) is refused as
    # the CLI's launch is
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.engine import spec_from_request

    def job(**strategy):
        return spec_from_request(str(request_dir / "request.json"), adapter=ADAPTER, student_dir=str(tiny_student),
                                 out_root=str(tmp_path), nproc=2, **strategy).job(device="cpu")

    with pytest.raises(ConfigError) as caught:
        job(strategy="fsdp")
    assert (caught.value.code, caught.value.field) == ("unsupported_strategy", "distributed.strategy")
    assert job().plan.settings.strategy == "ddp"


def test_check_strategy_accepts_fsdp_on_gpus_with_two_ranks_and_refuses_the_rest():
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.training.distributed.world import check_strategy

    assert check_strategy("fsdp", torch.device("cuda"), 2) == "fsdp"
    assert check_strategy("fsdp") == "fsdp"  # a rank checks the name only: the front checked the rest
    assert check_strategy(None, torch.device("cpu"), 1) == "ddp"
    with pytest.raises(ConfigError, match="refused on CPU"):
        check_strategy("fsdp", torch.device("cpu"), 2)
    with pytest.raises(ConfigError, match="nothing to shard"):
        check_strategy("fsdp", torch.device("cuda"), 1)
    with pytest.raises(ConfigError, match="must be ddp or fsdp") as caught:
        check_strategy("zero3")
    assert caught.value.field == "distributed.strategy"


def test_the_spec_takes_fsdp_with_several_ranks_and_refuses_it_with_one():
    from flows.spec import SpecError, parse_spec

    base = {"teacher": {"kind": "local_dir", "path": "./teacher"}, "corpus": "c.jsonl", "student": "s", "adapter": "a"}
    assert parse_spec({**base, "distributed": {"nproc": 2, "strategy": "fsdp"}}).distributed.strategy == "fsdp"
    gpus = {"engine": "ray", "workers": 2, "gpus_per_worker": 1, "strategy": "fsdp"}
    assert parse_spec({**base, "distributed": gpus}).distributed.strategy == "fsdp"
    for block in ({"nproc": 1, "strategy": "fsdp"}, {**gpus, "workers": 1}, {**gpus, "gpus_per_worker": 0}):
        with pytest.raises(SpecError) as caught:
            parse_spec({**base, "distributed": block})
        assert (caught.value.code, caught.value.field) == ("unsupported_strategy", "distributed.strategy")


def test_the_resume_command_of_an_fsdp_run_repeats_its_strategy():
    import argparse

    from flows.commands.train import add_arguments, resume_command

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--request", "r.json", "--adapter", "demo", "--student", "s", "--nproc", "4",
                              "--strategy", "fsdp"])
    command = resume_command(args, "demo-checkpoint-step-00000002.kiln-checkpoint")
    assert "--nproc 4 --backend auto --strategy fsdp --resume-checkpoint" in command
    ddp = resume_command(parser.parse_args(["--request", "r.json", "--adapter", "demo", "--student", "s"]), "c")
    assert "--strategy" not in ddp
