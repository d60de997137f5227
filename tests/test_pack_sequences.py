"""``config.pack_sequences``: a step's sequences in one forward pass, packed end to end without padding.

What a user relies on: the packed forward gives each sequence the hidden states it has alone (checked against
transformers' own forward of each sequence, fp32, 1e-5 relative), so a packed run trains the loss an unpacked
run trains (step losses within 1e-5, adapter within 1e-4); it resumes bit-exactly; it is recorded in the
effective config, the run key and the checkpoint's extension file, and a resume under the other setting is
refused; Kiln's one-sequence default and an unpacked run keep their files and keys unchanged.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kiln_core.contracts.opd_config import ConfigError, OpdConfig
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.storage import resolve
from kiln_core.training.checkpoint import ResumeError, latest_checkpoint
from kiln_core.training.trainer import train_opd
from plan_support import split_plan_options, train_plan
from test_trainer import Crash, crash_after, make_config, synthetic_tables

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ADAPTER = "demo"
DATASET_SHA = "sha256:" + "cd" * 32


def run(student, root, config, **kwargs):
    plan_options, hooks = split_plan_options(kwargs)
    return train_opd(train_plan(config, str(root), ADAPTER, **plan_options), synthetic_tables(n=7),
                     dataset_sha256=DATASET_SHA, dataset_path="corpus.jsonl", student_dir=str(student),
                     teacher_alias="tiny-teacher", **hooks)


def adapter(root) -> dict[str, torch.Tensor]:
    return load_file(str(root / "adapter" / "adapter_model.safetensors"))


def test_packed_hidden_states_equal_each_sequence_run_alone(tiny_student):
    """The reference is transformers' plain forward of each sequence by itself (no packing code involved)."""
    from transformers import AutoModelForCausalLM

    from kiln_core.training.student import load_student

    student = load_student(str(tiny_student), rank=4, alpha=8.0, seed=3, device="cpu", precision="fp32")
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_student), torch_dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 380, (length,), generator=generator) for length in (17, 1, 31, 9)]
    with torch.no_grad():
        packed = student.packed_hidden_states(sequences)
        # The LoRA starts with B = 0, so the student's function is the base model's.
        alone = [reference.model(input_ids=ids[None]).last_hidden_state[0] for ids in sequences]
    assert [tuple(rows.shape) for rows in packed] == [(len(ids), reference.config.hidden_size) for ids in sequences]
    for rows, expected in zip(packed, alone):
        torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)


def test_a_packed_run_trains_the_loss_an_unpacked_run_trains(tiny_student, tmp_path):
    one_by_one = run(tiny_student, tmp_path / "accumulated", make_config(sequences_per_step=3, checkpoint_interval=None))
    packed = run(tiny_student, tmp_path / "packed",
                 make_config(sequences_per_step=3, pack_sequences=True, checkpoint_interval=None))
    assert packed.status == one_by_one.status == "success" and packed.steps == one_by_one.steps == 3
    np.testing.assert_allclose(packed.loss_history, one_by_one.loss_history, rtol=1e-5, atol=1e-6)
    expected = adapter(tmp_path / "accumulated")
    for key, value in adapter(tmp_path / "packed").items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5)
    receipts = [json.loads((tmp_path / name / "train_receipt.json").read_text()) for name in ("accumulated", "packed")]
    assert receipts[0]["token_counts"] == receipts[1]["token_counts"]  # every candidate counted once, the same way


def test_a_packed_run_resumes_bit_exactly_and_records_the_setting(tiny_student, tmp_path):
    config = make_config(sequences_per_step=2, pack_sequences=True, checkpoint_interval=1)
    run(tiny_student, tmp_path / "reference", config)
    checkpoint = tmp_path / "reference" / "demo-checkpoint-step-00000001.kiln-checkpoint"
    extension = json.loads((checkpoint / "kiln_flows_state.json").read_text())
    assert (extension["pack_sequences"], extension["sequences_per_step"]) == (True, 2)
    manifest = json.loads((checkpoint / "checkpoint_manifest.json").read_text())
    assert "pack_sequences" not in manifest["effective_config"]  # ours, not Kiln's: in the extension file
    with pytest.raises(Crash):
        run(tiny_student, tmp_path / "resumed", config, on_step_committed=crash_after(2))
    resumed = run(tiny_student, tmp_path / "resumed", config,
                  resume_checkpoint=latest_checkpoint(resolve(str(tmp_path / "resumed")), ADAPTER))
    assert resumed.status == "success"
    assert (tmp_path / "resumed" / "adapter" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "reference" / "adapter" / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize("written, asked", [(False, True), (True, False)])
def test_a_resume_under_the_other_packing_is_refused(tiny_student, tmp_path, written, asked):
    config = make_config(sequences_per_step=2, pack_sequences=written, checkpoint_interval=1)
    with pytest.raises(Crash):
        run(tiny_student, tmp_path, config, on_step_committed=crash_after(1))
    with pytest.raises(ResumeError) as refused:
        run(tiny_student, tmp_path, config.model_copy(update={"pack_sequences": asked}),
            resume_checkpoint=latest_checkpoint(resolve(str(tmp_path)), ADAPTER))
    assert refused.value.code == "resume_pack_sequences"
    assert f"pack_sequences {written}" in str(refused.value) and f"asks for {asked}" in str(refused.value)


def test_an_unpacked_config_keeps_its_effective_config_and_checkpoint_files(tiny_student, tmp_path):
    for pack in (False, True):  # Kiln's effective config never names our extension
        settings = ResolvedSettings.resolve(OpdConfig(training_mode="off_policy", pack_sequences=pack), adapter="a")
        assert "pack_sequences" not in settings.kiln_effective_config(7)
    run(tiny_student, tmp_path, make_config(sequences_per_step=2, checkpoint_interval=1))
    extension = json.loads((tmp_path / "demo-checkpoint-step-00000001.kiln-checkpoint" / "kiln_flows_state.json").read_text())
    assert "pack_sequences" not in extension


def test_the_run_key_changes_only_when_packing_is_on():
    base = dict(training_mode="off_policy", sequences_per_step=2)
    unpacked, explicit, packed = (ResolvedSettings.resolve(OpdConfig(**base, **extra), adapter="a").run_key_config()
                                  for extra in ({}, {"pack_sequences": False}, {"pack_sequences": True}))
    assert unpacked == explicit and "pack_sequences" not in unpacked  # the keys runs had before packing existed
    assert packed == {**unpacked, "pack_sequences": True}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_packing_check_accepts_the_rounding_of_each_precision(precision, tmp_path):
    """bf16 moves every row by a few per cent whatever the packing (measured 2-3 % on SmolLM2's shape): the check
    compares the sequence that could see another with the one that cannot, not with a fixed tolerance."""
    from kiln_core.tiny_models import build_tiny_model
    from kiln_core.training.student import load_student

    # 12 layers: enough bf16 rounding (2.7 % of the largest value) to fail a fixed 2 % tolerance.
    model = build_tiny_model(tmp_path / "student", seed=4, hidden_size=192, num_layers=12, num_heads=3,
                             num_kv_heads=1, intermediate_size=384)
    load_student(str(model), rank=4, alpha=8.0, seed=3, device="cpu", precision=precision).check_packing()


def test_packing_is_refused_for_an_architecture_that_lets_sequences_see_each_other(tiny_student, monkeypatch):
    from kiln_core.training.student import Student, load_student

    student = load_student(str(tiny_student), rank=4, alpha=8.0, seed=3, device="cpu", precision="fp32")
    student.check_packing()  # this architecture keeps them apart

    def leaking(self, sequences):  # one causal sequence: later ones attend to earlier ones
        rows = self.hidden_states(torch.cat(list(sequences)))
        return list(rows.split([len(s) for s in sequences]))

    monkeypatch.setattr(Student, "packed_hidden_states", leaking)
    with pytest.raises(ConfigError) as refused:
        student.check_packing()
    assert refused.value.code == "unsupported" and refused.value.field == "config.pack_sequences"


def test_packing_is_refused_with_several_processes_before_any_model_loads(tiny_student, tmp_path):
    from kiln_core.training.distributed.world import World
    from kiln_core.training.plan import plan_off_policy_run

    config = make_config(sequences_per_step=2, pack_sequences=True)
    with pytest.raises(ConfigError) as refused:
        plan_off_policy_run(train_plan(config, str(tmp_path), ADAPTER), tables=synthetic_tables(n=4),
                            dataset_sha256=DATASET_SHA, dataset_path="corpus.jsonl", student_dir=str(tiny_student),
                            teacher_identity=None, teacher_alias="tiny-teacher", world=World(size=2, backend="gloo"))
    assert refused.value.code == "unsupported" and refused.value.field == "config.pack_sequences"
    assert "not 2" in str(refused.value) and not list(tmp_path.iterdir())
