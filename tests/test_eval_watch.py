"""Held-out evaluation during training on the tiny student: stops, alarms, determinism, exact resume.

What a user depends on: a run whose held-out KL diverges (a learning rate far too high) or whose loss
is flat is stopped with the rule named, a checkpoint saved and a ``failed`` receipt; a healthy run is
not; alarms reach the log and the receipt; watching never changes what training computes (the same
adapter and checkpoint tensors as an unwatched run, and an unwatched run writes no trace of the watch);
a resumed watched run ends with the adapter and the curve of the uninterrupted one.

Training and held-out data are the synthetic tables of ``test_trainer`` (random teacher rows per
example): a held-out KL that falls needs a small learning rate, and AdamW at 0.3 overfits the six
training examples at once, so the held-out KL rises — the same setup, only the learning rate differs.
"""

from __future__ import annotations

import json
import logging

import pytest

from kiln_core.contracts.eval_watch import EvalWatch
from kiln_core.contracts.opd_config import ConfigError
from kiln_core.corpus import CorpusTables
from kiln_core.storage import resolve
from kiln_core.training.checkpoint import load_checkpoint
from kiln_core.training.distributed.world import World
from kiln_core.training.receipt import read_receipt
from kiln_core.training.watch import HeldOutSlice
from test_trainer import Crash, adapter_bytes, crash_after, make_config, receipt, resume_from_latest, run
from test_trainer import synthetic_tables

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

HELD_OUT_SHA = "sha256:" + "cd" * 32


def held_out(**overrides) -> HeldOutSlice:
    settings = {"corpus": "heldout.jsonl", "every_steps": 2, "patience": 2, "min_improvement": 0.0, "flat_window": None,
                "stop_on_divergence": True, **overrides}
    return HeldOutSlice(EvalWatch(**settings), synthetic_tables(n=4, seed=7), HELD_OUT_SHA)


def adam(lr: float, **overrides):
    return make_config(**{"epochs": 2, "learning_rate": lr, "optimizer": {"kind": "adam_w"}, "checkpoint_interval": None,
                          **overrides})


def checkpoint_files(root, basename) -> dict[str, bytes]:
    location = resolve(str(root)).child(basename)
    return {name: location.child(name).read_bytes() for name in
            ("adapter.safetensors", "optimizer.safetensors", "opd_loop_state.json", "kiln_flows_state.json")}


def without_process_wide_generators(state: dict) -> dict:
    kept = {k: v for k, v in state.items() if k != "eval_curve"}
    kept["rank_rng"] = [{"torch_cpu": rank["torch_cpu"], "torch_cuda": rank["torch_cuda"]} for rank in state["rank_rng"]]
    return kept


def kl_curve(result) -> list[tuple[int, float]]:
    return [(p.step, p.reverse_kl) for p in result.eval_curve.points]


def test_a_run_that_diverges_is_stopped_with_the_rule_named(tiny_student, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln_core.training.watch"):
        result = run(tiny_student, tmp_path, adam(0.3, checkpoint_interval=4), eval_watch=held_out())
    assert result.status == "failed" and result.stop_reason == "diverged" and result.steps == 6 < result.total_steps
    kl = [kl for _, kl in kl_curve(result)]  # steps 0, 2, 4, 6: better once, then two rises
    assert kl[1] < kl[0] and kl[1] < kl[2] < kl[3]
    r = read_receipt(str(tmp_path))
    assert (r.status, r.failure_reason, r.stop_reason) == ("failed", "training_error", "diverged")
    assert "rule diverged" in r.failure_message and "rose at each of the last 2 evaluations" in r.failure_message
    assert [(a.step, a.rule) for a in r.eval_curve.alarms] == [(6, "diverged")]
    assert "[diverged]" in caplog.text
    # a clean stop: the state at the stop is a checkpoint carrying the curve; no adapter is published
    assert result.latest_checkpoint == "demo-checkpoint-step-00000006.kiln-checkpoint"
    assert load_checkpoint(resolve(str(tmp_path)), result.latest_checkpoint).extension.eval_curve == r.eval_curve
    assert result.adapter is None and not resolve(str(tmp_path)).child("adapter", "adapter_config.json").exists()


def test_a_healthy_run_is_not_stopped_and_reports_every_evaluation(tiny_student, tmp_path):
    reports = []
    result = run(tiny_student, tmp_path, adam(3e-3), eval_watch=held_out(), on_eval=reports.append)
    assert result.status == "success" and result.stop_reason is None and result.eval_curve.alarms == []
    curve = kl_curve(result)
    assert [step for step, _ in curve] == [0, 2, 4, 6, 8, 10, 12]
    assert all(after < before for (_, before), (_, after) in zip(curve, curve[1:]))
    assert [r.point.step for r in reports] == [0, 2, 4, 6, 8, 10, 12] and reports[-1].curve == result.eval_curve
    assert len(result.eval_curve.rows()) == 7 and read_receipt(str(tmp_path)).eval_curve == result.eval_curve
    assert result.phase_timings_ms["eval"] > 0


def test_a_stalled_run_is_stopped(tiny_student, tmp_path):
    result = run(tiny_student, tmp_path, adam(1.0), eval_watch=held_out())  # never better than before training
    assert (result.status, result.stop_reason, result.steps) == ("failed", "stalled", 4)
    assert "has not improved on its best" in receipt(tmp_path)["failure_message"]


def test_a_flat_training_loss_is_stopped(tiny_student, tmp_path):
    # lr 1e-9: nothing moves; windows of 6 steps = one epoch of the 6 examples, so their means are equal
    config = make_config(epochs=3, learning_rate=1e-9, checkpoint_interval=None)
    result = run(tiny_student, tmp_path, config, eval_watch=held_out(every_steps=3, flat_window=6, patience=100))
    assert (result.status, result.stop_reason, result.steps) == ("failed", "flat", 12)
    assert receipt(tmp_path)["stop_reason"] == "flat" and "training loss is flat" in receipt(tmp_path)["failure_message"]


def test_without_stop_alarms_are_warnings_and_a_rule_at_the_last_step_never_fails_the_run(tiny_student, tmp_path,
                                                                                           caplog):
    with caplog.at_level(logging.WARNING, logger="kiln_core.training.watch"):
        warned = run(tiny_student, tmp_path / "warned", adam(0.3), eval_watch=held_out(stop_on_divergence=False))
    assert warned.status == "success" and warned.steps == 12
    assert ("diverged", 6) in [(a.rule, a.step) for a in warned.eval_curve.alarms]
    assert receipt(tmp_path / "warned")["eval_curve"]["alarms"][0]["rule"] == "diverged" and "[diverged]" in caplog.text
    # flat first fires at step 12, the last: an alarm, not a failed run
    config = make_config(epochs=2, learning_rate=1e-9, checkpoint_interval=None)
    last = run(tiny_student, tmp_path / "last", config, eval_watch=held_out(every_steps=3, flat_window=6, patience=100))
    assert last.status == "success" and [(a.step, a.rule) for a in last.eval_curve.alarms] == [(12, "flat")]


def test_watching_leaves_training_untouched_and_an_unwatched_run_writes_no_trace(tiny_student, tmp_path):
    config = make_config(epochs=2, learning_rate=3e-3, optimizer={"kind": "adam_w"}, checkpoint_interval=4)
    plain = run(tiny_student, tmp_path / "plain", config)
    watched = run(tiny_student, tmp_path / "watched", config, eval_watch=held_out(every_steps=3, stop_on_divergence=False))
    assert adapter_bytes(tmp_path / "watched") == adapter_bytes(tmp_path / "plain")
    assert watched.loss_history == plain.loss_history
    for basename in ("demo-checkpoint-step-00000004.kiln-checkpoint", "demo-checkpoint-step-00000008.kiln-checkpoint"):
        a, b = checkpoint_files(tmp_path / "plain", basename), checkpoint_files(tmp_path / "watched", basename)
        assert {k: v for k, v in a.items() if k != "kiln_flows_state.json"} == \
               {k: v for k, v in b.items() if k != "kiln_flows_state.json"}
        plain_state, watched_state = json.loads(a["kiln_flows_state.json"]), json.loads(b["kiln_flows_state.json"])
        assert "eval_curve" not in plain_state  # the unwatched extension file is what it was before the watch
        # Every field matches, the torch generators (the ones training draws from) included. Python's and NumPy's
        # generators are process-wide: Prefect's background services left by earlier flow tests in this process
        # draw jitter from Python's (prefect.utilities.math.clamped_poisson_interval), so they are left out here.
        assert without_process_wide_generators(watched_state) == without_process_wide_generators(plain_state)
    plain_receipt = receipt(tmp_path / "plain")
    assert "eval_curve" not in plain_receipt and "stop_reason" not in plain_receipt and plain.eval_curve is None


def test_a_resumed_watched_run_ends_with_the_adapter_and_curve_of_an_uninterrupted_one(tiny_student, tmp_path, caplog):
    config = make_config(epochs=2, learning_rate=3e-3, optimizer={"kind": "adam_w"}, checkpoint_interval=2)
    watch = held_out(every_steps=3, stop_on_divergence=False)
    reference = run(tiny_student, tmp_path / "reference", config, eval_watch=watch)
    with pytest.raises(Crash):  # after step 5: the newest checkpoint is step 4, whose curve has steps 0 and 3
        run(tiny_student, tmp_path / "resumed", config, eval_watch=watch, on_step_committed=crash_after(5))
    resumed = resume_from_latest(tiny_student, tmp_path / "resumed", config, eval_watch=watch)
    assert resumed.resumed_from == "demo-checkpoint-step-00000004.kiln-checkpoint"
    assert adapter_bytes(tmp_path / "resumed") == adapter_bytes(tmp_path / "reference")
    assert resumed.eval_curve == reference.eval_curve and [p.step for p in resumed.eval_curve.points] == [0, 3, 6, 9, 12]
    # resumed on another slice (fewer examples): the curve restarts at the resume step, training is unchanged
    with pytest.raises(Crash):
        run(tiny_student, tmp_path / "other", config, eval_watch=watch, on_step_committed=crash_after(5))
    with caplog.at_level(logging.WARNING, logger="kiln_core.training.watch"):
        other = resume_from_latest(tiny_student, tmp_path / "other", config,
                                   eval_watch=held_out(every_steps=3, stop_on_divergence=False, max_examples=2))
    assert "the held-out curve restarts at step 4" in caplog.text
    assert [p.step for p in other.eval_curve.points] == [4, 6, 9, 12]
    assert adapter_bytes(tmp_path / "other") == adapter_bytes(tmp_path / "reference")


def test_a_watch_the_run_cannot_keep_is_refused_before_anything_is_written(tiny_student, tmp_path):
    with pytest.raises(ConfigError) as refused:
        run(tiny_student, tmp_path / "run", adam(3e-3), eval_watch=held_out(), world=World(rank=0, size=2))
    assert refused.value.code == "eval_watch_distributed" and not (tmp_path / "run").exists()
    empty = HeldOutSlice(held_out().watch, CorpusTables.from_examples([], 16), HELD_OUT_SHA)
    with pytest.raises(ConfigError) as refused:
        run(tiny_student, tmp_path / "run", adam(3e-3), eval_watch=empty)
    assert (refused.value.code, refused.value.field) == ("eval_watch_empty", "eval.corpus")
    assert not (tmp_path / "run").exists()
