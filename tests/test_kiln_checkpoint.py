"""A checkpoint the trainer writes is one Kiln can load (``crates/kiln-train/src/checkpoint.rs``).

The manifest and loop state are parsed by ``tests/kiln_structs.py`` — Kiln's structs transcribed as
strict models, independent of ``kiln_core`` — and every value Kiln recomputes on resume (data digest,
teacher revision, shard aggregate, provenance digest, effective config encoding) is recomputed here
from its definition. Kiln's ``validate()`` rules are checked one by one through the loader.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kiln_structs as kiln
from kiln_core.admission import admit_corpus
from kiln_core.synthetic import synthesize_corpus
from kiln_core.training.checkpoint import CheckpointError, load_checkpoint
from kiln_core.training.trainer import train_opd
from plan_support import train_plan
from test_trainer import ADAPTER, make_config

STEP = 3
NAME = f"{ADAPTER}-checkpoint-step-{STEP:08d}.kiln-checkpoint"
ALIAS = "tiny-teacher"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


@pytest.fixture(scope="module")
def run(tiny_student, tmp_path_factory):
    """An admitted corpus (manifest, plain and trajectory examples) trained for 8 steps with ECHO."""
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("kiln-checkpoint")
    corpus = synthesize_corpus(tiny_student, base / "corpus.jsonl", n_examples=4, top_k=16, seed=5, trajectory_every=2)
    admission = admit_corpus(str(corpus), str(tiny_student), top_k=16)
    config = make_config(epochs=2, checkpoint_interval=STEP, echo={"lambda": 0.5})
    root = base / "run"
    result = train_opd(train_plan(config, str(root), ADAPTER), admission.tables,
                       dataset_sha256=admission.dataset_sha256, dataset_path=str(corpus), student_dir=str(tiny_student),
                       teacher_alias=ALIAS, teacher_identity=admission.teacher_identity)
    assert result.status == "success"
    return {"root": root, "dir": root / NAME, "corpus": corpus, "admission": admission, "student": tiny_student}


def manifest_of(directory: Path) -> dict:
    return json.loads((directory / "checkpoint_manifest.json").read_text())


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# Kiln's structs


def test_manifest_and_loop_state_parse_as_kilns_structs(run):
    manifest = kiln.TrainingCheckpointManifest.model_validate_json((run["dir"] / "checkpoint_manifest.json").read_text())
    loop = kiln.OpdCheckpointLoopState.model_validate_json((run["dir"] / "opd_loop_state.json").read_text())
    assert (manifest.schema_version, manifest.manifest_type, manifest.training_kind) == (1, "kiln.training-checkpoint.v1", "opd")
    assert manifest.checkpoint_id == f"opd-step-{STEP:08d}" and manifest.progress.global_step == STEP == loop.global_step
    assert manifest.optimizer.step == manifest.scheduler.step == STEP
    assert set(manifest.auxiliary_state) == kiln.OPD_AUXILIARY_KEYS
    aux = manifest.auxiliary_state
    kiln.BaseWeightShardManifest.model_validate(aux["base_weight_shard_manifest"])
    kiln.ExecutionProvenanceV1.model_validate(aux["execution_provenance"])
    kiln.LogitSourceCaps.model_validate(aux["teacher_capabilities"])
    assert isinstance(aux["backend_runtime"], str) and aux["base_model_weights_sha256"].startswith("sha256:")
    assert set(manifest.effective_config) == kiln.OPD_EFFECTIVE_CONFIG_KEYS
    on_disk = {p.name for p in run["dir"].iterdir()}
    assert on_disk == set(manifest.files) | {"checkpoint_manifest.json"}
    for rel, entry in manifest.files.items():
        data = (run["dir"] / rel).read_bytes()
        assert (entry.size_bytes, entry.sha256) == (len(data), sha256(data))


def test_loop_state_counters_and_grad_norms_are_kilns(run):
    loop = json.loads((run["dir"] / "opd_loop_state.json").read_text())
    assert len(loop["loss_history"]) == STEP and loop["last_loss"] == loop["loss_history"][-1]
    assert loop["data_stats"]["examples_read"] == 4 and loop["data_stats"]["examples_trained"] == STEP
    assert isinstance(loop["run_env_ce"], float)  # the last ECHO env CE, a number (not our old object)
    modules = loop["lora_grad_norms"]["by_module"]
    assert set(modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for stats in modules.values():
        assert stats["sample_count"] == STEP
        assert all(re.fullmatch(r"0x[0-9a-f]{16}", stats[key]) for key in ("sum", "min", "max"))
        low, high, total = (struct.unpack("<d", bytes.fromhex(stats[key][2:])[::-1])[0] for key in ("min", "max", "sum"))
        assert 0 < low <= high <= total
        assert float(torch.tensor(high, dtype=torch.float32)) == high  # observed after rounding to f32, as Kiln


def test_extension_file_is_declared_and_never_referenced(run):
    m = manifest_of(run["dir"])
    assert m["files"]["kiln_flows_state.json"]["role"] == "rng-state"
    assert m["rng_states"] == {"lora-init": {"algorithm": "kiln.seeded-lora-init.v1", "seed": 11, "position": 0}}
    assert "kiln_flows_state.json" not in json.dumps(m["state_files"])
    assert m["state_files"] == {"adapter_parameters": "adapter.safetensors", "optimizer_state": "optimizer.safetensors",
                                "loss_history": "opd_loop_state.json"}
    extension = json.loads((run["dir"] / "kiln_flows_state.json").read_text())
    assert (extension["world_size"], extension["sequences_per_step"], extension["loss"]) == (1, 1, "teacher_top_k")
    assert len(extension["rank_rng"]) == 1 and set(extension["rank_rng"][0]) == {"torch_cpu", "torch_cuda", "python_random", "numpy"}


def test_effective_config_is_encoded_as_kilns_value(run):
    config = manifest_of(run["dir"])["effective_config"]
    # f32 fields go through serde_json::Value widened to f64 (Kiln's checkpoint.rs): 0.95 is 0.949999988079071.
    assert config["optimizer"] == {"kind": "muon", "momentum": 0.949999988079071, "nesterov": True, "ns_iters": 5,
                                   "weight_decay": 0.0}
    assert config["lora_alpha"] == 8.0 and config["learning_rate"] == 2e-2 and config["seed"] == 11
    for key in ("top_k", "samples_per_prompt", "max_tokens", "lora_rank", "epochs", "seed", "checkpoint_interval",
                "effective_top_k", "effective_samples_per_prompt"):
        assert type(config[key]) is int, key  # never 16.0
    assert "sampler_segments" not in config and "resume_checkpoint" not in config and "sequences_per_step" not in config
    assert config["max_cost_usd"] is None and config["base_adapter"] is None  # Options without skip stay null
    assert config["echo"]["lambda"] == 0.5


def test_data_hash_is_kilns_prompt_list_digest(run):
    prompts = []
    for line in run["corpus"].read_text().splitlines():
        record = json.loads(line)
        if record.get("schema") == "kiln.off-policy-distillation-manifest.v1":
            continue
        messages = [{k: v for k, v in m.items() if v is not None} for m in record["messages"]]
        if record.get("trajectory"):
            segments = [{k: v for k, v in s.items() if v is not None} for s in record["trajectory"]]
            prompts.append({"messages": messages, "trajectory": [{"kind": "context", **s} for s in segments]})
        else:
            prompts.append({"messages": messages + [{"role": "assistant", "content": record["teacher_response"]}]})
    # serde_json::Value without preserve_order: keys sorted, compact, raw UTF-8.
    expected = sha256(json.dumps(prompts, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
    data = manifest_of(run["dir"])["data"]
    assert data == {"source_kind": "inline-off-policy-opd-candidate-order-v1", "content_sha256": expected, "item_count": 4}
    assert expected != run["admission"].dataset_sha256.removeprefix("sha256:")  # not the file digest


def test_teacher_revision_and_capabilities_are_kilns(run):
    aux = manifest_of(run["dir"])["auxiliary_state"]
    identity = run["admission"].teacher_identity
    caps = {"teacher_id": ALIAS, "vocab_size": json.loads((run["student"] / "config.json").read_text())["vocab_size"],
            "max_top_k": 16, "supports_full_vocab": False, "supports_batched": True,
            "tokenizer_hash": identity.tokenizer_vocab_sha256}
    assert aux["teacher_capabilities"] == caps
    rows: dict[tuple, dict] = {}
    for example in run["admission"].tables:
        positions = rows.setdefault(tuple(example.input_ids.tolist()), {})
        for q, ids, logprobs in zip(example.action_positions.tolist(), example.teacher_ids, example.teacher_logprobs):
            positions[q - 1] = (ids.tolist(), [struct.unpack("<I", struct.pack("<f", x))[0] for x in logprobs.tolist()])
    ordered = [{"tokens": list(tokens), "position": p, "indices": rows[tokens][p][0], "logprob_bits": rows[tokens][p][1]}
               for tokens in sorted(rows) for p in sorted(rows[tokens])]
    descriptor = {"schema": "kiln.fixture-logit-source.v1", "capabilities": caps, "top_k": 16, "rows": ordered}
    expected = "sha256:" + sha256(json.dumps(descriptor, separators=(",", ":"), ensure_ascii=False).encode())
    assert aux["teacher_content_revision"] == expected
    assert aux["teacher_identity"] == json.loads(identity.canonical_json())
    receipt = json.loads((run["root"] / "train_receipt.json").read_text())
    assert receipt["opd"]["teacher_content_revision"] == expected


def test_base_weight_manifest_and_provenance_digests(run):
    aux = manifest_of(run["dir"])["auxiliary_state"]
    shards = aux["base_weight_shard_manifest"]
    records = []
    for shard in shards["shards"]:
        data = (run["student"] / shard["filename"]).read_bytes()
        assert shard == {"filename": shard["filename"], "size_bytes": len(data), "sha256": "sha256:" + sha256(data)}
        records.append((hashlib.sha256(data).digest(), len(data)))
    digest = hashlib.sha256(b"kiln.base-model-content.v1\0" + struct.pack("<Q", len(records)))
    for raw, size in sorted(records):
        digest.update(struct.pack("<Q", size) + raw)
    assert shards["aggregate_sha256"] == aux["base_model_weights_sha256"] == "sha256:" + digest.hexdigest()
    provenance = aux["execution_provenance"]
    body = {k: v for k, v in provenance.items() if k != "provenance_sha256"}
    assert provenance["provenance_sha256"] == "sha256:" + sha256(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode())
    kernels = provenance["kernels"]
    contract = [kernels["contract_type"], kernels["versions"], kernels["compiled_features"]]
    assert kernels["contract_sha256"] == "sha256:" + sha256(json.dumps(contract, separators=(",", ":")).encode())
    assert kernels["compiled_features"] == sorted(set(kernels["compiled_features"]))
    order = aux["prepared_source_indices"]
    assert order == [0, 1, 2, 3] and aux["prepared_source_order_sha256"] == "sha256:" + sha256(b"[0,1,2,3]")


def test_tensor_files_use_kilns_names(run):
    adapter = load_file(run["dir"] / "adapter.safetensors")
    pattern = re.compile(r"base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.(\w+_proj)\.lora_[AB]\.weight")
    for key, tensor in adapter.items():
        match = pattern.fullmatch(key)
        assert match, key
        assert (match.group(1) == "self_attn") == (match.group(2) in {"q_proj", "k_proj", "v_proj", "o_proj"})
        assert tensor.dtype == torch.float32
    optimizer = load_file(run["dir"] / "optimizer.safetensors")
    assert set(optimizer) == {f"{key}.muon.{part}" for key in adapter for part in ("momentum", "step")}
    for key in adapter:
        assert optimizer[f"{key}.muon.momentum"].shape == adapter[key].shape
        assert optimizer[f"{key}.muon.step"].dtype == torch.uint32 and optimizer[f"{key}.muon.step"].tolist() == [STEP]


# ---------------------------------------------------------------------------------------------
# Loader: layouts that are not ours


def copy_checkpoint(run, tmp_path) -> Path:
    target = tmp_path / NAME
    shutil.copytree(run["dir"], target)
    return target


def test_an_older_kiln_flows_checkpoint_gets_its_own_rejection(run, tmp_path):
    directory = copy_checkpoint(run, tmp_path)
    manifest = manifest_of(directory)
    manifest["rng_states"]["torch-cpu"] = {"algorithm": "torch.cpu.mt19937", "state_base64": "AAAA", "sha256": "0" * 64}
    (directory / "checkpoint_manifest.json").write_text(json.dumps(manifest, indent=2))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(str(tmp_path), NAME)
    assert caught.value.code == "checkpoint_old_format" and "written by an older kiln-flows" in caught.value.message
    manifest["rng_states"].pop("torch-cpu")
    manifest["distributed"] = {"world_size": 2}
    (directory / "checkpoint_manifest.json").write_text(json.dumps(manifest, indent=2))
    with pytest.raises(CheckpointError, match="written by an older kiln-flows"):
        load_checkpoint(str(tmp_path), NAME)


def test_a_checkpoint_without_our_extension_file_is_refused(run, tmp_path):
    directory = copy_checkpoint(run, tmp_path)
    manifest = manifest_of(directory)
    manifest["files"].pop("kiln_flows_state.json")
    (directory / "kiln_flows_state.json").unlink()
    (directory / "checkpoint_manifest.json").write_text(json.dumps(manifest, indent=2))
    kiln.TrainingCheckpointManifest.model_validate(manifest)  # still a valid Kiln checkpoint
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(str(tmp_path), NAME)
    assert caught.value.code == "checkpoint_extension_missing" and "not written by kiln-flows" in caught.value.message


def _break(manifest: dict, path: str, value) -> dict:
    node = manifest
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    if value is _DELETE:
        node.pop(last)
    else:
        node[last] = value
    return manifest


_DELETE = object()


@pytest.mark.parametrize("path, value, message", [
    ("schema_version", 2, "unsupported training checkpoint schema_version 2"),
    ("manifest_type", "kiln.other.v1", "invalid training checkpoint manifest_type"),
    ("checkpoint_id", "opd step 3", "checkpoint_id contains unsupported characters"),
    ("adapter_name", " ", "adapter_name must not be empty"),
    ("created_at", "yesterday", "created_at must be RFC 3339"),
    ("progress.global_step", 17, "global_step exceeds total_steps"),
    ("progress.cursor_in_epoch", 5, "cursor_in_epoch exceeds data_order length"),
    ("progress.data_order", [0, 1, 1, 3], "data_order contains duplicate item 1"),
    ("progress.data_order", [0, 1, 2, 4], "data_order item 4 exceeds item_count 4"),
    ("progress.data_order", [0, 1, 2], "data_order length 3 does not match data item_count 4"),
    ("data.content_sha256", "AB" * 32, "data.content_sha256 must be 64 lowercase hexadecimal characters"),
    ("data.source_kind", "", "data.source_kind must not be empty"),
    ("optimizer.step", 2, "optimizer step 2 does not match global_step 3"),
    ("scheduler.step", 4, "scheduler step 4 does not match global_step 3"),
    ("rng_states.lora-init.algorithm", " ", "rng algorithm must not be empty"),
    ("precision_policy.gradient_dtype", "", "gradient_dtype must not be empty"),
    ("state_files.loss_history", "kiln_flows_state.json", "has role rng-state, expected loss-history"),
    ("state_files.adapter_parameters", "missing.safetensors", "references untracked artifact 'missing.safetensors'"),
    ("optimizer.state_file", _DELETE, "state_files.optimizer_state is present but optimizer.state_file is absent"),
])
def test_kilns_manifest_rules_are_enforced_by_the_loader(run, tmp_path, path, value, message):
    directory = copy_checkpoint(run, tmp_path)
    manifest = _break(manifest_of(directory), path, value)
    (directory / "checkpoint_manifest.json").write_text(json.dumps(manifest, indent=2))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(str(tmp_path), NAME)
    assert caught.value.code == "checkpoint_manifest_invalid", caught.value.message
    assert message in caught.value.message


def test_an_unknown_field_anywhere_in_the_loop_state_is_refused(run, tmp_path):
    directory = copy_checkpoint(run, tmp_path)
    loop = json.loads((directory / "opd_loop_state.json").read_text())
    loop["lora_grad_norms"]["by_module"]["q_proj"]["mean"] = 1.0
    payload = json.dumps(loop, indent=2).encode()
    (directory / "opd_loop_state.json").write_bytes(payload)
    manifest = manifest_of(directory)
    manifest["files"]["opd_loop_state.json"].update(size_bytes=len(payload), sha256=sha256(payload))
    (directory / "checkpoint_manifest.json").write_text(json.dumps(manifest, indent=2))
    with pytest.raises(Exception):
        kiln.OpdCheckpointLoopState.model_validate(loop)  # Kiln refuses it too
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(str(tmp_path), NAME)
    assert caught.value.code == "checkpoint_manifest_invalid" and "opd_loop_state.json" in caught.value.message
