"""The held-out watch's rules on hand-written curves: when each fires, when it raises an alarm, and the slice.

Every expected outcome below is worked out by hand from the rule's definition in
``kiln_core/training/eval_curve.py`` (no model, no training): the sequences are short enough to check
on paper.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln_core.contracts.eval_watch import EvalWatch, parse_eval_watch
from kiln_core.contracts.opd_config import ConfigError
from kiln_core.corpus import CorpusTables, TrainingExample
from kiln_core.contracts.eval_curve import EvalCurve, EvalPoint, HeldOutSliceRecord
from kiln_core.training.eval_curve import firing_rules, new_alarms
from kiln_core.training.watch import select_examples


def watch(**overrides) -> EvalWatch:
    return EvalWatch(**{"corpus": "heldout.jsonl", "every_steps": 10, "patience": 2, "min_improvement": 0.0,
                        "flat_window": None, **overrides})


def curve(*kls: float | None, every: int = 10) -> list[EvalPoint]:
    return [EvalPoint(step=i * every, reverse_kl=kl, top1_agreement=0.0, teacher_token_nll=1.0, tokens=8)
            for i, kl in enumerate(kls)]


def rules(points, losses=(), **overrides) -> list[str]:
    return [rule for rule, _ in firing_rules(points, list(losses), watch(**overrides))]


@pytest.mark.parametrize("kls, expected", [
    ((2.0, 1.5, 1.0, 0.8), []),                   # improving every time
    ((2.0, 1.0, 1.1, 1.2), ["diverged"]),         # two rises in a row (patience 2)
    ((2.0, 1.0, 1.1, 0.9), []),                   # one rise, then a new best
    ((2.0, 1.0, 1.2, 1.1), ["stalled"]),          # no new best for two evaluations, but not two rises
    ((2.0, 1.0, 1.0, 1.0), ["stalled"]),          # equal is not an improvement
    ((2.0, 1.0, None), ["diverged"]),             # a non-finite KL diverges at once
])
def test_the_held_out_rules_with_patience_two(kls, expected):
    assert rules(curve(*kls)) == expected


def test_min_improvement_is_relative_for_both_rises_and_improvements():
    # 1.0 -> 0.995 -> 0.991: each a 0.5 % / 0.4 % improvement, below 1 %: no new best twice = stalled
    assert rules(curve(1.0, 0.995, 0.991), min_improvement=0.01) == ["stalled"]
    assert rules(curve(1.0, 0.995, 0.991)) == []  # with 0, each counts
    # rises of 0.5 % are not rises at 1 %, so it is a stall and not a divergence
    assert rules(curve(1.0, 1.005, 1.010), min_improvement=0.01) == ["stalled"]
    assert rules(curve(1.0, 1.02, 1.05), min_improvement=0.01) == ["diverged"]


def test_the_message_names_the_rule_and_the_numbers():
    (_, message), = firing_rules(curve(2.0, 1.0, 1.1, 1.2), [], watch())
    assert "rose at each of the last 2 evaluations" in message and "1 → 1.1 → 1.2" in message
    assert "steps 10–30" in message and "eval.patience=2" in message


@pytest.mark.parametrize("losses, expected", [
    ([3.0, 2.0, 3.0, 2.0], ["flat"]),             # windows of 2: means 2.5 and 2.5
    ([3.0, 2.0, 2.9, 2.0], ["flat"]),             # 2.45 vs 2.5: 2 % ≤ 5 %
    ([3.0, 2.0, 2.0, 1.5], []),                   # 1.75 vs 2.5: 30 %
    ([3.0, 2.0, 3.0], []),                        # fewer than 2W steps
    ([9.0, 9.0, 3.0, 2.0, 3.0, 2.0], ["flat"]),   # only the last two windows count
])
def test_the_flat_rule_compares_the_last_two_windows(losses, expected):
    assert rules(curve(1.0), losses, flat_window=2, flat_tolerance=0.05) == expected


def test_the_flat_rule_is_off_without_a_window():
    assert rules(curve(1.0), [2.0] * 100) == []


def test_an_alarm_is_raised_when_a_rule_starts_firing_not_while_it_keeps_firing():
    points = curve(2.0, 1.0, 1.0, 1.0, 1.5, 2.0)
    raised = [[(a.step, a.rule) for a in new_alarms(points[: i + 1], [], watch())] for i in range(len(points))]
    # stalled from the 4th point on (one alarm), then diverged (a new name) at the 6th
    assert raised == [[], [], [], [(30, "stalled")], [], [(50, "diverged")]]


def test_flat_alarms_use_the_losses_up_to_each_evaluation():
    points = curve(1.0, 1.0, 1.0, every=2)  # steps 0, 2, 4
    losses = [5.0, 1.0, 5.0, 1.0]  # flat only once 4 steps (2W) exist
    assert [a.rule for a in new_alarms(points, losses, watch(flat_window=2, patience=10))] == ["flat"]
    assert new_alarms(points[:2], losses[:2], watch(flat_window=2, patience=10)) == []


def test_curve_rows_carry_the_alarms_of_each_step():
    points = curve(2.0, 1.0, 1.0, 1.0)
    alarms = new_alarms(points, [], watch())
    record = HeldOutSliceRecord(corpus="h.jsonl", corpus_sha256="sha256:" + "0" * 64, example_indices=[0], tokens=8)
    rows = EvalCurve(watch=watch(), held_out=record, points=points, alarms=alarms).rows()
    assert [row["alarms"] for row in rows] == ["", "", "", "stalled"]


def tables_with_action_counts(counts: list[int]) -> CorpusTables:
    examples = []
    for i, count in enumerate(counts):
        ids = np.arange(1, count + 3, dtype=np.int32)
        actions = np.arange(2, count + 2, dtype=np.int32)
        examples.append(TrainingExample(
            index=i, line=i + 2, input_ids=ids, action_positions=actions, env_positions=np.zeros(0, dtype=np.int32),
            env_in_warning_prefix=np.zeros(0, dtype=bool), teacher_ids=np.tile(np.arange(16, dtype=np.int32), (count, 1)),
            teacher_logprobs=np.full((count, 16), -3.0, dtype=np.float32)))
    return CorpusTables.from_examples(examples, 16)


def test_the_slice_spreads_over_the_corpus_and_keeps_to_the_token_budget():
    tables = tables_with_action_counts([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    assert select_examples(tables, 4, 10_000) == [0, 2, 5, 7]  # i·10 // 4
    assert select_examples(tables, 4, 5 + 7 + 10) == [0, 2, 5]  # 12 more tokens would exceed 22
    assert select_examples(tables, 4, 1) == [0]  # the first example always stays
    assert select_examples(tables, 50, 10_000) == list(range(10))


@pytest.mark.parametrize("value, field", [
    ({"corpus": "h.jsonl", "every_steps": 0}, "eval.every_steps"),
    ({"corpus": "h.jsonl"}, "eval.every_steps"),
    ({"corpus": "h.jsonl", "every_steps": 5, "patience": 0}, "eval.patience"),
    ({"corpus": "h.jsonl", "every_steps": 5, "min_improvement": 1.0}, "eval.min_improvement"),
    ({"corpus": "h.jsonl", "every_steps": 5, "every": 5}, "eval.every"),
    ({"corpus": "h.jsonl", "every_steps": "5"}, "eval.every_steps"),
])
def test_bad_watch_settings_are_refused_naming_the_field(value, field):
    with pytest.raises(ConfigError) as refused:
        parse_eval_watch(value)
    assert refused.value.field == field and refused.value.message.startswith(f"invalid {field}")
