"""``kiln-flows demo``: the README's first command, end to end on tiny models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_demo_trains_publishes_and_the_loss_falls(prefect_harness, tmp_path, capsys):
    from flows.cli import main

    workdir = tmp_path / "kiln-data"
    assert main(["demo", "--workdir", str(workdir), "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # --json: stdout is one JSON object; the report goes to stderr
    output = captured.err

    assert summary["status"] == "success"
    receipt = json.loads(Path(summary["receipt"]).read_text())
    assert receipt["status"] == "success"
    assert receipt["training_data"]["sha256"] == summary["dataset_sha256"]
    assert (Path(summary["adapter"]) / "adapter_model.safetensors").is_file()
    assert json.loads(Path(summary["latest"]).read_text())["receipt"] == summary["receipt"]
    assert summary["checkpoints"] and all(Path(c, "checkpoint_manifest.json").is_file() for c in summary["checkpoints"])
    losses = summary["loss_history"]
    window = len(losses) // 5
    assert sum(losses[-window:]) / window < sum(losses[:window]) / window, "the demo's loss must fall"
    assert "falling" in output and "Prefect UI" in output
    # the scored corpus was produced by the teacher and admitted under its pinned manifest
    assert list((workdir / "scored").glob("*.jsonl"))
    assert list((workdir / "corpora").iterdir())


def test_the_demo_runs_again_after_its_storage_root_is_deleted(tmp_path):
    """``kiln-flows demo``, ``rm -rf kiln-data``, ``kiln-flows demo``: the second run scores and admits again.

    It used to exit 3 with ``[file_not_found] …/kiln-data/scored/<digest>.jsonl does not exist``: the score
    task's Prefect cache record, kept in Prefect's home and keyed by the output path, outlived the file."""
    repo = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key not in ("KILN_FLOWS_DEBUG", "PREFECT_API_URL")}
    env.update({"PYTHONPATH": os.pathsep.join([str(repo), *filter(None, [env.get("PYTHONPATH")])]),
                "PREFECT_HOME": str(tmp_path / "prefect-home"),  # one home for both runs, as on a user's machine
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect-home" / "storage"),
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"})
    workdir = tmp_path / "work"
    workdir.mkdir()

    def demo() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", "demo", "--json"], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=900)

    first = demo()
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(workdir / "kiln-data")
    second = demo()
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout)
    assert summary["status"] == "success" and summary["dataset_sha256"] == json.loads(first.stdout)["dataset_sha256"]
    assert "examples scored at" in second.stderr  # the teacher scored again: the cache went with the root
    assert not (tmp_path / "prefect-home" / "storage").exists()  # no cached result outside the storage root
