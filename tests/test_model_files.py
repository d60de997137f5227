"""Student and teacher model directories: files that do not parse are refused naming the file
(``model_unreadable``, exit 2) before any work, and a Hugging Face cache snapshot — files that are symlinks
into the same cache's ``blobs/`` — is accepted with the identity of a plain copy; a link out of the
cache is still refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from kiln_core.identity.hashing import IdentityHashError, base_model_sha256
from kiln_core.identity.local_teacher import local_teacher_identity
from kiln_core.identity.model_files import ModelUnreadable, check_model_files
from kiln_core.synthetic import synthesize_corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 9, "epochs": 1,
          "checkpoint_interval": None}


@pytest.fixture(scope="module")
def request_file(tiny_student, tmp_path_factory) -> Path:
    """An off-policy request for the tiny student (corpus and teacher manifest beside it)."""
    directory = tmp_path_factory.mktemp("model-files")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=2, top_k=16, seed=8)
    (directory / "teacher-manifest.jsonl").write_text((directory / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    request = directory / "request.json"
    request.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl", "config": CONFIG}))
    return request


def hf_cache_snapshot(model: Path, cache: Path, name: str = "models--kiln--tiny") -> Path:
    """``model`` laid out as the Hugging Face cache does: each file a blob named by its digest, the snapshot's
    entries relative symlinks to them (``snapshots/<rev>/config.json -> ../../blobs/<sha256>``)."""
    repo = cache / name
    snapshot = repo / "snapshots" / ("0123abcd" * 5)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(model.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    return snapshot


def damaged_copy(model: Path, where: Path, file: str, content: bytes | None = None) -> Path:
    """A copy of ``model`` whose ``file`` is cut in half (or replaced by ``content``)."""
    shutil.copytree(model, where)
    target = where / file
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2] if content is None else content)
    return where


def test_a_truncated_student_shard_is_refused_naming_the_file_before_any_work(tiny_student, request_file, tmp_path):
    student = damaged_copy(tiny_student, tmp_path / "student", "model.safetensors")
    argv = [sys.executable, "-m", "flows.cli", "train", "--request", str(request_file), "--adapter", "cut",
            "--student", str(student), "--out", str(tmp_path / "out"), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert (record["status"], record["code"], record["field"]) == ("rejected", "model_unreadable", "student")
    assert record["file"] == str(student / "model.safetensors") and "truncated" in record["message"]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()  # refused before admission wrote anything


@pytest.mark.parametrize("file, content, problem", [
    ("config.json", b"{garbage", "not valid JSON"),
    ("config.json", b"[1, 2]", "not a JSON object"),
    ("model.safetensors", b"\x05\x00", "shorter than the safetensors header length"),
    ("model.safetensors", (10**9).to_bytes(8, "little") + b"{}", "header claims"),
    ("model.safetensors", (2).to_bytes(8, "little") + b"[]", "header is not a JSON object"),
    ("model.safetensors", (4).to_bytes(8, "little") + b"{\"x\"", "header is not JSON"),
])
def test_a_model_file_that_does_not_parse_is_model_unreadable(tiny_student, tmp_path, file, content, problem):
    model = damaged_copy(tiny_student, tmp_path / "model", file, content)
    with pytest.raises(ModelUnreadable) as caught:
        check_model_files(model, role="teacher")
    assert (caught.value.code, caught.value.field, caught.value.file) == ("model_unreadable", "teacher", str(model / file))
    assert problem in caught.value.message


def test_a_model_with_trailing_bytes_after_its_tensors_is_refused(tiny_student, tmp_path):
    model = damaged_copy(tiny_student, tmp_path / "model", "model.safetensors",
                         (tiny_student / "model.safetensors").read_bytes() + b"\0" * 16)
    with pytest.raises(ModelUnreadable, match="cover"):
        check_model_files(model)


def test_a_truncated_teacher_is_refused_before_hashing_and_before_loading(tiny_teacher, tmp_path):
    from kiln_core.scoring.local import LocalTeacher

    teacher = damaged_copy(tiny_teacher, tmp_path / "teacher", "model.safetensors")
    with pytest.raises(ModelUnreadable) as caught:
        local_teacher_identity(teacher, served_model_id="cut")
    assert caught.value.file == str(teacher.resolve() / "model.safetensors")
    with pytest.raises(ModelUnreadable):  # a registered teacher damaged since: refused, not a crash in transformers
        LocalTeacher.load(str(teacher), vocab_size=1, device="cpu")


def test_a_cache_snapshot_teacher_has_the_identity_of_a_plain_copy(tiny_teacher, tmp_path):
    snapshot = hf_cache_snapshot(tiny_teacher, tmp_path / "hub")
    assert all((snapshot / name).is_symlink() for name in ("model.safetensors", "config.json", "tokenizer.json"))
    plain = local_teacher_identity(tiny_teacher, served_model_id="teacher")
    cached = local_teacher_identity(snapshot, served_model_id="teacher")
    assert cached == plain  # every digest is over the resolved bytes


def test_a_cache_snapshot_student_trains_as_the_same_run_as_a_plain_copy(tiny_student, request_file, tmp_path, capsys):
    from kiln_core.engine import spec_from_request
    from kiln_core.engine.pipeline import prepare

    snapshot = hf_cache_snapshot(tiny_student, tmp_path / "hub")
    assert base_model_sha256(snapshot) == base_model_sha256(tiny_student)
    planned = {}
    for label, student in (("plain", tiny_student), ("cache", snapshot)):
        run = spec_from_request(str(request_file), adapter="cached", student_dir=str(student), out_root=str(tmp_path / label))
        planned[label] = prepare(run.spec, resume=None).plan
    # the run key digests the student's weights, tokenizer and config: the same model, the same run
    assert Path(planned["cache"].run_uri).name == Path(planned["plain"].run_uri).name
    code = main(["train", "--request", str(request_file), "--adapter", "cached", "--student", str(snapshot),
                 "--out", str(tmp_path / "cache"), "--json", "--quiet"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["status"] == "success", result
    assert Path(result["run"]).name == Path(planned["plain"].run_uri).name
    receipt = json.loads(Path(result["receipt"]).read_text())
    shards = receipt["model"]["base_weight_shard_manifest"]["shards"]
    assert [shard["filename"] for shard in shards] == ["model.safetensors"]  # the snapshot's name, not the blob's


def test_a_symlink_out_of_its_cache_is_refused(tiny_student, request_file, tmp_path, capsys):
    snapshot = hf_cache_snapshot(tiny_student, tmp_path / "hub")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copyfile(tiny_student / "model.safetensors", outside)
    (snapshot / "model.safetensors").unlink()
    os.symlink(outside, snapshot / "model.safetensors")
    with pytest.raises(IdentityHashError) as caught:
        base_model_sha256(snapshot)
    assert caught.value.code == "symlink" and "outside its Hugging Face cache" in caught.value.message
    code = main(["train", "--request", str(request_file), "--adapter", "escape", "--student", str(snapshot),
                 "--out", str(tmp_path / "out"), "--json"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 2 and record["code"] == "symlink", record
    assert not (tmp_path / "out").exists()


def test_a_symlink_in_a_plain_model_directory_is_still_refused(tiny_student, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_student, model)
    (model / "model.safetensors").unlink()
    os.symlink(tiny_student / "model.safetensors", model / "model.safetensors")
    with pytest.raises(IdentityHashError) as caught:
        check_model_files(model)
    assert caught.value.code == "symlink"
