"""One run per run key at a time (``kiln_core.engine.run_lock``), with real processes.

* local disk: ``kiln-flows train`` while another process holds the run's lock exits 3 with
  ``run_in_progress`` naming that process's pid; two real ``train`` processes of one request (the first
  paused mid-run with SIGSTOP) — the second exits 3 naming the first, a third with ``--wait-for-lock``
  waits and then finds the run finished; a holder killed with SIGKILL leaves a record that the next
  run takes over;
* S3 (moto's standalone server, drills/s3_server.py): the same holder/second-process rules through
  conditional puts, a dead pid's record and an expired lease taken over, a fresh lease from another
  host respected, the heartbeat, and ``--wait``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kiln_core.engine.run_lock import Holder, RunInProgress, RunLock, lock_location
from kiln_core.storage import resolve

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
HOLDER_SCRIPT = str(TESTS / "lock_support.py")
CONFIG = {"training_mode": "off_policy", "objective": "reverse_kl", "loss": "teacher_top_k", "top_k": 16, "lora_rank": 4,
          "lora_alpha": 8.0, "seed": 3, "learning_rate": 0.02, "checkpoint_interval": 4, "epochs": 3}


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def start_holder(run_uri: str, *extra: str) -> subprocess.Popen:
    """Start a process that holds ``run_uri``'s lock; returns once it says it holds it."""
    process = subprocess.Popen([sys.executable, HOLDER_SCRIPT, run_uri, *extra], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
    line = process.stdout.readline()
    assert json.loads(line)["held"], (line, process.stderr.read())
    return process


def stop_holder(process: subprocess.Popen) -> dict:
    out, err = process.communicate("", timeout=60)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def second_holder(run_uri: str, *extra: str) -> tuple[int, dict]:
    """Another process trying the same lock (no stdin to hold on): exit code and its JSON line."""
    done = subprocess.run([sys.executable, HOLDER_SCRIPT, run_uri, *extra], input="", capture_output=True, text=True,
                          env=environment(), timeout=120)
    return done.returncode, json.loads(done.stdout.strip().splitlines()[0])


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def record(run_uri: str, *, host: str, pid: int, heartbeat_age: float, lease: float = 120.0) -> bytes:
    return Holder(token=uuid.uuid4().hex, host=host, pid=pid, since="2026-01-01T00:00:00Z",
                  heartbeat_at=time.time() - heartbeat_age, lease_seconds=lease, run=run_uri).to_bytes()


# ---------------------------------------------------------------------------------------------
# The rule, in one process (local disk and a store without conditional writes)


def test_second_lock_in_progress_then_free_after_release(tmp_path):
    run = resolve(str(tmp_path / "runs" / "demo" / "0123456789abcdef"))
    first = RunLock()
    first.acquire(run)
    lock_file = tmp_path / "runs" / "demo" / ".0123456789abcdef.lock"
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    with pytest.raises(RunInProgress) as refused:
        RunLock().acquire(run)
    error = refused.value
    assert error.code == "run_in_progress" and error.exit_code == 3
    assert f"pid {os.getpid()}" in error.message and socket.gethostname() in error.message and "UTC" in error.message
    assert error.to_json()["holder"]["pid"] == os.getpid()
    first.release()
    assert not lock_file.exists()  # nothing left beside the run directory
    second = RunLock()
    second.acquire(run)
    second.release()


def test_lock_object_is_beside_the_run_directory_not_in_it():
    location = lock_location(resolve("s3://bucket/root/runs/demo/0123456789abcdef"))
    assert location.uri == "s3://bucket/root/runs/demo/.0123456789abcdef.lock"


@pytest.mark.parametrize("age, host, alive, stale", [
    (1.0, "this", True, False),      # a live holder on this host
    (1.0, "this", False, True),      # a dead pid on this host: at once
    (1.0, "other", False, False),    # another host within its lease: its pid means nothing here
    (500.0, "other", True, True),    # another host whose heartbeat is older than the lease
])
def test_stale_rule(age, host, alive, stale):
    pid = os.getpid() if alive else dead_pid()
    holder = Holder.parse(record("r", host=socket.gethostname() if host == "this" else "elsewhere.example",
                                 pid=pid, heartbeat_age=age))
    assert holder.is_stale() is stale


def test_memory_store_record_rules():
    """A store without conditional writes (``memory://``): the same rules through write-and-read-back."""
    run = resolve(f"memory://locks-{uuid.uuid4().hex[:8]}/runs/demo/k1")
    location = lock_location(run)
    location.fs.pipe_file(location.path, record(run.uri, host="elsewhere.example", pid=1, heartbeat_age=5))
    with pytest.raises(RunInProgress, match="host elsewhere.example, pid 1"):
        RunLock().acquire(run)
    location.fs.pipe_file(location.path, record(run.uri, host="elsewhere.example", pid=1, heartbeat_age=500))
    lock = RunLock()
    lock.acquire(run)  # expired lease: taken over
    assert Holder.parse(location.fs.cat_file(location.path)).pid == os.getpid()
    lock.release()
    assert not location.fs.exists(location.path)


# ---------------------------------------------------------------------------------------------
# Local disk, real processes


def test_local_second_process_in_progress_names_the_holder_and_dead_holder_is_taken_over(tmp_path):
    run_uri = str(tmp_path / "runs" / "demo" / "0123456789abcdef")
    holder = start_holder(run_uri)
    code, refused = second_holder(run_uri)
    assert code == 3 and refused["code"] == "run_in_progress", refused
    assert refused["holder"]["pid"] == holder.pid and f"pid {holder.pid}" in refused["message"]
    holder.kill()  # SIGKILL: no release; the record stays, the kernel drops the flock
    holder.wait()
    lock_file = Path(str(lock_location(resolve(run_uri)).path))
    assert json.loads(lock_file.read_text())["pid"] == holder.pid
    taker = start_holder(run_uri)
    assert json.loads(lock_file.read_text())["pid"] == taker.pid
    assert stop_holder(taker) == {"released": True, "lost": False}


def test_local_wait_for_lock_takes_it_when_the_holder_ends(tmp_path):
    run_uri = str(tmp_path / "runs" / "demo" / "0123456789abcdef")
    holder = start_holder(run_uri)
    waiter = subprocess.Popen([sys.executable, HOLDER_SCRIPT, run_uri, "--wait", "60"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
    time.sleep(2.0)
    assert waiter.poll() is None  # still waiting
    stop_holder(holder)
    line = waiter.stdout.readline()
    assert json.loads(line)["pid"] == waiter.pid
    stop_holder(waiter)


# ---------------------------------------------------------------------------------------------
# kiln-flows train: two real runs of one request


@pytest.fixture(scope="module")
def request_file(tiny_student, tmp_path_factory) -> Path:
    from kiln_core.synthetic import synthesize_corpus

    directory = tmp_path_factory.mktemp("lock-corpus")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=4, top_k=16, seed=0)
    manifest = (directory / "corpus.jsonl").read_text().splitlines()[0]
    (directory / "teacher-manifest.jsonl").write_text(manifest + "\n")
    path = directory / "request.json"
    path.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl", "config": CONFIG}))
    return path


def train_command(request: Path, student: Path, out: Path, adapter: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train", "--request", str(request), "--adapter", adapter,
            "--student", str(student), "--out", str(out), "--json", *extra]


def wait_for(predicate, timeout: float = 180.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_two_train_processes_second_exits_3_naming_the_first_and_wait_finds_it_finished(request_file, tiny_student,
                                                                                         tmp_path):
    runs = tmp_path / "runs" / "twice"
    first = subprocess.Popen(train_command(request_file, tiny_student, tmp_path, "twice"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=environment())
    try:
        wait_for(lambda: runs.is_dir() and any(p.name.endswith(".lock") for p in runs.iterdir()) or first.poll() is not None,
                 what="the first run's lock")
        assert first.poll() is None, first.communicate()
        os.kill(first.pid, signal.SIGSTOP)  # the first run is mid-run for as long as this test needs
        second = subprocess.run(train_command(request_file, tiny_student, tmp_path, "twice"), capture_output=True,
                                text=True, env=environment(), timeout=300)
        assert second.returncode == 3, (second.stdout, second.stderr)
        refused = last_json(second.stdout)
        assert refused["code"] == "run_in_progress" and refused["status"] == "failed"
        assert refused["holder"]["pid"] == first.pid and f"pid {first.pid}" in refused["message"]
        assert "checkpoint_exists" not in second.stdout + second.stderr
        # a third waits for the first, then finds its run finished
        third = subprocess.Popen(train_command(request_file, tiny_student, tmp_path, "twice", "--wait-for-lock", "300"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
        time.sleep(1.0)
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
        assert last_json(out)["reused"] is False
        out3, err3 = third.communicate(timeout=300)
        assert third.returncode == 0, err3
        assert last_json(out3)["reused"] is True and last_json(out3)["run"] == last_json(out)["run"]
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
    assert not any(p.name.endswith(".lock") for p in runs.iterdir())  # released on the way out


def test_train_takes_over_the_lock_of_a_dead_run(request_file, tiny_student, tmp_path):
    """The run key's record names a pid that no longer exists (SIGKILLed holder): train runs."""
    from kiln_core.engine import prepare, spec_from_request

    spec = spec_from_request(str(request_file), adapter="dead", student_dir=str(tiny_student), out_root=str(tmp_path)).spec
    run_uri = prepare(spec).plan.run_uri  # the run directory train will use (admission only)
    holder = start_holder(run_uri)
    holder.kill()
    holder.wait()
    assert lock_location(resolve(run_uri)).exists()
    done = subprocess.run(train_command(request_file, tiny_student, tmp_path, "dead"), capture_output=True, text=True,
                          env=environment(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)["run"] == run_uri
    assert not lock_location(resolve(run_uri)).exists()


def test_wait_for_lock_must_not_be_negative(request_file, tiny_student, tmp_path):
    done = subprocess.run(train_command(request_file, tiny_student, tmp_path, "neg", "--wait-for-lock", "-1"),
                          capture_output=True, text=True, env=environment(), timeout=120)
    assert done.returncode == 2 and "--wait-for-lock" in done.stderr


# ---------------------------------------------------------------------------------------------
# S3 (moto's standalone server)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from drills.s3_server import S3Server, aws_environment

    server = S3Server(log_path=str(tmp_path_factory.mktemp("moto") / "moto.log"))
    server.start()
    try:
        server.create_bucket("kiln-locks")
        with aws_environment(server):
            yield server
    finally:
        server.stop()


@pytest.fixture
def s3_run(s3) -> str:
    from drills.s3_server import clear_s3fs_cache

    clear_s3fs_cache()
    return f"s3://kiln-locks/{uuid.uuid4().hex[:8]}/runs/demo/0123456789abcdef"


def test_s3_second_process_in_progress_then_released(s3_run):
    holder = start_holder(s3_run)
    code, refused = second_holder(s3_run)
    assert code == 3 and refused["code"] == "run_in_progress" and refused["holder"]["pid"] == holder.pid
    assert refused["file"] == s3_run.rsplit("/", 1)[0] + "/.0123456789abcdef.lock"
    assert stop_holder(holder) == {"released": True, "lost": False}
    assert not lock_location(resolve(s3_run)).exists()
    code, taken = second_holder(s3_run)
    assert code == 0 and taken["held"]


def test_s3_dead_pid_and_expired_lease_are_taken_over_a_live_lease_is_not(s3_run):
    location = lock_location(resolve(s3_run))
    location.fs.pipe_file(location.path, record(s3_run, host=socket.gethostname(), pid=dead_pid(), heartbeat_age=1))
    code, taken = second_holder(s3_run)  # same host, pid gone: at once (and released on exit)
    assert code == 0 and taken["held"]
    location.fs.pipe_file(location.path, record(s3_run, host="elsewhere.example", pid=1, heartbeat_age=10))
    code, refused = second_holder(s3_run)
    assert code == 3 and refused["holder"] == {"host": "elsewhere.example", "pid": 1, "since": "2026-01-01T00:00:00Z"}
    location.fs.pipe_file(location.path, record(s3_run, host="elsewhere.example", pid=1, heartbeat_age=500))
    code, taken = second_holder(s3_run)
    assert code == 0 and taken["held"]


def test_s3_create_is_conditional(s3_run):
    """Two runs creating the record at once: the store refuses the second put (If-None-Match)."""
    from kiln_core.engine.run_lock import _Store

    location = lock_location(resolve(s3_run))
    store = _Store(location)
    store.create(b"first")
    with pytest.raises(FileExistsError):
        store.create(b"second")
    assert location.read_bytes() == b"first"


def test_s3_heartbeat_keeps_a_short_lease_alive_and_wait_takes_it_after_release(s3_run):
    holder = start_holder(s3_run, "--lease", "2")
    location = lock_location(resolve(s3_run))
    first_beat = Holder.parse(location.read_bytes()).heartbeat_at
    time.sleep(3.5)  # longer than the lease: only the heartbeat keeps the record fresh
    assert Holder.parse(location.read_bytes()).heartbeat_at > first_beat
    code, refused = second_holder(s3_run)
    assert code == 3 and refused["holder"]["pid"] == holder.pid
    waiter = subprocess.Popen([sys.executable, HOLDER_SCRIPT, s3_run, "--wait", "60"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
    time.sleep(1.5)
    assert waiter.poll() is None
    stop_holder(holder)
    assert json.loads(waiter.stdout.readline())["pid"] == waiter.pid
    stop_holder(waiter)


# ---------------------------------------------------------------------------------------------
# kiln-flows run: the opd_distill flow takes the same lock


def test_pipeline_flow_run_exits_3_run_in_progress_while_the_run_key_is_held(tiny_student, tiny_teacher, tmp_path):
    import yaml

    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.contracts.spec_file import load_spec
    from kiln_core.engine import prepare
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.synthetic import synthesize_corpus

    line = build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32))
    corpus = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=2, top_k=16, manifest_line=line)
    spec = {"teacher": {"kind": "local_dir", "path": str(tiny_teacher)}, "corpus": str(corpus),
            "student": str(tiny_student), "storage_root": str(tmp_path / "out"), "adapter": "flow-held",
            "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "seed": 5, "lora_rank": 4,
                       "lora_alpha": 8.0}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_uri = prepare(load_spec(str(path))).plan.run_uri
    holder = start_holder(run_uri)
    try:
        env = {key: value for key, value in environment().items() if key != "PREFECT_API_URL"}
        env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"})
        done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path), "--json"], capture_output=True,
                              text=True, env=env, timeout=900)
    finally:
        stop_holder(holder)
    assert done.returncode == 3, (done.stdout, done.stderr[-3000:])
    refused = last_json(done.stdout)
    assert refused["code"] == "run_in_progress" and f"pid {holder.pid}" in refused["message"], refused
    assert not any((tmp_path / "out" / "runs" / "flow-held").glob("*/*.kiln-checkpoint"))
