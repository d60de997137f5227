"""The checkpoint state records the loss actually trained, and checkpoints that recorded it the old way resume.

``kiln_flows_state.json``'s ``loss`` is the loss a resume must train again. Before issue 31 it said
``teacher_top_k`` for runs of ``teacher_token_ce``, ``teacher_top_k_forward`` and
``teacher_top_k_tail_forward``. Such checkpoints stay resumable: the manifest's Kiln ``effective_config``
names those losses exactly and is compared first, so their ``teacher_top_k`` record is accepted for them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kiln_core.synthetic import synthesize_corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ADAPTER = "loss-record"
STEP_2 = f"{ADAPTER}-checkpoint-step-00000002.kiln-checkpoint"
EXTENSION_LOSSES = ["teacher_token_ce", "teacher_top_k_forward", "teacher_top_k_tail_forward"]


@pytest.fixture(scope="module")
def corpus(tiny_student, tmp_path_factory) -> Path:
    return synthesize_corpus(tiny_student, tmp_path_factory.mktemp("loss-record") / "corpus.jsonl", n_examples=4,
                             top_k=16, seed=0)


def spec_for(loss: str, student: Path, corpus: Path, root: Path):
    from kiln_core.contracts.pipeline import parse_spec

    return parse_spec({
        "teacher": {"kind": "manifest_file", "path": str(corpus)}, "student": str(student), "corpus": str(corpus),
        "storage_root": str(root), "adapter": ADAPTER,
        "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "checkpoint_interval": 2, "seed": 5,
                   "learning_rate": 0.01, "lora_rank": 4, "lora_alpha": 8, "optimizer": {"kind": "adam_w"}, "loss": loss},
    })


def run(spec, **stage_options):
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    return run_pipeline(spec, LocalStages(handle_signals=False, **stage_options), device="cpu")


@pytest.mark.parametrize("loss", [*EXTENSION_LOSSES, "teacher_top_k", "teacher_top_k_tail"])
def test_the_checkpoint_state_records_the_loss_trained(loss, tiny_student, corpus, tmp_path):
    result = run(spec_for(loss, tiny_student, corpus, tmp_path))
    assert result.status == "success"
    checkpoint = Path(result.run) / STEP_2
    assert json.loads((checkpoint / "kiln_flows_state.json").read_text())["loss"] == loss
    # Kiln's effective config names the Kiln loss the tail bucket extends; every other loss by its name
    kiln_name = "teacher_top_k" if loss == "teacher_top_k_tail" else loss
    assert json.loads((checkpoint / "checkpoint_manifest.json").read_text())["effective_config"]["loss"] == kiln_name


def record_legacy_loss(checkpoint: Path) -> None:
    """Rewrite the state as kiln-flows wrote it before issue 31 (``teacher_top_k``), its manifest entry re-digested."""
    state_path, manifest_path = checkpoint / "kiln_flows_state.json", checkpoint / "checkpoint_manifest.json"
    state = json.loads(state_path.read_text())
    state["loss"] = "teacher_top_k"
    payload = json.dumps(state, indent=2).encode()
    state_path.write_bytes(payload)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["kiln_flows_state.json"].update(size_bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    manifest_path.write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize("loss", EXTENSION_LOSSES)
def test_a_checkpoint_that_recorded_teacher_top_k_for_these_losses_still_resumes(loss, tiny_student, corpus, tmp_path):
    uninterrupted = run(spec_for(loss, tiny_student, corpus, tmp_path / "whole"))
    committed: list[int] = []
    stopped = run(spec_for(loss, tiny_student, corpus, tmp_path / "cut"), on_step_committed=committed.append,
                  should_cancel=lambda: bool(committed) and committed[-1] >= 2)
    assert stopped.status == "cancelled" and stopped.latest_checkpoint.endswith(STEP_2)
    record_legacy_loss(Path(stopped.run) / STEP_2)

    resumed = run(spec_for(loss, tiny_student, corpus, tmp_path / "cut"))
    assert resumed.status == "success" and resumed.loss_history == uninterrupted.loss_history
    assert (Path(resumed.adapter) / "adapter_model.safetensors").read_bytes() == \
        (Path(uninterrupted.adapter) / "adapter_model.safetensors").read_bytes()


def test_a_legacy_teacher_top_k_record_is_not_accepted_for_the_tail_loss(tiny_student, corpus, tmp_path):
    """``teacher_top_k_tail`` was always recorded by name: a ``teacher_top_k`` record is another run's."""
    from kiln_core.errors import Rejection

    committed: list[int] = []
    stopped = run(spec_for("teacher_top_k_tail", tiny_student, corpus, tmp_path), on_step_committed=committed.append,
                  should_cancel=lambda: bool(committed) and committed[-1] >= 2)
    record_legacy_loss(Path(stopped.run) / STEP_2)
    with pytest.raises(Rejection) as caught:
        run(spec_for("teacher_top_k_tail", tiny_student, corpus, tmp_path))
    assert caught.value.code == "resume_loss"
