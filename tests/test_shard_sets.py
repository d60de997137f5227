"""A corpus as an ordered set of shards (a directory or an index): each shard admitted as the single file it
is, materialized under its own digest and reused; the set's own rules and codes; the set record written
last; ``--workers N`` agreeing with one worker.

Shards are built by ``kiln_core.synthetic`` for the tiny student (line 1 the manifest, 16 candidates per
teacher token), two or three examples each, so every test stays fast.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from flows.cli import main
from kiln_core.admission import admit_corpus
from kiln_core.admission.shards import admit_shard_set, build_index, is_shard_set
from kiln_core.contracts.corpus_shards import CorpusSetRecord, set_sha256
from kiln_core.contracts.identity import TeacherIdentity, build_manifest_line
from kiln_core.errors import SHARD_SET_CODES, AdmissionError
from kiln_core.synthetic import synthesize_corpus


@pytest.fixture(scope="module")
def shard_lines(tiny_student, tmp_path_factory) -> list[list[str]]:
    """Four valid shards' lines (same teacher manifest, different examples)."""
    directory = tmp_path_factory.mktemp("shards")
    shards = []
    for seed in range(4):
        path = synthesize_corpus(tiny_student, directory / f"s{seed}.jsonl", n_examples=2, top_k=16, seed=40 + seed)
        shards.append(path.read_text(encoding="utf-8").splitlines())
    return shards


def write_shard(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def shard_directory(tmp_path: Path, shards: list[list[str]], names: list[str] | None = None) -> Path:
    directory = tmp_path / "corpus"
    directory.mkdir()
    for name, lines in zip(names or [f"part-{i:03d}.jsonl" for i in range(len(shards))], shards):
        write_shard(directory / name, lines)
    return directory


def digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def admit_cli(capsys, corpus, student, *extra) -> tuple[int, dict]:
    code = main(["admit", str(corpus), "--student", str(student), "--top-k", "16", "--json", *map(str, extra)])
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1, out
    return code, json.loads(out)


def set_records(root: Path) -> dict[str, bytes]:
    sets = root / "corpora" / "sets"
    return {str(p.relative_to(sets)): p.read_bytes() for p in sets.rglob("*.json")} if sets.exists() else {}


def rejected(corpus, student, root: Path | None = None, **kwargs) -> AdmissionError:
    with pytest.raises(AdmissionError) as caught:
        admit_shard_set(str(corpus), str(student), top_k=16, out_root=str(root) if root else None, **kwargs)
    if root is not None:
        assert set_records(root) == {}, "a rejected set must leave no set record"
    return caught.value


# --- admitted sets -------------------------------------------------------------------------------------


def test_directory_set_is_admitted_in_byte_order_of_names(capsys, tiny_student, shard_lines, tmp_path):
    # Byte order: "B-..." < "a-..." < "b-..."; hidden files and other suffixes are not shards.
    directory = shard_directory(tmp_path, shard_lines[:3], ["b-last.jsonl", "B-first.jsonl", "a-middle.jsonl"])
    (directory / ".staging.jsonl").write_text("{not json\n", encoding="utf-8")
    (directory / "notes.txt").write_text("not a shard\n", encoding="utf-8")
    root = tmp_path / "root"
    code, value = admit_cli(capsys, directory, tiny_student, "--out", root)
    assert code == 0
    ordered = [directory / "B-first.jsonl", directory / "a-middle.jsonl", directory / "b-last.jsonl"]
    assert [s["shard"] for s in value["shards"]] == [p.name for p in ordered]
    assert [s["dataset_sha256"] for s in value["shards"]] == [digest(p) for p in ordered]
    assert value["set_sha256"] == set_sha256([digest(p) for p in ordered])
    # The recipe, spelled out: the format line, then each shard digest on its own line.
    recipe = "kiln-flows.corpus-set.v1\n" + "".join(digest(p) + "\n" for p in ordered)
    assert value["set_sha256"] == "sha256:" + hashlib.sha256(recipe.encode()).hexdigest()
    assert value["totals"] == {"shards": 3, "examples": 6, "reused_shards": 0,
                               **{key: sum(s[key] for s in value["shards"])
                                  for key in ("action_tokens", "env_tokens", "observation_tokens")}}
    assert value["totals"]["action_tokens"] > 0
    assert not any(s["reused"] for s in value["shards"])

    record_path = Path(value["set_record"])
    assert record_path.parent == root / "corpora" / "sets" / value["set_sha256"].removeprefix("sha256:")
    record = CorpusSetRecord.model_validate_json(record_path.read_bytes())
    assert record.set_sha256 == value["set_sha256"]
    assert record.manifest_line == shard_lines[0][0]
    assert [s.dataset_sha256 for s in record.shards] == [digest(p) for p in ordered]
    for shard in record.shards:  # each shard materialized on its own, under its own digest
        assert shard.materialized == "corpora/" + shard.dataset_sha256.removeprefix("sha256:")
        assert (root / shard.materialized / "admission.json").is_file()


def test_index_set_is_admitted_in_index_order(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:3])
    names = ["part-002.jsonl", "part-000.jsonl", "sub/part-001.jsonl"]
    write_shard(directory / "sub" / "part-001.jsonl", shard_lines[1])
    index = directory / "corpus.index.json"
    build_index(str(index), names)
    code, value = admit_cli(capsys, index, tiny_student, "--out", tmp_path / "root")
    assert code == 0
    assert [s["shard"] for s in value["shards"]] == names
    assert value["set_sha256"] == set_sha256([digest(directory / name) for name in names])
    assert Path(value["set_record"]).is_file()


def test_index_is_recognized_by_its_format_as_well_as_its_name(tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:1])
    build_index(str(directory / "shards.json"), ["part-000.jsonl"])
    assert is_shard_set(str(directory / "shards.json"))
    assert is_shard_set(str(directory))
    assert not is_shard_set(str(directory / "part-000.jsonl"))
    assert not is_shard_set(str(directory / "absent.jsonl"))  # a missing file keeps its single-file verdict
    result = admit_shard_set(str(directory / "shards.json"), str(tiny_student), top_k=16)
    assert result.record_uri is None and result.shards[0].materialized is None  # validated only


def test_readmission_reuses_every_shard_and_rewrites_the_same_record(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:3])
    root = tmp_path / "root"
    _, first = admit_cli(capsys, directory, tiny_student, "--out", root)
    records = set_records(root)
    _, again = admit_cli(capsys, directory, tiny_student, "--out", root)
    assert [s["reused"] for s in again["shards"]] == [True, True, True]
    assert again["totals"]["reused_shards"] == 3
    assert again["set_sha256"] == first["set_sha256"]
    assert set_records(root) == records


def test_adding_a_shard_admits_only_the_new_one(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:2])
    root = tmp_path / "root"
    _, first = admit_cli(capsys, directory, tiny_student, "--out", root)
    write_shard(directory / "part-002.jsonl", shard_lines[2])
    _, grown = admit_cli(capsys, directory, tiny_student, "--out", root)
    assert [s["reused"] for s in grown["shards"]] == [True, True, False]
    assert grown["set_sha256"] != first["set_sha256"]
    assert len(set_records(root)) == 2  # each set keeps its own record


def test_one_shard_set_shard_is_the_single_file(tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:1])
    shard = directory / "part-000.jsonl"
    single = admit_corpus(str(shard), str(tiny_student), top_k=16, out_root=str(tmp_path / "single"))
    in_set = admit_shard_set(str(directory), str(tiny_student), top_k=16, out_root=str(tmp_path / "set"))
    (only,) = in_set.shards
    assert only.dataset_sha256 == single.dataset_sha256 == digest(shard)
    assert (only.examples, only.action_tokens, only.env_tokens) == (single.examples, single.action_tokens,
                                                                   single.env_tokens)
    # Kiln's single-file digest stays the file's; the set digest is another thing.
    assert in_set.set_sha256 == set_sha256([single.dataset_sha256]) != single.dataset_sha256
    single_files = sorted(p.name for p in (tmp_path / "single" / "corpora").rglob("*") if p.is_file())
    set_files = sorted(p.name for p in (tmp_path / "set" / "corpora" / single.dataset_sha256[7:]).rglob("*"))
    assert single_files == set_files == ["admission.json", "examples.parquet", "targets.parquet"]
    for name in ("examples.parquet", "targets.parquet"):
        assert (tmp_path / "single" / "corpora" / single.dataset_sha256[7:] / name).read_bytes() == \
               (tmp_path / "set" / "corpora" / single.dataset_sha256[7:] / name).read_bytes()


def test_two_workers_give_the_same_set_and_record_as_one(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:3])
    code_one, one = admit_cli(capsys, directory, tiny_student, "--out", tmp_path / "one", "--workers", "1")
    code_two, two = admit_cli(capsys, directory, tiny_student, "--out", tmp_path / "two", "--workers", "2")
    assert code_one == code_two == 0
    assert two["set_sha256"] == one["set_sha256"]
    assert [s["dataset_sha256"] for s in two["shards"]] == [s["dataset_sha256"] for s in one["shards"]]
    assert set_records(tmp_path / "two") == set_records(tmp_path / "one")


def test_identical_duplicates_across_shards_are_admitted(tiny_student, shard_lines, tmp_path):
    # The same example, same rows, in two shards: what one file allows, a set allows.
    second = [shard_lines[1][0], shard_lines[0][1], *shard_lines[1][1:]]
    directory = shard_directory(tmp_path, [shard_lines[0], second])
    assert admit_shard_set(str(directory), str(tiny_student), top_k=16).totals()["examples"] == 5


def test_memory_root_set_is_admitted_and_reused(tiny_student, shard_lines):
    """Any fsspec URI: shards in memory://, materialized under a memory:// root (in this one process)."""
    import uuid

    import fsspec

    base = f"memory://shards-{uuid.uuid4().hex}"
    fs, _ = fsspec.core.url_to_fs(base)
    for i, lines in enumerate(shard_lines[:2]):
        with fsspec.open(f"{base}/corpus/part-{i}.jsonl", "wb") as handle:
            handle.write(("\n".join(lines) + "\n").encode("utf-8"))
    first = admit_shard_set(f"{base}/corpus", str(tiny_student), top_k=16, out_root=f"{base}/root", workers=2)
    again = admit_shard_set(f"{base}/corpus", str(tiny_student), top_k=16, out_root=f"{base}/root", workers=2)
    assert [s.reused for s in first.shards] == [False, False] and [s.reused for s in again.shards] == [True, True]
    assert again.set_sha256 == first.set_sha256
    assert fs.exists(first.record_uri) and first.record_uri.startswith(f"{base}/root/corpora/sets/")


def test_a_shard_error_survives_the_trip_from_a_worker_process():
    import pickle

    error = AdmissionError("invalid_json", 3, "line 3 is not JSON", file="part-001.jsonl")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.line, copy.file, copy.message) == ("invalid_json", 3, "part-001.jsonl", error.message)
    assert copy.to_json()["file"] == "part-001.jsonl"


def test_workers_below_one_are_a_usage_error(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:1])
    with pytest.raises(SystemExit) as caught:
        main(["admit", str(directory), "--student", str(tiny_student), "--workers", "0"])
    assert caught.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_human_output_names_the_set_and_each_shard(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:2])
    assert main(["admit", str(directory), "--student", str(tiny_student), "--top-k", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("admitted set sha256:") and "2 shards, 4 examples" in out
    assert "part-000.jsonl" in out and "part-001.jsonl" in out and "--out" in out


# --- bad input ---------------------------------------------------------------------------------------------


def test_empty_directory_is_an_empty_set(capsys, tiny_student, tmp_path):
    directory = tmp_path / "corpus"
    directory.mkdir()
    (directory / "readme.txt").write_text("no shards here\n", encoding="utf-8")
    root = tmp_path / "root"
    code, value = admit_cli(capsys, directory, tiny_student, "--out", root)
    assert code == 2
    assert (value["status"], value["code"], value["line"]) == ("rejected", "shard_set_empty", None)
    assert value["file"] == str(directory)
    assert not (root / "corpora").exists()


def test_empty_index_is_an_empty_set(tiny_student, tmp_path):
    index = tmp_path / "corpus.index.json"
    index.write_text(json.dumps({"format": "kiln-flows.corpus-shards.v1", "shards": []}), encoding="utf-8")
    assert rejected(index, tiny_student, tmp_path / "root").code == "shard_set_empty"


@pytest.mark.parametrize("document, where", [
    ({"format": "kiln-flows.corpus-shards.v1", "shards": [], "extra": 1}, "extra"),
    ({"format": "kiln-flows.corpus-shards.v2", "shards": []}, "format"),
    ({"format": "kiln-flows.corpus-shards.v1",
      "shards": [{"uri": "a.jsonl", "sha256": "sha256:" + "0" * 64, "size_bytes": "12"}]}, "shards.0.size_bytes"),
    ({"format": "kiln-flows.corpus-shards.v1",
      "shards": [{"uri": "a.jsonl", "sha256": "0" * 64, "size_bytes": 12}]}, "shards.0.sha256"),
    ({"format": "kiln-flows.corpus-shards.v1",
      "shards": [{"uri": "a.jsonl", "sha256": "sha256:" + "0" * 64, "size_bytes": 12, "note": "x"}]},
     "shards.0.note"),
])
def test_invalid_index_names_the_field(capsys, tiny_student, tmp_path, document, where):
    index = tmp_path / "corpus.index.json"
    index.write_text(json.dumps(document), encoding="utf-8")
    code, value = admit_cli(capsys, index, tiny_student, "--out", tmp_path / "root")
    assert code == 2
    assert value["code"] == "shard_index_invalid" and value["file"] == str(index)
    assert where in value["message"]
    assert set_records(tmp_path / "root") == {}


def test_index_named_as_one_that_is_not_json_is_invalid(tiny_student, tmp_path):
    index = tmp_path / "corpus.index.json"
    index.write_text("{not json", encoding="utf-8")
    assert rejected(index, tiny_student).code == "shard_index_invalid"


@pytest.mark.parametrize("entry", ["../outside.jsonl", "/etc/passwd", "sub/../../outside.jsonl", "a//b.jsonl"])
def test_index_entry_escaping_its_directory_is_unsafe(capsys, tiny_student, shard_lines, tmp_path, entry):
    directory = shard_directory(tmp_path, shard_lines[:1])
    write_shard(tmp_path / "outside.jsonl", shard_lines[1])
    index = directory / "corpus.index.json"
    build_index(str(index), ["part-000.jsonl"])
    document = json.loads(index.read_text(encoding="utf-8"))
    document["shards"].append({"uri": entry, "sha256": digest(tmp_path / "outside.jsonl"),
                               "size_bytes": (tmp_path / "outside.jsonl").stat().st_size})
    index.write_text(json.dumps(document), encoding="utf-8")
    code, value = admit_cli(capsys, index, tiny_student, "--out", tmp_path / "root")
    assert code == 2
    assert (value["code"], value["file"]) == ("shard_path_unsafe", entry)
    assert "index entry 1" in value["message"]
    assert not (tmp_path / "root" / "corpora").exists()  # refused before any shard was admitted


def test_symlinked_shard_in_an_index_is_unsafe(tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:2])
    build_index(str(directory / "corpus.index.json"), ["part-000.jsonl", "part-001.jsonl"])
    target = write_shard(tmp_path / "elsewhere.jsonl", shard_lines[1])
    (directory / "part-001.jsonl").unlink()
    os.symlink(target, directory / "part-001.jsonl")
    error = rejected(directory / "corpus.index.json", tiny_student, tmp_path / "root")
    assert (error.code, error.file) == ("shard_path_unsafe", "part-001.jsonl")


def test_symlinked_directory_on_an_index_path_is_unsafe(tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:1])
    write_shard(tmp_path / "elsewhere" / "part.jsonl", shard_lines[1])
    os.symlink(tmp_path / "elsewhere", directory / "linked")
    build_index(str(directory / "corpus.index.json"), ["part-000.jsonl", "linked/part.jsonl"])
    error = rejected(directory / "corpus.index.json", tiny_student, tmp_path / "root")
    assert (error.code, error.file) == ("shard_path_unsafe", "linked/part.jsonl")
    assert "linked" in error.message


def test_symlinked_shard_in_a_directory_is_unsafe(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:1])
    os.symlink(write_shard(tmp_path / "elsewhere.jsonl", shard_lines[1]), directory / "part-001.jsonl")
    code, value = admit_cli(capsys, directory, tiny_student, "--out", tmp_path / "root")
    assert code == 2 and value["code"] == "shard_path_unsafe"
    assert value["file"].endswith("part-001.jsonl")


def test_missing_shard(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:2])
    build_index(str(directory / "corpus.index.json"), ["part-000.jsonl", "part-001.jsonl"])
    (directory / "part-001.jsonl").unlink()
    root = tmp_path / "root"
    code, value = admit_cli(capsys, directory / "corpus.index.json", tiny_student, "--out", root)
    assert code == 2
    assert (value["code"], value["file"], value["line"]) == ("shard_missing", "part-001.jsonl", None)
    assert set_records(root) == {}
    # The shard before it is content-addressed and valid on its own: it may stay, and is reused later.
    assert (root / "corpora" / digest(directory / "part-000.jsonl")[7:] / "admission.json").is_file()


def test_a_directory_holding_index_json_is_read_through_it(capsys, tiny_student, shard_lines, tmp_path):
    directory = shard_directory(tmp_path, shard_lines[:2])
    build_index(str(directory / "index.json"), ["part-000.jsonl", "part-001.jsonl"])
    code, value = admit_cli(capsys, directory, tiny_student)
    assert code == 0 and [shard["shard"] for shard in value["shards"]] == ["part-000.jsonl", "part-001.jsonl"]
    assert value["set_sha256"] == set_sha256([digest(directory / "part-000.jsonl"), digest(directory / "part-001.jsonl")])
    write_shard(directory / "part-002.jsonl", shard_lines[2])  # a shard the index does not list
    error = rejected(directory, tiny_student, tmp_path / "root")
    assert (error.code, error.file) == ("shard_unlisted", "part-002.jsonl")
    (directory / "part-002.jsonl").unlink()
    (directory / "part-001.jsonl").unlink()  # a shard the index lists, gone
    assert (rejected(directory, tiny_student).code, rejected(directory, tiny_student).file) == ("shard_missing",
                                                                                               "part-001.jsonl")


@pytest.mark.parametrize("change", ["size", "same_size"])
def test_shard_bytes_not_matching_the_index(capsys, tiny_student, shard_lines, tmp_path, change):
    directory = shard_directory(tmp_path, shard_lines[:2])
    build_index(str(directory / "corpus.index.json"), ["part-000.jsonl", "part-001.jsonl"])
    shard = directory / "part-001.jsonl"
    data = shard.read_bytes()
    shard.write_bytes(data + b"\n" if change == "size" else data[:-1] + b" ")
    assert shard.stat().st_size == len(data) + (change == "size")
    code, value = admit_cli(capsys, directory / "corpus.index.json", tiny_student, "--out", tmp_path / "root")
    assert code == 2
    assert (value["code"], value["file"]) == ("shard_digest_mismatch", "part-001.jsonl")
    assert ("bytes" if change == "size" else "digest") in value["message"]
    assert set_records(tmp_path / "root") == {}


def test_shards_pinning_different_teachers(capsys, tiny_student, shard_lines, tmp_path):
    identity = TeacherIdentity.model_validate(json.loads(shard_lines[1][0])["teacher_identity"])
    other = build_manifest_line(identity.model_copy(update={"served_model_id": "another-teacher"}))
    directory = shard_directory(tmp_path, [shard_lines[0], shard_lines[2], [other, *shard_lines[1][1:]]])
    code, value = admit_cli(capsys, directory, tiny_student, "--out", tmp_path / "root")
    assert code == 2
    assert (value["code"], value["file"], value["line"]) == ("shard_identity_mismatch", "part-002.jsonl", 1)
    assert "part-000.jsonl" in value["message"]  # both shards named
    assert set_records(tmp_path / "root") == {}


def conflicting_copy(example_line: str) -> str:
    """The same example (same token sequence) with one teacher logprob changed."""
    record = json.loads(example_line)
    candidates = record["teacher_tokens"][0]["top_logprobs"]
    candidates[-1]["logprob"] -= 1.0  # still non-increasing, mass still below one
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


def test_conflicting_duplicate_across_shards(capsys, tiny_student, shard_lines, tmp_path):
    second = [shard_lines[1][0], shard_lines[1][1], conflicting_copy(shard_lines[0][2])]
    directory = shard_directory(tmp_path, [shard_lines[0], second])
    # The same corpus as one file is refused by the single-file rule this mirrors.
    single = write_shard(tmp_path / "single.jsonl", shard_lines[0] + second[1:])
    with pytest.raises(AdmissionError) as caught:
        admit_corpus(str(single), str(tiny_student), top_k=16)
    assert caught.value.code == "conflicting_duplicate_row"
    code, value = admit_cli(capsys, directory, tiny_student, "--out", tmp_path / "root")
    assert code == 2
    assert (value["code"], value["file"], value["line"]) == ("shard_duplicate_conflict", "part-001.jsonl", 3)
    assert "line 3" in value["message"] and "part-000.jsonl" in value["message"]
    assert set_records(tmp_path / "root") == {}


def test_a_shard_rejection_names_the_shard_and_its_line(capsys, tiny_student, shard_lines, tmp_path):
    bad = shard_lines[1][:2] + ["{not json"] + shard_lines[1][2:]
    directory = shard_directory(tmp_path, [shard_lines[0], bad, shard_lines[2]])
    code, value = admit_cli(capsys, directory, tiny_student, "--out", tmp_path / "root")
    assert code == 2
    assert (value["code"], value["file"], value["line"]) == ("invalid_json", "part-001.jsonl", 3)
    assert set_records(tmp_path / "root") == {}


def test_with_workers_the_first_bad_shard_in_set_order_is_reported(capsys, tiny_student, shard_lines, tmp_path):
    bad_json = shard_lines[1][:2] + ["{not json"] + shard_lines[1][2:]
    identity = TeacherIdentity.model_validate(json.loads(shard_lines[2][0])["teacher_identity"])
    other = build_manifest_line(identity.model_copy(update={"served_model_id": "another-teacher"}))
    directory = shard_directory(tmp_path, [shard_lines[0], [other, *shard_lines[2][1:]], bad_json])
    code, value = admit_cli(capsys, directory, tiny_student, "--out", tmp_path / "root", "--workers", "2")
    assert code == 2
    assert (value["code"], value["file"]) == ("shard_identity_mismatch", "part-001.jsonl")
    assert set_records(tmp_path / "root") == {}


def test_storage_failure_mid_set_exits_3_and_keeps_committed_shards(capsys, tiny_student, shard_lines, tmp_path,
                                                                    monkeypatch):
    from kiln_core import materialize

    directory = shard_directory(tmp_path, shard_lines[:3])
    root = tmp_path / "root"
    real_write = materialize.write_materialization
    calls = []

    def failing_second_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(materialize, "write_materialization", failing_second_write)
    code, value = admit_cli(capsys, directory, tiny_student, "--out", root)
    assert code == 3 and value["status"] == "failed"
    assert set_records(root) == {}
    monkeypatch.setattr(materialize, "write_materialization", real_write)
    code, value = admit_cli(capsys, directory, tiny_student, "--out", root)
    assert code == 0
    assert [s["reused"] for s in value["shards"]] == [True, False, False]
    assert len(set_records(root)) == 1


def test_every_shard_set_code_is_covered():
    """Guard: each set code has a test above that produces it."""
    source = Path(__file__).read_text(encoding="utf-8")
    missing = [code for code in SHARD_SET_CODES if f'"{code}"' not in source.replace(f'"{code}" in', "")]
    assert not missing, missing


# --- the validate-corpus flow: one mapped task per shard ------------------------------------------------


def test_validate_corpus_flow_maps_one_task_per_shard(prefect_harness, tiny_student, shard_lines, tmp_path):
    from flows.validate_corpus import validate_corpus

    directory = shard_directory(tmp_path, shard_lines[:3])
    state = validate_corpus(str(directory), str(tiny_student), top_k=16, shard_concurrency=2, return_state=True)
    assert state.is_completed(), state.message
    verdict = state.result()
    expected = admit_shard_set(str(directory), str(tiny_student), top_k=16)
    assert verdict["status"] == "admitted" and verdict["set_sha256"] == expected.set_sha256
    assert (verdict["shards"], verdict["examples"]) == (3, 6)
    assert not list(tmp_path.glob("**/corpora"))  # validation materializes nothing


def test_validate_corpus_flow_names_the_first_bad_shard(prefect_harness, tiny_student, shard_lines, tmp_path):
    from flows.validate_corpus import validate_corpus

    bad = shard_lines[1][:2] + ["{not json"] + shard_lines[1][2:]
    directory = shard_directory(tmp_path, [shard_lines[0], bad, bad, shard_lines[2]])
    state = validate_corpus(str(directory), str(tiny_student), top_k=16, shard_concurrency=2, return_state=True)
    assert state.is_failed(), f"{state.type}: {state.message}"
    assert "[invalid_json] part-001.jsonl line 3" in state.message, state.message
