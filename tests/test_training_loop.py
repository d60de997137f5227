"""The one training loop and its one end-of-step: order, checkpoints and stops, for both modes.

``StepBoundary`` is exercised with stand-ins for the checkpoint writer and the watch (no model): what a
user depends on is the order — the progress line before the checkpoint, a checkpoint before a stop —
and that nothing is checkpointed or stopped after the last step.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from kiln_core.training.boundary import StepBoundary
from kiln_core.training.lifecycle import CANCEL_MESSAGE
from kiln_core.training.progress import Clock, LoopProgress
from kiln_core.training.step import StopTraining

ROOT = Path(__file__).resolve().parents[1]


class _World:
    size = 1

    def __init__(self, others_stop: bool = False):
        self.others_stop, self.collectives = others_stop, 0

    def any_rank(self, flag: bool) -> bool:
        self.collectives += 1
        return flag or self.others_stop


class _Checkpoints:
    def __init__(self, events: list[str], progress: LoopProgress):
        self.events, self.progress = events, progress
        self.published = None  # CheckpointPublisher's: the newest checkpoint of the run, None before the first

    def publish(self) -> str:
        self.events.append(f"checkpoint {self.progress.global_step}")
        return f"step-{self.progress.global_step}"


class _Watch:
    def __init__(self, events: list[str], halt_at: int | None = None):
        self.events, self.halt_at = events, halt_at

    def after_step(self, student, progress, clock, *, steps_left):
        self.events.append(f"watch {progress.global_step}")
        if progress.global_step == self.halt_at:
            return StopTraining("training_error", "held-out loss diverged", stop_reason="diverged")
        return None


def _boundary(events, *, interval=2, cancel_at=None, watch=None, world=None, signalled=None):
    progress = LoopProgress()
    boundary = StepBoundary(
        _Checkpoints(events, progress), progress, Clock(), world or _World(), interval, signalled or threading.Event(),
        should_cancel=(lambda: progress.global_step == cancel_at) if cancel_at is not None else None,
        on_step_committed=lambda step: events.append(f"committed {step}"), watch=watch)
    return boundary, progress


def _run(boundary, progress, events, total):
    for step in range(1, total + 1):
        progress.global_step = step
        boundary.after_step(None, steps_left=step < total, report=lambda: events.append(f"report {progress.global_step}"))


def test_the_end_of_a_step_runs_in_one_order_and_never_checkpoints_after_the_last():
    events: list[str] = []
    boundary, progress = _boundary(events, watch=_Watch(events))
    _run(boundary, progress, events, total=4)
    assert events == ["report 1", "watch 1", "committed 1",
                      "report 2", "watch 2", "checkpoint 2", "committed 2",
                      "report 3", "watch 3", "committed 3",
                      "report 4", "watch 4", "committed 4"]  # step 4 is the last: the adapter follows


def test_a_cancel_checkpoints_first_and_is_not_checked_after_the_last_step():
    events: list[str] = []
    boundary, progress = _boundary(events, interval=None, cancel_at=3)
    with pytest.raises(StopTraining) as stopped:
        _run(boundary, progress, events, total=5)
    assert (stopped.value.reason, stopped.value.message) == ("cancelled", f"{CANCEL_MESSAGE}; checkpoint step-3 kept "
                                                                          "(a retry resumes from it)")
    assert events[-2:] == ["committed 3", "checkpoint 3"]
    events.clear()
    boundary, progress = _boundary(events, interval=None, cancel_at=5)
    _run(boundary, progress, events, total=5)  # asked to stop once everything is trained: nothing changes
    assert "checkpoint 5" not in events


def test_a_watch_stop_wins_over_a_cancel_and_saves_the_state_once():
    events: list[str] = []
    boundary, progress = _boundary(events, interval=2, cancel_at=2, watch=_Watch(events, halt_at=2))
    with pytest.raises(StopTraining) as stopped:
        _run(boundary, progress, events, total=5)
    assert stopped.value.stop_reason == "diverged"
    assert events.count("checkpoint 2") == 2  # the periodic one, then the stop's (the publisher writes once)


def test_a_signal_or_another_rank_stops_every_rank_at_the_same_boundary():
    events: list[str] = []
    signalled = threading.Event()
    boundary, progress = _boundary(events, interval=None, signalled=signalled)
    signalled.set()
    with pytest.raises(StopTraining):
        boundary.before_first_step()
    assert events == []  # nothing trained yet: nothing to save
    world = _World(others_stop=True)
    world.size = 2
    boundary, progress = _boundary(events, interval=None, world=world)
    with pytest.raises(StopTraining):
        _run(boundary, progress, events, total=3)
    assert world.collectives == 1 and events[-1] == "checkpoint 1"


def _calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(tree) if isinstance(node, ast.Call)}


def test_both_modes_run_the_one_loop_and_only_it_does_end_of_step_work():
    training = ROOT / "kiln_core" / "training"
    for entry in ("trainer.py", "on_policy_trainer.py"):
        calls = _calls(training / entry)
        assert "run_training" in calls, entry
        assert not calls & {"publish", "after_step", "train_examples", "train_step_distributed", "start_student"}, entry
    doing_end_of_step = sorted(path.name for path in training.rglob("*.py")
                               if "StopTraining(\"cancelled\"" in path.read_text(encoding="utf-8"))
    assert doing_end_of_step == ["boundary.py"]


# --- the time bound (kiln_core.training.time_bound) ------------------------------------------------------


def _measured(monkeypatch, clock: list[float], max_hours, *, steps_left: bool = True, epochs: int = 1000):
    """Three committed steps of a 4-example run of ``epochs`` epochs; the bound reads the clock at the end of the
    first step and of the third, the readings ``clock``. Returns the refusal, or None."""
    import kiln_core.training.time_bound as time_bound
    from kiln_core.training.plan import Schedule

    readings = iter(clock)
    monkeypatch.setattr(time_bound.time, "perf_counter", lambda: next(readings))
    bound = time_bound.TimeBound(max_hours, Schedule(examples=4, samples_per_prompt=1, epochs=epochs,
                                                     sequences_per_step=1), _World())
    progress = LoopProgress()
    for _ in range(3):
        progress.global_step += 1
        try:
            bound.after_step(progress, steps_left=steps_left)
        except time_bound.TrainingTooLong as refused:
            return refused
    return None


def test_the_time_bound_projects_from_the_steps_after_the_first(monkeypatch):
    # Step 1 ends at 100 s (warm-up, not counted); steps 2 and 3 take 1 s each: 3,997 steps left ≈ 1.11 hours.
    refused = _measured(monkeypatch, [100.0, 102.0], max_hours=1.0)
    assert refused is not None and (refused.code, refused.field) == ("training_too_long", "config.epochs")
    assert "4,000 steps (1,000 epochs)" in refused.message and "the 3,997 left take about 1 hours" in refused.message
    assert "above the 1-hour bound" in refused.message
    assert _measured(monkeypatch, [100.0, 102.0], max_hours=2.0) is None


def test_the_time_bound_is_off_without_a_bound_and_after_the_last_step(monkeypatch):
    assert _measured(monkeypatch, [], max_hours=None) is None  # no bound: the clock is never read
    assert _measured(monkeypatch, [0.0, 2000.0], max_hours=1e-9, steps_left=False) is None


def test_every_rank_decides_the_time_bound_together(monkeypatch):
    import kiln_core.training.time_bound as time_bound
    from kiln_core.training.plan import Schedule

    readings = iter([0.0, 0.002])
    monkeypatch.setattr(time_bound.time, "perf_counter", lambda: next(readings))
    world = _World(others_stop=True)  # this rank is fast; another rank found the run too long
    bound = time_bound.TimeBound(168.0, Schedule(examples=4, samples_per_prompt=1, epochs=2, sequences_per_step=1),
                                 world)
    progress = LoopProgress()
    with pytest.raises(time_bound.TrainingTooLong):
        for _ in range(3):
            progress.global_step += 1
            bound.after_step(progress, steps_left=True)
    assert world.collectives == 1  # one collective, at the measured step only
