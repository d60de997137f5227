"""SIGKILL drill: kill a training process at random points; every resume ends byte-identical.

One uninterrupted reference run per checkpoint interval is trained in this process. Each trial then
starts a training subprocess over the same request (``drills.driver``, which runs
``drills.train``, the one door ``kiln-flows train`` uses, or the real
``kiln-flows train`` CLI), SIGKILLs it at a point
drawn from a seeded RNG, resumes from ``latest_checkpoint`` (a fresh start when none was committed)
and compares the final ``adapter_model.safetensors`` bytes and the loss history with the reference.

Kill points (the driver reports each event on stdout and, for the precise modes, waits for the
drill's ``go`` before carrying on, so the kill lands exactly there):

* ``step`` — right after optimizer step k, before its checkpoint is written;
* ``staged-file`` — in the middle of writing checkpoint k (some of its files staged, not committed);
* ``before-commit`` — every file of checkpoint k staged, the manifest not yet written;
* ``after-commit`` — right after checkpoint k is committed;
* ``random`` — a free-running driver killed after a random delay (mid-step, mid-fsync, anywhere);
* ``cli`` — ``kiln-flows train --json`` killed just after checkpoint k appears on disk;
* ``twice`` — killed at step k, resumed by a second driver, killed again later, then resumed.

Every committed checkpoint left behind must load (``load_checkpoint`` verifies every file), the
killed run must not have published an adapter or receipt, and the resume must succeed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from drills import DrillReport, fresh_dir, one_torch_thread, prepare_training_inputs, subprocess_env, where
from drills.driver import EVENT_TIMEOUT_S, Driver

MODES = ("step", "staged-file", "before-commit", "after-commit", "random", "cli", "twice")


# ------------------------------------------------------------------------------------------ checks


def checkpoint_step_of(uri: str) -> int | None:
    """The step in a ``...-checkpoint-step-<8 digits>.kiln-checkpoint[/file]`` URI."""
    import re

    match = re.search(r"-checkpoint-step-(\d{8})\.kiln-checkpoint", uri)
    return int(match.group(1)) if match else None


def inspect_run_dir(run_uri: str, adapter: str) -> tuple[list[str], list[str]]:
    """(problems, committed basenames): every committed checkpoint must load and verify."""
    from kiln_core.storage import list_children, resolve
    from kiln_core.training.checkpoint import CheckpointError, committed_checkpoints, load_checkpoint

    run = resolve(run_uri)
    problems = []
    committed = [name for _, name in committed_checkpoints(run, adapter)]
    for name in committed:
        try:
            load_checkpoint(run, name)
        except CheckpointError as error:
            problems.append(f"committed checkpoint {name} does not load: [{error.code}] {error}")
    children = list_children(run)
    staging = [name for name in children if name.startswith(".") and ".incomplete-" in name]
    return problems, committed + [f"(staging) {name}" for name in staging]


def adapter_bytes(run_uri: str) -> bytes:
    from kiln_core.storage import resolve

    return resolve(run_uri).child("adapter", "adapter_model.safetensors").read_bytes()


def resume_like_the_pipeline(request: Path, adapter: str, student: Path, out: str):
    """What every pipeline attempt does (``kiln_core.engine``): resume from the newest committed
    checkpoint, if any. Returns that checkpoint's name and the result."""
    from drills import run_directory, train
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import latest_checkpoint

    latest = latest_checkpoint(resolve(run_directory(out, adapter)), adapter)
    with one_torch_thread():
        return latest, train(request, adapter=adapter, student=student, out=out, resume="latest")


# ------------------------------------------------------------------------------------------ drill


def run(*, workdir: Path, trials: int = 20, seed: int = 0, **_: Any) -> dict[str, Any]:
    """Run ``trials`` kill-and-resume trials; see the module docstring."""
    from drills import run_directory, train

    report = DrillReport("sigkill", seed=seed)
    inputs = prepare_training_inputs(workdir / "fixture")
    out = fresh_dir(workdir, "out")
    logs = fresh_dir(workdir, "logs")
    references: dict[int, tuple[bytes, list[float]]] = {}
    with one_torch_thread():
        for interval in inputs.requests:
            result = train(inputs.request(interval), adapter=f"reference-{interval}", student=inputs.student,
                           out=out)
            assert result.status == "success", result
            references[interval] = (adapter_bytes(run_directory(str(out), f"reference-{interval}")), result.loss_history)
            total = result.total_steps
    report["total_steps"] = total
    report["references_equal_across_intervals"] = len({ref[0] for ref in references.values()}) == 1
    rng = random.Random(seed)
    for trial in range(trials):
        mode = MODES[trial] if trial < len(MODES) else rng.choice(MODES)
        interval = rng.choice(sorted(inputs.requests))
        kill_step = rng.randint(1, total - 1)
        if mode in ("staged-file", "before-commit", "after-commit"):  # a step that has a checkpoint
            kill_step = max(interval, min(kill_step - kill_step % interval, total - 1))
        adapter = f"trial-{trial:03d}"
        label = f"trial {trial} mode={mode} interval={interval} kill_step={kill_step}"
        try:
            outcome = _trial(mode, rng, inputs.request(interval), adapter, inputs.student, str(out), kill_step, total,
                             interval, logs / f"{adapter}.log")
            run_uri = run_directory(str(out), adapter)
            if outcome.get("problem"):
                report.failed_trial(f"{label}: {outcome['problem']}")
                continue
            report.bump("modes", mode)
            report.figures.setdefault("kill_points", []).append(
                f"{mode}@{kill_step}" + (f"+{outcome['second_kill']}" if outcome.get("second_kill") else "")
                + f"/interval-{interval}")
            reference, losses = references[interval]
            if outcome.get("completed_before_kill"):  # nothing to resume: the run must simply be right
                report.count("completed_before_kill")
                if adapter_bytes(run_uri) == reference:
                    report.passed_trial()
                else:
                    report.failed_trial(f"{label}: the run finished before the kill with another adapter")
                continue
            report.count("kills")
            latest, resumed = resume_like_the_pipeline(inputs.request(interval), adapter, inputs.student, str(out))
            run_uri = resumed.run  # a kill before the first write leaves no run directory to look up earlier
            report.bump("resumed_from_step", str(int(latest.split("-step-")[1][:8]) if latest else 0))
            problems = []
            if resumed.status != "success":
                problems.append(f"resume ended {resumed.status}: {resumed.failure_message}")
            elif adapter_bytes(run_uri) != reference:
                problems.append(f"adapter bytes differ from the reference after resuming from {latest}")
            elif resumed.loss_history != losses:
                problems.append(f"loss history differs from the reference after resuming from {latest}")
            if problems:
                report.failed_trial(f"{label}: " + "; ".join(problems))
            else:
                report.passed_trial()
        except Exception as error:  # anything unexpected is a crash of the trial, reported with its place
            report.failed_trial(f"{label}: {type(error).__name__}: {error} @ {where(error)}", crash=True)
    return report.finish()


def _trial(mode: str, rng: random.Random, request: Path, adapter: str, student: Path, out: str, kill_step: int,
           total: int, interval: int, log: Path) -> dict[str, Any]:
    """Start, kill and inspect one interrupted run; returns ``{"problem": ...}`` or facts."""
    from drills import run_directory

    facts: dict[str, Any] = {}
    if mode == "cli":
        code = _kill_cli(request, adapter, student, out, kill_step, rng, log)
    elif mode == "random":
        code = _kill_random(request, adapter, student, out, rng, log)
    elif mode == "twice":
        first = min(kill_step, total - 2)
        code = _kill_at(Driver.training(request=request, adapter=adapter, student=student, out=out, log_path=log),
                        "step", first, rng)
        if code != -signal.SIGKILL:
            return {"problem": f"first kill: driver exited {code} before the kill point"}
        run_uri = run_directory(out, adapter)  # created by the driver
        problems, _ = inspect_run_dir(run_uri, adapter)
        if problems:
            return {"problem": "; ".join(problems)}
        from kiln_core.storage import resolve
        from kiln_core.training.checkpoint import latest_checkpoint

        latest = latest_checkpoint(resolve(run_uri), adapter)
        second, second_mode = rng.randint(first + 1, total - 1), rng.choice(["step", "staged-file", "after-commit"])
        if second_mode != "step":
            second = max(first + 1, min(second, total - 1 - (total - 1) % interval))
        facts["second_kill"] = f"{second_mode}@{second}"
        code = _kill_at(Driver.training(request=request, adapter=adapter, student=student, out=out, log_path=log,
                                        resume=latest), second_mode, second, rng)
    else:
        code = _kill_at(Driver.training(request=request, adapter=adapter, student=student, out=out, log_path=log),
                        mode, kill_step, rng)
    if code == 0:
        facts["completed_before_kill"] = True
    elif code != -signal.SIGKILL:
        return {"problem": f"driver exited {code} instead of being killed; log: {log.read_text()[-1500:]}"}
    run_uri = run_directory(out, adapter)
    problems, _ = inspect_run_dir(run_uri, adapter)
    from kiln_core.storage import resolve

    run = resolve(run_uri)
    if not facts.get("completed_before_kill"):
        if run.child("adapter", "adapter_config.json").exists():
            problems.append("a killed run published its adapter")
        if run.child("train_receipt.json").exists():
            problems.append("a killed run wrote a receipt")
    return {"problem": "; ".join(problems)} if problems else facts


def _kill_at(driver: Driver, mode: str, kill_step: int, rng: random.Random) -> int:
    """Drive a handshake driver to the kill point of ``mode`` at (or after) ``kill_step`` and kill it."""
    files_before_kill = rng.randint(0, 2)  # checkpoint files: adapter, optimizer, loop state
    written: dict[int, int] = {}
    try:
        while True:
            event = driver.next_event()
            if event is None:
                return driver.wait(30)
            kind, arg = event
            step = None
            if kind == "step":
                step = int(arg)
                if mode == "step" and step >= kill_step:
                    return driver.kill()
            elif kind in ("write", "commit", "committed"):
                step = checkpoint_step_of(arg)
                if step is not None and step >= kill_step:
                    if mode == "staged-file" and kind == "write":
                        if written.get(step, 0) == files_before_kill:
                            return driver.kill()
                        written[step] = written.get(step, 0) + 1
                    elif mode == "staged-file" and kind == "commit":
                        return driver.kill()  # fewer files than drawn: kill before the manifest
                    elif (mode, kind) in (("before-commit", "commit"), ("after-commit", "committed")):
                        return driver.kill()
            driver.go()
    finally:
        if driver.process.poll() is None:
            driver.kill()


def _kill_random(request: Path, adapter: str, student: Path, out: str, rng: random.Random, log: Path) -> int:
    """A free-running driver (it only waits at its last step, so it never publishes) killed at a
    random moment after its first step."""
    driver = Driver.training(request=request, adapter=adapter, student=student, out=out, log_path=log,
                             handshake="laststep")
    try:
        while True:
            event = driver.next_event()
            if event is None:
                return driver.wait(30)
            if event == ("step", "1"):
                break
        time.sleep(rng.uniform(0.0, 0.4))
        return driver.kill()
    finally:
        if driver.process.poll() is None:
            driver.kill()


def _kill_cli(request: Path, adapter: str, student: Path, out: str, kill_step: int, rng: random.Random,
              log: Path) -> int:
    """``kiln-flows train --json`` killed a moment after checkpoint ``kill_step`` (or later) is on disk."""
    from drills import run_directory
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import committed_checkpoints

    kill_step = min(kill_step, 6)  # stay clear of the end: the run must not publish before the kill
    argv = [sys.executable, "-m", "flows.cli", "train", "--request", str(request), "--adapter", adapter,
            "--student", str(student), "--out", out, "--json", "--quiet"]
    with open(log, "ab") as handle:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=handle, stderr=handle, env=subprocess_env())
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    try:
        while process.poll() is None and time.monotonic() < deadline:
            run = resolve(run_directory(out, adapter))  # the CLI creates it once admission is done
            if any(step >= kill_step for step, _ in committed_checkpoints(run, adapter)):
                time.sleep(rng.uniform(0.0, 0.02))
                break
            time.sleep(0.002)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
    return process.wait()
