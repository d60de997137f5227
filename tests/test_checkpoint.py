"""Checkpoints: Kiln's layout, atomic immutable publish, loader refusals and resume identity checks (§6)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save

from kiln_core.canonical import sha256_hex
from kiln_core.storage import resolve
from kiln_core.training.checkpoint import (
    DATA_SOURCE_KIND,
    CheckpointError,
    DataBinding,
    OpdLoopState,
    Progress,
    ResumeError,
    ResumeExpectation,
    capture_rng_states,
    check_resume_basename,
    latest_checkpoint,
    load_checkpoint,
    previous_checkpoint,
    restore_rng_states,
    validate_resume,
    write_checkpoint,
)

ADAPTER = "demo"
TOTAL = 10
AUX = {"model_config_sha256": "c" * 64, "teacher_identity": None}
HYPER = {"learning_rate": 0.1, "optimizer": {"kind": "adam_w", "beta1": 0.9}}
STATS = {"examples": 10, "action_tokens": 50}


def write_sample(run_uri: str, step: int = 3, *, optimizer_kind: str = "adam_w", seed: int = 7, adapter: str = ADAPTER) -> str:
    """Publish a small, internally consistent checkpoint (no model needed)."""
    run_dir = resolve(run_uri)
    epoch, cursor = divmod(step, TOTAL)
    return write_checkpoint(
        run_dir,
        adapter_name=adapter,
        effective_config={"seed": seed, "x": 1},
        precision_policy={"device_type": "cpu", "activation_dtype": "float32"},
        progress=Progress(global_step=step, total_steps=TOTAL, epoch_index=epoch, cursor_in_epoch=cursor, data_order=list(range(TOTAL))),
        data=DataBinding(source_kind=DATA_SOURCE_KIND, content_sha256="ab" * 32, item_count=TOTAL),
        rng_states=capture_rng_states(seed),
        optimizer_kind=optimizer_kind,
        optimizer_hyperparameters=HYPER if optimizer_kind != "sgd" else {"learning_rate": 0.1, "optimizer": {"kind": "sgd"}},
        learning_rate=0.1,
        auxiliary_state=AUX,
        adapter_bytes=save({"lora.weight": torch.full((2, 3), float(step))}),
        optimizer_bytes=save({"lora.weight::exp_avg": torch.zeros(2, 3)}) if optimizer_kind != "sgd" else None,
        loop_state=OpdLoopState(
            global_step=step, epoch_index=epoch, cursor_in_epoch=cursor, loss_history=[1.5] * step, last_loss=1.5,
            data_stats=STATS, token_counts={"action_tokens": 5 * step}, run_env_ce={"observed_candidates": 0, "sum": 0.0, "last": None},
            lora_grad_norms=[0.5] * step, guardrail={}),
    )


def expectation(**overrides) -> ResumeExpectation:
    values = dict(
        adapter_name=ADAPTER,
        data=DataBinding(source_kind=DATA_SOURCE_KIND, content_sha256="ab" * 32, item_count=TOTAL),
        requested_seed=None,
        effective_config_for_seed=lambda s: {"seed": s, "x": 1},
        precision_policy={"device_type": "cpu", "activation_dtype": "float32"},
        total_steps=TOTAL,
        data_order=list(range(TOTAL)),
        optimizer_kind="adam_w",
        optimizer_hyperparameters=HYPER,
        learning_rate=0.1,
        cuda_streams=0,
        auxiliary_state=AUX,
        data_stats=STATS,
        expected_cursor=lambda step: divmod(step, TOTAL),
    )
    values.update(overrides)
    return ResumeExpectation(**values)


def _load(run: Path | str, name: str):
    return load_checkpoint(resolve(str(run)), name)


def _refused(run, name, code, *fragments):
    with pytest.raises(CheckpointError) as caught:
        _load(run, name)
    assert caught.value.code == code, caught.value.message
    for fragment in fragments:
        assert fragment in caught.value.message
    return caught.value


# ---------------------------------------------------------------------------------------------
# Layout and publish


def test_layout_naming_and_manifest(tmp_path):
    name = write_sample(str(tmp_path), step=25)
    assert name == "demo-checkpoint-step-00000025.kiln-checkpoint"
    directory = tmp_path / name
    assert sorted(os.listdir(directory)) == ["adapter.safetensors", "checkpoint_manifest.json", "opd_loop_state.json", "optimizer.safetensors"]
    text = (directory / "checkpoint_manifest.json").read_text()
    assert text.startswith('{\n  "schema_version": 1,')  # pretty JSON
    m = json.loads(text)
    assert list(m) == ["schema_version", "manifest_type", "checkpoint_kind", "checkpoint_id", "training_kind", "adapter_name",
                       "created_at", "effective_config", "precision_policy", "progress", "data", "rng_states", "optimizer",
                       "scheduler", "state_files", "auxiliary_state", "files"]
    assert (m["manifest_type"], m["checkpoint_kind"], m["checkpoint_id"], m["training_kind"]) == (
        "kiln.training-checkpoint.v1", "resumable", "opd-step-00000025", "opd")
    assert m["optimizer"]["step"] == m["scheduler"]["step"] == m["progress"]["global_step"] == 25
    assert m["scheduler"] == {"kind": "constant", "step": 25, "state": {"learning_rate": 0.1}}
    assert m["optimizer"]["state_file"] == "optimizer.safetensors"
    assert m["state_files"] == {"adapter_parameters": "adapter.safetensors", "optimizer_state": "optimizer.safetensors",
                                "loss_history": "opd_loop_state.json"}
    assert m["data"] == {"source_kind": "inline-off-policy-opd-candidate-order-v1", "content_sha256": "ab" * 32, "item_count": 10}
    assert m["rng_states"]["lora-init"] == {"algorithm": "kiln.seeded-lora-init.v1", "seed": 7, "position": 0}
    assert set(m["rng_states"]) == {"lora-init", "torch-cpu", "torch-cuda", "python-random", "numpy"}
    roles = {"adapter.safetensors": "adapter-parameters", "optimizer.safetensors": "optimizer-state", "opd_loop_state.json": "loss-history"}
    assert set(m["files"]) == set(roles)
    for rel, entry in m["files"].items():
        payload = (directory / rel).read_bytes()
        assert entry == {"role": roles[rel], "size_bytes": len(payload), "sha256": sha256_hex(payload)}
    loop = json.loads((directory / "opd_loop_state.json").read_text())
    assert (loop["schema_version"], loop["state_type"], loop["global_step"]) == (1, "kiln.opd-loop-state.v1", 25)


def test_sgd_checkpoint_has_no_optimizer_file(tmp_path):
    name = write_sample(str(tmp_path), optimizer_kind="sgd")
    assert "optimizer.safetensors" not in os.listdir(tmp_path / name)
    loaded = _load(tmp_path, name)
    assert loaded.optimizer_tensors == {} and loaded.manifest.state_files.optimizer_state is None


def test_published_basename_is_never_overwritten(tmp_path):
    name = write_sample(str(tmp_path), step=3)
    before = (tmp_path / name / "adapter.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="refusing to overwrite immutable training checkpoint") as caught:
        write_sample(str(tmp_path), step=3, seed=99)
    assert caught.value.code == "checkpoint_exists"
    assert (tmp_path / name / "adapter.safetensors").read_bytes() == before
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_crash_mid_write_leaves_only_a_hidden_staging_dir(tmp_path):
    run = tmp_path / "run"
    script = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import kiln_core.storage as storage\n"
        "original = storage.StagedDirectory.write\n"
        "def dying_write(self, rel, data):\n"
        "    original(self, rel, data)\n"
        "    os._exit(9)  # the process dies after the first artifact, as in a power cut\n"
        "storage.StagedDirectory.write = dying_write\n"
        "import test_checkpoint\n"
        f"test_checkpoint.write_sample({str(run)!r}, step=4)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    entries = os.listdir(run)
    assert len(entries) == 1 and entries[0].startswith(".demo-checkpoint-step-00000004.kiln-checkpoint.incomplete-")
    assert (run / entries[0] / ".incomplete").read_text() == "opd-step-00000004\n"
    assert latest_checkpoint(resolve(str(run)), ADAPTER) is None
    with pytest.raises(CheckpointError):
        check_resume_basename(entries[0], resolve(str(run)), ADAPTER)
    _refused(run, entries[0], "checkpoint_staging", "staging")
    # the writer may retry the same basename later
    assert write_sample(str(run), step=4) == "demo-checkpoint-step-00000004.kiln-checkpoint"
    assert latest_checkpoint(resolve(str(run)), ADAPTER) == "demo-checkpoint-step-00000004.kiln-checkpoint"


def test_latest_and_previous_checkpoint(tmp_path):
    run = resolve(str(tmp_path))
    assert latest_checkpoint(run, ADAPTER) is None
    for step in (2, 10, 4):
        write_sample(str(tmp_path), step=step)
    write_sample(str(tmp_path), step=12, adapter="other")
    (tmp_path / "demo-checkpoint-step-00000020.kiln-checkpoint").mkdir()  # not committed: no manifest
    assert latest_checkpoint(run, ADAPTER) == "demo-checkpoint-step-00000010.kiln-checkpoint"
    assert previous_checkpoint(run, ADAPTER, "demo-checkpoint-step-00000010.kiln-checkpoint") == "demo-checkpoint-step-00000004.kiln-checkpoint"
    assert previous_checkpoint(run, ADAPTER, "demo-checkpoint-step-00000002.kiln-checkpoint") is None


def test_rng_states_round_trip_exactly():
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    states = capture_rng_states(3)
    first = (torch.rand(4), random.random(), np.random.rand(3))
    restore_rng_states(states)
    second = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(first[0], second[0]) and first[1] == second[1] and np.array_equal(first[2], second[2])
    corrupted = states.model_copy(update={"torch_cpu": states.torch_cpu.model_copy(update={"sha256": "0" * 64})})
    with pytest.raises(CheckpointError, match="torch-cpu"):
        restore_rng_states(corrupted)


# ---------------------------------------------------------------------------------------------
# Loader refusals (each names the file)


def test_loader_accepts_a_good_checkpoint(tmp_path):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    assert torch.equal(loaded.adapter_tensors["lora.weight"], torch.full((2, 3), 3.0))
    assert loaded.loop_state.global_step == 3 and set(loaded.optimizer_tensors) == {"lora.weight::exp_avg"}


def test_loader_refuses_symlinks_and_non_directories(tmp_path):
    name = write_sample(str(tmp_path), step=3)
    link = "demo-checkpoint-step-00000005.kiln-checkpoint"
    os.symlink(tmp_path / name, tmp_path / link)
    _refused(tmp_path, link, "checkpoint_symlink", link)
    assert latest_checkpoint(resolve(str(tmp_path)), ADAPTER) == name  # a symlink is never "latest"
    (tmp_path / "demo-checkpoint-step-00000006.kiln-checkpoint").write_text("not a dir")
    _refused(tmp_path, "demo-checkpoint-step-00000006.kiln-checkpoint", "checkpoint_not_directory")
    _refused(tmp_path, "demo-checkpoint-step-00000007.kiln-checkpoint", "checkpoint_not_found")
    os.symlink(tmp_path / name / "adapter.safetensors", tmp_path / name / "extra.safetensors")
    _refused(tmp_path, name, "checkpoint_symlink", "extra.safetensors")


def test_loader_refuses_incomplete_sentinel(tmp_path):
    name = write_sample(str(tmp_path))
    (tmp_path / name / ".incomplete").write_text("opd-step-00000003\n")
    _refused(tmp_path, name, "checkpoint_incomplete", ".incomplete")


def test_loader_refuses_peft_adapter_dirs(tmp_path):
    name = "demo-checkpoint-step-00000003.kiln-checkpoint"
    (tmp_path / name).mkdir()
    (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / name / "adapter_model.safetensors").write_bytes(save({"w": torch.zeros(1)}))
    _refused(tmp_path, name, "peft_adapter_not_checkpoint", "PEFT adapter snapshots are not resumable checkpoints")


@pytest.mark.parametrize("rel", ["adapter.safetensors", "optimizer.safetensors", "opd_loop_state.json"])
def test_loader_refuses_missing_extra_and_changed_files(tmp_path, rel):
    name = write_sample(str(tmp_path / "missing"))
    (tmp_path / "missing" / name / rel).unlink()
    _refused(tmp_path / "missing", name, "checkpoint_file_missing", rel)

    name = write_sample(str(tmp_path / "changed"))
    path = tmp_path / "changed" / name / rel
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # same size, different bytes
    path.write_bytes(bytes(data))
    _refused(tmp_path / "changed", name, "checkpoint_file_sha256", rel)

    name = write_sample(str(tmp_path / "resized"))
    with open(tmp_path / "resized" / name / rel, "ab") as handle:
        handle.write(b" ")
    _refused(tmp_path / "resized", name, "checkpoint_file_size", rel)


def test_loader_refuses_untracked_files_and_unknown_manifest_fields(tmp_path):
    name = write_sample(str(tmp_path / "a"))
    (tmp_path / "a" / name / "notes.txt").write_text("hi")
    _refused(tmp_path / "a", name, "checkpoint_file_untracked", "notes.txt")

    name = write_sample(str(tmp_path / "b"))
    manifest = tmp_path / "b" / name / "checkpoint_manifest.json"
    data = json.loads(manifest.read_text())
    data["surprise"] = 1
    manifest.write_text(json.dumps(data, indent=2))
    _refused(tmp_path / "b", name, "checkpoint_manifest_invalid", "surprise", "checkpoint_manifest.json")

    data.pop("surprise")
    data["optimizer"]["step"] = 2  # optimizer.step must equal global_step
    manifest.write_text(json.dumps(data, indent=2))
    _refused(tmp_path / "b", name, "checkpoint_manifest_invalid", "optimizer.step")


def test_memory_filesystem_round_trip_and_uncommitted_prefix():
    root = f"memory://ckpt-{uuid.uuid4().hex}/runs/demo"
    name = write_sample(root, step=5)
    run = resolve(root)
    assert latest_checkpoint(run, ADAPTER) == name
    assert _load(root, name).loop_state.global_step == 5
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        write_sample(root, step=5)
    # a crashed object-store publish: artifacts without the commit file
    leftover = run.child("demo-checkpoint-step-00000006.kiln-checkpoint")
    with leftover.child("adapter.safetensors").fs.open(leftover.child("adapter.safetensors").path, "wb") as handle:
        handle.write(b"partial")
    assert latest_checkpoint(run, ADAPTER) == name
    _refused(root, "demo-checkpoint-step-00000006.kiln-checkpoint", "checkpoint_missing_manifest")
    assert write_sample(root, step=6) == "demo-checkpoint-step-00000006.kiln-checkpoint"  # retry replaces the leftover
    assert _load(root, "demo-checkpoint-step-00000006.kiln-checkpoint").adapter_tensors["lora.weight"][0, 0] == 6.0
    changed = run.child(name, "opd_loop_state.json")
    text = changed.read_text().replace('"global_step": 5', '"global_step": 6')
    with changed.fs.open(changed.path, "wb") as handle:
        handle.write(text.encode())
    _refused(root, name, "checkpoint_file_sha256", "opd_loop_state.json")


# ---------------------------------------------------------------------------------------------
# Resume basename and identity


def test_resume_basename_rules(tmp_path):
    run = resolve(str(tmp_path))
    good = "demo-checkpoint-step-00000003.kiln-checkpoint"
    assert check_resume_basename(good, run, ADAPTER) == good
    assert check_resume_basename(str(tmp_path / good), run, ADAPTER) == good  # absolute, directly beneath
    for bad in [
        f"../{good}", f"nested/{good}", "/etc/" + good, str(tmp_path / "sub" / good), "..", "", ".hidden.kiln-checkpoint",
        "demo-checkpoint-step-00000003", "other-checkpoint-step-00000003.kiln-checkpoint",
        "demo-checkpoint-step-3.kiln-checkpoint", f"memory://x/{good}", "a\\b.kiln-checkpoint",
    ]:
        with pytest.raises(CheckpointError) as caught:
            check_resume_basename(bad, run, ADAPTER)
        assert caught.value.code == "invalid_checkpoint_name", bad


def test_resume_identity_matches(tmp_path):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    assert validate_resume(loaded, expectation()) == 7
    assert validate_resume(loaded, expectation(requested_seed=7)) == 7


@pytest.mark.parametrize(
    "overrides, code, fragment",
    [
        ({"adapter_name": "renamed"}, "resume_adapter_name", "renamed"),
        ({"data": DataBinding(source_kind=DATA_SOURCE_KIND, content_sha256="cd" * 32, item_count=TOTAL)},
         "resume_data_hash", "resume checkpoint OPD training data hash differs from this request"),
        ({"requested_seed": 8}, "resume_seed", "OPD resume seed 7 differs from requested seed 8"),
        ({"effective_config_for_seed": lambda s: {"seed": s, "x": 2}}, "resume_effective_config",
         'effective OPD configuration differs from this request: checkpoint={"seed": 7, "x": 1}, request={"seed": 7, "x": 2}'),
        ({"precision_policy": {"device_type": "cuda", "activation_dtype": "bfloat16"}}, "resume_precision", "precision"),
        ({"data": DataBinding(source_kind="other", content_sha256="ab" * 32, item_count=TOTAL)}, "resume_data_identity", "data identity"),
        ({"total_steps": 20}, "resume_candidate_order", "OPD candidate order differs from this run"),
        ({"data_order": list(range(TOTAL))[::-1]}, "resume_candidate_order", "candidate order"),
        ({"optimizer_kind": "muon"}, "resume_optimizer", "optimizer contract"),
        ({"optimizer_hyperparameters": {"learning_rate": 0.1, "optimizer": {"kind": "adam_w", "beta1": 0.8}}}, "resume_optimizer", "optimizer"),
        ({"learning_rate": 0.2}, "resume_scheduler", "scheduler contract"),
        ({"cuda_streams": 1}, "resume_rng_streams", "RNG streams differ from this request"),
        ({"auxiliary_state": {**AUX, "model_config_sha256": "d" * 64}}, "resume_auxiliary_state",
         "model/tokenizer/teacher/runtime identity differs from this run (keys ['model_config_sha256'])"),
        ({"auxiliary_state": {**AUX, "teacher_identity": {"served_model_id": "x"}}}, "resume_auxiliary_state", "teacher_identity"),
        ({"expected_cursor": lambda step: (1, 0)}, "resume_loop_state", "loop state"),
        ({"data_stats": {**STATS, "action_tokens": 51}}, "resume_prepared_rows", "OPD prepared-row counters differ"),
    ],
)
def test_each_resume_identity_has_its_own_error(tmp_path, overrides, code, fragment):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    with pytest.raises(ResumeError) as caught:
        validate_resume(loaded, expectation(**overrides))
    assert caught.value.code == code
    assert fragment in caught.value.message


def test_resume_refuses_other_training_kinds_and_state_file_drift(tmp_path):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    other = loaded.manifest.model_copy(update={"training_kind": "sft"})
    with pytest.raises(ResumeError, match="resume checkpoint is not an OPD checkpoint"):
        validate_resume(type(loaded)(loaded.basename, other, loaded.loop_state, {}, {}), expectation())
    sgd = _load(tmp_path / "sgd", write_sample(str(tmp_path / "sgd"), optimizer_kind="sgd"))
    with pytest.raises(ResumeError) as caught:
        validate_resume(sgd, expectation())
    assert caught.value.code == "resume_optimizer"
    done = _load(tmp_path / "done", write_sample(str(tmp_path / "done"), step=TOTAL))
    with pytest.raises(ResumeError, match="nothing left to train"):
        validate_resume(done, expectation())
