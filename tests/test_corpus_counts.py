"""ECHO's two counts as the trainer and receipts read them from an admitted corpus (kiln_core.corpus).

Kiln's |O| is the observation spans' width before warning trimming (trajectory_mask.rs
``total_obs_len``); its ``env_tokens`` is the env mask after the warning filter, which trims only
with ``warning_filter`` on and ``env_mask_mode: env_only`` — Kiln's defaults when ``echo`` is null.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln_core.admission import admit_corpus
from kiln_core.corpus import CorpusTables, TrainingExample
from kiln_core.synthetic import synthesize_corpus
from kiln_core.tokenization import load_student_tokenizer


@pytest.fixture(scope="module")
def admitted(tiny_student, tmp_path_factory):
    path = synthesize_corpus(tiny_student, tmp_path_factory.mktemp("counts") / "c.jsonl", n_examples=4, top_k=16, seed=4,
                             trajectory_every=2)
    return admit_corpus(str(path), str(tiny_student), top_k=16, student=load_student_tokenizer(tiny_student))


def test_admission_reports_kilns_env_tokens_and_observation_tokens(admitted):
    tables = admitted.tables
    warned = int(tables.env_in_warning_prefix.sum())
    assert warned > 0  # the synthetic observations start with a 9-byte "warning: " prefix
    assert admitted.env_tokens == tables.env_tokens() == len(tables.env_positions) - warned
    assert admitted.observation_tokens == int(tables.observation_tokens.sum()) == len(tables.env_positions)
    assert tables.env_tokens(warning_filter=False) == tables.env_tokens(env_mask_mode="full_obs") == len(tables.env_positions)


def test_each_example_carries_its_observation_tokens_and_echo_targets(admitted):
    tables = admitted.tables
    with_trajectory = [example for example in tables if example.env_positions.size]
    assert with_trajectory
    for example in with_trajectory:
        assert example.observation_tokens == example.env_positions.size
        kept = example.env_targets()
        np.testing.assert_array_equal(kept, example.env_positions[~example.env_in_warning_prefix])
        np.testing.assert_array_equal(example.env_targets(warning_filter=False), example.env_positions)
        assert example.context_tokens == example.input_ids.size - example.action_positions.size - kept.size
        assert example.to_torch()["observation_tokens"] == example.observation_tokens


def test_tables_built_by_hand_keep_or_default_observation_tokens():
    base = dict(index=0, line=1, input_ids=np.arange(8, dtype=np.int32), action_positions=np.array([6, 7], np.int32),
                env_positions=np.array([2, 3, 4], np.int32), env_in_warning_prefix=np.array([True, False, False]),
                teacher_ids=np.zeros((2, 1), np.int32), teacher_logprobs=np.zeros((2, 1), np.float32))
    assert TrainingExample(**base).observation_tokens == 3  # default: every observation token
    explicit = TrainingExample(**base, observation_tokens=4)  # a zero-width token inside the span counts in |O|
    tables = CorpusTables.from_examples([explicit, TrainingExample(**base)], top_k=1)
    assert tables.observation_tokens.tolist() == [4, 3]
    assert tables.example(0).observation_tokens == 4
    legacy = CorpusTables(**{name: getattr(tables, name) for name in CorpusTables.__dataclass_fields__ if name != "observation_tokens"})
    assert legacy.observation_tokens.tolist() == [3, 3]
