"""Content-addressed materialization of admitted corpora (DESIGN.md decision 7).

``<root>/corpora/<sha256 of the exact bytes>/`` holds ``examples.parquet``, ``targets.parquet`` and
``admission.json`` (written last: the commit). Re-admitting the same bytes for the same student is
free; another student gets its own variant; readers verify every file and ignore anything
uncommitted; local and ``memory://`` roots behave the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

from kiln_core.admission import admit_corpus
from kiln_core.admission import admit as admit_module
from kiln_core.corpus import CorpusTables
from kiln_core.materialize import read_materialization
from kiln_core.synthetic import synthesize_corpus
from kiln_core.tokenization import load_student_tokenizer

TABLE_FIELDS = [f.name for f in dataclasses.fields(CorpusTables)]


@pytest.fixture(scope="module")
def student(tiny_student):
    return load_student_tokenizer(tiny_student)


@pytest.fixture(scope="module")
def plain_student(tiny_student_plain):
    return load_student_tokenizer(tiny_student_plain)


@pytest.fixture(scope="module")
def corpus_bytes(tiny_student, tmp_path_factory) -> bytes:
    path = synthesize_corpus(
        tiny_student, tmp_path_factory.mktemp("mat") / "corpus.jsonl", n_examples=5, top_k=32, seed=17, trajectory_every=2
    )
    return path.read_bytes()


@pytest.fixture()
def corpus(tmp_path, corpus_bytes) -> Path:
    path = tmp_path / "teacher-data.jsonl"
    path.write_bytes(corpus_bytes)
    return path


def admit(path, student, tiny_student, **kwargs):
    return admit_corpus(str(path), str(tiny_student), student=student, **kwargs)


def assert_tables_equal(a: CorpusTables, b: CorpusTables) -> None:
    for name in TABLE_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if not isinstance(x, np.ndarray):  # kiln_prompts_sha256
            assert x == y, name
            continue
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- layout and record ---------------------------------------------------------------------------


def test_admission_writes_the_committed_layout(corpus, corpus_bytes, student, tiny_student, tmp_path):
    root = tmp_path / "root"
    result = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    hex_digest = hashlib.sha256(corpus_bytes).hexdigest()
    directory = root / "corpora" / hex_digest
    assert Path(result.materialized) == directory
    assert not result.reused
    assert sorted(p.name for p in directory.iterdir()) == ["admission.json", "examples.parquet", "targets.parquet"]
    assert [p.name for p in (root / "corpora").iterdir()] == [hex_digest]  # no staging left next to it

    record = json.loads((directory / "admission.json").read_text(encoding="utf-8"))
    assert record["dataset_sha256"] == "sha256:" + hex_digest == result.dataset_sha256
    assert record["effective_top_k"] == 32 and record["requested_top_k"] == 32
    assert (record["examples"], record["action_tokens"], record["env_tokens"]) == (
        result.examples, result.action_tokens, result.env_tokens
    )
    assert record["examples"] == 5 and record["action_tokens"] > 0 and record["env_tokens"] > 0
    assert record["student"] == student.identity()
    assert set(record["student"]) >= {"tokenizer_vocab_sha256", "tokenizer_config_sha256", "chat_template_sha256", "vocab_size"}
    assert record["manifest_line"] == corpus_bytes.split(b"\n", 1)[0].decode("utf-8")
    assert record["manifest_line_number"] == 1
    assert record["teacher_identity_revision"] == result.teacher_identity.identity_revision()
    assert set(record["files"]) == {"examples.parquet", "targets.parquet"}
    for name, digest in record["files"].items():
        assert digest["bytes"] == (directory / name).stat().st_size
        assert digest["sha256"] == sha256_file(directory / name)
    tables = result.tables
    assert record["format_version"] == "kiln-flows.admission.v2"
    assert record["env_tokens_in_warning_prefix"] == int(tables.env_in_warning_prefix.sum()) > 0
    # Kiln's counts: env tokens after the default warning filter, |O| before it, context the rest
    assert record["env_tokens"] == len(tables.env_positions) - record["env_tokens_in_warning_prefix"]
    assert record["observation_tokens"] == int(tables.observation_tokens.sum()) == len(tables.env_positions)
    assert record["context_tokens"] == len(tables.input_ids) - len(tables.action_positions) - record["env_tokens"]


def test_materialization_of_another_format_version_is_never_reused(corpus, student, tiny_student, tmp_path):
    """An older kiln-flows built other masks: its commit is left alone and a fresh variant is written."""
    root = tmp_path / "root"
    first = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    commit = Path(first.materialized) / "admission.json"
    old = json.loads(commit.read_text(encoding="utf-8"))
    old["format_version"] = "kiln-flows.admission.v1"
    commit.write_text(json.dumps(old), encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="another format"):
        read_materialization(first.materialized)
    again = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    assert not again.reused
    assert again.materialized != first.materialized
    assert Path(again.materialized).is_relative_to(Path(first.materialized) / "variants")
    assert json.loads(commit.read_text(encoding="utf-8"))["format_version"] == "kiln-flows.admission.v1"
    assert_tables_equal(read_materialization(again.materialized).tables, first.tables)
    assert admit(corpus, student, tiny_student, out_root=str(root), top_k=32).reused


def test_read_materialization_round_trips_every_array(corpus, student, tiny_student, tmp_path):
    root = tmp_path / "root"
    result = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    read = read_materialization(result.materialized)
    assert read.record.dataset_sha256 == result.dataset_sha256
    assert read.tables.top_k == 32
    assert_tables_equal(read.tables, result.tables)
    # and it equals a validate-only admission of the same bytes
    assert_tables_equal(read.tables, admit(corpus, student, tiny_student, top_k=32).tables)
    example = read.tables.example(0)
    assert example.teacher_ids.shape == (len(example.action_positions), 32)
    assert example.teacher_logprobs.dtype == np.float32


def test_top_k_16_materializes_the_first_16_candidates(corpus, student, tiny_student, tmp_path):
    root = tmp_path / "root"
    wide = admit(corpus, student, tiny_student, top_k=32).tables
    narrow = admit(corpus, student, tiny_student, out_root=str(root), top_k=20)
    assert narrow.effective_top_k == 16
    tables = read_materialization(narrow.materialized).tables
    np.testing.assert_array_equal(tables.teacher_ids, wide.teacher_ids[:, :16])
    np.testing.assert_array_equal(tables.teacher_logprobs, wide.teacher_logprobs[:, :16])


# --- reuse and variants --------------------------------------------------------------------------


def test_readmitting_the_same_bytes_reuses_without_parsing(corpus, student, tiny_student, tmp_path, monkeypatch):
    root = tmp_path / "root"
    first = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)

    def no_parsing(data, **options):
        raise AssertionError("parse_corpus must not run for a reused materialization")

    monkeypatch.setattr(admit_module, "parse_corpus", no_parsing)
    again = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    assert again.reused is True
    assert again.materialized == first.materialized
    assert (again.examples, again.action_tokens, again.env_tokens, again.dataset_sha256) == (
        first.examples, first.action_tokens, first.env_tokens, first.dataset_sha256
    )
    assert again.teacher_identity == first.teacher_identity
    assert_tables_equal(again.tables, first.tables)
    # a copy of the same bytes under another name is the same corpus
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(corpus.read_bytes())
    assert admit(copy, student, tiny_student, out_root=str(root), top_k=32).reused is True
    # without out_root nothing can be reused: the parser runs (and here, refuses)
    with pytest.raises(AssertionError, match="must not run"):
        admit(corpus, student, tiny_student, top_k=32)


def test_another_student_gets_its_own_variant(
    corpus, student, plain_student, tiny_student, tiny_student_plain, tmp_path, monkeypatch
):
    assert student.identity() != plain_student.identity()
    assert student.identity()["tokenizer_vocab_sha256"] == plain_student.identity()["tokenizer_vocab_sha256"]
    root = tmp_path / "root"
    first = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    second = admit(corpus, plain_student, tiny_student_plain, out_root=str(root), top_k=32)
    assert not second.reused
    assert second.materialized != first.materialized
    assert Path(second.materialized).is_relative_to(root / "corpora")
    a, b = read_materialization(first.materialized), read_materialization(second.materialized)
    assert a.record.student == student.identity()
    assert b.record.student == plain_student.identity()
    assert a.record.dataset_sha256 == b.record.dataset_sha256
    assert_tables_equal(a.tables, b.tables)  # same tokenizer, same marked positions
    # both are found again and reused
    monkeypatch.setattr(admit_module, "parse_corpus", lambda data, **options: pytest.fail("re-parsed"))
    again_first = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    again_second = admit(corpus, plain_student, tiny_student_plain, out_root=str(root), top_k=32)
    assert (again_first.reused, again_second.reused) == (True, True)
    assert (again_first.materialized, again_second.materialized) == (first.materialized, second.materialized)


def test_another_top_k_gets_its_own_variant(corpus, student, tiny_student, tmp_path):
    root = tmp_path / "root"
    k32 = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    k16 = admit(corpus, student, tiny_student, out_root=str(root), top_k=16)
    assert not k16.reused and k16.materialized != k32.materialized
    assert read_materialization(k16.materialized).tables.top_k == 16
    assert read_materialization(k32.materialized).tables.top_k == 32
    assert admit(corpus, student, tiny_student, out_root=str(root), top_k=31).reused  # resolves to 16 again


# --- verification on read ------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip-byte", "truncate", "append"])
@pytest.mark.parametrize("name", ["examples.parquet", "targets.parquet"])
def test_corrupted_file_is_detected_on_read(corpus, student, tiny_student, tmp_path, damage, name):
    root = tmp_path / "root"
    result = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    target = Path(result.materialized) / name
    data = bytearray(target.read_bytes())
    if damage == "flip-byte":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        del data[-1]
    else:
        data += b"\0"
    target.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="size or SHA-256"):
        read_materialization(result.materialized).tables
    reused = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    assert reused.reused
    with pytest.raises(ValueError, match="size or SHA-256"):
        reused.tables


def test_reading_an_uncommitted_directory_fails(tmp_path):
    directory = tmp_path / "corpora" / ("a" * 64)
    directory.mkdir(parents=True)
    (directory / "examples.parquet").write_bytes(b"junk")
    with pytest.raises(FileNotFoundError):
        read_materialization(str(directory))


# --- uncommitted leftovers -----------------------------------------------------------------------


def test_files_without_admission_json_are_absent(corpus, corpus_bytes, student, tiny_student, tmp_path):
    root = tmp_path / "root"
    directory = root / "corpora" / hashlib.sha256(corpus_bytes).hexdigest()
    directory.mkdir(parents=True)
    (directory / "examples.parquet").write_bytes(b"half-written")
    (directory / "stray.tmp").write_bytes(b"x")
    result = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    assert not result.reused
    assert Path(result.materialized) == directory
    read = read_materialization(result.materialized)
    assert_tables_equal(read.tables, result.tables)
    assert (directory / "examples.parquet").read_bytes() != b"half-written"
    assert not (directory / "stray.tmp").exists()


def test_leftover_staging_directory_is_ignored(corpus, corpus_bytes, student, tiny_student, tmp_path):
    root = tmp_path / "root"
    hex_digest = hashlib.sha256(corpus_bytes).hexdigest()
    staging = root / "corpora" / f".{hex_digest}.incomplete-{uuid.uuid4()}"
    staging.mkdir(parents=True)
    (staging / ".incomplete").write_text(f"sha256:{hex_digest}\n")
    (staging / "examples.parquet").write_bytes(b"partial")
    (staging / "admission.json").write_text("{}")  # even a commit file inside staging is not a commit
    result = admit(corpus, student, tiny_student, out_root=str(root), top_k=32)
    assert not result.reused
    assert Path(result.materialized) == root / "corpora" / hex_digest
    assert_tables_equal(read_materialization(result.materialized).tables, result.tables)
    assert admit(corpus, student, tiny_student, out_root=str(root), top_k=32).reused


# --- memory:// -----------------------------------------------------------------------------------


def test_memory_root_and_memory_corpus(corpus_bytes, student, tiny_student, tmp_path, monkeypatch):
    bucket = f"memory://kiln-mat-{uuid.uuid4().hex}"
    fs, corpus_path = fsspec.core.url_to_fs(bucket + "/in/teacher-data.jsonl")
    fs.pipe(corpus_path, corpus_bytes)
    root = bucket + "/store"
    result = admit(bucket + "/in/teacher-data.jsonl", student, tiny_student, out_root=root, top_k=32)
    hex_digest = hashlib.sha256(corpus_bytes).hexdigest()
    assert result.dataset_sha256 == "sha256:" + hex_digest
    assert result.materialized.startswith("memory://")
    assert result.materialized.rstrip("/").endswith(f"/corpora/{hex_digest}")
    _, directory = fsspec.core.url_to_fs(result.materialized)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(directory)) == [
        "admission.json", "examples.parquet", "targets.parquet"
    ]
    record = json.loads(fs.cat(directory + "/admission.json"))
    for name, digest in record["files"].items():
        data = fs.cat(directory + "/" + name)
        assert (len(data), hashlib.sha256(data).hexdigest()) == (digest["bytes"], digest["sha256"])
    local = tmp_path / "local.jsonl"
    local.write_bytes(corpus_bytes)
    assert_tables_equal(read_materialization(result.materialized).tables, admit(local, student, tiny_student, top_k=32).tables)

    monkeypatch.setattr(admit_module, "parse_corpus", lambda data, **options: pytest.fail("re-parsed"))
    again = admit(bucket + "/in/teacher-data.jsonl", student, tiny_student, out_root=root, top_k=32)
    assert again.reused and again.materialized == result.materialized


def test_memory_prefix_without_commit_is_absent(corpus_bytes, student, tiny_student, tmp_path):
    bucket = f"memory://kiln-mat-{uuid.uuid4().hex}"
    hex_digest = hashlib.sha256(corpus_bytes).hexdigest()
    fs, directory = fsspec.core.url_to_fs(f"{bucket}/corpora/{hex_digest}")
    fs.pipe(directory + "/examples.parquet", b"half-written")
    with pytest.raises(FileNotFoundError):
        read_materialization(f"{bucket}/corpora/{hex_digest}")
    local = tmp_path / "corpus.jsonl"
    local.write_bytes(corpus_bytes)
    result = admit(local, student, tiny_student, out_root=bucket, top_k=32)
    assert not result.reused
    assert_tables_equal(read_materialization(result.materialized).tables, result.tables)


def test_corrupted_memory_file_is_detected(corpus, student, tiny_student):
    root = f"memory://kiln-mat-{uuid.uuid4().hex}"
    result = admit(corpus, student, tiny_student, out_root=root, top_k=32)
    fs, directory = fsspec.core.url_to_fs(result.materialized)
    data = bytearray(fs.cat(directory + "/targets.parquet"))
    data[100] ^= 0xFF
    fs.pipe(directory + "/targets.parquet", bytes(data))
    with pytest.raises(ValueError, match="size or SHA-256"):
        read_materialization(result.materialized).tables


# --- the digest is of the exact bytes ------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b + b"\n",
        lambda b: b.replace(b"\n", b" \n", 2).replace(b" \n", b"\n", 1),  # trailing space on line 2
        lambda b: b.replace(b"\n", b"\r\n"),
        lambda b: b.rstrip(b"\n"),
    ],
    ids=["extra-blank-line", "trailing-space", "crlf", "no-final-newline"],
)
def test_whitespace_change_gives_another_digest(corpus_bytes, student, tiny_student, tmp_path, change):
    changed = change(corpus_bytes)
    assert changed != corpus_bytes
    original_path, changed_path = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    original_path.write_bytes(corpus_bytes)
    changed_path.write_bytes(changed)
    root = tmp_path / "root"
    original = admit(original_path, student, tiny_student, out_root=str(root), top_k=32)
    other = admit(changed_path, student, tiny_student, out_root=str(root), top_k=32)
    assert other.dataset_sha256 == "sha256:" + hashlib.sha256(changed).hexdigest()
    assert other.dataset_sha256 != original.dataset_sha256
    assert not other.reused
    assert other.materialized != original.materialized
    assert_tables_equal(other.tables, original.tables)
    assert len(list((root / "corpora").iterdir())) == 2
