"""Training handed to a GPU work-pool deployment (``options.train_deployment``), exactly once.

The parent ``opd_distill`` runs in a CLI process against the live server; admission happens there and
training runs as a ``kiln-train/gpu`` flow run picked up by the pool's worker. A parent retry (the same
parent run id and run key) must find the child it already started instead of starting a second one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from .conftest import pipeline_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_training_runs_once_on_the_gpu_deployment(live_server, deployment, worker, pipeline_inputs, tmp_path):
    live_server.cli(["--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "-n", "gpu"])
    train_deployment = live_server.deployment("kiln-train", "gpu")

    adapter = "itest-dispatch"
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["short_corpus"], adapter)
    spec["options"]["train_deployment"] = "kiln-train/gpu"
    spec_file = tmp_path / "pipeline.yaml"
    spec_file.write_text(yaml.safe_dump(spec), encoding="utf-8")

    parent = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(spec_file), "--json"],
        env=live_server.client_env(), capture_output=True, text=True, timeout=900,
    )
    assert parent.returncode == 0, f"{parent.stdout[-3000:]}\n{parent.stderr[-3000:]}\n{live_server.tails()}"
    summary = json.loads(parent.stdout.strip().splitlines()[-1])
    receipt = json.loads(open(summary["receipt"].removeprefix("file://"), encoding="utf-8").read())
    assert receipt["status"] == "success"

    [child] = live_server.runs_of(train_deployment["id"])
    assert child["state"]["type"] == "COMPLETED"
    assert child["name"] == f"train-{adapter}"
    parent_run_id, _, run_key, attempt = child["idempotency_key"].split(":")
    assert attempt == "0" and summary["run"].rstrip("/").endswith(run_key)

    # A retry of the parent dispatches again with the same key: it gets the finished child back.
    retry = subprocess.run(
        [sys.executable, "-c", (
            "import json, sys; from flows.train_stage import dispatch_training; "
            "ref = dispatch_training(sys.argv[1], parent_run_id=sys.argv[2], run_key=sys.argv[3], "
            "parameters=json.loads(sys.argv[4]), poll_seconds=1); print(ref.model_dump_json())"
        ), "kiln-train/gpu", parent_run_id, run_key, json.dumps(child["parameters"])],
        env=live_server.client_env(), capture_output=True, text=True, timeout=300,
    )
    assert retry.returncode == 0, f"{retry.stdout[-2000:]}\n{retry.stderr[-3000:]}"
    again = json.loads(retry.stdout.strip().splitlines()[-1])
    assert again["receipt_uri"] == summary["receipt"]
    assert len(live_server.runs_of(train_deployment["id"])) == 1, "a parent retry started a second GPU run"
