"""The ``opd_distill`` flow with a ``distributed: {engine: ray}`` block, against the Prefect test harness.

What a user depends on: the pipeline's train task is the Ray driver — it starts a local Ray instance for
the run, trains on two Ray workers, stops Ray — and the flow publishes what a one-process run with
``sequences_per_step: 2`` publishes (the same computation), with a receipt that says Ray and world size 2.
One Ray run (a local start and a 2-worker group: about a minute on a busy 2-core runner).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray  # a missing Ray fails the module (CI installs .[test], which includes kiln-flows[ray])

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def spec(corpus: Path, teacher: Path, student: Path, root: Path, **extra) -> dict:
    return {
        "teacher": {"kind": "local_dir", "path": str(teacher)}, "student": str(student), "corpus": str(corpus),
        "storage_root": str(root), "adapter": "ray-demo",
        "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "checkpoint_interval": 2,
                   "learning_rate": 0.01, "lora_rank": 4, "lora_alpha": 8, "optimizer": {"kind": "adam_w"}, "seed": 7,
                   **extra.pop("config", {})},
        "options": {"progress_every_seconds": 0.2, "cancel_poll_seconds": 5.0, "train_retries": 0},
        **extra,
    }


def run_flow(value: dict) -> dict:
    from flows.opd_distill import opd_distill
    from flows.spec import parse_spec

    state = opd_distill(parse_spec(value), return_state=True)
    assert state.is_completed(), f"{state.type}: {state.message}"
    return state.result()


def test_the_pipeline_trains_on_two_ray_workers(prefect_harness, tiny_student, tiny_teacher, tmp_path):
    import torch
    from safetensors.torch import load_file

    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.synthetic import synthesize_corpus

    line = build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32))
    corpus = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=6, top_k=16, manifest_line=line)
    on_ray = run_flow(spec(corpus, tiny_teacher, tiny_student, tmp_path / "ray",
                           distributed={"engine": "ray", "address": "local", "workers": 2}))
    assert not ray.is_initialized()  # the train task stopped the instance it started
    assert on_ray["status"] == "success"
    receipt = json.loads(Path(on_ray["receipt"]).read_text())
    assert receipt["distributed"]["engine"] == "ray" and receipt["distributed"]["world_size"] == 2
    assert (receipt["distributed"]["ray_version"], receipt["distributed"]["address"]) == (ray.__version__, "local")
    assert len(receipt["loss_history"]) == 3  # 6 candidates, 2 per optimizer step

    here = run_flow(spec(corpus, tiny_teacher, tiny_student, tmp_path / "here", config={"sequences_per_step": 2}))
    reference = load_file(Path(here["adapter"]) / "adapter_model.safetensors")
    trained = load_file(Path(on_ray["adapter"]) / "adapter_model.safetensors")
    assert set(trained) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(trained[name], tensor, atol=1e-6, rtol=0)
