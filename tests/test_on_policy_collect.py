"""One candidate's rollout through the store: reuse what is committed, commit before anyone trains.

What a user depends on: a committed rollout comes back as stored without sampling or scoring again;
a stored rollout that belongs to another prompt is refused, never trained on; an empty rollout is
committed without asking the teacher; a teacher row that breaks Kiln's row rules commits nothing.
The teacher here is the real tiny teacher; the sampler is scripted, since only its tokens matter.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln_core.errors import Rejection
from kiln_core.on_policy.collect import RolloutCollector
from kiln_core.on_policy.prepare import PreparedPrompt
from kiln_core.on_policy.sampler import SamplingParams
from kiln_core.on_policy.schedule import Candidate
from kiln_core.on_policy.store import RolloutStore, rollout_run_key
from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherRows

PREFIX = np.array([1, 87, 34, 2], np.int32)
HINTED = np.array([1, 99, 98, 87, 34, 2], np.int32)
RUN = rollout_run_key({"test": "collect"})


class Scripted:
    """A sampler that returns the given tokens and counts its calls."""

    def __init__(self, tokens):
        self.tokens, self.calls = list(tokens), 0

    def sample(self, prompt_ids, *, params, max_tokens, eos_token_ids, seed):
        self.calls += 1
        return list(self.tokens)


class Counted:
    def __init__(self, scorer):
        self.scorer, self.calls = scorer, 0

    def score(self, tokens, target_positions, top_k=None):
        self.calls += 1
        return self.scorer.score(tokens, target_positions, top_k=top_k)


@pytest.fixture(scope="module")
def teacher(tiny_teacher) -> LiveLocalTeacher:
    from kiln_core.identity.local_teacher import local_teacher_identity

    identity = local_teacher_identity(str(tiny_teacher), max_top_k=32, device_kind="cpu")
    return LiveLocalTeacher.load(str(tiny_teacher), identity=identity, top_k=16, device="cpu")


def collector(tmp_path, backend, scorer) -> RolloutCollector:
    return RolloutCollector(RolloutStore(str(tmp_path / "rollouts")), RUN, backend, scorer,
                            params=SamplingParams.for_rollouts(temperature=1.0, top_p=0.9), max_tokens=8,
                            eos_token_ids=[0], top_k=16, vocab_size=400, metadata={"run": "test"})


def candidate(cursor: int = 0, sample: int = 0) -> Candidate:
    return Candidate(epoch=0, cursor=cursor, prepared_index=0, source_index=3, sample_index=sample, skipped=False)


def test_a_committed_rollout_is_reused_without_sampling_or_scoring(tmp_path, teacher):
    prompt = PreparedPrompt(3, PREFIX, PREFIX[2:], PREFIX, HINTED)
    first_sampler, first_teacher = Scripted([120, 208, 5]), Counted(teacher)
    made = collector(tmp_path, first_sampler, first_teacher).rollout(candidate(), prompt, global_step=4, seed=77)
    assert (first_sampler.calls, first_teacher.calls) == (1, 1)
    rows = teacher.score(np.concatenate([HINTED, [120, 208, 5]]), np.array([6, 7, 8]), top_k=16)
    np.testing.assert_array_equal(made.teacher_ids, rows.ids)  # scored in the teacher's own (hinted) prompt
    retry_sampler, retry_teacher = Scripted([9, 9, 9]), Counted(teacher)
    retry = collector(tmp_path, retry_sampler, retry_teacher)
    again = retry.rollout(candidate(), prompt, global_step=4, seed=77)
    assert (retry_sampler.calls, retry_teacher.calls, retry.counters.reused, retry.counters.sampled) == (0, 0, 1, 0)
    assert again.sampled_ids.tolist() == [120, 208, 5] and again.metadata == {"run": "test"}
    np.testing.assert_array_equal(again.teacher_logprobs, made.teacher_logprobs)
    # another step or seed is another candidate: sampled afresh
    collector(tmp_path, retry_sampler, retry_teacher).rollout(candidate(), prompt, global_step=5, seed=78)
    assert retry_sampler.calls == 1


def test_a_stored_rollout_of_another_prompt_is_refused(tmp_path, teacher):
    prompt = PreparedPrompt(3, PREFIX, PREFIX[2:], PREFIX, None)
    collector(tmp_path, Scripted([120, 208]), teacher).rollout(candidate(), prompt, global_step=0, seed=5)
    other = PreparedPrompt(3, np.array([1, 75, 2], np.int32), PREFIX[2:], np.array([1, 75, 2], np.int32), None)
    with pytest.raises(Rejection) as caught:
        collector(tmp_path, Scripted([1]), teacher).rollout(candidate(), other, global_step=0, seed=5)
    assert caught.value.code == "corrupt_rollout"


def test_an_empty_rollout_is_committed_without_asking_the_teacher(tmp_path, teacher):
    prompt = PreparedPrompt(3, PREFIX, PREFIX[2:], PREFIX, None)
    counted = Counted(teacher)
    empty = collector(tmp_path, Scripted([]), counted).rollout(candidate(1, 1), prompt, global_step=2, seed=9)
    assert empty.empty and counted.calls == 0 and empty.teacher_ids.shape == (0, 16)
    reused = collector(tmp_path, Scripted([4]), counted).rollout(candidate(1, 1), prompt, global_step=2, seed=9)
    assert reused.empty


def test_teacher_rows_that_break_kilns_rules_commit_nothing(tmp_path):
    class Duplicates:
        def score(self, tokens, target_positions, top_k=None):
            n = len(target_positions)
            return TeacherRows(np.zeros((n, 16), np.int32), np.full((n, 16), -3.0, np.float32))

    prompt = PreparedPrompt(3, PREFIX, PREFIX[2:], PREFIX, None)
    with pytest.raises(Rejection) as caught:
        collector(tmp_path, Scripted([120]), Duplicates()).rollout(candidate(), prompt, global_step=0, seed=1)
    assert caught.value.code == "teacher_output" and "duplicate" in caught.value.message
    assert RolloutStore(str(tmp_path / "rollouts")).audit(RUN) == []
