"""Checkpoints without a model: Kiln's layout, atomic immutable publish, loader refusals, and the resume
checks in Kiln's order, each with its own code (``checkpoint.rs``, ``opd.rs`` ·
``OpdCheckpointDescriptor::validate_resume``)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save

from kiln_core.storage import resolve
from kiln_core.training.checkpoint import (
    OFF_POLICY_SOURCE_KIND,
    CheckpointError,
    DataBinding,
    DataStats,
    KilnFlowsState,
    OpdLoopState,
    ResumeError,
    RunContract,
    TokenCounts,
    capture_rng_state,
    check_resume_basename,
    latest_checkpoint,
    load_checkpoint,
    previous_checkpoint,
    restore_rng_state,
    validate_resume,
    write_checkpoint,
)

ADAPTER = "demo"
PER_EPOCH, EPOCHS = 5, 2
ADAM = {"kind": "adam_w", "beta1": 0.8999999761581421, "beta2": 0.9990000128746033, "eps": 9.99999993922529e-09, "weight_decay": 0.0}
PRECISION = {"parameter_dtype": "f32", "optimizer_state_dtype": "f32", "activation_dtype": "f32", "gradient_dtype": "f32",
             "stochastic_rounding": {"mode": "round_to_nearest"}}


def shard_manifest(content: bytes = b"weights") -> dict:
    digest = hashlib.sha256(content).digest()
    aggregate = hashlib.sha256(b"kiln.base-model-content.v1\0" + struct.pack("<Q", 1) + struct.pack("<Q", len(content)) + digest)
    return {"schema_version": 1, "manifest_type": "kiln.base-weight-shards.v1", "aggregate_algorithm": "kiln.base-model-content.v1",
            "aggregate_sha256": "sha256:" + aggregate.hexdigest(), "total_size_bytes": len(content),
            "shards": [{"filename": "model.safetensors", "size_bytes": len(content), "sha256": "sha256:" + digest.hex()}]}


def provenance(device: str = "cpu") -> dict:
    body = {"schema_version": 1, "provenance_type": "kiln.execution-provenance.v1", "backend": {"name": "torch", "device": device}}
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return {**body, "provenance_sha256": "sha256:" + hashlib.sha256(text.encode()).hexdigest()}


def auxiliary(**overrides) -> dict:
    shards = shard_manifest()
    aux = {"model_config_sha256": "sha256:" + "c" * 64, "teacher_identity": None, "base_model_weights_sha256": shards["aggregate_sha256"],
           "base_weight_shard_manifest": shards, "execution_provenance": provenance()}
    aux.update(overrides)
    return aux


def contract(seed: int = 7, **overrides) -> RunContract:
    values = dict(adapter_name=ADAPTER, effective_config={"seed": seed, "x": 1}, precision_policy=PRECISION,
                  data=DataBinding(source_kind=OFF_POLICY_SOURCE_KIND, content_sha256="ab" * 32, item_count=PER_EPOCH),
                  init_seed=seed, optimizer_kind="adam_w", optimizer_json=ADAM, learning_rate=0.1, epochs=EPOCHS,
                  auxiliary_state=auxiliary(), examples_read=PER_EPOCH, optimizer_steps_total=PER_EPOCH * EPOCHS)
    values.update(overrides)
    return RunContract(**values)


def loop_state(step: int) -> OpdLoopState:
    epoch, cursor = divmod(step, PER_EPOCH)
    return OpdLoopState(global_step=step, epoch_index=epoch, cursor_in_epoch=cursor, loss_history=[1.5] * step,
                        last_loss=1.5 if step else None, data_stats=DataStats(examples_read=PER_EPOCH, examples_filtered=0,
                                                                               examples_trained=step),
                        token_counts=TokenCounts(action_tokens=5 * step))


def extension(world_size: int = 1, sequences_per_step: int = 1) -> KilnFlowsState:
    return KilnFlowsState(kiln_flows_version="test", world_size=world_size, backend=None, sequences_per_step=sequences_per_step,
                          optimizer_steps_total=PER_EPOCH * EPOCHS, loss="teacher_top_k",
                          rank_rng=[capture_rng_state()] * world_size)


def write_sample(run_uri: str, step: int = 3, *, optimizer_kind: str = "adam_w", seed: int = 7, adapter: str = ADAPTER,
                 **contract_overrides) -> str:
    """Publish a small, internally consistent checkpoint (no model needed)."""
    state = contract_overrides.pop("extension", None) or extension()
    c = contract(seed, adapter_name=adapter, optimizer_kind=optimizer_kind,
                 optimizer_json=ADAM if optimizer_kind != "sgd" else {"kind": "sgd"}, **contract_overrides)
    optimizer = save({"lora.weight.adamw.m": torch.zeros(2, 3)}) if optimizer_kind != "sgd" else None
    return write_checkpoint(resolve(run_uri), c, loop_state(step), adapter_bytes=save({"lora.weight": torch.full((2, 3), float(step))}),
                            optimizer_bytes=optimizer, extension=state)


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
    name = write_sample(str(tmp_path), step=4)
    assert name == "demo-checkpoint-step-00000004.kiln-checkpoint"
    directory = tmp_path / name
    assert sorted(os.listdir(directory)) == ["adapter.safetensors", "checkpoint_manifest.json", "kiln_flows_state.json",
                                             "opd_loop_state.json", "optimizer.safetensors"]
    text = (directory / "checkpoint_manifest.json").read_text()
    assert text.startswith('{\n  "schema_version": 1,')  # pretty JSON
    m = json.loads(text)
    assert list(m) == ["schema_version", "manifest_type", "checkpoint_kind", "checkpoint_id", "training_kind", "adapter_name",
                       "created_at", "effective_config", "precision_policy", "progress", "data", "rng_states", "optimizer",
                       "scheduler", "state_files", "auxiliary_state", "files"]
    assert (m["manifest_type"], m["checkpoint_kind"], m["checkpoint_id"], m["training_kind"]) == (
        "kiln.training-checkpoint.v1", "resumable", "opd-step-00000004", "opd")
    assert m["created_at"].endswith("+00:00")
    assert m["progress"] == {"global_step": 4, "total_steps": 10, "epoch_index": 0, "cursor_in_epoch": 4, "data_order": [0, 1, 2, 3, 4]}
    assert m["optimizer"] == {"kind": "adam_w", "step": 4, "hyperparameters": {"learning_rate": 0.1, "optimizer": ADAM},
                              "state_file": "optimizer.safetensors"}
    assert m["scheduler"] == {"kind": "constant", "step": 4, "state": {"learning_rate": 0.1}}
    assert m["rng_states"] == {"lora-init": {"algorithm": "kiln.seeded-lora-init.v1", "seed": 7, "position": 0}}
    roles = {"adapter.safetensors": "adapter-parameters", "optimizer.safetensors": "optimizer-state",
             "opd_loop_state.json": "loss-history", "kiln_flows_state.json": "rng-state"}
    assert set(m["files"]) == set(roles)
    for rel, entry in m["files"].items():
        payload = (directory / rel).read_bytes()
        assert entry == {"role": roles[rel], "size_bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    loop = json.loads((directory / "opd_loop_state.json").read_text())
    assert (loop["schema_version"], loop["state_type"], loop["global_step"]) == (1, "kiln.opd-loop-state.v1", 4)
    assert loop["lora_grad_norms"] == {"by_module": {}} and loop["run_env_ce"] is None


def test_sgd_checkpoint_has_no_optimizer_file(tmp_path):
    name = write_sample(str(tmp_path), optimizer_kind="sgd")
    assert "optimizer.safetensors" not in os.listdir(tmp_path / name)
    loaded = _load(tmp_path, name)
    assert loaded.optimizer_tensors == {} and loaded.manifest.state_files.optimizer_state is None
    assert "state_file" not in json.loads((tmp_path / name / "checkpoint_manifest.json").read_text())["optimizer"]


def test_published_basename_is_never_overwritten(tmp_path):
    name = write_sample(str(tmp_path), step=3)
    before = (tmp_path / name / "adapter.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="refusing to overwrite immutable training checkpoint") as caught:
        write_sample(str(tmp_path), step=3, seed=99)
    assert caught.value.code == "checkpoint_exists"
    assert (tmp_path / name / "adapter.safetensors").read_bytes() == before
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_records_that_break_kilns_rules_are_never_written(tmp_path):
    c = contract()
    bad = loop_state(3).model_copy(update={"loss_history": [1.5, 1.5]})  # 2 losses for 3 steps
    with pytest.raises(CheckpointError, match="loss-history length 2 does not match global step 3") as caught:
        write_checkpoint(resolve(str(tmp_path)), c, bad, adapter_bytes=b"a", optimizer_bytes=b"o", extension=extension())
    assert caught.value.code == "checkpoint_manifest_invalid" and os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match="next epoch 2 exceeds configured epochs 2"):  # a checkpoint is never "finished"
        write_checkpoint(resolve(str(tmp_path)), c, loop_state(PER_EPOCH * EPOCHS), adapter_bytes=b"a", optimizer_bytes=b"o",
                         extension=extension())


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
    assert write_sample(str(run), step=4) == "demo-checkpoint-step-00000004.kiln-checkpoint"  # a retry may reuse the name
    assert latest_checkpoint(resolve(str(run)), ADAPTER) == "demo-checkpoint-step-00000004.kiln-checkpoint"


def test_latest_and_previous_checkpoint(tmp_path):
    run = resolve(str(tmp_path))
    assert latest_checkpoint(run, ADAPTER) is None
    for step in (2, 8, 4):
        write_sample(str(tmp_path), step=step)
    write_sample(str(tmp_path), step=6, adapter="other")
    (tmp_path / "demo-checkpoint-step-00000009.kiln-checkpoint").mkdir()  # not committed: no manifest
    assert latest_checkpoint(run, ADAPTER) == "demo-checkpoint-step-00000008.kiln-checkpoint"
    assert previous_checkpoint(run, ADAPTER, "demo-checkpoint-step-00000008.kiln-checkpoint") == "demo-checkpoint-step-00000004.kiln-checkpoint"
    assert previous_checkpoint(run, ADAPTER, "demo-checkpoint-step-00000002.kiln-checkpoint") is None


def test_generator_states_round_trip_exactly():
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    state = capture_rng_state()
    first = (torch.rand(4), random.random(), np.random.rand(3))
    restore_rng_state(state)
    second = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(first[0], second[0]) and first[1] == second[1] and np.array_equal(first[2], second[2])
    corrupted = state.model_copy(update={"torch_cpu": state.torch_cpu.model_copy(update={"sha256": "0" * 64})})
    with pytest.raises(CheckpointError, match="torch-cpu") as caught:
        restore_rng_state(corrupted)
    assert caught.value.code == "checkpoint_rng_state"


# ---------------------------------------------------------------------------------------------
# Loader refusals (each names the file)


def test_loader_accepts_a_good_checkpoint(tmp_path):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    assert torch.equal(loaded.adapter_tensors["lora.weight"], torch.full((2, 3), 3.0))
    assert loaded.loop_state.global_step == 3 and set(loaded.optimizer_tensors) == {"lora.weight.adamw.m"}
    assert loaded.world_size == 1 and loaded.extension.sequences_per_step == 1


def test_loader_refuses_symlinks_and_non_directories(tmp_path):
    name = write_sample(str(tmp_path), step=3)
    link = "demo-checkpoint-step-00000005.kiln-checkpoint"
    os.symlink(tmp_path / name, tmp_path / link)
    _refused(tmp_path, link, "checkpoint_symlink", link)
    assert latest_checkpoint(resolve(str(tmp_path)), ADAPTER) == name  # a symlink is never "latest"
    (tmp_path / "demo-checkpoint-step-00000006.kiln-checkpoint").write_text("not a dir")
    _refused(tmp_path, "demo-checkpoint-step-00000006.kiln-checkpoint", "checkpoint_not_directory")
    _refused(tmp_path, "demo-checkpoint-step-00000007.kiln-checkpoint", "checkpoint_not_found")
    _refused(tmp_path, "demo-checkpoint-step-00000007", "invalid_checkpoint_name", ".kiln-checkpoint")
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


@pytest.mark.parametrize("rel", ["adapter.safetensors", "optimizer.safetensors", "opd_loop_state.json", "kiln_flows_state.json"])
def test_loader_refuses_missing_extra_and_changed_files(tmp_path, rel):
    name = write_sample(str(tmp_path / "missing"))
    (tmp_path / "missing" / name / rel).unlink()
    error = _refused(tmp_path / "missing", name, "checkpoint_file_missing", rel)
    assert error.file == rel

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
    data["rng_states"]["lora-init"]["extra"] = 0  # every nested record denies unknown fields too
    manifest.write_text(json.dumps(data, indent=2))
    _refused(tmp_path / "b", name, "checkpoint_manifest_invalid", "extra")


def test_memory_filesystem_round_trip_and_uncommitted_prefix():
    root = f"memory://ckpt-{uuid.uuid4().hex}/runs/demo"
    name = write_sample(root, step=5)
    run = resolve(root)
    assert latest_checkpoint(run, ADAPTER) == name
    assert _load(root, name).loop_state.global_step == 5
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        write_sample(root, step=5)
    leftover = run.child("demo-checkpoint-step-00000006.kiln-checkpoint")  # a crashed object-store publish
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
        "demo-checkpoint-step-00000003.kiln-checkpoint\n",
    ]:
        with pytest.raises(CheckpointError) as caught:
            check_resume_basename(bad, run, ADAPTER)
        assert caught.value.code == "invalid_checkpoint_name", bad


def resume(loaded, requested_seed=None, **overrides):
    return validate_resume(loaded, lambda seed: contract(seed, **overrides), requested_seed)


def test_resume_identity_matches_and_inherits_the_seed(tmp_path):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    assert resume(loaded).init_seed == 7
    assert resume(loaded, requested_seed=7).effective_config == {"seed": 7, "x": 1}


@pytest.mark.parametrize(
    "overrides, requested, code, fragment",
    [
        ({"adapter_name": "renamed"}, None, "resume_adapter_name", "resume checkpoint adapter 'demo' does not match 'renamed'"),
        ({"data": DataBinding(source_kind=OFF_POLICY_SOURCE_KIND, content_sha256="cd" * 32, item_count=PER_EPOCH)}, None,
         "resume_data_hash", "resume checkpoint OPD training data hash differs from this request"),
        ({}, 8, "resume_seed", "OPD resume seed 7 differs from requested seed 8"),
        ({"effective_config": {"seed": 7, "x": 2}}, None, "resume_effective_config",
         'resume checkpoint effective OPD configuration differs from this request: checkpoint={"seed":7,"x":1}, request={"seed":7,"x":2}'),
        ({"precision_policy": {**PRECISION, "activation_dtype": "bf16"}}, None, "resume_precision",
         "resume checkpoint precision policy differs from this runtime"),
        ({"data": DataBinding(source_kind="other", content_sha256="ab" * 32, item_count=PER_EPOCH)}, None,
         "resume_data_identity", "resume checkpoint OPD data identity differs from this request"),
        ({"epochs": 3}, None, "resume_candidate_order", "resume checkpoint OPD candidate order differs from this run"),
        ({"optimizer_json": {**ADAM, "beta1": 0.5}}, None, "resume_optimizer", "resume checkpoint optimizer contract differs"),
        ({"optimizer_kind": "muon"}, None, "resume_optimizer", "optimizer contract"),
        ({"learning_rate": 0.2}, None, "resume_optimizer", "optimizer contract"),  # the lr is an optimizer hyperparameter first
        ({"on_policy": True}, None, "resume_rng_streams", "resume checkpoint RNG streams differ from this request"),
        ({"auxiliary_state": auxiliary(base_weight_shard_manifest=shard_manifest(b"other weights"),
                                       base_model_weights_sha256=shard_manifest(b"other weights")["aggregate_sha256"])},
         None, "resume_base_weights", "resume checkpoint base-weight shard content differs from this run"),
        ({"auxiliary_state": auxiliary(execution_provenance=provenance("cuda"))}, None, "resume_execution_provenance",
         "resume checkpoint execution provenance differs from this run (in ['backend'])"),
        ({"auxiliary_state": auxiliary(model_config_sha256="sha256:" + "d" * 64)}, None, "resume_auxiliary_state",
         "model/tokenizer/teacher/runtime identity differs from this run (keys ['model_config_sha256'])"),
        ({"examples_read": 6}, None, "resume_prepared_rows", "resume checkpoint OPD prepared-row counters differ from this request"),
        ({"world_size": 2}, None, "resume_world_size", "world size 1"),
        ({"sequences_per_step": 2}, None, "resume_sequences_per_step", "sequences_per_step 1"),
        ({"loss": "teacher_top_k_tail"}, None, "resume_loss", "teacher_top_k_tail"),
    ],
)
def test_each_resume_check_has_its_own_error(tmp_path, overrides, requested, code, fragment):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    with pytest.raises(ResumeError) as caught:
        resume(loaded, requested, **overrides)
    assert caught.value.code == code
    assert fragment in caught.value.message


def test_checks_run_in_kilns_order(tmp_path):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    mismatches = {"adapter_name": "renamed", "effective_config": {"x": 2}, "world_size": 2,
                  "data": DataBinding(source_kind=OFF_POLICY_SOURCE_KIND, content_sha256="cd" * 32, item_count=PER_EPOCH)}
    order = ["resume_adapter_name", "resume_data_hash", "resume_effective_config", "resume_world_size"]
    keys = ["adapter_name", "data", "effective_config", "world_size"]
    for index, expected in enumerate(order):
        with pytest.raises(ResumeError) as caught:
            resume(loaded, **{key: mismatches[key] for key in keys[index:]})
        assert caught.value.code == expected


def test_resume_refuses_other_kinds_missing_streams_and_a_foreign_shard_manifest(tmp_path):
    loaded = _load(tmp_path, write_sample(str(tmp_path)))
    other = type(loaded)(loaded.basename, loaded.manifest.model_copy(update={"training_kind": "sft"}), loaded.loop_state,
                         loaded.extension, {}, {})
    with pytest.raises(ResumeError, match="resume checkpoint is not an OPD checkpoint"):
        resume(other)
    no_stream = type(loaded)(loaded.basename, loaded.manifest.model_copy(update={"rng_states": {}}), loaded.loop_state,
                             loaded.extension, {}, {})
    with pytest.raises(ResumeError, match="OPD resume checkpoint has no lora-init RNG state") as caught:
        resume(no_stream)
    assert caught.value.code == "resume_lora_init"
    torn = auxiliary()
    torn["base_model_weights_sha256"] = "sha256:" + "0" * 64  # disagrees with its own shard manifest
    manifest = loaded.manifest.model_copy(update={"auxiliary_state": torn})
    with pytest.raises(ResumeError, match="differs from its shard manifest") as caught:
        resume(type(loaded)(loaded.basename, manifest, loaded.loop_state, loaded.extension, {}, {}))
    assert caught.value.code == "resume_base_weights"
    sgd = _load(tmp_path / "sgd", write_sample(str(tmp_path / "sgd"), optimizer_kind="sgd"))
    with pytest.raises(ResumeError) as caught:
        resume(sgd)
    assert caught.value.code == "resume_optimizer"
