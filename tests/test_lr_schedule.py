"""The learning-rate schedule extension (``config.lr_schedule``): warm-up then linear or cosine decay, opt-in.

A config without it trains at Kiln's constant rate with the same run key, effective config and checkpoint
files as before the extension existed; with it, each optimizer step trains at the scheduled rate, the schedule
is recorded in the effective config and the checkpoint's extension file, and an interrupted run resumes to the
bytes of an uninterrupted one. Rates are compared with a reference written here from the formula in words.
"""

from __future__ import annotations

import json
import math

import pytest

from kiln_core.contracts.opd_config import LrSchedule, OpdConfig
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.storage import resolve
from kiln_core.training.checkpoint import ResumeError, latest_checkpoint
from test_trainer import ADAPTER, Crash, adapter_bytes, crash_after, make_config, receipt, resume_from_latest, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_rate(base: float, kind: str, warmup: int, final: float, step: int, total: int) -> float:
    """Warm-up: step/warmup of the base rate. Then a fraction p of the decay has passed before step s
    ((s - warmup - 1) of the total - warmup decay steps), and the rate is final + (1 - final)·g(p) of the base,
    g falling from 1 at p=0 to 0 at p=1: linearly, or as half a cosine period."""
    if step <= warmup:
        return base * step / warmup
    passed = (step - warmup - 1) / max(1, total - warmup)
    falling = (1 - passed) if kind == "linear" else (math.cos(math.pi * passed) + 1) / 2
    return base * (final + (1 - final) * falling)


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("warmup, final, total", [(0, 0.1, 10), (3, 0.0, 12), (5, 0.5, 5), (2, 1.0, 7)])
def test_each_step_trains_at_the_scheduled_rate(kind, warmup, final, total):
    from kiln_core.training.optim import scheduled_learning_rate

    schedule = LrSchedule(kind=kind, warmup_steps=warmup, final_lr_ratio=final)
    for step in range(1, total + 1):
        got = scheduled_learning_rate(2e-3, schedule, step, total)
        assert got == pytest.approx(reference_rate(2e-3, kind, warmup, final, step, total), rel=1e-12, abs=1e-18)
    assert scheduled_learning_rate(2e-3, None, 3, total) == 2e-3


@pytest.mark.fast
def test_a_config_without_a_schedule_keeps_its_run_key_and_kilns_effective_config():
    def settings(**config) -> ResolvedSettings:
        return ResolvedSettings.resolve(OpdConfig(training_mode="off_policy", **config), adapter="a")

    plain, scheduled = settings(), settings(lr_schedule={"warmup_steps": 2})
    assert "lr_schedule" not in plain.run_key_config()  # the run key runs had before schedules existed
    assert scheduled.run_key_config()["lr_schedule"] == {"kind": "cosine", "warmup_steps": 2, "final_lr_ratio": 0.1}
    assert {key: value for key, value in scheduled.run_key_config().items() if key != "lr_schedule"} == \
        plain.run_key_config()
    assert scheduled.kiln_effective_config(7) == plain.kiln_effective_config(7)  # ours: in the extension file


@pytest.mark.fast
@pytest.mark.parametrize("bad", [{"kind": "step"}, {"warmup_steps": -1}, {"final_lr_ratio": 1.5}, {"warmup": 2}])
def test_a_bad_schedule_is_refused_naming_its_field(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        OpdConfig(training_mode="off_policy", lr_schedule=bad)
    assert "lr_schedule" in str(caught.value)


def test_a_scheduled_run_trains_at_each_steps_rate_and_resumes_to_the_same_bytes(tiny_student, tmp_path, monkeypatch):
    import kiln_core.training.step as step_module

    schedule = {"kind": "linear", "warmup_steps": 2, "final_lr_ratio": 0.0}
    config = make_config(epochs=2, optimizer={"kind": "adam_w"}, lr_schedule=schedule)  # 12 steps, checkpoints every 2
    rates, real_set = [], step_module.set_learning_rate

    def recording(optimizer, rate):
        rates.append(rate)
        real_set(optimizer, rate)
        assert all(group["lr"] == rate for group in optimizer.param_groups)

    monkeypatch.setattr(step_module, "set_learning_rate", recording)
    reference = run(tiny_student, tmp_path / "reference", config)
    assert reference.status == "success" and reference.total_steps == 12
    assert rates == pytest.approx([reference_rate(2e-2, "linear", 2, 0.0, s, 12) for s in range(1, 13)], rel=1e-12)
    assert receipt(tmp_path / "reference")["config"]["lr_schedule"] == {"final_lr_ratio": 0.0, "kind": "linear",
                                                                         "warmup_steps": 2}
    checkpoint = tmp_path / "reference" / "demo-checkpoint-step-00000002.kiln-checkpoint"
    assert json.loads((checkpoint / "kiln_flows_state.json").read_text())["lr_schedule"] == {
        "kind": "linear", "warmup_steps": 2, "final_lr_ratio": 0.0}
    assert "lr_schedule" not in json.loads((checkpoint / "checkpoint_manifest.json").read_text())["effective_config"]

    constant = run(tiny_student, tmp_path / "constant", make_config(epochs=2, optimizer={"kind": "adam_w"}))
    assert adapter_bytes(tmp_path / "constant") != adapter_bytes(tmp_path / "reference")
    assert constant.status == "success"

    rates.clear()
    with pytest.raises(Crash):
        run(tiny_student, tmp_path / "resumed", config, on_step_committed=crash_after(5))
    final = resume_from_latest(tiny_student, tmp_path / "resumed", config)
    assert final.status == "success" and final.resumed_from == "demo-checkpoint-step-00000004.kiln-checkpoint"
    assert adapter_bytes(tmp_path / "resumed") == adapter_bytes(tmp_path / "reference")
    assert final.loss_history == reference.loss_history


def test_a_flat_schedule_trains_the_bytes_of_no_schedule(tiny_student, tmp_path):
    """Warm-up 0 and a final ratio of 1 keep every rate at the base: setting it each step changes nothing."""
    flat = run(tiny_student, tmp_path / "flat", make_config(lr_schedule={"final_lr_ratio": 1.0}))
    plain = run(tiny_student, tmp_path / "plain", make_config())
    assert flat.status == plain.status == "success"
    assert adapter_bytes(tmp_path / "flat") == adapter_bytes(tmp_path / "plain")


def test_a_checkpoint_resumes_only_under_the_schedule_it_was_written_with(tiny_student, tmp_path):
    config = make_config(epochs=2, lr_schedule={"warmup_steps": 2})
    with pytest.raises(Crash):
        run(tiny_student, tmp_path, config, on_step_committed=crash_after(3))
    basename = latest_checkpoint(resolve(str(tmp_path)), ADAPTER)
    for other in (make_config(epochs=2), make_config(epochs=2, lr_schedule={"warmup_steps": 3})):
        with pytest.raises(ResumeError) as caught:
            run(tiny_student, tmp_path, other, resume_checkpoint=basename)
        assert caught.value.code == "resume_lr_schedule", caught.value
