"""The fault drills' own checks, without running a drill: each one flags a damaged state and passes a good one.

A drill is only as trustworthy as its checkers: a checker that passes a damaged store would let a drill
report "passed" over the very failure it provokes. ``test_drills.py`` runs the drills themselves (slow);
here each checker meets a state built for it — a real checkpoint (``test_checkpoint.write_sample``), a
real materialization, a real moto S3 server — once whole and once damaged.
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import pytest
from test_checkpoint import ADAPTER, write_sample

from kiln_core.storage import resolve

# ------------------------------------------------------------------------------------------ concurrency


@pytest.fixture(scope="module")
def materialized(tiny_student, tmp_path_factory):
    """A corpus admitted twice into one root (the second admission reuses the first's commit)."""
    from drills.concurrency import tables_digest
    from kiln_core.admission import admit_corpus
    from kiln_core.canonical import sha256_hex
    from kiln_core.synthetic import synthesize_corpus

    base = tmp_path_factory.mktemp("materialized")
    corpus = synthesize_corpus(tiny_student, base / "corpus.jsonl", n_examples=6, top_k=16, seed=7, trajectory_every=4)
    root = base / "root"
    outcomes = []
    for _ in range(2):
        result = admit_corpus(str(corpus), str(tiny_student), top_k=16, out_root=str(root))
        outcomes.append({"uri": result.materialized, "reused": result.reused, "tables": tables_digest(result.tables),
                         "record": result.record.model_dump(mode="json")})
    return root, sha256_hex(corpus.read_bytes()), outcomes


def test_check_root_passes_one_commit_that_both_admissions_name(materialized):
    from drills.concurrency import check_root

    root, dataset_hex, outcomes = materialized
    assert [outcome["reused"] for outcome in outcomes] == [False, True]
    assert check_root(root, dataset_hex, outcomes) == []


def test_check_root_flags_a_failed_admission(materialized):
    from drills.concurrency import check_root

    root, dataset_hex, outcomes = materialized
    problems = check_root(root, dataset_hex, [outcomes[0], {"error": "OSError: disk full @ kiln_core/storage.py:1"}])
    assert problems == ["admission 1 failed: OSError: disk full @ kiln_core/storage.py:1"]


@pytest.mark.parametrize("leftover", ["staging", "second-commit", "sentinel"])
def test_check_root_flags_what_a_race_leaves_in_corpora(materialized, tmp_path, leftover):
    from drills.concurrency import check_root

    original, dataset_hex, outcomes = materialized
    root = tmp_path / "root"
    shutil.copytree(original, root)
    committed = root / "corpora" / dataset_hex
    if leftover == "staging":
        (root / "corpora" / f".{dataset_hex}.incomplete-0f0f").mkdir()
        expected = "1 committed materializations ['<hex>'] and 1 staging entries"
    elif leftover == "second-commit":
        shutil.copytree(committed, root / "corpora" / "variants" / dataset_hex)
        expected = "2 committed materializations"
    else:
        (committed / ".incomplete").write_text("", encoding="utf-8")
        expected = "1 staging entries ['<hex>/.incomplete']"
    [problem] = check_root(root, dataset_hex, outcomes)
    assert expected in problem


def test_check_root_flags_admissions_that_disagree_with_the_commit(materialized):
    from drills.concurrency import check_root

    root, dataset_hex, outcomes = materialized
    elsewhere = {**outcomes[1], "uri": str(root / "corpora" / "other")}
    assert check_root(root, dataset_hex, [outcomes[0], elsewhere]) == [
        f"admission 1 points at {root / 'corpora' / 'other'}, not {root / 'corpora' / dataset_hex}"]
    other_record = {**outcomes[0], "record": {**outcomes[0]["record"], "examples": -1}}
    assert check_root(root, dataset_hex, [other_record, outcomes[1]]) == [
        "admission 0 returned a record other than the committed admission.json"]
    other_tables = {**outcomes[1], "tables": "0" * 64}
    assert check_root(root, dataset_hex, [outcomes[0], other_tables]) == [
        "the two admissions' tables differ from each other or from the committed materialization"]


# ------------------------------------------------------------------------------------------ corruption


def _files(directory: Path) -> dict[str, bytes | str]:
    return {path.name: ("symlink" if path.is_symlink() else path.read_bytes()) for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("index, kind", list(enumerate(__import__("drills.corruption").corruption.KINDS)))
def test_each_damage_kind_damages_the_file_it_names_and_is_refused_with_its_code(tmp_path, index, kind):
    """The drill's promise per kind: the loader refuses it with the code the drill expects, naming the file."""
    from drills.corruption import _damage
    from kiln_core.training.checkpoint import CheckpointError, load_checkpoint

    run = tmp_path / "run"
    name = write_sample(str(run), step=4)
    checkpoint = run / name
    before = _files(checkpoint)
    load_checkpoint(resolve(str(run)), name)  # whole before the damage

    named, code = _damage(checkpoint, kind, random.Random(index), index)

    assert _files(checkpoint) != before
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(resolve(str(run)), name)
    assert refused.value.code == code, refused.value.describe()
    assert named in str(refused.value)


def test_an_unknown_damage_kind_is_an_error_not_a_silent_pass(tmp_path):
    from drills.corruption import _damage

    run = tmp_path / "run"
    name = write_sample(str(run), step=4)
    with pytest.raises(ValueError, match="melt"):
        _damage(run / name, "melt", random.Random(0), 0)


# ------------------------------------------------------------------------------------------ sigkill


def test_checkpoint_step_of_reads_the_step_from_a_checkpoint_uri_or_a_file_in_it():
    from drills.sigkill import checkpoint_step_of

    assert checkpoint_step_of("s3://b/runs/x/k/demo-checkpoint-step-00000012.kiln-checkpoint") == 12
    assert checkpoint_step_of("/out/runs/x/k/demo-checkpoint-step-00000003.kiln-checkpoint/adapter_model.safetensors") == 3
    assert checkpoint_step_of("/out/runs/x/k/adapter/adapter_model.safetensors") is None
    assert checkpoint_step_of("/out/runs/x/k/demo-checkpoint-step-12.kiln-checkpoint") is None  # not 8 digits


def test_inspect_run_dir_lists_committed_checkpoints_and_staging_and_flags_one_that_does_not_load(tmp_path):
    from drills.sigkill import inspect_run_dir
    from kiln_core.training.checkpoint import ADAPTER_FILE

    run = tmp_path / "run"
    first, second = write_sample(str(run), step=2), write_sample(str(run), step=4)
    staging = run / f".{ADAPTER}-checkpoint-step-00000006.kiln-checkpoint.incomplete-1234"
    staging.mkdir()
    (staging / ".incomplete").write_text("opd-step-00000006\n", encoding="utf-8")

    problems, listed = inspect_run_dir(str(run), ADAPTER)
    assert problems == [] and listed == [first, second, f"(staging) {staging.name}"]

    damaged = run / second / ADAPTER_FILE
    data = damaged.read_bytes()
    damaged.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    problems, _ = inspect_run_dir(str(run), ADAPTER)
    assert len(problems) == 1 and second in problems[0] and "checkpoint_file_sha256" in problems[0]


# ------------------------------------------------------------------------------------------ s3 outage


@pytest.mark.parametrize("kind, arg, category", [
    ("write", "s3://b/r/corpora/abc/examples.parquet", "corpus"),
    ("commit", "s3://b/r/corpora/abc", "corpus"),
    ("write", "s3://b/r/runs/a/k/a-checkpoint-step-00000002.kiln-checkpoint/adapter_model.safetensors", "checkpoint-file"),
    ("commit", "s3://b/r/runs/a/k/a-checkpoint-step-00000002.kiln-checkpoint", "checkpoint-commit"),
    ("write", "s3://b/r/runs/a/k/adapter/adapter_model.safetensors", "adapter"),
    ("commit", "s3://b/r/runs/a/k/adapter", "adapter"),
    ("put", "s3://b/r/runs/a/k/train_receipt.json", "receipt"),
    ("committed", "s3://b/r/runs/a/k/adapter", None),  # after the commit: nothing left to interrupt
    ("put", "s3://b/r/runs/a/latest.json", None),
    ("step", "3", None),
])
def test_outages_are_classified_by_the_publication_write_they_interrupt(kind, arg, category):
    from drills.s3_outage import _classify

    assert _classify(kind, arg) == category


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from drills.s3_outage import BUCKET
    from drills.s3_server import S3Server

    with S3Server(log_path=str(tmp_path_factory.mktemp("moto") / "moto.log")) as server:
        server.create_bucket(BUCKET)
        yield server


def _upload(server, directory: Path, prefix: str) -> None:
    from drills.s3_outage import BUCKET

    client = server.boto3_client()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(directory).as_posix()}", Body=path.read_bytes())


def test_verify_store_passes_committed_prefixes_and_skips_uncommitted_ones(s3, materialized, tmp_path):
    from drills.s3_outage import verify_store

    original_root, dataset_hex, _ = materialized
    run = tmp_path / "runs" / ADAPTER / "key"
    write_sample(str(run), step=2)
    write_sample(str(run), step=4)
    staged = run / f"{ADAPTER}-checkpoint-step-00000006.kiln-checkpoint"  # files put, the manifest never was
    shutil.copytree(run / f"{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint", staged)
    (staged / "checkpoint_manifest.json").unlink()
    _upload(s3, tmp_path / "runs", "whole/runs")
    _upload(s3, original_root / "corpora", "whole/corpora")

    problems, counts = verify_store(s3, "whole", ADAPTER)
    assert problems == []
    assert counts == {"committed_checkpoints": 2, "uncommitted_checkpoints": 1, "committed_corpora": 1,
                      "uncommitted_corpora": 0}


def test_verify_store_flags_each_kind_of_partial_commit(s3, materialized, tmp_path):
    from drills.s3_outage import BUCKET, verify_store
    from kiln_core.training.checkpoint import ADAPTER_FILE, OPTIMIZER_FILE

    original_root, dataset_hex, _ = materialized
    run = tmp_path / "runs" / ADAPTER / "key"
    name = write_sample(str(run), step=2)
    _upload(s3, tmp_path / "runs", "damaged/runs")
    _upload(s3, original_root / "corpora", "damaged/corpora")
    client = s3.boto3_client()
    checkpoint = f"damaged/runs/{ADAPTER}/key/{name}"
    adapter = client.get_object(Bucket=BUCKET, Key=f"{checkpoint}/{ADAPTER_FILE}")["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"{checkpoint}/{ADAPTER_FILE}", Body=bytes(len(adapter)))  # same size
    client.delete_object(Bucket=BUCKET, Key=f"{checkpoint}/{OPTIMIZER_FILE}")
    client.put_object(Bucket=BUCKET, Key=f"{checkpoint}/stray.bin", Body=b"x")
    client.put_object(Bucket=BUCKET, Key=f"damaged/corpora/{dataset_hex}/examples.parquet", Body=b"truncated")
    client.put_object(Bucket=BUCKET, Key=f"damaged/runs/{ADAPTER}/key/train_receipt.json", Body=b'{"status": "succ')
    client.put_object(Bucket=BUCKET, Key=f"damaged/runs/{ADAPTER}/key/adapter/adapter_config.json", Body=b"{}")

    problems, counts = verify_store(s3, "damaged", ADAPTER)
    prefix = f"runs/{ADAPTER}/key/{name}"
    assert sorted(problems) == sorted([
        f"committed {prefix}: {ADAPTER_FILE} SHA-256 differs from the manifest",
        f"committed {prefix} lacks declared file {OPTIMIZER_FILE}",
        f"committed {prefix} holds undeclared files ['stray.bin']",
        f"committed corpora/{dataset_hex}: examples.parquet does not match admission.json",
        f"damaged/runs/{ADAPTER}/key/train_receipt.json is not whole JSON",
        f"committed runs/{ADAPTER}/key/adapter has no adapter_model.safetensors",
    ])
    assert counts["committed_checkpoints"] == 1 and counts["committed_corpora"] == 1


# ------------------------------------------------------------------------------------------ driver

_SPEAKER = r"""
import json, sys
print("loading the model", flush=True)  # not an event: the drill skips it
print("EVENT start 42", flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(70)
print("EVENT write s3://b/r/runs/a/k/a-checkpoint-step-00000002.kiln-checkpoint/adapter_model.safetensors", flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(71)
print("RESULT " + json.dumps({"status": "success", "steps": 2, "latest_checkpoint": None}), flush=True)
print("the child's stderr goes to the log", file=sys.stderr, flush=True)
"""


def test_driver_reads_events_answers_go_and_reads_the_result(tmp_path):
    from drills.driver import Driver

    driver = Driver([sys.executable, "-c", _SPEAKER], log_path=tmp_path / "driver.log")
    try:
        assert driver.next_event(timeout=30) == ("start", "42")
        driver.go()
        kind, arg = driver.next_event(timeout=30)
        assert kind == "write" and arg.endswith("adapter_model.safetensors")
        driver.go()
        assert driver.next_event(timeout=30) is None  # the child finished: no more events
        assert driver.wait(30) == 0
    finally:
        if driver.process.poll() is None:
            driver.kill()
    assert driver.result() == {"status": "success", "steps": 2, "latest_checkpoint": None}
    assert "loading the model" in driver.lines
    assert "the child's stderr goes to the log" in driver.log_tail()


def test_driver_kill_lands_while_the_child_waits_for_go(tmp_path):
    from drills.driver import Driver

    driver = Driver([sys.executable, "-c", _SPEAKER], log_path=tmp_path / "driver.log")
    assert driver.next_event(timeout=30) == ("start", "42")
    assert driver.kill() == -9  # SIGKILL, never a clean exit
    assert driver.result() is None


def test_driver_times_out_on_a_silent_child(tmp_path):
    from drills.driver import Driver

    driver = Driver([sys.executable, "-c", "import time; time.sleep(30)"], log_path=tmp_path / "driver.log")
    try:
        with pytest.raises(TimeoutError, match="said nothing"):
            driver.next_line(timeout=0.3)
    finally:
        driver.kill()


@pytest.mark.parametrize("argv, fragment", [
    (["--adapter", "a", "--student", "s", "--out", "o"], "--request"),
    (["--request", "r", "--adapter", "a", "--student", "s", "--out", "o", "--handshake", "sometimes"], "--handshake"),
])
def test_driver_main_refuses_incomplete_arguments_before_training(argv, fragment, capsys):
    from drills.driver import driver_main

    with pytest.raises(SystemExit) as exited:
        driver_main(argv)
    assert exited.value.code == 2 and fragment in capsys.readouterr().err

