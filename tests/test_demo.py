"""``kiln-flows demo``: the README's first command, end to end on tiny models."""

from __future__ import annotations

import json
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
