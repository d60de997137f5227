"""The teacher identity digests (Kiln's ``scripts/vllm_teacher.py``): golden vectors, shard selection, refusals, and a tiny teacher's identity."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from kiln_core.contracts.identity import KILN_FLOWS_PROTOCOL, build_manifest_line, parse_manifest_line
from kiln_core.identity.hashing import (
    IdentityHashError,
    adapter_config_sha256,
    adapter_weights_sha256,
    base_model_digest,
    base_model_sha256,
    model_vocab_size,
    select_weight_shards,
    sha256_file,
    tokenizer_config_sha256,
    tokenizer_vocab_sha256,
    vocab_digest,
)
from kiln_core.identity.local_teacher import (
    build_inference_config,
    implementation_string,
    local_teacher_identity,
    served_model_id_for,
)

BASE_GOLDEN = "aa7e9961df654af2a7405c5d2c07eb5a72b58f86060035c245c3415793c459c1"
VOCAB_GOLDEN = "0e7ed7c4b2c375344d31b534f7cbb119b528114f1301f09d6642801b100710ff"


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------- golden vectors


def test_base_model_golden_vector(tmp_path):
    _write(tmp_path / "model.safetensors", b"weight-v1")
    assert base_model_sha256(tmp_path) == BASE_GOLDEN
    assert base_model_digest([(hashlib.sha256(b"weight-v1").digest(), 9)]) == BASE_GOLDEN


def test_vocab_golden_vector():
    assert vocab_digest({"a": 0, "b": 1}) == VOCAB_GOLDEN
    assert vocab_digest({"b": 1, "a": 0}) == VOCAB_GOLDEN  # insertion order never matters


def test_adapter_digests_recomputed_independently(tmp_path):
    weights = b"\x00lora-weights\xff" * 1000
    config = b'{"base_model_name_or_path": "/models/base", "r": 8}\n'
    _write(tmp_path / "adapter_model.safetensors", weights)
    _write(tmp_path / "adapter_config.json", config)

    name = b"adapter_model.safetensors"
    expected = hashlib.sha256(
        b"kiln.adapter-weights.v1\0"
        + (1).to_bytes(8, "little")
        + len(name).to_bytes(8, "little")
        + name
        + len(weights).to_bytes(8, "little")
        + hashlib.sha256(weights).digest()
    ).hexdigest()
    assert adapter_weights_sha256(tmp_path) == expected
    assert adapter_config_sha256(tmp_path) == hashlib.sha256(config).hexdigest()


def test_adapter_needs_exactly_one_weights_file(tmp_path):
    _write(tmp_path / "adapter_config.json", b"{}")
    with pytest.raises(IdentityHashError, match="exactly one"):
        adapter_weights_sha256(tmp_path)
    _write(tmp_path / "adapter_model.safetensors", b"x")
    _write(tmp_path / "adapter_model.bin", b"y")
    with pytest.raises(IdentityHashError, match="exactly one"):
        adapter_weights_sha256(tmp_path)


# ----------------------------------------------------------------------------- shards


def _independent_base_digest(blobs: list[bytes]) -> str:
    records = sorted((hashlib.sha256(blob).digest(), len(blob)) for blob in blobs)
    data = b"kiln.base-model-content.v1\0" + struct.pack("<Q", len(records))
    for digest, length in records:
        data += struct.pack("<Q", length) + digest
    return hashlib.sha256(data).hexdigest()


def test_index_selects_shards_and_ignores_strays(tmp_path):
    blobs = {"model-00001-of-00002.safetensors": b"shard-one" * 100, "model-00002-of-00002.safetensors": b"shard-2"}
    for name, blob in blobs.items():
        _write(tmp_path / name, blob)
    _write(tmp_path / "consolidated.safetensors", b"not selected")  # absent from the index
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors",
                                            "c": "model-00001-of-00002.safetensors"}}
    _write(tmp_path / "model.safetensors.index.json", json.dumps(index).encode())
    assert [p.name for p in select_weight_shards(tmp_path)] == sorted(blobs)
    expected = _independent_base_digest(list(blobs.values()))
    assert base_model_sha256(tmp_path, max_workers=1) == expected
    assert base_model_sha256(tmp_path, max_workers=2) == expected


def test_shard_names_and_order_do_not_matter(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a / "x.safetensors", b"one")
    _write(a / "y.safetensors", b"two")
    _write(b / "first.safetensors", b"two")
    _write(b / "second.safetensors", b"one")
    assert base_model_sha256(a) == base_model_sha256(b) == _independent_base_digest([b"one", b"two"])


def test_single_file_preferred_over_glob(tmp_path):
    _write(tmp_path / "model.safetensors", b"weight-v1")
    _write(tmp_path / "extra.safetensors", b"other")
    assert base_model_sha256(tmp_path) == BASE_GOLDEN


def test_symlinked_shard_refused(tmp_path):
    real = _write(tmp_path / "elsewhere" / "blob", b"weight-v1")
    model = tmp_path / "model"
    model.mkdir()
    os.symlink(real, model / "model.safetensors")
    with pytest.raises(IdentityHashError, match="symlink") as caught:
        base_model_sha256(model)
    assert caught.value.code == "symlink"


def test_empty_shard_refused(tmp_path):
    _write(tmp_path / "model.safetensors", b"")
    with pytest.raises(IdentityHashError, match="empty") as caught:
        base_model_sha256(tmp_path)
    assert caught.value.code == "empty_file"


def test_no_shards_and_bad_index_refused(tmp_path):
    with pytest.raises(IdentityHashError) as caught:
        base_model_sha256(tmp_path)
    assert caught.value.code == "no_shards"
    escaping = {"weight_map": {"a": "../escape.safetensors"}}
    _write(tmp_path / "model.safetensors.index.json", json.dumps(escaping).encode())
    with pytest.raises(IdentityHashError) as caught:
        base_model_sha256(tmp_path)
    assert caught.value.code == "bad_index"


def test_missing_indexed_shard_refused(tmp_path):
    _write(tmp_path / "model.safetensors.index.json", json.dumps({"weight_map": {"a": "gone.safetensors"}}).encode())
    with pytest.raises(IdentityHashError) as caught:
        base_model_sha256(tmp_path)
    assert caught.value.code == "missing_file"


def test_streaming_hash_matches_hashlib_across_buffer_boundaries(tmp_path):
    data = os.urandom(3 * 1024 + 17)
    path = _write(tmp_path / "blob", data)
    assert sha256_file(path, buffer_bytes=1024) == (hashlib.sha256(data).digest(), len(data))


# ----------------------------------------------------------------------------- tokenizer and config


class _FakeBackend:
    def __init__(self, size: int) -> None:
        self.size = size

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.size

    def to_str(self) -> str:
        return '{"model":"fake"}'


class _FakeTokenizer:
    def __init__(self, vocab: dict[str, int], backend_size: int) -> None:
        self.vocab = vocab
        self.backend_tokenizer = _FakeBackend(backend_size)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_vocab_count_mismatch_refused():
    assert tokenizer_vocab_sha256(_FakeTokenizer({"a": 0, "b": 1}, 2)) == VOCAB_GOLDEN
    with pytest.raises(IdentityHashError) as caught:
        tokenizer_vocab_sha256(_FakeTokenizer({"a": 0, "b": 1}, 3))
    assert caught.value.code == "vocab_count_mismatch"


def test_vocab_rules():
    with pytest.raises(IdentityHashError, match="u32"):
        vocab_digest({"a": 2**32})
    with pytest.raises(IdentityHashError, match="UTF-8"):
        vocab_digest({"\ud800": 0})
    # Duplicate ids are allowed; pairs sort by (id, bytes).
    assert vocab_digest({"y": 5, "x": 5}) == vocab_digest({"x": 5, "y": 5})


def test_tokenizer_config_hashes_backend_string():
    expected = hashlib.sha256(b'{"model":"fake"}').hexdigest()
    assert tokenizer_config_sha256(_FakeTokenizer({}, 0)) == expected


def test_real_tokenizer_digests(tiny_teacher):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_teacher))
    by_dir = tokenizer_vocab_sha256(tiny_teacher)
    assert by_dir == tokenizer_vocab_sha256(tokenizer) == vocab_digest(tokenizer.get_vocab())
    expected_config = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()
    assert tokenizer_config_sha256(tiny_teacher) == expected_config


def test_model_vocab_size(tmp_path, tiny_teacher):
    assert model_vocab_size(tiny_teacher) == 400
    _write(tmp_path / "config.json", json.dumps({"text_config": {"vocab_size": 7}}).encode())
    assert model_vocab_size(tmp_path) == 7
    _write(tmp_path / "config.json", json.dumps({"vocab_size": 8, "text_config": {"vocab_size": 7}}).encode())
    with pytest.raises(IdentityHashError, match="disagrees"):
        model_vocab_size(tmp_path)


# ----------------------------------------------------------------------------- full identity


def test_tiny_teacher_identity_is_deterministic(tiny_teacher, tmp_path):
    first = local_teacher_identity(tiny_teacher, served_model_id="tiny-teacher", device_kind="cpu")
    second = local_teacher_identity(tiny_teacher, served_model_id="tiny-teacher", device_kind="cpu")
    assert first.canonical_json() == second.canonical_json()
    line = build_manifest_line(first)
    assert parse_manifest_line(line).teacher_identity == first
    assert first.protocol == KILN_FLOWS_PROTOCOL
    assert first.implementation == implementation_string()
    assert first.implementation.startswith("kiln-flows/")
    assert first.adapter is None
    assert (first.vocab_size, first.max_top_k, first.max_model_len) == (400, 32, 2048)
    assert first.max_prompt_logprob_candidates == 1_000_000
    assert first.base_model_sha256 == base_model_sha256(tiny_teacher)

    # Options that change the numerics change the inference digest, and only it.
    bf16 = local_teacher_identity(tiny_teacher, served_model_id="tiny-teacher", device_kind="cpu", dtype="bfloat16")
    assert bf16.inference_config_sha256 != first.inference_config_sha256
    assert bf16.base_model_sha256 == first.base_model_sha256


def test_inference_config_key_order_and_digest(tiny_teacher):
    from kiln_core.canonical import kiln_compact_json, sha256_hex
    from kiln_core.identity.local_teacher import library_versions

    config_bytes = (Path(tiny_teacher) / "config.json").read_bytes()
    config = build_inference_config(
        config_bytes, dtype="float32", attn_implementation="eager", device_kind="cpu",
        versions=library_versions(), max_top_k=16, max_model_len=1024,
    )
    assert list(config) == ["schema", "model_config_sha256", "dtype", "attn_implementation", "device_kind",
                            "library_versions", "max_top_k", "max_model_len"]
    assert list(config["library_versions"]) == ["kiln_flows", "torch", "transformers"]
    assert config["model_config_sha256"] == hashlib.sha256(config_bytes).hexdigest()
    identity = local_teacher_identity(
        tiny_teacher, served_model_id="t", device_kind="cpu", max_top_k=16, max_model_len=1024
    )
    assert identity.inference_config_sha256 == sha256_hex(kiln_compact_json(config).encode("utf-8"))


def test_identity_bounds_refused(tiny_teacher):
    with pytest.raises(IdentityHashError) as caught:
        local_teacher_identity(tiny_teacher, device_kind="cpu", max_top_k=401)
    assert caught.value.code == "invalid_identity"


def test_peft_adapter_dir_identity(tiny_teacher, tmp_path):
    adapter = tmp_path / "my-lora"
    _write(adapter / "adapter_model.safetensors", b"lora-bytes")
    _write(adapter / "adapter_config.json", json.dumps({"base_model_name_or_path": str(tiny_teacher)}).encode())
    identity = local_teacher_identity(adapter, served_model_id="my-lora", device_kind="cpu")
    base = local_teacher_identity(tiny_teacher, served_model_id="my-lora", device_kind="cpu")
    assert identity.adapter is not None
    assert identity.adapter.name == identity.served_model_id == "my-lora"
    assert identity.adapter.weights_sha256 == adapter_weights_sha256(adapter)
    assert identity.adapter.config_sha256 == adapter_config_sha256(adapter)
    assert identity.base_model_sha256 == base.base_model_sha256
    assert identity.tokenizer_vocab_sha256 == base.tokenizer_vocab_sha256

    _write(adapter / "adapter_config.json", json.dumps({"base_model_name_or_path": "Qwen/Qwen3-8B"}).encode())
    with pytest.raises(IdentityHashError) as caught:
        local_teacher_identity(adapter, device_kind="cpu")
    assert caught.value.code == "adapter_base_not_local"


def test_served_model_id_sanitized():
    assert served_model_id_for("teacher-large@vllm", "/x/y") == "teacher-large@vllm"
    assert served_model_id_for(" padded ", "/models/My Teacher (v2)") == "My-Teacher-v2"
    assert served_model_id_for(None, "/models/@@@") == "local-teacher"


def test_cli_manifest_from_teacher_dir(tiny_teacher, capsys):
    from flows.cli import main

    assert main(["manifest", "--teacher", str(tiny_teacher), "--alias", "tiny-teacher", "--device", "cpu",
                 "--max-top-k", "16"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1
    identity = parse_manifest_line(out[:-1]).teacher_identity
    assert identity.max_top_k == 16 and identity.served_model_id == "tiny-teacher"

    assert main(["manifest", "--teacher", str(tiny_teacher / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
