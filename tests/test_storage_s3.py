"""Everything kiln-flows publishes, on a real S3 endpoint (moto's standalone server, drills/s3_server.py).

No S3 client is patched: s3fs talks HTTP to a separate process on loopback. The session's endpoint and
dummy credentials reach s3fs through the environment (``AWS_ENDPOINT_URL_S3`` and friends, see
drills/s3_server.py); one flow test removes them all and supplies credentials from a Prefect ``Secret``
block instead.

1. storage primitives: commit order, absent-until-committed, ``write_bytes_atomic``, ``list_children``,
   ``localize_directory`` of a model directory;
2. admission from ``s3://`` into an ``s3://`` root, reuse, digest verification;
3. training with ``run_root`` on S3, crash, resume from S3 → the same adapter bytes as on local disk;
4. the ``opd_distill`` flow with ``storage_root=s3://…``, credentials from the environment and from a
   ``Secret`` block, and no secret in parameters, receipt, artifacts, results or logs.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from drills.s3_server import S3Server, aws_environment, clear_s3fs_cache, fsspec_config, without_aws_environment

from kiln_core.canonical import sha256_hex, sha256_prefixed
from kiln_core.storage import StagedDirectory, list_children, localize_directory, resolve, write_bytes_atomic, write_bytes_exclusive

pytestmark = pytest.mark.integration

BUCKET = "kiln-test"
ADAPTER = "demo"


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A moto server for the session with one bucket; the environment points s3fs/boto3 at it."""
    server = S3Server(log_path=str(tmp_path_factory.mktemp("moto") / "moto.log"))
    server.start()
    try:
        server.create_bucket(BUCKET)
        with aws_environment(server):
            yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _fresh_s3fs_instances():
    """Each test gets new ``S3FileSystem`` instances (clients and listing caches)."""
    clear_s3fs_cache()
    yield
    clear_s3fs_cache()


@pytest.fixture
def prefix(s3, request) -> str:
    """A key prefix no other test (or earlier session) uses."""
    return f"{request.node.name.split('[')[0][:40]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def corpus_file(tiny_student, tiny_teacher, tmp_path_factory) -> Path:
    """A 6-example scored corpus whose manifest is the local teacher directory's identity."""
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.synthetic import synthesize_corpus

    line = build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32))
    path = tmp_path_factory.mktemp("s3-corpus") / "corpus.jsonl"
    return synthesize_corpus(str(tiny_student), str(path), n_examples=6, top_k=16, manifest_line=line)


@pytest.fixture(scope="module")
def s3_corpus(s3, corpus_file) -> str:
    """The corpus uploaded to S3 (its URI)."""
    key = f"inputs-{uuid.uuid4().hex[:8]}/corpus.jsonl"
    s3.boto3_client().put_object(Bucket=BUCKET, Key=key, Body=corpus_file.read_bytes())
    return f"s3://{BUCKET}/{key}"


def _keys(s3: S3Server, prefix: str) -> list[str]:
    """Keys under ``prefix`` relative to it (read with boto3: no s3fs cache involved)."""
    return [key[len(prefix) + 1 :] for key in s3.list_keys(BUCKET, prefix + "/")]


def _tables_equal(a, b) -> None:
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# ---------------------------------------------------------------------------------------------
# 0. The server helper itself (fault tests build on restart and pause)


def test_s3_server_restarts_on_the_same_port_and_pauses(tmp_path):
    import urllib.request

    with S3Server(log_path=str(tmp_path / "moto.log")) as server:
        endpoint = server.endpoint_url
        server.create_bucket("kiln-restart")
        server.boto3_client().put_object(Bucket="kiln-restart", Key="a", Body=b"1")
        first_pid = server.process.pid
        server.restart()
        assert server.endpoint_url == endpoint and server.process.pid != first_pid
        assert "kiln-restart" not in [b["Name"] for b in server.boto3_client().list_buckets()["Buckets"]]  # state lost
        server.create_bucket("kiln-restart")
        server.pause()
        with pytest.raises(OSError):  # accepted by the kernel, never answered
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=0.5)
        server.resume()
        assert server.list_keys("kiln-restart") == []
    assert not server.running


# ---------------------------------------------------------------------------------------------
# 1. Storage primitives


def test_staged_directory_writes_the_commit_file_last_and_uncommitted_prefixes_are_absent(s3, prefix):
    from kiln_core.materialize import read_materialization_at

    target = resolve(f"s3://{BUCKET}/{prefix}/corpora/abc")
    opened: list[str] = []
    real_open = target.fs.open

    def recording_open(path, mode="rb", *args, **kwargs):
        if "w" in mode:
            opened.append(path.rsplit("/", 1)[-1])
        return real_open(path, mode, *args, **kwargs)

    target.fs.open = recording_open  # instance attribute: only this (cached) filesystem records
    try:
        with StagedDirectory(target, commit_name="admission.json") as staged:
            assert staged.staging == target  # object stores: no staging prefix, no rename
            staged.write("examples.parquet", b"e" * 10)
            staged.write("nested/targets.parquet", b"t" * 20)
            # Before the commit the files are in the bucket, and every reader treats the prefix as absent.
            assert _keys(s3, f"{prefix}/corpora/abc") == ["examples.parquet", "nested/targets.parquet"]
            assert read_materialization_at(target) is None
            with pytest.raises(ValueError):
                staged.write("admission.json", b"{}")  # the commit file only goes through commit()
            staged.commit(b'{"committed": true}')
    finally:
        del target.fs.open
    assert opened == ["examples.parquet", "targets.parquet", "admission.json"]
    assert _keys(s3, f"{prefix}/corpora/abc") == ["admission.json", "examples.parquet", "nested/targets.parquet"]
    assert s3.get_object(BUCKET, f"{prefix}/corpora/abc/admission.json") == b'{"committed": true}'
    assert s3.get_object(BUCKET, f"{prefix}/corpora/abc/nested/targets.parquet") == b"t" * 20
    with pytest.raises(FileExistsError):  # a committed prefix is immutable
        with StagedDirectory(target, commit_name="admission.json"):
            pass


def test_an_exception_before_commit_leaves_no_commit_file_and_a_retry_commits(s3, prefix):
    from kiln_core.training.checkpoint import latest_checkpoint

    run = resolve(f"s3://{BUCKET}/{prefix}/runs/{ADAPTER}")
    name = f"{ADAPTER}-checkpoint-step-00000002.kiln-checkpoint"
    with pytest.raises(RuntimeError, match="crash"):
        with StagedDirectory(run.child(name), commit_name="checkpoint_manifest.json") as staged:
            staged.write("adapter.safetensors", b"partial")
            raise RuntimeError("crash between the files and the commit")
    assert _keys(s3, f"{prefix}/runs/{ADAPTER}/{name}") == ["adapter.safetensors"]
    assert latest_checkpoint(run, ADAPTER) is None  # the uncommitted prefix is not a checkpoint

    with StagedDirectory(run.child(name), commit_name="checkpoint_manifest.json") as staged:
        staged.write("adapter.safetensors", b"whole")
        staged.commit(b"{}")
    assert latest_checkpoint(run, ADAPTER) == name
    assert s3.get_object(BUCKET, f"{prefix}/runs/{ADAPTER}/{name}/adapter.safetensors") == b"whole"


def test_write_bytes_atomic_and_list_children_on_s3(s3, prefix):
    root = resolve(f"s3://{BUCKET}/{prefix}")
    pointer = root.child("runs", ADAPTER, "latest.json")
    write_bytes_atomic(pointer, b'{"v": 1}')
    write_bytes_atomic(pointer, b'{"v": 2}')  # replaces in one PUT
    assert pointer.read_bytes() == b'{"v": 2}'
    assert _keys(s3, prefix) == [f"runs/{ADAPTER}/latest.json"]  # no temp objects left behind
    with pytest.raises(FileExistsError):
        write_bytes_exclusive(pointer, b"other")
    assert s3.get_object(BUCKET, f"{prefix}/runs/{ADAPTER}/latest.json") == b'{"v": 2}'

    write_bytes_atomic(root.child("runs", ADAPTER, "b-checkpoint", "file"), b"1")
    write_bytes_atomic(root.child("runs", ADAPTER, "a.json"), b"2")
    assert list_children(root.child("runs", ADAPTER)) == ["a.json", "b-checkpoint", "latest.json"]
    assert list_children(root.child("runs")) == [ADAPTER]
    assert list_children(root.child("nothing-here")) == []
    assert root.child("runs", ADAPTER, "b-checkpoint").exists()
    assert not root.child("runs", "other").exists()


def test_read_bytes_of_an_object_another_writer_keeps_rewriting_returns_one_whole_version(s3, prefix):
    """A run lock's heartbeat rewrites its record while others read it: a read gets one version whole.

    Reading through s3fs's file object takes the ETag first and then reads with If-Match, so a
    rewrite in between made the read fail (FileExpired) - CI saw it once on the lock test.
    """
    import threading

    location = resolve(f"s3://{BUCKET}/{prefix}/record.json")
    versions = [json.dumps({"beat": n, "pad": "x" * 200}).encode() for n in range(400)]
    location.fs.pipe_file(location.path, versions[0])
    writer_fs = resolve(f"s3://{BUCKET}/{prefix}/record.json").fs
    stop = threading.Event()

    def rewrite():
        n = 0
        while not stop.is_set():
            n = (n + 1) % len(versions)
            writer_fs.pipe_file(location.path, versions[n])

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        reads = [location.read_bytes() for _ in range(60)]
    finally:
        stop.set()
        writer.join(timeout=30)
    assert all(data in versions for data in reads)
    assert len(set(reads)) > 1  # the writer did rewrite it between reads


def test_localize_directory_copies_a_model_dir_from_s3_and_its_tokenizer_loads(s3, prefix, tiny_student, tmp_path):
    from kiln_core.tokenization import load_student_tokenizer

    uri = f"s3://{BUCKET}/{prefix}/models/student"
    location = resolve(uri)
    location.fs.put(str(tiny_student) + "/", location.path + "/", recursive=True)
    files = sorted(p.name for p in Path(tiny_student).iterdir() if p.is_file())
    assert _keys(s3, f"{prefix}/models/student") == files

    local = localize_directory(uri, cache_dir=str(tmp_path))
    assert Path(local).is_dir() and str(tmp_path) in local
    for name in files:
        assert (Path(local) / name).read_bytes() == (Path(tiny_student) / name).read_bytes(), name
    tokenizer = load_student_tokenizer(local)
    assert tokenizer.identity() == load_student_tokenizer(str(tiny_student)).identity()
    assert tokenizer.vocab_size == load_student_tokenizer(str(tiny_student)).vocab_size

    # The second call reuses the local copy (no download: it works with the objects gone).
    s3.boto3_client().delete_object(Bucket=BUCKET, Key=f"{prefix}/models/student/model.safetensors")
    assert localize_directory(uri, cache_dir=str(tmp_path)) == local
    assert (Path(local) / "model.safetensors").exists()
    # Local paths are never copied.
    assert localize_directory(str(tiny_student)) == str(tiny_student)


# ---------------------------------------------------------------------------------------------
# 2. Admission and materialization on S3


def test_admission_reads_s3_materializes_to_s3_reuses_and_verifies_digests(s3, prefix, s3_corpus, corpus_file, tiny_student):
    from kiln_core.admission import admit_corpus
    from kiln_core.materialize import read_materialization

    root = f"s3://{BUCKET}/{prefix}"
    data = corpus_file.read_bytes()
    hex_digest = sha256_hex(data)
    first = admit_corpus(s3_corpus, str(tiny_student), top_k=16, out_root=root)
    assert first.reused is False and first.examples == 6 and first.effective_top_k == 16
    assert first.dataset_sha256 == "sha256:" + hex_digest
    assert first.source_uri == s3_corpus
    assert first.materialized == f"{root}/corpora/{hex_digest}"
    corpus_prefix = f"{prefix}/corpora/{hex_digest}"
    assert _keys(s3, corpus_prefix) == ["admission.json", "examples.parquet", "targets.parquet"]
    record = json.loads(s3.get_object(BUCKET, f"{corpus_prefix}/admission.json"))
    assert record["source_uri"] == s3_corpus and record["dataset_sha256"] == first.dataset_sha256
    for name, digest in record["files"].items():
        payload = s3.get_object(BUCKET, f"{corpus_prefix}/{name}")
        assert (len(payload), sha256_hex(payload)) == (digest["bytes"], digest["sha256"])

    # The tables read back from S3 are the ones a local admission of the same bytes produces.
    local = admit_corpus(str(corpus_file), str(tiny_student), top_k=16)
    _tables_equal(read_materialization(first.materialized).tables, local.tables)

    clear_s3fs_cache()  # a new process would start with no listing cache
    again = admit_corpus(s3_corpus, str(tiny_student), top_k=16, out_root=root)
    assert again.reused is True and again.materialized == first.materialized
    _tables_equal(again.tables, local.tables)

    # Without its commit file the materialization is absent: readers refuse it, admission rewrites it.
    location = resolve(first.materialized)
    location.fs.rm(location.child("admission.json").path)
    with pytest.raises(FileNotFoundError, match="not a committed corpus materialization"):
        read_materialization(first.materialized)
    rewritten = admit_corpus(s3_corpus, str(tiny_student), top_k=16, out_root=root)
    assert rewritten.reused is False and rewritten.materialized == first.materialized
    assert read_materialization(first.materialized).record.files == first.record.files

    # Same size, one byte changed: the SHA-256 check refuses it.
    payload = bytearray(s3.get_object(BUCKET, f"{corpus_prefix}/targets.parquet"))
    payload[len(payload) // 2] ^= 0xFF
    s3.boto3_client().put_object(Bucket=BUCKET, Key=f"{corpus_prefix}/targets.parquet", Body=bytes(payload))
    clear_s3fs_cache()
    with pytest.raises(ValueError, match="does not match admission.json"):
        read_materialization(first.materialized).tables
    from kiln_core.engine.stages import MaterializationMismatch, verify
    from kiln_core.contracts.stage_refs import CorpusRef

    ref = CorpusRef(uri=first.materialized, dataset_sha256=first.dataset_sha256, source_uri=s3_corpus, examples=6,
                    action_tokens=first.action_tokens, env_tokens=first.env_tokens, effective_top_k=16,
                    teacher_identity_revision=None)
    with pytest.raises(MaterializationMismatch, match="does not match admission.json") as damaged:
        verify(ref)  # the stage names it (materialization_mismatch: exit 3, the flow admits it again)
    assert damaged.value.code == "materialization_mismatch"


# ---------------------------------------------------------------------------------------------
# 3. Training with run_root on S3


def _config():
    from kiln_core.contracts.opd_config import OpdConfig

    return OpdConfig.model_validate(dict(training_mode="off_policy", top_k=16, lora_rank=4, lora_alpha=8.0, seed=11,
                                         learning_rate=2e-2, checkpoint_interval=2, epochs=1))


def test_training_publishes_to_s3_and_resumes_from_s3_bit_exactly(s3, prefix, s3_corpus, tiny_student, tmp_path):
    from kiln_core.admission import admit_corpus
    from kiln_core.materialize import read_materialization
    from kiln_core.training.checkpoint import load_checkpoint, latest_checkpoint
    from kiln_core.training.trainer import train_opd
    from plan_support import split_plan_options, train_plan
    from test_trainer import Crash, crash_after

    admitted = admit_corpus(s3_corpus, str(tiny_student), top_k=16, out_root=f"s3://{BUCKET}/{prefix}")
    tables = read_materialization(admitted.materialized).tables  # verified read from S3
    config = _config()

    def train(run_root: str, **kwargs):
        plan_options, hooks = split_plan_options(kwargs)
        return train_opd(train_plan(config, run_root, ADAPTER, **plan_options), tables,
                         dataset_sha256=admitted.dataset_sha256, dataset_path=s3_corpus, student_dir=str(tiny_student),
                         teacher_alias="tiny-teacher", teacher_identity=admitted.teacher_identity, **hooks)

    reference_dir = tmp_path / "reference"
    reference = train(str(reference_dir))  # uninterrupted, local disk
    assert reference.status == "success" and reference.total_steps == 6

    run_prefix = f"{prefix}/runs/{ADAPTER}"
    run_root = f"s3://{BUCKET}/{run_prefix}"
    step = lambda n: f"{ADAPTER}-checkpoint-step-{n:08d}.kiln-checkpoint"  # noqa: E731
    with pytest.raises(Crash):
        train(run_root, on_step_committed=crash_after(3))
    keys = _keys(s3, run_prefix)
    assert f"{step(2)}/checkpoint_manifest.json" in keys and "train_receipt.json" in keys
    assert not any(key.startswith("adapter/") for key in keys)
    failed = json.loads(s3.get_object(BUCKET, f"{run_prefix}/train_receipt.json"))
    assert failed["status"] != "success" and failed["failure_reason"] == "training_error"

    # A crash while publishing checkpoint 4 left files without their manifest: not a checkpoint.
    s3.boto3_client().put_object(Bucket=BUCKET, Key=f"{run_prefix}/{step(4)}/adapter.safetensors", Body=b"torn")
    clear_s3fs_cache()
    latest = latest_checkpoint(resolve(run_root), ADAPTER)
    assert latest == step(2)

    final = train(run_root, resume_checkpoint=latest)
    assert final.status == "success" and final.resumed_from == step(2)
    assert final.adapter == f"{run_root}/adapter" and final.receipt == f"{run_root}/train_receipt.json"
    assert final.loss_history == reference.loss_history

    keys = _keys(s3, run_prefix)
    for n in (2, 4):
        for name in ("checkpoint_manifest.json", "adapter.safetensors", "optimizer.safetensors", "opd_loop_state.json",
                     "kiln_flows_state.json"):
            assert f"{step(n)}/{name}" in keys, (n, name)
        assert (s3.get_object(BUCKET, f"{run_prefix}/{step(n)}/adapter.safetensors")
                == (reference_dir / step(n) / "adapter.safetensors").read_bytes()), n
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "train_receipt.json"} <= set(keys)
    assert not any(".incomplete" in key for key in keys)
    adapter = s3.get_object(BUCKET, f"{run_prefix}/adapter/adapter_model.safetensors")
    assert adapter == (reference_dir / "adapter" / "adapter_model.safetensors").read_bytes()
    receipt = json.loads(s3.get_object(BUCKET, f"{run_prefix}/train_receipt.json"))
    assert receipt["status"] == "success"
    assert receipt["adapters"]["output"]["adapter_model_sha256"] == sha256_prefixed(adapter)
    # Checkpoint 4 was rewritten whole over the torn prefix and passes every loader check.
    assert load_checkpoint(resolve(run_root), step(4)).manifest.progress.global_step == 4
    assert latest_checkpoint(resolve(run_root), ADAPTER) == step(4)


# ---------------------------------------------------------------------------------------------
# 4. The opd_distill flow with an s3:// storage root


def _spec(teacher: Path, corpus: str, student: Path, storage_root: str, storage_block: str | None = None):
    from flows.spec import parse_spec

    return parse_spec({
        "teacher": {"kind": "local_dir", "path": str(teacher)},
        "corpus": corpus,
        "student": str(student),
        "storage_root": storage_root,
        "adapter": ADAPTER,
        "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "checkpoint_interval": 2,
                   "learning_rate": 0.02, "lora_rank": 4, "lora_alpha": 8.0, "seed": 11, "optimizer": {"kind": "adam_w"}},
        "options": {"train_retries": 0, "storage_block": storage_block},
    })


def _check_published(s3: S3Server, prefix: str, summary: dict, corpus_file: Path) -> dict:
    root = f"s3://{BUCKET}/{prefix}"
    assert summary["status"] == "success", summary
    assert summary["latest"] == f"{root}/runs/{ADAPTER}/latest.json"
    assert summary["receipt"].startswith(f"{root}/runs/{ADAPTER}/") and summary["receipt"].endswith("/train_receipt.json")
    keys = _keys(s3, prefix)
    hex_digest = sha256_hex(corpus_file.read_bytes())
    assert f"corpora/{hex_digest}/admission.json" in keys
    latest = json.loads(s3.get_object(BUCKET, f"{prefix}/runs/{ADAPTER}/latest.json"))
    assert latest["receipt"] == summary["receipt"] and latest["adapter"] == summary["adapter"]
    run_prefix = summary["run"][len(f"s3://{BUCKET}/"):]
    receipt_bytes = s3.get_object(BUCKET, f"{run_prefix}/train_receipt.json")
    assert latest["receipt_sha256"] == "sha256:" + sha256_hex(receipt_bytes)
    adapter = s3.get_object(BUCKET, f"{run_prefix}/adapter/adapter_model.safetensors")
    assert latest["adapter_model_sha256"] == sha256_prefixed(adapter)
    assert f"{run_prefix[len(prefix) + 1:]}/{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint/checkpoint_manifest.json" in keys
    receipt = json.loads(receipt_bytes)
    assert receipt["status"] == "success"
    return receipt


def test_opd_distill_flow_on_s3_with_environment_credentials(s3, prefix, prefect_harness, tiny_teacher, tiny_student, corpus_file):
    from flows.opd_distill import opd_distill

    assert os.environ["AWS_ENDPOINT_URL_S3"] == s3.endpoint_url  # nothing else tells s3fs where S3 is
    spec = _spec(tiny_teacher, str(corpus_file), tiny_student, f"s3://{BUCKET}/{prefix}")
    summary = opd_distill(spec)
    _check_published(s3, prefix, summary, corpus_file)


def test_opd_distill_flow_on_s3_with_secret_block_credentials(s3, prefix, prefect_harness, tiny_teacher, tiny_student,
                                                              corpus_file, caplog, capfd):
    import botocore.exceptions
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.opd_distill import opd_distill

    key_id = "KILNKEY" + uuid.uuid4().hex[:12].upper()
    secret_key = "kiln-secret-" + uuid.uuid4().hex
    Secret(value={"s3": s3.storage_options(key=key_id, secret=secret_key)}).save("kiln-s3", overwrite=True)
    storage_root = f"s3://{BUCKET}/{prefix}"
    spec = _spec(tiny_teacher, str(corpus_file), tiny_student, storage_root, storage_block="secret/kiln-s3")
    caplog.set_level(logging.DEBUG, logger="prefect")
    caplog.set_level(logging.INFO)

    with without_aws_environment(), fsspec_config("s3", None):
        assert not any(name.startswith("AWS_") and name != "AWS_EC2_METADATA_DISABLED" for name in os.environ)
        # Control: with no environment and no block, S3 is unreachable for lack of credentials.
        with pytest.raises(botocore.exceptions.NoCredentialsError):
            resolve(f"{storage_root}/probe").fs.ls(BUCKET)
        clear_s3fs_cache()
        state = opd_distill(spec, return_state=True)
        assert state.is_completed(), state
        summary = state.result()  # completed without any AWS_* variable: the block's options reached s3fs
    assert "s3" not in __import__("fsspec").config.conf  # the block's credentials do not outlive the run
    receipt = _check_published(s3, prefix, summary, corpus_file)

    secrets = (key_id, secret_key)
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert flow_run.parameters["spec"]["options"]["storage_block"] == "secret/kiln-s3"
    assert artifacts, "the flow records artifacts"
    places = {
        "flow run parameters": json.dumps(flow_run.parameters, default=str),
        "receipt": json.dumps(receipt),
        "summary": json.dumps(summary),
        "artifacts": json.dumps([a.model_dump(mode="json") for a in artifacts], default=str),
        "logs": caplog.text + "\n".join(r.getMessage() for r in caplog.records),
        "console": "".join(capfd.readouterr()),
    }
    for key in s3.list_keys(BUCKET, prefix + "/"):
        places[f"s3://{BUCKET}/{key}"] = s3.get_object(BUCKET, key).decode("latin-1")
    results_dir = os.environ.get("PREFECT_RESULTS_LOCAL_STORAGE_PATH")
    for directory, _, names in os.walk(results_dir or "/nonexistent"):
        for name in names:
            places[os.path.join(directory, name)] = Path(directory, name).read_bytes().decode("latin-1")
    assert any("opd-" in text for text in (places["logs"], places["console"])), "no flow logs were captured"
    for where, text in places.items():
        for value in secrets:
            assert value not in text, f"a secret value leaked into {where}"


# ---------------------------------------------------------------------------------------------
# Regressions: a reader must see commits made by other processes, and only a Secret block may hold
# storage credentials.


def test_a_checkpoint_committed_by_another_process_is_visible_to_a_reader_that_listed_before(s3, prefix):
    from kiln_core.training.checkpoint import latest_checkpoint

    run = resolve(f"s3://{BUCKET}/{prefix}/runs/{ADAPTER}")
    client = s3.boto3_client()

    def commit(step: int) -> str:  # what a trainer on other infrastructure does last
        name = f"{ADAPTER}-checkpoint-step-{step:08d}.kiln-checkpoint"
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/runs/{ADAPTER}/{name}/checkpoint_manifest.json", Body=b"{}")
        return name

    first = commit(2)
    assert latest_checkpoint(run, ADAPTER) == first  # this process lists the run directory once
    newer = commit(4)  # then a retry elsewhere publishes a newer checkpoint
    assert latest_checkpoint(run, ADAPTER) == newer  # actual: still step 2 (stale listing)


def test_a_storage_block_slug_of_another_block_type_is_not_read_as_a_secret(prefect_harness):
    import fsspec
    from prefect.blocks.system import Secret

    from flows.opd_distill import storage_credentials

    Secret(value={"s3": {"key": "not-these", "secret": "not-these"}}).save("kiln-typed", overwrite=True)
    with fsspec_config("s3", None):
        raised = None
        try:
            with storage_credentials("aws-credentials/kiln-typed"):
                pass
        except Exception as error:  # refusing the type, or not finding an aws-credentials block, are both fine
            raised = error
        assert "s3" not in fsspec.config.conf, "a Secret block was applied for an aws-credentials slug"
        assert raised is not None
