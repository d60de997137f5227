"""Admission, materialization and the pipeline on ``file://`` URIs and ``memory://`` roots.

``file://`` must behave exactly like a plain local path (staging + sentinel + rename, URIs recorded as
given), never as a relative directory named ``file:``; ``memory://`` is an object-store-like fsspec
filesystem (no rename: files first, commit file last) that lives in this process.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from kiln_core.canonical import sha256_hex, sha256_prefixed
from kiln_core.storage import resolve

ADAPTER = "demo"


@pytest.fixture(scope="module")
def corpus_file(tiny_student, tiny_teacher, tmp_path_factory) -> Path:
    """A 6-example scored corpus whose manifest is the local teacher directory's identity."""
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.synthetic import synthesize_corpus

    line = build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32))
    path = tmp_path_factory.mktemp("uris-corpus") / "corpus.jsonl"
    return synthesize_corpus(str(tiny_student), str(path), n_examples=6, top_k=16, manifest_line=line)


@pytest.fixture(scope="module")
def local_admission(corpus_file, tiny_student):
    """The same corpus admitted from a plain path without materializing (the reference tables)."""
    from kiln_core.admission import admit_corpus

    return admit_corpus(str(corpus_file), str(tiny_student), top_k=16)


@pytest.fixture
def memory_root():
    """A ``memory://`` root unique to the test, removed afterwards."""
    import fsspec

    name = f"kiln-uris-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _tables_equal(a, b) -> None:
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def _flip_a_byte(location) -> None:
    data = bytearray(location.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with location.fs.open(location.path, "wb") as handle:
        handle.write(bytes(data))


def _round_trip(corpus_uri: str, root: str, tiny_student, corpus_file: Path, local_admission) -> str:
    """Admit ``corpus_uri`` into ``root``, re-admit (reuse), read back; returns the materialization URI."""
    from kiln_core.admission import admit_corpus
    from kiln_core.materialize import read_materialization

    hex_digest = sha256_hex(corpus_file.read_bytes())
    first = admit_corpus(corpus_uri, str(tiny_student), top_k=16, out_root=root)
    assert first.reused is False and first.examples == 6
    assert first.dataset_sha256 == local_admission.dataset_sha256 == "sha256:" + hex_digest
    assert first.source_uri == corpus_uri
    assert first.materialized == f"{root}/corpora/{hex_digest}"
    location = resolve(first.materialized)
    assert sorted(location.fs.ls(location.path, detail=False)) == sorted(
        location.child(name).path for name in ("admission.json", "examples.parquet", "targets.parquet"))
    record = json.loads(location.child("admission.json").read_bytes())
    assert record["source_uri"] == corpus_uri
    _tables_equal(read_materialization(first.materialized).tables, local_admission.tables)

    again = admit_corpus(corpus_uri, str(tiny_student), top_k=16, out_root=root)
    assert again.reused is True and again.materialized == first.materialized
    _tables_equal(again.tables, local_admission.tables)
    return first.materialized


def _corruption_is_refused(uri: str) -> None:
    from kiln_core.materialize import read_materialization

    _flip_a_byte(resolve(uri).child("examples.parquet"))
    with pytest.raises(ValueError, match="does not match admission.json"):
        read_materialization(uri).tables


def test_admission_round_trip_on_file_uris(corpus_file, tiny_student, local_admission, tmp_path):
    from kiln_core.admission import admit_corpus

    root_dir = tmp_path / "store"
    root = f"file://{root_dir}"
    uri = _round_trip(f"file://{corpus_file}", root, tiny_student, corpus_file, local_admission)
    assert uri.startswith("file:///")
    corpora = root_dir / "corpora"
    # Local semantics: staged, renamed into place, nothing hidden (staging, sentinel) left behind.
    assert [p.name for p in corpora.iterdir()] == [uri.rsplit("/", 1)[-1]]
    assert sorted(p.name for p in (corpora / uri.rsplit("/", 1)[-1]).iterdir()) == [
        "admission.json", "examples.parquet", "targets.parquet"]
    # A plain path to the same root finds the same materialization, and vice versa.
    plain = admit_corpus(str(corpus_file), str(tiny_student), top_k=16, out_root=str(root_dir))
    assert plain.reused is True and plain.materialized == str(corpora / uri.rsplit("/", 1)[-1])
    _corruption_is_refused(uri)


def test_admission_round_trip_on_memory_corpus_and_root(corpus_file, tiny_student, local_admission, memory_root):
    from kiln_core.admission import admit_corpus
    from kiln_core.materialize import read_materialization

    corpus_uri = f"{memory_root}/inputs/corpus.jsonl"
    location = resolve(corpus_uri)
    location.fs.pipe(location.path, corpus_file.read_bytes())
    root = f"{memory_root}/store"
    uri = _round_trip(corpus_uri, root, tiny_student, corpus_file, local_admission)
    assert uri.startswith("memory://")

    # Object-store semantics: without admission.json the prefix is absent; admission writes it again.
    materialized = resolve(uri)
    materialized.fs.rm(materialized.child("admission.json").path)
    with pytest.raises(FileNotFoundError, match="not a committed corpus materialization"):
        read_materialization(uri)
    rewritten = admit_corpus(corpus_uri, str(tiny_student), top_k=16, out_root=root)
    assert rewritten.reused is False and rewritten.materialized == uri
    _corruption_is_refused(uri)


def test_opd_distill_flow_with_a_file_uri_storage_root(prefect_harness, tiny_teacher, tiny_student, corpus_file,
                                                       tmp_path, monkeypatch):
    from flows.opd_distill import opd_distill
    from flows.spec import parse_spec

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a file:// URI mistaken for a relative path would show up here
    root_dir = tmp_path / "kiln-data"
    storage_root = f"file://{root_dir}"
    spec = parse_spec({
        "teacher": {"kind": "local_dir", "path": str(tiny_teacher)},
        "corpus": f"file://{corpus_file}",
        "student": f"file://{tiny_student}",
        "storage_root": storage_root,
        "adapter": ADAPTER,
        "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "checkpoint_interval": 2,
                   "learning_rate": 0.02, "lora_rank": 4, "lora_alpha": 8.0, "seed": 11, "optimizer": {"kind": "adam_w"}},
        "options": {"train_retries": 0},
    })
    summary = opd_distill(spec)
    assert summary["status"] == "success", summary
    assert summary["latest"] == f"{storage_root}/runs/{ADAPTER}/latest.json"
    for name in ("adapter", "receipt", "run"):
        assert summary[name].startswith(f"{storage_root}/runs/{ADAPTER}/"), (name, summary[name])
    assert list(cwd.iterdir()) == []

    run_dir = Path(resolve(summary["run"]).path)
    assert run_dir.parent == root_dir / "runs" / ADAPTER
    assert (root_dir / "corpora" / sha256_hex(corpus_file.read_bytes()) / "admission.json").is_file()
    latest = json.loads((root_dir / "runs" / ADAPTER / "latest.json").read_text())
    receipt_bytes = (run_dir / "train_receipt.json").read_bytes()
    adapter = (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()
    assert latest["receipt"] == summary["receipt"] and latest["adapter"] == summary["adapter"]
    assert latest["receipt_sha256"] == "sha256:" + sha256_hex(receipt_bytes)
    assert latest["adapter_model_sha256"] == sha256_prefixed(adapter)
    assert json.loads(receipt_bytes)["status"] == "success"
    assert (run_dir / f"{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint" / "checkpoint_manifest.json").is_file()
    assert not [p for p in run_dir.rglob("*") if ".incomplete" in p.name]

    # The same spec again: the admitted corpus and the finished run are found, nothing is retrained.
    mtime = os.stat(run_dir / "adapter" / "adapter_model.safetensors").st_mtime_ns
    again = opd_distill(spec)
    assert again["status"] == "success" and again["adapter"] == summary["adapter"]
    assert again["receipt"] == summary["receipt"] and again["final_loss"] == summary["final_loss"]
    assert os.stat(run_dir / "adapter" / "adapter_model.safetensors").st_mtime_ns == mtime
    assert list(cwd.iterdir()) == []


def test_a_storage_root_is_checked_in_process_before_any_work(tmp_path):
    """``check_storage_root`` itself (the CLI subprocess tests are in tests/test_newcomer_cli.py)."""
    from kiln_core.storage_root import check_storage_root
    from kiln_core.storage_settings import StorageRejection

    assert check_storage_root(str(tmp_path / "new" / "root")).is_local
    assert not (tmp_path / "new").exists()  # checked, not created
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageRejection) as in_the_way:
        check_storage_root(str(tmp_path / "file" / "root"), field="--out")
    assert (in_the_way.value.code, in_the_way.value.field) == ("out_not_directory", "--out")
    with pytest.raises(StorageRejection) as typo:
        check_storage_root("s3:/bucket/kiln")
    assert typo.value.code == "invalid_uri" and "s3://bucket/kiln" in typo.value.message
