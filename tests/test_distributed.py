"""Data-parallel training on torch.distributed (CPU, gloo, 2 ranks under torchrun).

Tolerances: a 2-rank run sums two per-rank gradients, which is the same single fp32 addition the
one-process ``sequences_per_step=2`` accumulation does, so on CPU the results are in fact bit-identical;
the comparison with one process is nevertheless stated as a tolerance (adapter tensors ``atol=1e-6,
rtol=0``; losses ``rtol=1e-5``), which is what data parallelism promises in general (W > 2 may sum in
another order). Interrupted-and-resumed 2-rank runs are compared with an uninterrupted 2-rank run
byte for byte (DESIGN.md decision 8).

Each torchrun launch costs ~10-15 s on a busy 2-core runner (two interpreters importing torch and
transformers), so the file launches five times in all and does everything else in process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kiln_core.storage import resolve
from kiln_core.training.checkpoint import ResumeError, latest_checkpoint
from kiln_core.training.trainer import train_opd
from plan_support import train_plan
from test_trainer import ADAPTER, DATASET_SHA, Crash, crash_after, make_config, synthetic_tables, table_arrays

LAUNCH_TIMEOUT = 300
# 5 examples × 3 epochs = 15 candidates, 2 per step → 8 steps: groups that span an epoch boundary and a last
# group of one candidate (rank 1 idle); checkpoints after steps 2, 4 and 6.
CONFIG = make_config(epochs=3, checkpoint_interval=2)
EXAMPLES = 5


def tables():
    return synthetic_tables(n=EXAMPLES)


DRIVER = """
import json, sys
import numpy as np, torch
torch.set_num_threads(1)
from kiln_core.contracts.stage_refs import TrainPlan
from kiln_core.corpus import CorpusTables
from kiln_core.training.checkpoint import ResumeError
from kiln_core.training.distributed.world import init_world, shutdown_world
from kiln_core.training.trainer import train_opd

args = json.loads(sys.argv[1])


def crash(step):
    if step == args.get("fail_at_step"):
        raise RuntimeError(f"simulated crash after step {step}")


world = init_world("gloo", "cpu")
data = np.load(args["tables"])
try:
    result = train_opd(
        TrainPlan.model_validate_json(args["plan"]), CorpusTables(**{k: data[k] for k in data.files}),
        dataset_sha256=args["sha"], dataset_path="corpus.jsonl", student_dir=args["student"],
        teacher_alias="tiny-teacher", on_step_committed=crash, world=world)
except ResumeError as error:
    print("REJECTED", json.dumps(error.to_json()), flush=True)
    sys.exit(2)
finally:
    shutdown_world()
if world.is_main:
    print("RESULT", result.model_dump_json(), flush=True)
"""


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The driver script and the synthetic corpus, shared by every launch."""
    directory = tmp_path_factory.mktemp("distributed")
    (directory / "driver.py").write_text(DRIVER)
    corpus = tables()
    np.savez(directory / "tables.npz", **table_arrays(corpus))
    return directory


def torchrun(workdir: Path, student: Path, root: Path, nproc: int = 2, resume: str | None = None,
             **extra) -> tuple[int, dict | None, str]:
    """Launch the driver on ``nproc`` gloo ranks; returns (exit status, rank 0's RESULT/REJECTED JSON, stderr)."""
    plan = train_plan(CONFIG, str(root), ADAPTER, resume_checkpoint=resume, nproc=nproc)
    args = {"tables": str(workdir / "tables.npz"), "sha": DATASET_SHA, "student": str(student),
            "plan": plan.model_dump_json(), **extra}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(nproc), str(workdir / "driver.py"), json.dumps(args)]
    proc = subprocess.run(command, cwd=Path(__file__).parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    payload = None
    for line in proc.stdout.splitlines():
        if line.startswith(("RESULT ", "REJECTED ")):
            payload = json.loads(line.split(" ", 1)[1])
    return proc.returncode, payload, proc.stderr


def adapter_bytes(root: Path) -> bytes:
    return (root / "adapter" / "adapter_model.safetensors").read_bytes()


def receipt(root: Path) -> dict:
    return json.loads((root / "train_receipt.json").read_text())


@pytest.fixture(scope="module")
def two_rank_run(workdir, tiny_student) -> tuple[Path, dict]:
    """An uninterrupted 2-rank run (the reference for tests a and b)."""
    root = workdir / "two-ranks"
    code, result, stderr = torchrun(workdir, tiny_student, root)
    assert code == 0 and result is not None, stderr[-4000:]
    return root, result


# ---------------------------------------------------------------------------------------------


def test_two_ranks_match_one_process_with_two_sequences_per_step(two_rank_run, tiny_student, tmp_path):
    root, result = two_rank_run
    assert result["status"] == "success" and result["world_size"] == 2
    assert result["steps"] == result["total_steps"] == 8  # 15 candidates, 2 per optimizer step
    single = train_opd(train_plan(CONFIG.model_copy(update={"sequences_per_step": 2}), str(tmp_path), ADAPTER),
                       tables(), dataset_sha256=DATASET_SHA, dataset_path="corpus.jsonl",
                       student_dir=str(tiny_student), teacher_alias="tiny-teacher")
    assert single.total_steps == 8
    np.testing.assert_allclose(result["loss_history"], single.loss_history, rtol=1e-5, atol=0)
    distributed, reference = load_file(root / "adapter" / "adapter_model.safetensors"), load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(distributed) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(distributed[name], tensor, atol=1e-6, rtol=0)
    r2, r1 = receipt(root), receipt(tmp_path)
    assert r2["token_counts"] == r1["token_counts"]  # every candidate counted once, across both ranks
    assert [row["module"] for row in r2["lora_grad_norms"]] == [row["module"] for row in r1["lora_grad_norms"]]
    for a, b in zip(r2["lora_grad_norms"], r1["lora_grad_norms"]):
        assert a["sample_count"] == b["sample_count"] == 8
        np.testing.assert_allclose([a["min"], a["mean"], a["max"]], [b["min"], b["mean"], b["max"]], rtol=1e-5)
    assert r2["distributed"] == {"world_size": 2, "backend": "gloo", "strategy": "ddp", "sequences_per_step_per_rank": 1,
                                 "sequences_per_optimizer_step": 2}
    assert "distributed" not in r1  # a one-process receipt is unchanged
    directory = root / f"{ADAPTER}-checkpoint-step-00000002.kiln-checkpoint"
    manifest = json.loads((directory / "checkpoint_manifest.json").read_text())
    assert "distributed" not in manifest  # Kiln's manifest has no such field: the world lives in our extension file
    extension = json.loads((directory / "kiln_flows_state.json").read_text())
    assert (extension["world_size"], extension["backend"], len(extension["rank_rng"])) == (2, "gloo", 2)
    assert (manifest["progress"]["epoch_index"], manifest["progress"]["cursor_in_epoch"]) == (0, 4)
    assert manifest["progress"]["total_steps"] == 15  # Kiln counts candidates, not optimizer steps
    single = json.loads((tmp_path / f"{ADAPTER}-checkpoint-step-00000002.kiln-checkpoint" / "kiln_flows_state.json").read_text())
    assert (single["world_size"], single["sequences_per_step"]) == (1, 2)


def test_interrupted_two_rank_run_resumes_bit_exactly(two_rank_run, workdir, tiny_student):
    reference_root, reference = two_rank_run
    root = workdir / "interrupted"
    code, _, stderr = torchrun(workdir, tiny_student, root, fail_at_step=5)
    assert code != 0 and "simulated crash after step 5" in stderr
    assert latest_checkpoint(resolve(str(root)), ADAPTER) == f"{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint"
    assert receipt(root)["failure_reason"] == "training_error" and not (root / "adapter").exists()
    code, result, stderr = torchrun(workdir, tiny_student, root, resume=f"{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint")
    assert code == 0 and result["status"] == "success", stderr[-4000:]
    assert result["resumed_from"] == f"{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint"
    assert adapter_bytes(root) == adapter_bytes(reference_root)
    assert result["loss_history"] == reference["loss_history"]
    assert receipt(root)["token_counts"] == receipt(reference_root)["token_counts"]
    assert (root / f"{ADAPTER}-checkpoint-step-00000006.kiln-checkpoint" / "checkpoint_manifest.json").exists()


def test_a_different_world_size_is_refused_before_training(two_rank_run, workdir, tiny_student, tmp_path):
    # a 2-rank checkpoint resumed by one process
    root, _ = two_rank_run
    before = sorted(os.listdir(root)), receipt(root)
    with pytest.raises(ResumeError) as caught:
        train_opd(train_plan(CONFIG, str(root), ADAPTER,
                             resume_checkpoint=f"{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint"),
                  tables(), dataset_sha256=DATASET_SHA, dataset_path="corpus.jsonl",
                  student_dir=str(tiny_student), teacher_alias="tiny-teacher")
    assert caught.value.code == "resume_world_size"
    assert "world size 2" in caught.value.message and "world size 1" in caught.value.message
    assert (sorted(os.listdir(root)), receipt(root)) == before  # nothing trained, nothing written

    # a one-process checkpoint resumed by 2 ranks: every rank refuses in planning, before the model loads
    single = tmp_path / "single"
    with pytest.raises(Crash):
        train_opd(train_plan(CONFIG.model_copy(update={"sequences_per_step": 2}), str(single), ADAPTER),
                  tables(), dataset_sha256=DATASET_SHA, dataset_path="corpus.jsonl", student_dir=str(tiny_student),
                  teacher_alias="tiny-teacher", on_step_committed=crash_after(3))
    listing = sorted(os.listdir(single))
    code, rejected, stderr = torchrun(workdir, tiny_student, single, resume=f"{ADAPTER}-checkpoint-step-00000002.kiln-checkpoint")
    assert code != 0 and rejected is not None, stderr[-4000:]
    assert rejected["code"] == "resume_world_size"
    assert "world size 1" in rejected["message"] and "world size 2" in rejected["message"]
    assert sorted(os.listdir(single)) == listing


def test_an_extension_file_that_lost_a_rank_is_refused_by_the_loader(two_rank_run, tmp_path):
    import hashlib
    import shutil

    from kiln_core.training.checkpoint import CheckpointError, load_checkpoint

    root, _ = two_rank_run
    name = f"{ADAPTER}-checkpoint-step-00000002.kiln-checkpoint"
    shutil.copytree(root / name, tmp_path / name)
    assert load_checkpoint(str(tmp_path), name).world_size == 2
    extension_path = tmp_path / name / "kiln_flows_state.json"
    extension = json.loads(extension_path.read_text())
    extension["rank_rng"].pop()
    payload = json.dumps(extension, indent=2).encode()
    extension_path.write_bytes(payload)
    manifest_path = tmp_path / name / "checkpoint_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["kiln_flows_state.json"].update(size_bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    manifest_path.write_text(json.dumps(manifest, indent=2))
    with pytest.raises(CheckpointError, match="generator states of 1 ranks for a world size of 2") as caught:
        load_checkpoint(str(tmp_path), name)
    assert caught.value.code == "checkpoint_extension_invalid"


def test_shard_takes_contiguous_blocks_and_short_groups_leave_ranks_idle():
    from kiln_core.training.distributed.world import World

    assert [World(rank=r, size=2).shard(range(4, 6), 1) for r in (0, 1)] == [range(4, 5), range(5, 6)]
    assert [list(World(rank=r, size=3).shard(range(6, 11), 2)) for r in (0, 1, 2)] == [[6, 7], [8, 9], [10]]
    assert list(World(rank=1, size=2).shard(range(10, 11), 1)) == []  # the last group is one candidate short


def test_fsdp_and_nccl_on_cpu_are_refused():
    from flows.spec import SpecError, parse_spec
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.training.distributed.world import check_strategy, resolve_backend

    with pytest.raises(ConfigError, match="fsdp shards the student across GPUs and is refused on CPU") as caught:
        check_strategy("fsdp", torch.device("cpu"), 2)
    assert (caught.value.code, caught.value.field) == ("unsupported_strategy", "distributed.strategy")
    with pytest.raises(ConfigError, match="nccl backend needs CUDA"):
        resolve_backend("nccl", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "gloo" and resolve_backend("auto", torch.device("cuda")) == "nccl"
    base = {"teacher": {"kind": "local_dir", "path": "./teacher"}, "corpus": "c.jsonl", "student": "s", "adapter": "a"}
    assert parse_spec(base).distributed is None
    assert parse_spec({**base, "distributed": {"nproc": 4}}).distributed.model_dump() == {"nproc": 4, "backend": "auto", "strategy": "ddp"}
    with pytest.raises(SpecError, match="`distributed.strategy`: fsdp shards the student across two or more ranks"):
        parse_spec({**base, "distributed": {"nproc": 1, "strategy": "fsdp"}})


def test_cli_nproc_2_end_to_end(tiny_student, tmp_path, capsys):
    from flows.cli import main
    from kiln_core.synthetic import synthesize_corpus

    synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=4, top_k=16, seed=0)
    (tmp_path / "teacher-manifest.jsonl").write_text((tmp_path / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    config = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
              "learning_rate": 0.02, "checkpoint_interval": 1, "epochs": 1}
    (tmp_path / "request.json").write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl",
                                                       "config": config}))
    out = tmp_path / "out"
    base = ["train", "--request", str(tmp_path / "request.json"), "--student", str(tiny_student), "--out", str(out), "--json"]

    def cli(*argv):
        code = main([*base, *argv])
        lines = capsys.readouterr().out.strip().splitlines()
        return code, json.loads(lines[-1])

    code, result = cli("--adapter", "dist", "--nproc", "2")
    assert code == 0, result
    run_dir = Path(result["run"])
    assert run_dir.parent == out / "runs" / "dist"  # <root>/runs/<adapter>/<run key>/, the world size in the key
    assert (result["status"], result["adapter"], result["receipt"], result["latest_checkpoint"]) == (
        "success", str(run_dir / "adapter"), str(run_dir / "train_receipt.json"), "dist-checkpoint-step-00000001.kiln-checkpoint")
    r = receipt(run_dir)
    assert r["status"] == "success" and r["distributed"]["world_size"] == 2 and len(r["loss_history"]) == 2
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()

    # the 2-rank checkpoint with one process: refused (exit 2) before any training
    code, rejected = cli("--adapter", "dist", "--resume-checkpoint", "dist-checkpoint-step-00000001.kiln-checkpoint")
    assert code == 2 and rejected["code"] == "resume_world_size"
    # a one-process checkpoint with --nproc 2: refused here, before torchrun is launched
    assert cli("--adapter", "single")[0] == 0
    code, rejected = cli("--adapter", "single", "--nproc", "2", "--resume-checkpoint", "single-checkpoint-step-00000002.kiln-checkpoint")
    assert code == 2 and rejected["code"] == "resume_world_size" and "world size 1" in rejected["message"]
    code, rejected = cli("--adapter", "mem", "--nproc", "2", "--out", "memory://per-process")
    assert code == 2 and rejected["code"] == "unshared_storage"


def test_a_multi_node_job_written_by_the_cli_trains_the_nproc_adapter_under_torchrun(tiny_student, tmp_path, capsys):
    """``kiln-flows train --write-job`` (the one door, stopped after planning) then torchrun by hand with the
    worker and that job: the adapter ``--nproc 2`` trains, byte for byte; rank 0 records the request keys
    ``--kiln-lenient`` ignored. ``--write-job`` is refused with ``--ray`` and below two ranks."""
    from flows.cli import main
    from kiln_core.synthetic import synthesize_corpus
    from kiln_core.training.distributed.launcher import torchrun_command

    synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=4, top_k=16, seed=0)
    (tmp_path / "teacher-manifest.jsonl").write_text((tmp_path / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    config = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
              "learning_rate": 0.02, "checkpoint_interval": 1, "epochs": 1}
    for name, extra in (("request.json", {}), ("lenient.json", {"learnign_rate": 1.0})):
        (tmp_path / name).write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl",
                                                 "config": {**config, **extra}}))
    out = tmp_path / "out"

    def cli(request: str, *argv: str) -> tuple[int, dict]:
        code = main(["train", "--request", str(tmp_path / request), "--student", str(tiny_student), "--out", str(out),
                     "--json", *argv])
        return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    code, reference = cli("request.json", "--adapter", "dist", "--nproc", "2")
    assert code == 0, reference
    job_file = tmp_path / "jobs" / "multi.json"
    code, written = cli("lenient.json", "--adapter", "multi", "--nproc", "2", "--kiln-lenient", "--write-job", str(job_file))
    assert code == 0, written
    assert (written["job"], written["world_size"]) == (str(job_file), 2)
    assert written["command"][-4:] == ["-m", "kiln_core.training.distributed.worker", "--job", str(job_file)]
    assert not Path(written["run"]).exists()  # planned, nothing trained yet

    result_file = tmp_path / "result.json"
    done = subprocess.run(torchrun_command(2, ["--job", str(job_file), "--result", str(result_file)]),
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(result_file.read_text())["result"]["status"] == "success"
    run_dir = Path(written["run"])
    assert adapter_bytes(run_dir) == adapter_bytes(Path(reference["run"]))
    assert receipt(run_dir)["ignored_request_keys"] == ["config.learnign_rate"]

    for argv, field in ((["--nproc", "1"], "nproc"), (["--nproc", "2", "--ray", "local"], "ray")):
        code, rejected = cli("request.json", "--adapter", "refused", "--write-job", str(job_file), *argv)
        assert (code, rejected["code"], rejected["field"]) == (2, "unsupported", field)
