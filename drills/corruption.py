"""Corrupt-checkpoint drill: a damaged checkpoint is refused naming the file, never skipped silently.

A base run (checkpoint interval 2, 10 steps) crashes after step 7, leaving committed checkpoints at
steps 2, 4 and 6. Each trial copies that storage root and damages the newest checkpoint in one of
the ways below, then checks three paths:

1. **automatic** — what the pipeline's retry does (``tasks/train.py``: ``latest_checkpoint`` then
   resume from it): it must still pick the damaged step-6 checkpoint and be refused with a
   ``CheckpointError`` whose code is the expected one and whose message names the damaged file and
   the checkpoint; nothing in the run directory may change (no silent fallback to step 4, no new
   checkpoint, no adapter);
2. **CLI** (first trial only, it costs a process) — ``kiln-flows train --resume-checkpoint <latest>
   --json`` exits 2 with the same code and the file named;
3. **user fallback** — ``--resume-checkpoint <previous_checkpoint(...)>`` (step 4), what a user asks
   for after reading the refusal: the run resumes and ends byte-identical to an uninterrupted run.
   Should that be refused, the drill also records whether it succeeds once the damaged checkpoint is
   moved out of the way (``fallback_after_quarantine``), to say what the user has to do today.

Damage kinds: a flipped byte, a truncated file, bytes appended, a same-size overwrite, a deleted
file, an untracked extra file, a symlink in place of a file, a garbled manifest, a manifest whose
recorded SHA-256 of a file was edited.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from drills import DrillReport, fresh_dir, one_torch_thread, prepare_training_inputs, subprocess_env, where
from drills.sigkill import adapter_bytes

ADAPTER = "corrupt"
CRASH_AFTER_STEP = 7
KINDS = ("flip-byte", "truncate", "append", "same-size-overwrite", "delete-file", "untracked-file", "symlink",
         "garbled-manifest", "manifest-sha-edited")


class _Crash(RuntimeError):
    pass


def _damage(checkpoint: Path, kind: str, rng: random.Random, index: int) -> tuple[str, str]:
    """Damage ``checkpoint`` in place; returns (file named in the refusal, expected error code)."""
    from kiln_core.training.checkpoint import ADAPTER_FILE, LOOP_STATE_FILE, MANIFEST_FILE, OPTIMIZER_FILE

    files = [ADAPTER_FILE, OPTIMIZER_FILE, LOOP_STATE_FILE]
    name = files[index % len(files)]
    path = checkpoint / name
    data = path.read_bytes()
    if kind == "flip-byte":
        position = rng.randrange(len(data))
        path.write_bytes(data[:position] + bytes([data[position] ^ rng.randrange(1, 256)]) + data[position + 1:])
        return name, "checkpoint_file_sha256"
    if kind == "truncate":
        path.write_bytes(data[: rng.randrange(len(data))])
        return name, "checkpoint_file_size"
    if kind == "append":
        path.write_bytes(data + b"\0" * rng.randint(1, 64))
        return name, "checkpoint_file_size"
    if kind == "same-size-overwrite":
        path.write_bytes(bytes(len(data)))
        return name, "checkpoint_file_sha256"
    if kind == "delete-file":
        path.unlink()
        return name, "checkpoint_file_missing"
    if kind == "untracked-file":
        (checkpoint / "stray.bin").write_bytes(b"left here by someone")
        return "stray.bin", "checkpoint_file_untracked"
    if kind == "symlink":
        copy = checkpoint.parent / f"elsewhere-{name}"
        copy.write_bytes(data)
        path.unlink()
        os.symlink(copy, path)
        return name, "checkpoint_symlink"
    manifest = checkpoint / MANIFEST_FILE
    if kind == "garbled-manifest":
        text = manifest.read_bytes()
        manifest.write_bytes(text[: len(text) // 2])
        return MANIFEST_FILE, "checkpoint_manifest_invalid"
    if kind == "manifest-sha-edited":
        record = json.loads(manifest.read_text())
        record["files"][name]["sha256"] = "0" * 64
        manifest.write_text(json.dumps(record, indent=2))
        return name, "checkpoint_file_sha256"
    raise ValueError(kind)


def _snapshot(root: Path) -> dict[str, bytes | str]:
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "symlink -> " + os.readlink(path)
        elif path.is_file():
            found[rel] = path.read_bytes()
        else:
            found[rel] = "dir"
    return found


def run(*, workdir: Path, trials: int = 8, seed: int = 0, cli: bool = True, **_: Any) -> dict[str, Any]:
    """Run ``trials`` damage trials; see the module docstring."""
    from drills import run_directory, train
    from kiln_core.training.checkpoint import CheckpointError, latest_checkpoint, previous_checkpoint

    report = DrillReport("corrupt-checkpoint", seed=seed)
    inputs = prepare_training_inputs(workdir / "fixture")
    request = str(inputs.request(2))
    base = fresh_dir(workdir, "base")
    trials_dir = fresh_dir(workdir, "trials")
    with one_torch_thread():
        reference = train(request, adapter="reference", student=inputs.student, out=base)
        reference_bytes = adapter_bytes(run_directory(str(base), "reference"))

        def crash(step: int, total: int, loss: float) -> None:
            if step == CRASH_AFTER_STEP:
                raise _Crash(f"simulated crash after step {step}")

        try:
            train(request, adapter=ADAPTER, student=inputs.student, out=base, on_progress=crash)
            raise RuntimeError("the base run did not crash")
        except _Crash:
            pass
    shutil.rmtree(Path(run_directory(str(base), "reference")))
    latest_name = latest_checkpoint(run_directory(str(base), ADAPTER), ADAPTER)
    previous_name = previous_checkpoint(run_directory(str(base), ADAPTER), ADAPTER, latest_name)
    report["latest"], report["previous"] = latest_name, previous_name
    report["total_steps"] = reference.total_steps
    rng = random.Random(seed)
    for trial in range(trials):
        kind = KINDS[trial] if trial < len(KINDS) else rng.choice(KINDS)
        out = trials_dir / f"trial-{trial:03d}"
        shutil.copytree(base, out, symlinks=True)
        run_dir = Path(run_directory(str(out), ADAPTER))
        label = f"trial {trial} damage={kind}"
        problems: list[str] = []
        try:
            named, code = _damage(run_dir / latest_name, kind, rng, trial)
            label += f" file={named}"
            report.bump("damage", kind)
            before = _snapshot(run_dir)
            # 1. the automatic path: newest committed checkpoint, resumed as the pipeline does
            automatic = latest_checkpoint(str(run_dir), ADAPTER)
            if automatic != latest_name:
                problems.append(f"latest_checkpoint picked {automatic} instead of the damaged {latest_name} (silent fallback)")
            try:
                with one_torch_thread():
                    train(request, adapter=ADAPTER, student=inputs.student, out=out, resume=automatic)
                problems.append(f"resuming from {automatic} was not refused")
            except CheckpointError as error:
                if error.code != code:
                    problems.append(f"refused with {error.code}, expected {code}: {error}")
                if named not in str(error) or latest_name not in str(error):
                    problems.append(f"the refusal does not name {named} in {latest_name}: {error}")
                else:
                    report.count("refusals_naming_the_file")
            if _snapshot(run_dir) != before:
                problems.append("the refused resume changed the run directory")
            # 2. the CLI, once
            if cli and trial == 0:
                problems += _check_cli(request, str(inputs.student), str(out), latest_name, named, code)
                report["cli_checked"] = True
            # 3. the user asks for the previous checkpoint
            previous = previous_checkpoint(str(run_dir), ADAPTER, latest_name)
            if previous != previous_name:
                problems.append(f"previous_checkpoint gave {previous}, expected {previous_name}")
            outcome = _resume(request, inputs.student, out, previous, reference_bytes)
            report.bump("fallback_to_previous", outcome["verdict"])
            if outcome["verdict"] != "exact":
                problems.append(f"--resume-checkpoint {previous} (the user's fallback): {outcome['message']}")
                quarantine = run_dir / f".quarantined-{latest_name}"
                os.rename(run_dir / latest_name, quarantine)
                retried = _resume(request, inputs.student, out, previous, reference_bytes)
                report.bump("fallback_after_quarantine", retried["verdict"])
            if problems:
                report.failed_trial(f"{label}: " + "; ".join(problems))
            else:
                report.passed_trial()
        except Exception as error:
            report.failed_trial(f"{label}: {type(error).__name__}: {error} @ {where(error)}", crash=True)
    return report.finish()


def _resume(request: str, student: Path, out: Path, basename: str | None, reference_bytes: bytes) -> dict[str, str]:
    from drills import run_directory, train
    from kiln_core.errors import Rejection

    try:
        with one_torch_thread():
            result = train(request, adapter=ADAPTER, student=student, out=out, resume=basename)
    except Rejection as error:
        return {"verdict": f"refused:{error.code}", "message": f"refused [{error.code}]: {error}"}
    if result.status != "success":
        return {"verdict": result.status, "message": f"ended {result.status}: {result.failure_message}"}
    if adapter_bytes(run_directory(str(out), ADAPTER)) != reference_bytes:
        return {"verdict": "differs", "message": "the adapter differs from the uninterrupted run"}
    return {"verdict": "exact", "message": ""}


def _check_cli(request: str, student: str, out: str, latest: str, named: str, code: str) -> list[str]:
    argv = [sys.executable, "-m", "flows.cli", "train", "--request", request, "--adapter", ADAPTER, "--student", student,
            "--out", out, "--resume-checkpoint", latest, "--json", "--quiet"]
    done = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    lines = done.stdout.strip().splitlines()
    try:
        payload = json.loads(lines[-1]) if lines else {}
    except ValueError:
        payload = {}
    if done.returncode != 2 or payload.get("code") != code or named not in payload.get("message", ""):
        return [f"kiln-flows train --resume-checkpoint {latest}: exit {done.returncode}, {payload or done.stderr[-800:]}"]
    return []
