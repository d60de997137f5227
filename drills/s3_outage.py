"""S3 outage drill: the object store stops answering in the middle of a publication.

A moto S3 server runs as a subprocess on loopback. Each trial trains the drill request (the driver of
the SIGKILL drill, ``drills.driver``) with its storage root on ``s3://`` — the corpus materialization, the
checkpoints, the adapter and the receipt all go to the server — and freezes the server (SIGSTOP) just
before one write drawn by a seeded RNG: a corpus file or its commit, a checkpoint file, a checkpoint
manifest (the commit), an adapter file or its commit, or the receipt. The driver runs with short
client timeouts, so its write fails and the run dies. The server is then thawed (SIGCONT: moto keeps
its state in memory, which a restart would lose) and the drill checks, reading the bucket with boto3
(no s3fs cache in the way):

* nothing committed is partial: every checkpoint prefix holding ``checkpoint_manifest.json`` has
  every declared file with the declared size and SHA-256 and loads with ``load_checkpoint``; every
  ``corpora/<hex>/`` holding ``admission.json`` matches its digests; a committed adapter has its
  weights; a receipt, when present, is whole JSON;
* uncommitted prefixes are ignored: ``latest_checkpoint`` never names one, ``load_checkpoint`` refuses
  them, ``find_materialization`` and ``read_materialization`` do not open a corpus without
  ``admission.json``;
* a retry completes: what every pipeline attempt does (``kiln_core.engine``: a run with a committed
  adapter and a successful receipt is finished; otherwise resume from the newest committed
  checkpoint) ends in ``success`` with the same adapter bytes as an uninterrupted local run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

from drills import DrillReport, fresh_dir, one_torch_thread, prepare_training_inputs, subprocess_env, where
from drills.driver import Driver
from drills.s3_server import S3Server, aws_environment
from drills.sigkill import adapter_bytes, checkpoint_step_of

CATEGORIES = ("corpus", "checkpoint-file", "checkpoint-commit", "adapter", "receipt")
BUCKET = "kiln-drill"


# ------------------------------------------------------------------------------------------ checks


def verify_store(server: S3Server, root_prefix: str, adapter: str) -> tuple[list[str], dict[str, int]]:
    """Check every committed prefix under ``s3://BUCKET/<root_prefix>/`` byte for byte (boto3).

    Returns (problems, counts of committed/uncommitted checkpoint and corpus prefixes).
    """
    objects = server.object_sizes(BUCKET, root_prefix + "/")
    problems: list[str] = []
    counts = {"committed_checkpoints": 0, "uncommitted_checkpoints": 0, "committed_corpora": 0, "uncommitted_corpora": 0}

    def digest(key: str) -> str:
        return hashlib.sha256(server.get_object(BUCKET, key)).hexdigest()

    prefixes: dict[str, set[str]] = {}
    for key in objects:
        rel = key[len(root_prefix) + 1:]
        parts = rel.split("/")
        if parts[0] == "corpora" and len(parts) >= 3:
            prefixes.setdefault("/".join(parts[:2]), set()).add("/".join(parts[2:]))
        elif parts[0] == "runs" and len(parts) >= 5:  # runs/<adapter>/<run key>/<checkpoint or adapter>/<file>
            prefixes.setdefault("/".join(parts[:4]), set()).add("/".join(parts[4:]))
    for prefix, files in sorted(prefixes.items()):
        base = f"{root_prefix}/{prefix}/"
        if prefix.endswith(".kiln-checkpoint"):
            if "checkpoint_manifest.json" not in files:
                counts["uncommitted_checkpoints"] += 1
                continue
            counts["committed_checkpoints"] += 1
            manifest = json.loads(server.get_object(BUCKET, base + "checkpoint_manifest.json"))
            for rel, entry in manifest["files"].items():
                key = base + rel
                if key not in objects:
                    problems.append(f"committed {prefix} lacks declared file {rel}")
                elif objects[key] != entry["size_bytes"]:
                    problems.append(f"committed {prefix}: {rel} has {objects[key]} bytes, manifest says {entry['size_bytes']}")
                elif digest(key) != entry["sha256"]:
                    problems.append(f"committed {prefix}: {rel} SHA-256 differs from the manifest")
            extra = files - set(manifest["files"]) - {"checkpoint_manifest.json"}
            if extra:
                problems.append(f"committed {prefix} holds undeclared files {sorted(extra)}")
        elif prefix.startswith("corpora/"):
            if "admission.json" not in files:
                counts["uncommitted_corpora"] += 1
                continue
            counts["committed_corpora"] += 1
            record = json.loads(server.get_object(BUCKET, base + "admission.json"))
            for rel, entry in record["files"].items():
                key = base + rel
                if key not in objects:
                    problems.append(f"committed {prefix} lacks declared file {rel}")
                elif objects[key] != entry["bytes"] or digest(key) != entry["sha256"]:
                    problems.append(f"committed {prefix}: {rel} does not match admission.json")
        elif prefix.endswith("/adapter"):
            if "adapter_config.json" in files and not objects.get(base + "adapter_model.safetensors"):
                problems.append(f"committed {prefix} has no adapter_model.safetensors")
    runs = f"{root_prefix}/runs/{adapter}/"
    receipt_keys = [key for key in objects if key.startswith(runs) and key.count("/", len(runs)) == 1
                    and key.endswith("/train_receipt.json")]  # runs/<adapter>/<run key>/train_receipt.json
    for receipt_key in receipt_keys:
        try:
            receipt = json.loads(server.get_object(BUCKET, receipt_key))
        except ValueError:
            problems.append(f"{receipt_key} is not whole JSON")
        else:
            adapter_key = receipt_key.rsplit("/", 1)[0] + "/adapter/adapter_model.safetensors"
            if receipt.get("status") == "success" and adapter_key in objects:
                expected = ((receipt.get("adapters") or {}).get("output") or {}).get("adapter_model_sha256")
                if expected and expected != "sha256:" + digest(adapter_key):
                    problems.append("the successful receipt names other adapter bytes than the committed adapter")
    return problems, counts


def verify_readers(root: str, adapter: str, dataset_hex: str, student_identity: dict, top_k: int) -> list[str]:
    """The readers ignore uncommitted prefixes (run in this process through s3fs)."""
    from kiln_core.contracts.admission import COMMIT_FILE
    from kiln_core.materialize import corpus_location, find_materialization, read_materialization
    from kiln_core.storage import list_children, resolve
    from kiln_core.training.checkpoint import (
        CheckpointError,
        checkpoint_step,
        committed_checkpoints,
        latest_checkpoint,
        load_checkpoint,
    )
    from drills import run_directory

    problems = []
    run = resolve(run_directory(root, adapter))
    names = [name for name in list_children(run) if checkpoint_step(name, adapter) is not None]
    committed = {name for _, name in committed_checkpoints(run, adapter)}
    latest = latest_checkpoint(run, adapter)
    if latest is not None and latest not in committed:
        problems.append(f"latest_checkpoint named uncommitted {latest}")
    if committed and latest != max(committed, key=lambda n: checkpoint_step(n, adapter)):
        problems.append(f"latest_checkpoint is {latest}, not the newest committed one")
    for name in names:
        if name in committed:
            try:
                load_checkpoint(run, name)
            except CheckpointError as error:
                problems.append(f"committed {name} does not load: {error}")
        else:
            try:
                load_checkpoint(run, name)
                problems.append(f"uncommitted {name} loaded")
            except CheckpointError as error:
                if error.code != "checkpoint_missing_manifest":
                    problems.append(f"uncommitted {name} refused with {error.code}, expected checkpoint_missing_manifest")
    location = corpus_location(root, dataset_hex)
    if location.exists() and not location.child(COMMIT_FILE).exists():
        if find_materialization(root, dataset_hex, student_identity, top_k) is not None:
            problems.append("find_materialization returned an uncommitted corpus")
        try:
            read_materialization(location.uri)
            problems.append("read_materialization opened an uncommitted corpus")
        except FileNotFoundError:
            pass
    return problems


# ------------------------------------------------------------------------------------------ drill


def _classify(kind: str, arg: str) -> str | None:
    if kind in ("write", "commit") and "/corpora/" in arg:
        return "corpus"
    if kind == "write" and ".kiln-checkpoint/" in arg:
        return "checkpoint-file"
    if kind == "commit" and arg.endswith(".kiln-checkpoint"):
        return "checkpoint-commit"
    if kind in ("write", "commit") and (arg.endswith("/adapter") or "/adapter/" in arg):
        return "adapter"
    if kind == "put" and arg.endswith("/train_receipt.json"):
        return "receipt"
    return None


def run(*, workdir: Path, trials: int = 8, seed: int = 0, **_: Any) -> dict[str, Any]:
    """Run ``trials`` outage trials; see the module docstring."""
    from drills import run_directory, train
    from kiln_core.canonical import sha256_hex
    from kiln_core.storage import resolve
    from kiln_core.tokenization import load_student_tokenizer
    from kiln_core.training.receipt import read_receipt

    report = DrillReport("s3-outage", seed=seed, method="moto server frozen with SIGSTOP, thawed with SIGCONT")
    inputs = prepare_training_inputs(workdir / "fixture")
    local = fresh_dir(workdir, "local")
    logs = fresh_dir(workdir, "logs")
    with one_torch_thread():
        reference = train(inputs.request(1), adapter="reference", student=inputs.student, out=local)
    reference_bytes = adapter_bytes(run_directory(str(local), "reference"))
    total = reference.total_steps
    dataset_hex = sha256_hex(inputs.corpus.read_bytes())
    identity = load_student_tokenizer(str(inputs.student)).identity()
    rng = random.Random(seed)
    server = S3Server(log_path=str(logs / "moto.log")).start()
    try:
        server.create_bucket(BUCKET)
        for trial in range(trials):
            category = CATEGORIES[trial] if trial < len(CATEGORIES) else rng.choice(CATEGORIES)
            prefix = f"trial-{trial:03d}"
            root = f"s3://{BUCKET}/{prefix}"
            adapter = "s3-run"
            label = f"trial {trial} outage={category}"
            try:
                target_step = rng.randint(1, total - 1)
                nth = rng.randint(0, 2 if category == "checkpoint-file" else 1 if category in ("corpus", "adapter") else 0)
                seen = 0
                driver = Driver.training(request=inputs.request(1), adapter=adapter, student=inputs.student, out=root,
                                         log_path=logs / f"{prefix}.log", s3_fast_fail=True,
                                         env=subprocess_env(**server.environment()))
                paused_at = None
                try:
                    while paused_at is None:
                        event = driver.next_event()
                        if event is None:
                            break
                        kind, arg = event
                        if _classify(kind, arg) == category and (
                            category not in ("checkpoint-file", "checkpoint-commit") or checkpoint_step_of(arg) == target_step
                        ):
                            if seen == nth:
                                server.pause()
                                paused_at = f"{kind} {arg[len(root) + 1:]}"
                            seen += 1
                        driver.go()
                    outage_started = time.monotonic()
                    while paused_at is not None and driver.process.poll() is None:
                        event = driver.next_event(timeout=120)  # the run fails on its own, within seconds
                        if event is None:
                            break
                        driver.go()
                    try:
                        code = driver.wait(90)
                    except subprocess.TimeoutExpired:  # a client that never gives up: the orchestrator's kill
                        code = driver.kill()
                        report.count("drivers_killed_after_outage")
                    outage = time.monotonic() - outage_started
                finally:
                    if driver.process.poll() is None:
                        driver.kill()
                    if server.process is not None and paused_at is not None:
                        server.resume()
                server.wait_ready()
                time.sleep(1.0)  # requests the frozen server had buffered are answered now; let them land
                if paused_at is None:
                    report.failed_trial(f"{label}: the run ended (exit {code}) before the drawn write happened")
                    continue
                report.bump("outages", category)
                report.count("outage_seconds_total", round(outage, 1))
                problems = []
                if code == 0:
                    problems.append("the run succeeded although the store froze during a write")
                store_problems, counts = verify_store(server, prefix, adapter)
                problems += store_problems
                for key, value in counts.items():
                    report.count(key, value)
                with aws_environment(server):
                    problems += verify_readers(root, adapter, dataset_hex, identity, 16)
                    retry = _retry_like_the_pipeline(inputs, adapter, root)
                    if retry["status"] != "success":
                        problems.append(f"retry after the outage at `{paused_at}` did not complete: {retry['message']}")
                    else:
                        report.bump("retry_resumed_from", retry["resumed_from"] or "fresh start")
                        if adapter_bytes(run_directory(root, adapter)) != reference_bytes:
                            problems.append("the retried run's adapter differs from the uninterrupted local run")
                        receipt = read_receipt(resolve(run_directory(root, adapter)))
                        if receipt.status != "success":
                            problems.append(f"receipt after the retry says {receipt.status}")
                store_problems, _ = verify_store(server, prefix, adapter)
                problems += [f"after the retry: {p}" for p in store_problems]
                if problems:
                    report.failed_trial(f"{label} (froze at `{paused_at}`): " + "; ".join(problems))
                else:
                    report.passed_trial()
            except Exception as error:
                report.failed_trial(f"{label}: {type(error).__name__}: {error} @ {where(error)}", crash=True)
                with contextlib.suppress(Exception):
                    server.resume()
    finally:
        server.stop()
    return report.finish()


def _retry_like_the_pipeline(inputs, adapter: str, root: str) -> dict[str, Any]:
    """What every pipeline attempt does (``kiln_core.engine``, ``resume="latest"``): a finished run
    (adapter + successful receipt) is done; otherwise admit again (reusing a committed
    materialization) and resume from the newest checkpoint."""
    from drills import run_directory, train
    from kiln_core.errors import Rejection
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import latest_checkpoint

    latest = latest_checkpoint(resolve(run_directory(root, adapter)), adapter)
    try:
        with one_torch_thread():
            result = train(inputs.request(1), adapter=adapter, student=inputs.student, out=root, resume="latest")
    except Rejection as error:
        return {"status": "rejected", "message": f"[{error.code}] {error}", "resumed_from": latest}
    resumed_from = "finished before the outage" if result.reused else latest
    return {"status": result.status, "message": result.failure_message or "", "resumed_from": resumed_from}
