"""``train_receipt.json``: Kiln's fields with Kiln's names and types (tests/kiln_structs.py
``TrainReceipt``), our extras kept, one typed model to write and read it."""

from __future__ import annotations

import json

import pytest
import torch

import kiln_structs as kiln
from kiln_core.training.receipt import ReceiptError, read_receipt, receipt_status
from test_trainer import make_config, run, synthetic_tables


@pytest.fixture(scope="module")
def finished(tiny_student, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("receipt")
    result = run(tiny_student, root, make_config(checkpoint_interval=None, echo={"lambda": 0.5}), tables=synthetic_tables(n=3))
    assert result.status == "success"
    return root, result


def test_a_receipt_parses_as_kilns_train_receipt(finished):
    root, result = finished
    text = (root / "train_receipt.json").read_text()
    assert text.startswith("{\n  ") and not text.endswith("\n")  # pretty, no trailing newline
    receipt = kiln.TrainReceipt.model_validate_json(text)
    assert (receipt.schema_version, receipt.receipt_type, receipt.status) == (1, "kiln_train_receipt", "success")
    assert receipt.model.base_weight_shard_manifest is not None  # Kiln's name for what we had as base_weights_hash
    assert receipt.opd.teacher_content_revision.startswith("sha256:")
    assert receipt.runtime.execution_provenance is not None and receipt.runtime.training_precision.parameter_dtype == "f32"
    assert receipt.adapters.output.adapter_model_sha256.startswith("sha256:") and receipt.adapters.base.path is None
    assert receipt.data.examples_trained == result.steps == 3 and receipt.data.examples_read == 3
    assert {row.module for row in receipt.lora_grad_norms} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(row.sample_count == 3 and row.min <= row.mean <= row.max for row in receipt.lora_grad_norms)
    assert all(row.pair_count == 2 and row.delta_l2_upper_bound_max >= row.delta_l2_upper_bound_mean for row in receipt.lora_delta_norms)
    assert receipt.phase_timings.policy_forward_ms > 0 and receipt.phase_timings.backward_ms > 0
    assert receipt.echo.enabled and isinstance(receipt.echo.final_env_ce, float)  # fired: a number
    assert receipt.token_counts.action_tokens == int(synthetic_tables(n=3).action_positions.shape[0])
    raw = json.loads(text)
    assert raw["hyperparameters"]["optimizer"] == "muon" and raw["data"]["total_steps"] == 3  # our extras are kept
    assert raw["loss_history"] == result.loss_history and raw["kiln"]["implementation"] == "kiln-flows"
    assert "failure_message" not in raw and "dropped_reason" not in raw["echo"]  # Kiln skips these when None


def test_read_receipt_is_typed_and_refuses_what_is_not_a_receipt(finished, tmp_path):
    root, result = finished
    receipt = read_receipt(str(root))
    assert receipt.status == "success" and receipt.loss_history == result.loss_history
    assert read_receipt(str(root / "train_receipt.json")).opd.final_opd_loss == result.final_loss
    assert receipt_status(str(root)) == "success"

    with pytest.raises(ReceiptError) as caught:
        read_receipt(str(tmp_path))
    assert caught.value.code == "receipt_missing" and receipt_status(str(tmp_path)) is None

    older = json.loads((root / "train_receipt.json").read_text())
    older["lora_grad_norms"] = [0.5, 0.25]  # what kiln-flows wrote before Kiln's per-module summaries
    (tmp_path / "train_receipt.json").write_text(json.dumps(older))
    with pytest.raises(ReceiptError) as caught:
        read_receipt(str(tmp_path))
    assert caught.value.code == "receipt_invalid" and "lora_grad_norms" in caught.value.message
    assert receipt_status(str(tmp_path)) == "success"  # the status alone still answers


def test_a_cancelled_run_has_kilns_failed_shape(tiny_student, tmp_path):
    result = run(tiny_student, tmp_path, make_config(checkpoint_interval=None), tables=synthetic_tables(n=3),
                 should_cancel=lambda: True)
    assert result.status == "cancelled" and result.steps == 0
    receipt = kiln.TrainReceipt.model_validate_json((tmp_path / "train_receipt.json").read_text())
    assert (receipt.status, receipt.failure_reason) == ("failed", "cancelled")
    assert receipt.adapters.output.adapter_model_sha256 is None and receipt.lora_delta_norms == []
    assert read_receipt(str(tmp_path)).failure_message.startswith("training cancelled by user")
