"""Scoring at size (issue 20, scope 5): ``--shard-size`` writes a set of shards plus ``index.json`` that
``admit`` takes as a directory or as its index, resumes an interrupted set shard by shard, and refuses what
would make a set that is not one run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_scoring import EXAMPLES, TOP_K, write_jsonl  # tests/ is on sys.path under pytest

from flows.cli import main
from kiln_core.admission.shards import admit_shard_set
from kiln_core.scoring import ScoringError, score_examples
from kiln_core.scoring.shards import KILN_MAX_SHARD_BYTES, STATE_DIR, parse_shard_size

# With the tiny models the six examples' row bounds are about 9.3k, 10.4k, 29.6k, 22k, 6.5k and 9.3k bytes,
# so 40,000-byte shards hold [1, 2], [3], [4, 5, 6]: three shards, and example 6 repeats example 1 (shard 0)
# in shard 2, the cross-shard duplicate whose rows must be copied, not scored again.
SHARD_SIZE = 40_000
SHARDS = ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]


class Crash(Exception):
    """Injected: the run dies right after a shard was committed."""


def score_set(examples: Path, out: Path, teacher: Path, student: Path, **options):
    options.setdefault("shard_size", SHARD_SIZE)
    return score_examples(str(examples), teacher_dir=str(teacher), student_dir=str(student), top_k=TOP_K,
                          out_uri=str(out), device="cpu", **options)


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (state records included) by relative path."""
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([*map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def examples_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("examples") / "examples.jsonl", EXAMPLES)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, examples_file, tiny_teacher, tiny_student):
    """One sharded run start to finish: the reference every other run is compared with."""
    out = tmp_path_factory.mktemp("uninterrupted") / "scored"
    progress = []
    result = score_set(examples_file, out, tiny_teacher, tiny_student, on_progress=progress.append)
    return result, out, progress


# --- the size option ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [("64MiB", 64 * 2**20), ("500KiB", 500 * 1024), ("1 mib", 2**20),
                                            ("4096", 4096), (4096, 4096), ("10B", 10)])
def test_shard_sizes_are_bytes_or_binary_units(text, size):
    assert parse_shard_size(text) == size


@pytest.mark.parametrize("text", ["64MB", "1.5MiB", "lots", "", "-1", "0", "2TiB"])
def test_a_shard_size_that_is_no_size_is_refused(text):
    with pytest.raises(ScoringError) as caught:
        parse_shard_size(text)
    assert caught.value.code == "invalid_option" and "--shard-size" in caught.value.message


@pytest.mark.parametrize("text", ["65MiB", "1GiB", str(KILN_MAX_SHARD_BYTES + 1)])
def test_a_shard_size_above_kilns_64_mib_is_refused(text):
    with pytest.raises(ScoringError) as caught:
        parse_shard_size(text)
    assert caught.value.code == "invalid_option" and "above 64 MiB" in caught.value.message
    assert parse_shard_size(str(KILN_MAX_SHARD_BYTES)) == KILN_MAX_SHARD_BYTES  # the limit itself is fine


def test_cli_refuses_a_bad_shard_size_with_exit_2_before_reading_anything(tmp_path, capsys):
    code, out, err = run_cli(capsys, "score", tmp_path / "missing.jsonl", "--teacher", tmp_path, "--student",
                             tmp_path, "--top-k", 16, "--out", tmp_path / "scored", "--shard-size", "65MiB")
    assert code == 2 and out == ""
    assert "invalid_option" in err and "above 64 MiB" in err and "Traceback" not in err
    assert not (tmp_path / "scored").exists()


def test_cli_refuses_an_out_that_is_a_file_when_sharding(tmp_path, capsys):
    (tmp_path / "scored").write_text("not a directory", encoding="utf-8")
    code, _, err = run_cli(capsys, "score", tmp_path / "missing.jsonl", "--teacher", tmp_path, "--student", tmp_path,
                           "--top-k", 16, "--out", tmp_path / "scored", "--shard-size", "1MiB")
    assert code == 2 and "out_not_directory" in err and str(tmp_path / "scored") in err
    assert (tmp_path / "scored").read_text(encoding="utf-8") == "not a directory"


def test_workers_are_for_a_vllm_teacher(tmp_path):
    with pytest.raises(ScoringError) as caught:
        score_examples(str(tmp_path / "examples.jsonl"), teacher_dir=str(tmp_path), student_dir=str(tmp_path),
                       top_k=16, out_uri=str(tmp_path / "scored"), shard_size="1MiB", workers=2)
    assert caught.value.code == "invalid_option" and "vLLM" in caught.value.message


# --- a set Kiln admits shard by shard ---------------------------------------------------------------------


def test_the_set_is_shards_each_a_corpus_within_the_size_and_admitted(uninterrupted, tiny_student):
    result, out, progress = uninterrupted
    assert [Path(shard.uri).name for shard in result.shards] == SHARDS
    assert sorted(p.name for p in out.iterdir()) == sorted([*SHARDS, "index.json", STATE_DIR])
    rows_by_shard = []
    for shard in result.shards:
        data = Path(shard.uri).read_bytes()
        assert len(data) == shard.size_bytes <= SHARD_SIZE
        lines = data.decode("utf-8").splitlines()
        assert lines[0] == result.manifest_line  # every shard pins the same teacher, byte for byte
        rows_by_shard.append([json.loads(line) for line in lines[1:]])
    assert [len(rows) for rows in rows_by_shard] == [2, 1, 3] and result.examples == len(EXAMPLES)
    assert [shard.first_line for shard in result.shards] == [1, 3, 4]
    # The repeat of example 1 in the last shard carries shard 0's rows, so admission finds no conflict.
    assert rows_by_shard[2][2]["teacher_tokens"] == rows_by_shard[0][0]["teacher_tokens"]
    assert result.reused_rows == 1 and result.resumed_shards == 0

    index = json.loads((out / "index.json").read_text(encoding="utf-8"))
    assert index["format"] == "kiln-flows.corpus-shards.v1"
    assert [entry["uri"] for entry in index["shards"]] == SHARDS
    assert [entry["sha256"] for entry in index["shards"]] == [shard.sha256 for shard in result.shards]

    for admitted_uri in (out, out / "index.json"):
        admitted = admit_shard_set(str(admitted_uri), str(tiny_student), top_k=TOP_K,
                                   pinned_manifest=result.manifest_line)
        assert admitted.set_sha256 == result.set_sha256
        assert admitted.totals()["examples"] == len(EXAMPLES)
        assert admitted.totals()["action_tokens"] == result.action_tokens

    # Progress counts shards and tokens, ending at the totals.
    assert progress[0].shards_done == 0 and progress[0].tokens_done == 0
    last = progress[-1]
    assert (last.shards_done, last.shards_total) == (3, 3) and last.tokens_done == last.tokens_total == result.action_tokens
    assert [p.tokens_done for p in progress] == sorted(p.tokens_done for p in progress)


def test_each_rows_bound_holds_for_the_row_written(uninterrupted, tiny_student):
    """The split is only safe if the bound is one: every row written is at most its bound."""
    from kiln_core.scoring import _encode
    from kiln_core.scoring.examples import iter_examples
    from kiln_core.scoring.shards import row_size_bound
    from kiln_core.scoring.writer import TokenTexts, row_head
    from kiln_core.tokenization import load_student_tokenizer

    result, out, _ = uninterrupted
    student = load_student_tokenizer(tiny_student)
    token_text = TokenTexts(student.tokenizer)
    for shard in result.shards:
        path = Path(shard.uri)
        examples = list(iter_examples(str(path)))
        rows = path.read_bytes().split(b"\n")[1:-1]
        for example, request, row in zip(examples, _encode(student, examples, 2048), rows):
            targets = request.input_ids[request.positions].tolist()
            texts = [json.dumps(token_text(t), ensure_ascii=False) for t in targets]
            bound = row_size_bound(row_head(example.record), texts, targets, TOP_K, student.vocab_size)
            assert len(row) + 1 <= bound < 1.5 * (len(row) + 1)


# --- resume ----------------------------------------------------------------------------------------------


def test_a_crash_after_shard_one_resumes_the_rest_and_ends_byte_identical(
        tmp_path, monkeypatch, uninterrupted, examples_file, tiny_teacher, tiny_student):
    from kiln_core.scoring.local import LocalTeacher

    reference, reference_out, _ = uninterrupted
    out = tmp_path / "scored"

    def crash_after_first_shard(progress):
        if progress.shards_done == 1:
            raise Crash()

    with pytest.raises(Crash):
        score_set(examples_file, out, tiny_teacher, tiny_student, on_progress=crash_after_first_shard)
    assert sorted(p.name for p in out.iterdir()) == [STATE_DIR, SHARDS[0]]  # no index: the set is not whole
    first = out / SHARDS[0]
    first_bytes, first_mtime = first.read_bytes(), first.stat().st_mtime_ns

    scored_requests = []
    original = LocalTeacher.score

    def counting(self, requests, top_k):
        scored_requests.extend(request.line for request in requests)
        return original(self, requests, top_k)

    monkeypatch.setattr(LocalTeacher, "score", counting)
    progress = []
    result = score_set(examples_file, out, tiny_teacher, tiny_student, on_progress=progress.append)

    # Shard 0 was neither rescored nor rewritten; only lines 3, 4, 5 went to the teacher (6 repeats line 1).
    assert first.read_bytes() == first_bytes and first.stat().st_mtime_ns == first_mtime
    assert sorted(scored_requests) == [3, 4, 5]
    assert [shard.resumed for shard in result.shards] == [True, False, False] and result.resumed_shards == 1
    assert progress[0].shards_done == 1 and progress[0].tokens_resumed == reference.shards[0].action_tokens
    # The set is the uninterrupted run's, byte for byte (records and plan included).
    assert files_of(out) == files_of(reference_out)
    assert result.set_sha256 == reference.set_sha256 and result.index_uri == str(out / "index.json")

    # A run over a finished set scores nothing and changes nothing.
    scored_requests.clear()
    again = score_set(examples_file, out, tiny_teacher, tiny_student)
    assert scored_requests == [] and again.resumed_shards == 3 and files_of(out) == files_of(reference_out)


def test_a_shard_whose_bytes_changed_since_its_record_is_scored_again(
        tmp_path, uninterrupted, examples_file, tiny_teacher, tiny_student):
    _, reference_out, _ = uninterrupted
    out = tmp_path / "scored"
    shutil.copytree(reference_out, out)
    (out / SHARDS[1]).write_bytes((out / SHARDS[1]).read_bytes()[:-10] + b"corrupted\n")
    (out / "index.json").unlink()
    result = score_set(examples_file, out, tiny_teacher, tiny_student)
    assert [shard.resumed for shard in result.shards] == [True, False, True]
    assert files_of(out) == files_of(reference_out)


# --- what a rerun may not mix in --------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "differing"), [
    ({"shard_size": SHARD_SIZE + 1}, "shard_size"),
    ({"top_k": TOP_K + 1}, "top_k"),
    ({"examples": EXAMPLES[:4]}, "examples_sha256"),
])
def test_a_rerun_with_other_inputs_into_the_same_directory_is_refused(
        tmp_path, uninterrupted, examples_file, tiny_teacher, tiny_student, change, differing):
    _, reference_out, _ = uninterrupted
    out = tmp_path / "scored"
    shutil.copytree(reference_out, out)
    (out / SHARDS[2]).unlink()  # an unfinished set: the rerun must still not touch it
    before = {name: (out / name).stat().st_mtime_ns for name in files_of(out)}
    examples = examples_file
    if "examples" in change:
        examples = write_jsonl(tmp_path / "other-examples.jsonl", change["examples"])
    options = {"shard_size": change.get("shard_size", SHARD_SIZE)}
    with pytest.raises(ScoringError) as caught:
        score_examples(str(examples), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student),
                       top_k=change.get("top_k", TOP_K), out_uri=str(out), device="cpu", **options)
    assert caught.value.code == "scored_set_mismatch" and differing in caught.value.message
    assert {name: (out / name).stat().st_mtime_ns for name in files_of(out)} == before


def test_a_directory_with_other_jsonl_files_is_refused(tmp_path, examples_file, tiny_teacher, tiny_student):
    out = tmp_path / "scored"
    out.mkdir()
    (out / "notes.jsonl").write_text("{}\n", encoding="utf-8")
    with pytest.raises(ScoringError) as caught:
        score_set(examples_file, out, tiny_teacher, tiny_student)
    assert caught.value.code == "scored_set_mismatch" and "notes.jsonl" in caught.value.message
    assert sorted(p.name for p in out.iterdir()) == ["notes.jsonl"]


def test_an_example_too_large_for_one_shard_is_refused_naming_its_line(tmp_path, examples_file, tiny_teacher,
                                                                       tiny_student, uninterrupted):
    result, _, _ = uninterrupted
    size = len(result.manifest_line.encode("utf-8")) + 1 + 12_000  # holds line 1 and line 2, not line 3's row
    out = tmp_path / "scored"
    with pytest.raises(ScoringError) as caught:
        score_set(examples_file, out, tiny_teacher, tiny_student, shard_size=size)
    assert caught.value.code == "row_exceeds_shard_size" and caught.value.line == 3
    assert "examples line 3" in str(caught.value) and f"shard of {size} bytes" in caught.value.message
    assert not out.exists()  # refused before anything was written

    with pytest.raises(ScoringError) as tiny:
        score_set(examples_file, out, tiny_teacher, tiny_student, shard_size=100)
    assert tiny.value.code == "invalid_option" and "manifest line" in tiny.value.message


# --- the command and the flow ------------------------------------------------------------------------------


def test_cli_scores_a_set_that_admit_takes_as_a_directory_and_as_its_index(
        tmp_path, capsys, examples_file, tiny_teacher, tiny_student):
    out = tmp_path / "scored"
    code, stdout, stderr = run_cli(capsys, "score", examples_file, "--teacher", tiny_teacher, "--student", tiny_student,
                                   "--top-k", TOP_K, "--out", out, "--shard-size", SHARD_SIZE, "--device", "cpu",
                                   "--json")
    assert code == 0, stderr
    result = json.loads(stdout)  # the progress line stays on stderr
    assert result["index_uri"] == str(out / "index.json") and len(result["shards"]) == 3
    assert "shards 3/3" in stderr and "tokens" in stderr and "ETA" in stderr

    for target in (out, out / "index.json"):
        code, stdout, stderr = run_cli(capsys, "admit", target, "--student", tiny_student, "--top-k", TOP_K, "--json")
        assert code == 0, stderr
        admitted = json.loads(stdout)
        assert admitted["status"] == "admitted" and admitted["totals"]["examples"] == len(EXAMPLES)
        assert admitted["set_sha256"] == result["set_sha256"]

    code, stdout, _ = run_cli(capsys, "score", examples_file, "--teacher", tiny_teacher, "--student", tiny_student,
                              "--top-k", TOP_K, "--out", out, "--shard-size", SHARD_SIZE, "--device", "cpu")
    assert code == 0 and "3 shards (3 finished by an earlier run)" in stdout
    code, stdout, _ = run_cli(capsys, "score", examples_file, "--teacher", tiny_teacher, "--student", tiny_student,
                              "--top-k", TOP_K, "--out", out, "--shard-size", SHARD_SIZE, "--device", "cpu", "--quiet")
    assert code == 0 and stdout == ""  # --quiet: nothing but warnings and errors


def test_score_corpus_flow_shards_and_names_the_index(tmp_path, examples_file, tiny_teacher, tiny_student,
                                                      prefect_harness):
    from flows.score_corpus import score_corpus

    first = score_corpus(str(examples_file), str(tiny_student), teacher_dir=str(tiny_teacher),
                         storage_root=str(tmp_path), top_k=TOP_K, shard_size=str(SHARD_SIZE))
    index = Path(first["uri"])
    assert index.name == "index.json" and index.parent.parent == tmp_path / "scored"
    assert first["examples"] == len(EXAMPLES) and first["reused"] is False
    admitted = admit_shard_set(str(index), str(tiny_student), top_k=TOP_K)
    assert admitted.set_sha256 == first["sha256"] and len(admitted.shards) == 3

    one_file = score_corpus(str(examples_file), str(tiny_student), teacher_dir=str(tiny_teacher),
                            storage_root=str(tmp_path), top_k=TOP_K)
    assert one_file["uri"].endswith(".jsonl") and Path(one_file["uri"]).is_file()  # without shard_size: as before


def test_score_corpus_refuses_a_bad_shard_size_before_reading(tmp_path):
    from flows.score_corpus import score_corpus

    with pytest.raises(ScoringError) as caught:
        score_corpus.fn(str(tmp_path / "examples.jsonl"), str(tmp_path / "student"), teacher_dir=str(tmp_path),
                        storage_root=str(tmp_path / "root"), shard_size="65MiB")
    assert caught.value.code == "invalid_option"
    assert not (tmp_path / "root").exists()


# --- a vLLM teacher, shards in parallel ------------------------------------------------------------------

from test_scoring_vllm import SERVED_MODEL, manifest_file, server_url, vllm_identity  # noqa: E402,F401 - fixtures


def test_vllm_shards_scored_in_parallel_equal_the_sequential_set_and_are_admitted(
        tmp_path, monkeypatch, server_url, manifest_file, examples_file, tiny_student):  # noqa: F811
    import threading

    from kiln_core.scoring.vllm import VllmTeacher

    pinned = manifest_file.read_text(encoding="utf-8")
    threads = set()
    original = VllmTeacher.score_one

    def recording(self, request, top_k):
        threads.add(threading.current_thread().name.split("_")[0])
        return original(self, request, top_k)

    monkeypatch.setattr(VllmTeacher, "score_one", recording)

    def score(out: Path, workers: int):
        return score_examples(str(examples_file), vllm_url=f"{server_url}/ok", served_model=SERVED_MODEL,
                              pinned_manifest=pinned, student_dir=str(tiny_student), top_k=TOP_K, out_uri=str(out),
                              batch_size=1, shard_size=SHARD_SIZE, workers=workers)

    sequential = score(tmp_path / "sequential", 1)
    assert "score-shard" not in threads
    parallel = score(tmp_path / "parallel", 3)
    assert "score-shard" in threads  # the shards ran on the pool's threads
    assert files_of(tmp_path / "parallel") == files_of(tmp_path / "sequential")
    assert parallel.set_sha256 == sequential.set_sha256 and len(parallel.shards) == 3
    admitted = admit_shard_set(str(tmp_path / "parallel" / "index.json"), str(tiny_student), top_k=TOP_K,
                               pinned_manifest=pinned.rstrip("\n"), kiln_strict=True)
    assert admitted.totals()["examples"] == len(EXAMPLES) and admitted.set_sha256 == parallel.set_sha256


def test_a_vllm_failure_mid_set_keeps_the_committed_shards_for_the_rerun(
        tmp_path, monkeypatch, server_url, manifest_file, examples_file, tiny_student):  # noqa: F811
    """The server answers shard 0, then goes away: an environment failure (exit 3), shard 0 kept, no index;
    the rerun resumes from shard 1."""
    from kiln_core.errors import EnvironmentFailure
    from kiln_core.scoring.vllm import VllmTeacher, completions_url

    out = tmp_path / "scored"
    options = dict(vllm_url=f"{server_url}/ok", served_model=SERVED_MODEL,
                   pinned_manifest=manifest_file.read_text(encoding="utf-8"), student_dir=str(tiny_student),
                   top_k=TOP_K, out_uri=str(out), batch_size=2, shard_size=SHARD_SIZE, workers=2)
    server_gone = {"now": False}
    original_post = VllmTeacher._post

    def post(self, body, line):
        if server_gone["now"]:
            self.url = completions_url("http://127.0.0.1:9")  # nothing listens there
        return original_post(self, body, line)

    def gone_after_first_shard(progress):
        # Shard 2 repeats an example of shard 0, so it waits for shard 0's commit: it always meets the outage.
        server_gone["now"] = server_gone["now"] or progress.shards_done >= 1

    monkeypatch.setattr(VllmTeacher, "_post", post)
    with pytest.raises(ScoringError) as caught:
        score_examples(str(examples_file), on_progress=gone_after_first_shard, **options)
    assert caught.value.code == "vllm_unreachable" and isinstance(caught.value, EnvironmentFailure)
    assert not (out / "index.json").exists() and (out / SHARDS[0]).is_file()
    kept = (out / SHARDS[0]).stat().st_mtime_ns

    monkeypatch.undo()
    result = score_examples(str(examples_file), **options)
    assert result.shards[0].resumed and (out / SHARDS[0]).stat().st_mtime_ns == kept
    assert (out / "index.json").is_file() and result.examples == len(EXAMPLES)


def test_a_set_scored_into_an_fsspec_uri_is_admitted_from_its_index(examples_file, tiny_teacher, tiny_student,
                                                                    uninterrupted):
    import uuid

    reference, _, _ = uninterrupted
    out = f"memory://score-shards-{uuid.uuid4().hex}/scored"
    result = score_examples(str(examples_file), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student),
                            top_k=TOP_K, out_uri=out, device="cpu", shard_size=SHARD_SIZE)
    assert result.index_uri == out + "/index.json" and result.set_sha256 == reference.set_sha256
    admitted = admit_shard_set(result.index_uri, str(tiny_student), top_k=TOP_K)
    assert admitted.set_sha256 == result.set_sha256
    again = score_examples(str(examples_file), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student),
                           top_k=TOP_K, out_uri=out, device="cpu", shard_size=SHARD_SIZE)
    assert again.resumed_shards == 3
