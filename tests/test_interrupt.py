"""Ctrl-C in a terminal during ``kiln-flows run``: SIGINT to the whole process group, as a terminal
sends it, reaches the CLI and everything it started in that group.

The first Ctrl-C stops training at the next step boundary: a checkpoint is published, the receipt
says ``cancelled``, the command exits 3 within seconds (Prefect's temporary API server runs in a
session of its own, so it survives the Ctrl-C and the run can report). A second Ctrl-C exits at once.
Either way the temporary server does not outlive the command.

Event-driven, not timed: a hook on the subprocess's path holds training after step 3 until the test
says go (a file), so the Ctrl-C always lands in a run that is mid-way.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml

from kiln_core.synthetic import synthesize_corpus

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KILN_FLOWS = str(Path(sys.executable).with_name("kiln-flows"))
HOLD_STEP = 3

HOOK = textwrap.dedent(
    """
    # Test hook (only on this subprocess's PYTHONPATH): after step HOLD_STEP, say so and wait for the
    # test's go file; the Ctrl-C arrives while training waits here.
    import os
    import time

    if os.environ.get("KILN_TEST_HOLD_STEP"):
        import kiln_core.training.trainer as _trainer

        _train_opd = _trainer.train_opd
        _hold = int(os.environ["KILN_TEST_HOLD_STEP"])
        _go = os.environ["KILN_TEST_GO_FILE"]

        def _held(*args, **kwargs):
            report = kwargs.get("on_progress")

            def progress(step, total, loss):
                if report is not None:
                    report(step, total, loss)
                if step == _hold:
                    with open(os.environ["KILN_TEST_HELD_FILE"], "w") as held:
                        held.write(str(step))
                    while not os.path.exists(_go):
                        time.sleep(0.05)

            return _train_opd(*args, **{**kwargs, "on_progress": progress})

        _trainer.train_opd = _held
    """
)


@pytest.fixture
def pipeline(tiny_student, tiny_teacher, tmp_path):
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity

    line = build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32))
    corpus = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=4, top_k=16, manifest_line=line)
    spec = {"teacher": {"kind": "local_dir", "path": str(tiny_teacher)}, "corpus": str(corpus),
            "student": str(tiny_student), "storage_root": str(tmp_path / "out"), "adapter": "interrupted",
            "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 2, "checkpoint_interval": 2, "seed": 5,
                       "learning_rate": 0.01, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "adam_w"}}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return {**held_training(tmp_path), "argv": [KILN_FLOWS, "run", str(path), "--json"]}


def held_training(tmp_path: Path) -> dict:
    """The environment of a CLI subprocess whose training the hook holds after step ``HOLD_STEP``."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    python_path = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))  # the hook, then the caller's
    env.update({"PYTHONPATH": python_path, "KILN_TEST_HOLD_STEP": str(HOLD_STEP), "KILN_TEST_GO_FILE": str(tmp_path / "go"),
                "KILN_TEST_HELD_FILE": str(tmp_path / "held"),
                "PREFECT_HOME": str(tmp_path / "prefect-home"),  # its own temporary API and database
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"})
    return {"env": env, "go": tmp_path / "go", "held": tmp_path / "held", "out": tmp_path / "out",
            "log": tmp_path / "run.log"}


def start(pipeline) -> tuple[subprocess.Popen, object]:
    assert os.path.exists(KILN_FLOWS), f"no kiln-flows console script beside {sys.executable}: pip install -e ."
    log = open(pipeline["log"], "wb")
    process = subprocess.Popen(pipeline["argv"], env=pipeline["env"],
                               stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                               start_new_session=True)  # its own process group: the test plays the terminal
    return process, log


def wait_until_held(process: subprocess.Popen, pipeline, timeout: float = 600) -> list[psutil.Process]:
    """Wait until the hook holds training; returns every process the CLI started by then."""
    deadline = time.monotonic() + timeout
    while not pipeline["held"].exists():
        assert process.poll() is None, f"exited {process.returncode} early:\n{pipeline['log'].read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"training never reached step {HOLD_STEP}:\n{pipeline['log'].read_text()[-3000:]}"
        time.sleep(0.05)
    return psutil.Process(process.pid).children(recursive=True)


def ctrl_c(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGINT)  # what a terminal does: the whole foreground process group


def assert_gone(processes: list[psutil.Process], timeout: float = 30) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, f"left running after the command exited: {[p.cmdline() for p in alive]}"


def test_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint_and_a_cancelled_receipt(pipeline):
    process, log = start(pipeline)
    try:
        started = wait_until_held(process, pipeline)
        assert any("uvicorn" in " ".join(child.cmdline()) for child in started), "no temporary API server started"
        ctrl_c(process)
        signalled = time.monotonic()
        time.sleep(0.5)  # the handler has run; training resumes into the stop at the next step boundary
        pipeline["go"].write_text("")
        out, _ = process.communicate(timeout=120)
        elapsed = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    stderr = pipeline["log"].read_text()
    assert process.returncode == 3, stderr[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s to stop after Ctrl-C"
    assert "Traceback" not in stderr, stderr[-3000:]
    offline_noise = [line for line in stderr.splitlines() if any(word in line.lower() for word in ("telemetry", "analytics"))]
    assert offline_noise == [], offline_noise  # an offline machine: no telemetry or analytics errors
    record = json.loads(out.decode().strip().splitlines()[-1])
    assert record["status"] == "cancelled"
    [run] = [p for p in (pipeline["out"] / "runs" / "interrupted").iterdir() if p.is_dir()]
    receipt = json.loads((run / "train_receipt.json").read_text())
    assert (receipt["status"], receipt["failure_reason"]) == ("failed", "cancelled")
    checkpoint = run / f"interrupted-checkpoint-step-{HOLD_STEP:08d}.kiln-checkpoint" / "checkpoint_manifest.json"
    assert checkpoint.is_file(), sorted(p.name for p in run.iterdir())  # published at the step boundary
    assert not (run / "adapter").exists()
    assert_gone(started)


def test_a_second_ctrl_c_exits_at_once(pipeline):
    process, log = start(pipeline)
    try:
        started = wait_until_held(process, pipeline)
        ctrl_c(process)  # training is held: the first Ctrl-C can only ask for a stop
        time.sleep(1.0)
        assert process.poll() is None
        ctrl_c(process)
        signalled = time.monotonic()
        process.communicate(timeout=60)
        elapsed = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    stderr = pipeline["log"].read_text()
    assert process.returncode == 3, stderr[-3000:]
    assert elapsed < 30, f"took {elapsed:.0f} s to exit after the second Ctrl-C"
    assert "Ctrl-C again to stop now" in stderr and "interrupted" in stderr
    assert_gone(started)


def test_ctrl_c_in_demo_ends_the_demo_cancelled_in_one_line(tmp_path):
    """``kiln-flows demo`` wraps the pipeline in a flow of its own: a Ctrl-C that stops training cleanly
    ends both flows ``Cancelled`` and says so in one line, without Prefect's ``CancelledRun`` traceback
    or a ``Failed`` outer run."""
    demo = {**held_training(tmp_path), "argv": [KILN_FLOWS, "demo", "--out", str(tmp_path / "out")]}
    process, log = start(demo)
    try:
        started = wait_until_held(process, demo)
        ctrl_c(process)
        time.sleep(0.5)
        demo["go"].write_text("")
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    stderr = demo["log"].read_text()
    assert process.returncode == 3, stderr[-3000:]
    assert "Traceback" not in stderr and "CancelledRun" not in stderr, stderr[-3000:]
    assert "Failed" not in stderr and "FAILED" not in out.decode(), stderr[-3000:]
    assert out.decode() == ""  # how a run ended that did not complete goes to stderr, in one line
    ended = [line for line in stderr.splitlines() if line.startswith("demo run ended")]
    assert ended == [f"demo run ended CANCELLED: training cancelled at step {HOLD_STEP}; "
                     f"checkpoint demo-checkpoint-step-{HOLD_STEP:08d}.kiln-checkpoint kept (a retry resumes from it)"]
    assert "Flow run 'demo' - Finished in state Cancelled(" in stderr
    [run] = [p for p in (demo["out"] / "runs" / "demo").iterdir() if p.is_dir()]
    receipt = json.loads((run / "train_receipt.json").read_text())
    assert (receipt["status"], receipt["failure_reason"]) == ("failed", "cancelled")
    assert_gone(started)


def test_a_second_ctrl_c_in_train_prints_the_command_that_resumes_it(tiny_student, tiny_teacher, tmp_path):
    """``kiln-flows train`` stopped at once by a second Ctrl-C names its newest checkpoint in the exact command that
    resumes it; that command, run as printed, finishes the run."""
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity

    line = build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32))
    synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=4, top_k=16, manifest_line=line)
    (tmp_path / "teacher-manifest.jsonl").write_text(line + "\n")
    (tmp_path / "request.json").write_text(json.dumps({
        "dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl",
        "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 2, "checkpoint_interval": 2, "seed": 5,
                   "learning_rate": 0.01, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "adam_w"}}}))
    argv = [KILN_FLOWS, "train", "--request", str(tmp_path / "request.json"), "--adapter", "interrupted",
            "--student", str(tiny_student), "--out", str(tmp_path / "out")]
    train = {**held_training(tmp_path), "argv": argv}
    process, log = start(train)
    try:
        wait_until_held(process, train)
        ctrl_c(process)
        time.sleep(1.0)
        ctrl_c(process)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    stderr = train["log"].read_text()
    assert process.returncode == 3, stderr[-3000:]
    newest = f"interrupted-checkpoint-step-{HOLD_STEP - 1:08d}.kiln-checkpoint"  # the hold is after step 3
    [resume] = [line.split("resume with: ", 1)[1] for line in stderr.splitlines() if "resume with: " in line]
    assert resume.startswith("kiln-flows train --request ") and resume.endswith(f"--resume-checkpoint {newest}")
    env = {key: value for key, value in train["env"].items() if not key.startswith("KILN_TEST_")}
    resumed = subprocess.run([KILN_FLOWS, *shlex.split(resume)[1:], "--json"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == 8
