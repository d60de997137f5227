"""The gate in the ``opd_distill`` flow, against a real (test-harness) Prefect server: the decision is an
event automations can route (``kiln-flows.adapter.promoted`` / ``.rejected``), the base-vs-distilled
table is an artifact, and the spec's ``eval:`` block watches the run.

Events are read back from the server's event store (``read_events``), as an automation would see
them, not from a stub of ``emit_event``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kiln_core.post_eval import SuiteRegistry
from gate_support import training_and_held_out

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]  # one thread: conftest

CONFIG = {"training_mode": "off_policy", "top_k": 16, "epochs": 2, "checkpoint_interval": 4, "learning_rate": 0.05,
          "lora_rank": 4, "lora_alpha": 8, "optimizer": {"kind": "adam_w"}, "seed": 5}
PROMPTS = [f"Name {i} colors." for i in range(24)]


@pytest.fixture(scope="module")
def data(tiny_student, tmp_path_factory):
    return training_and_held_out(tiny_student, tmp_path_factory.mktemp("gate-flow"))


def spec(data: Path, student, root: Path, adapter: str, **extra) -> dict:
    return {"teacher": {"kind": "manifest_file", "path": str(data / "manifest.jsonl")},
            "corpus": str(data / "corpus.jsonl"), "student": str(student), "storage_root": str(root),
            "adapter": adapter, "config": CONFIG, "options": {"progress_every_seconds": 0.2}, **extra}


def run_flow(spec_dict: dict) -> dict:
    from flows.opd_distill import opd_distill
    from flows.spec import parse_spec

    state = opd_distill(parse_spec(spec_dict), return_state=True)
    assert state.is_completed(), f"{state.type}: {state.message}"
    return state.result()


def adapter_events(adapter: str, timeout: float = 60.0) -> list:
    """The ``kiln-flows.adapter.*`` events about ``adapter`` in the server's event store."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            page = client.read_events(EventFilter(event=EventNameFilter(prefix=["kiln-flows.adapter."])), limit=50)
        found = [event for event in page.events if event.resource.get("prefect.resource.name") == adapter]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_promoted_adapter_emits_promoted_and_publishes_the_table(data, tiny_student, prefect_harness, tmp_path):
    from prefect.artifacts import Artifact

    summary = run_flow(spec(data, tiny_student, tmp_path, "flow-promoted",
                            quality_gate={"corpus": str(data / "heldout.jsonl"), "max_reverse_kl": 1e6}))
    assert summary["gate"]["outcome"] == "promoted" and summary["latest"] is not None
    events = adapter_events("flow-promoted")
    assert [event.event for event in events] == ["kiln-flows.adapter.promoted"]
    event = events[0]
    run_key = Path(summary["run"]).name
    assert event.resource.id == f"kiln-flows.adapter.flow-promoted.run.{run_key}"
    assert event.payload["outcome"] == "promoted" and event.payload["run"] == summary["run"]
    quality = summary["gate"]["quality_gate"]
    assert event.payload["quality"]["distilled"] == quality["distilled"]
    table = json.loads(Artifact.get("before-after-flow-promoted").data)
    assert [row["metric"] for row in table] == ["reverse_kl", "top1_agreement", "teacher_token_nll"]
    assert table[0]["base"] == quality["base"]["reverse_kl"] and table[0]["distilled"] == quality["distilled"]["reverse_kl"]
    assert table[0]["threshold"] == "≤ 1e+06"


def test_an_inconclusive_kiln_gate_outweighs_a_passing_quality_gate(data, tiny_student, prefect_harness, tmp_path):
    """Two gates: the stronger outcome wins (Kiln's rule); ``inconclusive`` is not promoted, not renamed."""
    doc = {"name": "far", "default_scorer": {"kind": "exact_match"}, "generation": {"max_tokens": 2},
           "examples": [{"id": f"q{i}", "messages": [{"role": "user", "content": p}], "target": "unreachable"}
                        for i, p in enumerate(PROMPTS)]}
    (tmp_path / "far.json").write_text(json.dumps(doc))
    SuiteRegistry.for_storage_root(str(tmp_path)).register(str(tmp_path / "far.json"))
    summary = run_flow(spec(data, tiny_student, tmp_path, "flow-held",
                            post_eval={"suite": "far", "min_accuracy": 0.0},
                            quality_gate={"corpus": str(data / "heldout.jsonl"), "max_reverse_kl": 1e6}))
    gate = summary["gate"]
    assert gate["outcome"] == "inconclusive" and gate["quality_gate"]["outcome"] == "promoted"
    assert gate["verdict"].startswith("INCONCLUSIVE") and summary["latest"] is None
    assert Path(summary["run"]).parent.name == "flow-held" and Path(summary["run"]).exists()  # not renamed
    assert not (tmp_path / "runs" / "flow-held" / "latest.json").exists()
    events = adapter_events("flow-held")
    assert [event.event for event in events] == ["kiln-flows.adapter.rejected"]
    evidence = events[0].payload["evidence"]
    assert (evidence["improved"], evidence["regressed"], evidence["tied"]) == (0, 0, len(PROMPTS))
    assert evidence["exact_sign_test_p_value"] == 1.0 and evidence["outcome"] == "inconclusive"
    receipt = json.loads(Path(summary["receipt"]).read_text())
    assert receipt["gate_outcome"] == "inconclusive" and receipt["post_eval"]["gate_outcome"] == "inconclusive"


def test_the_spec_eval_block_watches_the_run(data, tiny_student, prefect_harness, tmp_path):
    watch = {"corpus": str(data / "heldout.jsonl"), "every_steps": 4, "flat_window": None}
    summary = run_flow(spec(data, tiny_student, tmp_path, "flow-watched", eval=watch))
    receipt = json.loads(Path(summary["receipt"]).read_text())
    curve = receipt["eval_curve"]
    assert [point["step"] for point in curve["points"]] == [0, 4, 8]
    assert curve["held_out"]["corpus"] == watch["corpus"] and curve["watch"]["every_steps"] == 4
    assert all(point["reverse_kl"] is not None for point in curve["points"])
    # watching never changes what training computes: the unwatched run's adapter bytes
    plain = run_flow(spec(data, tiny_student, tmp_path / "plain", "flow-watched"))
    assert (Path(plain["adapter"]) / "adapter_model.safetensors").read_bytes() == \
        (Path(summary["adapter"]) / "adapter_model.safetensors").read_bytes()
    assert "eval_curve" not in json.loads(Path(plain["receipt"]).read_text())


def test_kiln_flows_run_exits_4_when_the_gate_holds_the_adapter_back(data, tiny_student, prefect_harness, tmp_path):
    """``kiln-flows run``: the run did not fail (``status: success``), but nothing was promoted: exit 4."""
    import os
    import subprocess
    import sys

    import prefect.settings
    import yaml

    kiln_flows = Path(sys.executable).with_name("kiln-flows")
    assert kiln_flows.exists(), f"no kiln-flows console script beside {sys.executable}: pip install -e ."
    spec_path = tmp_path / "pipeline.yaml"
    spec_path.write_text(yaml.safe_dump(spec(data, tiny_student, tmp_path, "cli-held",
                                             quality_gate={"corpus": str(data / "heldout.jsonl"), "max_reverse_kl": 0.0})))
    env = {**os.environ, "PREFECT_API_URL": prefect.settings.PREFECT_API_URL.value()}
    done = subprocess.run([str(kiln_flows), "run", str(spec_path), "--json"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["status"] == "success" and summary["latest"] is None
    assert summary["gate"]["outcome"] == "demoted" and summary["gate"]["promoted"] is False
    assert summary["run"] == str(tmp_path / "runs" / "cli-held" / "cli-held.failed")
