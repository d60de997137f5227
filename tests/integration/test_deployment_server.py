"""``opd_distill`` deployed from deployments/prefect.yaml to a real server, run by a real worker.

The run is created through the API call the UI's Custom run form makes, training happens in the
worker's flow-run subprocess, and the outputs are checked on disk. A second run is cancelled the way
the UI's Cancel button does it, after its first checkpoint: the run must end Cancelled with a
published checkpoint and a ``failed``/``cancelled`` receipt (Kiln's convention) naming the checkpoint
kept, and its log and task runs show a cancel, not a crash.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .conftest import as_the_form_sends, pipeline_spec
from .server import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _receipt(storage_root: Path, adapter: str) -> tuple[Path, dict]:
    receipts = sorted((storage_root / "runs" / adapter).glob("*/train_receipt.json"))
    assert len(receipts) == 1, f"expected one receipt for {adapter}, found {receipts}"
    return receipts[0], json.loads(receipts[0].read_text(encoding="utf-8"))


def _committed_checkpoints(storage_root: Path, adapter: str) -> list[str]:
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import committed_checkpoints

    found = []
    for run_dir in sorted((storage_root / "runs" / adapter).glob("*/")):
        found += [str(run_dir / name) for _, name in committed_checkpoints(resolve(str(run_dir)), adapter)]
    return found


def _logs(live_server, flow_run_id: str) -> list[dict]:
    body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200, "sort": "TIMESTAMP_ASC"}
    return live_server.api("POST", "/logs/filter", json=body)


def test_deployment_runs_from_ui_parameters_and_schedules(live_server, deployment, worker, pipeline_inputs):
    # The yaml's settings reached the server.
    assert deployment["entrypoint"] == "flows.opd_distill.opd_distill"
    assert deployment["work_pool_name"] == "gpu"
    assert deployment["pull_steps"] == []
    assert deployment["enforce_parameter_schema"] is True
    assert (deployment.get("global_concurrency_limit") or {}).get("limit") == 1
    assert deployment["job_variables"]["env"]["PREFECT_RESULTS_PERSIST_BY_DEFAULT"] == "true"
    [schedule] = deployment["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["slug"] == "nightly-0200"
    assert "spec" in deployment["parameter_openapi_schema"]["properties"]

    # The server's scheduler (not the test) creates the upcoming nightly runs.
    scheduled = wait_for(
        lambda: live_server.runs_of(deployment["id"], ["SCHEDULED"]), timeout=120, interval=2,
        what="scheduler-created runs of the nightly schedule",
    )
    assert all(run["auto_scheduled"] for run in scheduled)
    assert all(run["parameters"] == deployment["parameters"] for run in scheduled)

    adapter = "itest-ok"
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["short_corpus"], adapter, checkpoint_interval=2)
    run = live_server.create_run(deployment, {"spec": spec}, name="itest-ui-custom-run")
    assert run["parameters"]["spec"]["adapter"] == adapter

    final = live_server.wait_for_state(run["id"], {"COMPLETED"}, timeout=600)
    assert final["state"]["type"] == "COMPLETED", f"{final['state']}\n{live_server.tails()}"
    assert final["name"] == "itest-ui-custom-run"  # the name typed in the UI's form is kept
    assert f"adapter:{adapter}" in final["tags"]  # and the adapter is a tag

    storage_root = pipeline_inputs["storage_root"]
    receipt_path, receipt = _receipt(storage_root, adapter)
    assert receipt["status"] == "success", receipt
    latest = json.loads((storage_root / "runs" / adapter / "latest.json").read_text(encoding="utf-8"))
    assert Path(latest["receipt"].removeprefix("file://")).resolve() == receipt_path.resolve()
    assert (Path(latest["adapter"].removeprefix("file://")) / "adapter_model.safetensors").is_file()
    assert _committed_checkpoints(storage_root, adapter), "no committed checkpoint was published"


def test_cancel_from_ui_publishes_checkpoint_and_cancelled_receipt(live_server, deployment, worker, pipeline_inputs):
    adapter = "itest-cancel"
    storage_root = pipeline_inputs["storage_root"]
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["long_corpus"], adapter, epochs=3, checkpoint_interval=2)
    run = live_server.create_run(deployment, {"spec": spec}, name="itest-cancel-run")

    def checkpoint_or_end():
        state = (live_server.flow_run(run["id"]).get("state") or {}).get("type")
        assert state not in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, (
            f"run ended ({state}) before it could be cancelled\n{live_server.tails()}"
        )
        return _committed_checkpoints(storage_root, adapter)

    try:
        wait_for(checkpoint_or_end, timeout=600, interval=1, what=f"a committed checkpoint of {adapter}")
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{live_server.tails()}") from None
    live_server.cancel(run["id"])

    final = live_server.wait_for_state(run["id"], {"CANCELLED"}, timeout=300)
    assert final["state"]["type"] == "CANCELLED", f"{final['state']}\n{live_server.tails()}"

    checkpoints = _committed_checkpoints(storage_root, adapter)
    assert checkpoints, "no committed checkpoint after cancellation"
    _, receipt = _receipt(storage_root, adapter)
    assert receipt["status"] == "failed", receipt
    assert receipt["failure_reason"] == "cancelled", receipt
    # The receipt and the run's final state say which checkpoint a retry resumes from (not "TerminationSignal: ").
    kept = re.search(r"checkpoint (\S+\.kiln-checkpoint) kept \(a retry resumes from it\)", receipt["failure_message"])
    assert kept and any(path.endswith(kept.group(1)) for path in checkpoints), receipt["failure_message"]
    assert kept.group(1) in final["state"]["message"], final["state"]
    # A cancel is not a crash: no "Crash detected!", no Crashed task (the UI's orange), no traceback.
    tasks = live_server.api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}})
    [train] = [task for task in tasks if task["name"].startswith("train-")]
    assert train["state"]["type"] == "CANCELLED", train["state"]
    assert not [task["name"] for task in tasks if task["state"]["type"] == "CRASHED"]
    lines = wait_for(lambda: [entry for entry in _logs(live_server, run["id"])
                              if entry["message"].startswith("Finished in state Cancelled")], timeout=60,
                     what="the run's final log line") and _logs(live_server, run["id"])
    noisy = [entry["message"][:200] for entry in lines if entry["level"] >= 40 or "Crash" in entry["message"]
             or "Traceback" in entry["message"] or "unexpected exception" in entry["message"]]
    assert noisy == [], noisy
    assert not (storage_root / "runs" / adapter / "latest.json").exists(), "a cancelled run must not publish latest.json"
    # Training stopped early: far fewer than the 180 steps three epochs of 60 examples would take.
    steps = (receipt.get("data") or {}).get("examples_trained")
    assert steps is not None and steps < 180, receipt.get("data")


def test_kiln_flows_serve_creates_deployment_and_runs_it(live_server, pipeline_inputs, tmp_path):
    """``kiln-flows serve --spec … --cron …`` registers a scheduled deployment and executes UI runs."""
    import os
    import signal
    import sys

    import yaml

    adapter = "itest-served"
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["short_corpus"], adapter)
    spec_file = tmp_path / "pipeline.yaml"
    spec_file.write_text(yaml.safe_dump(spec), encoding="utf-8")
    kiln_flows = str(Path(sys.executable).with_name("kiln-flows"))
    proc = live_server.spawn(
        "serve",
        [kiln_flows, "serve", "--name", "itest-served", "--cron", "0 3 * * *", "--timezone", "UTC",
         "--spec", str(spec_file), "--limit", "1"],
        live_server.client_env(PREFECT_RUNNER_POLL_FREQUENCY="2"),
        cwd=tmp_path,
    )
    try:
        def served():
            assert proc.poll() is None, f"kiln-flows serve exited {proc.returncode}\n{live_server.tails()}"
            return live_server.find_deployment("opd-distill", "itest-served")

        deployment = wait_for(served, timeout=180, interval=2, what="the served deployment")
        defaults = deployment["parameters"]["spec"]
        assert defaults["adapter"] == adapter
        # What the form's training-data kind decides is not pinned by the served file (issue 19).
        assert "training_mode" not in defaults["config"] and "temperature" not in defaults["config"]
        [schedule] = deployment["schedules"]
        assert schedule["schedule"]["cron"] == "0 3 * * *" and schedule["schedule"]["timezone"] == "UTC"
        assert "in time zone UTC" in deployment["description"]
        assert deployment["entrypoint"] == "flows.opd_distill.opd_distill"

        # A run from each kind of the form's training data, starting from the deployment's defaults as
        # the form does: the served corpus (off-policy), then Kind → prompts with a prompts file (on-policy).
        runs = {"corpus": live_server.create_run(deployment, {"spec": defaults}, name="itest-served-run")}
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text},
                                                             {"role": "assistant", "content": ""}]}) + "\n"
                                   for text in ("What is two plus two?", "Name a colour.")), encoding="utf-8")
        on_policy = as_the_form_sends({**defaults, "adapter": f"{adapter}-prompts",
                                       "source": {"kind": "prompts", "corpus": None, "prompts": str(prompts),
                                                  "sampling": {"samples_per_prompt": 2, "max_tokens": 4}}})
        runs["prompts"] = live_server.create_run(deployment, {"spec": on_policy}, name="itest-served-prompts")
        for kind, run in runs.items():
            final = live_server.wait_for_state(run["id"], {"COMPLETED", "FAILED", "CRASHED"}, timeout=600)
            assert final["state"]["type"] == "COMPLETED", f"{kind}: {final['state']}\n{live_server.tails()}"
        _, receipt = _receipt(pipeline_inputs["storage_root"], adapter)
        assert receipt["status"] == "success" and receipt["opd"]["training_mode"] == "off_policy"
        _, receipt = _receipt(pipeline_inputs["storage_root"], f"{adapter}-prompts")
        assert receipt["status"] == "success" and receipt["opd"]["training_mode"] == "on_policy", receipt
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    # pause_on_shutdown: the schedule stops with the serving process.
    assert live_server.deployment("opd-distill", "itest-served")["paused"] is True


def test_an_on_policy_run_from_the_form_trains_and_publishes(live_server, deployment, worker, pipeline_inputs, tmp_path):
    """The form's *Prompts (on-policy)* tab, as the UI submits it: the student samples, the teacher
    scores, the run publishes an on-policy receipt and latest.json."""
    prompts = tmp_path / "prompts.jsonl"
    # Kiln's on-policy prompt shape: the user turn, then an empty assistant turn the student fills in
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text},
                                                         {"role": "assistant", "content": ""}]}) + "\n"
                               for text in ("What is two plus two?", "Name a colour.")), encoding="utf-8")
    adapter = "itest-on-policy"
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["short_corpus"], adapter, checkpoint_interval=2)
    spec = as_the_form_sends({**spec, "source": {"kind": "prompts", "prompts": str(prompts),
                                                 "sampling": {"samples_per_prompt": 2, "max_tokens": 4}}})
    run = live_server.create_run(deployment, {"spec": spec}, name="itest-ui-on-policy")

    final = live_server.wait_for_state(run["id"], {"COMPLETED", "FAILED", "CRASHED"}, timeout=600)
    assert final["state"]["type"] == "COMPLETED", f"{final['state']}\n{live_server.tails()}"
    storage_root = pipeline_inputs["storage_root"]
    _, receipt = _receipt(storage_root, adapter)
    assert receipt["status"] == "success" and receipt["opd"]["training_mode"] == "on_policy", receipt
    assert receipt["opd"]["samples_per_prompt"] == 2 and receipt["config"]["max_tokens"] == 4
    assert (storage_root / "runs" / adapter / "latest.json").is_file()
