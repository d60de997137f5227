"""One candidate's rollout: read back from the rollout store, or sampled, scored and committed first.

This is the per-candidate work of on-policy training before the loss (``opd.rs`` ·
``opd_train_to_with_checkpoint_root_and_runtime``: the student samples after the rollout prefix with
the candidate's seed; the teacher scores every sampled token in its own sequence, ``teacher_extra_messages``
included, with one top-K query). What is new here is the store in between:

1. the candidate's key (run, epoch, cursor, step, seed) is looked up; a committed rollout is returned
   as stored — never re-sampled, never re-scored — after checking that it belongs to this prompt;
2. otherwise the student samples, the teacher scores (an empty rollout is not scored), the rows are
   checked with Kiln's row rules, and the rollout is committed before anyone trains on it;
3. what comes back is always the stored copy (``RolloutStore.put`` reads it back), so a run that
   sampled a candidate and a retry that reuses it train on the very same numbers.

``RolloutCounters`` keep what the progress display needs: rollouts sampled or reused, tokens sampled,
teacher tokens scored, and the time spent sampling and scoring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from kiln_core.errors import Rejection
from kiln_core.on_policy.prepare import PreparedPrompt, candidate_sequences, check_target_pairs
from kiln_core.on_policy.sampler import RolloutBackend, SamplingParams
from kiln_core.on_policy.schedule import Candidate
from kiln_core.on_policy.store import Rollout, RolloutKey, RolloutStore
from kiln_core.on_policy.teacher import RolloutScorer, TeacherRows, check_teacher_rows

__all__ = ["RolloutCollector", "RolloutCounters"]


@dataclass
class RolloutCounters:
    """This process's rollout work so far (a resumed run starts again from zero)."""

    sampled: int = 0
    """Rollouts sampled (and scored, when not empty) by this process."""
    reused: int = 0
    """Rollouts read back from the store, committed by an earlier attempt."""
    sampled_tokens: int = 0
    """Tokens this process sampled (EOS excluded)."""
    teacher_tokens_scored: int = 0
    """Targets the teacher scored for this process."""
    sampling_s: float = 0.0
    scoring_s: float = 0.0


class RolloutCollector:
    """Rollouts of one run's candidates, through its rollout store.

    Args:
        store: Where rollouts are committed.
        run_key: The run's key in the store (``rollout_run_key``).
        backend: The student's sampler (its current LoRA weights).
        scorer: The teacher.
        params: Sampling parameters (``SamplingParams.for_rollouts``).
        max_tokens: Most new tokens per rollout.
        eos_token_ids: Ids that end a rollout.
        top_k: Effective top-K of the teacher's rows.
        vocab_size: The teacher's vocabulary (row ids must lie below it).
        teacher_id: Named in row errors.
        metadata: Audit fields stored with every rollout this collector commits.

    Example:
        >>> collector = RolloutCollector(store, run_key, backend, teacher, params=params, max_tokens=64,
        ...                              eos_token_ids=[2], top_k=32, vocab_size=400)  # doctest: +SKIP
        >>> collector.rollout(candidate, prompt, global_step=0, seed=7).sampled_ids  # doctest: +SKIP
        array([17,  4, 88], dtype=int32)
    """

    def __init__(self, store: RolloutStore, run_key: str, backend: RolloutBackend, scorer: RolloutScorer, *,
                 params: SamplingParams, max_tokens: int, eos_token_ids: tuple[int, ...] | list[int], top_k: int,
                 vocab_size: int, teacher_id: str = "teacher", metadata: Mapping[str, Any] | None = None) -> None:
        self.store, self.run_key, self.backend, self.scorer = store, run_key, backend, scorer
        self.params, self.max_tokens, self.eos_token_ids = params, max_tokens, tuple(int(i) for i in eos_token_ids)
        self.top_k, self.vocab_size, self.teacher_id = top_k, vocab_size, teacher_id
        self.metadata = dict(metadata or {})
        self.counters = RolloutCounters()

    def rollout(self, candidate: Candidate, prompt: PreparedPrompt, *, global_step: int, seed: int) -> Rollout:
        """The committed rollout of ``candidate`` sampled at ``global_step`` with ``seed``.

        Raises:
            Rejection: ``corrupt_rollout`` when the stored rollout does not belong to this prompt;
                the teacher's row and pairing rules.
            EnvironmentFailure: ``storage_unavailable``.
        """
        if prompt.rollout_prefix is None:
            raise ValueError(f"prompt {prompt.source_index} has no prompt/assistant split; its candidates are skipped")
        key = RolloutKey(self.run_key, candidate.epoch, candidate.cursor, global_step, seed)
        stored = self.store.get(key)
        if stored is not None:
            _check_belongs(stored, candidate, prompt, self.top_k, self.store.location(key).uri)
            self.counters.reused += 1
            return stored
        started = time.perf_counter()
        sync_weights = getattr(self.backend, "sync_weights", None)
        if sync_weights is not None:  # a backend serving a copy of the weights (vLLM) catches up first
            sync_weights(global_step)
        sampled = self.backend.sample(prompt.rollout_prefix.tolist(), params=self.params, max_tokens=self.max_tokens,
                                      eos_token_ids=self.eos_token_ids, seed=seed)
        scored = time.perf_counter()
        rows = self._score(prompt, sampled)
        self.counters.sampling_s += scored - started
        self.counters.scoring_s += time.perf_counter() - scored
        self.counters.sampled += 1
        self.counters.sampled_tokens += len(sampled)
        self.counters.teacher_tokens_scored += int(rows.ids.shape[0])
        return self.store.put(Rollout(
            key=key, source_index=prompt.source_index, sample_index=candidate.sample_index,
            rollout_prefix=prompt.rollout_prefix, sampled_ids=np.asarray(sampled, dtype=np.int32),
            teacher_prefix=prompt.teacher_prefix, teacher_ids=rows.ids, teacher_logprobs=rows.logprobs,
            metadata=self.metadata))

    def _score(self, prompt: PreparedPrompt, sampled: list[int]) -> TeacherRows:
        if not sampled:  # consumed without an update: nothing to score
            return TeacherRows(np.zeros((0, self.top_k), np.int32), np.zeros((0, self.top_k), np.float32))
        sequences = candidate_sequences(prompt, sampled)
        check_target_pairs(sequences)
        rows = self.scorer.score(sequences.teacher_ids, sequences.teacher_positions, top_k=self.top_k)
        check_teacher_rows(rows, self.top_k, self.vocab_size, self.teacher_id)
        return rows


def _check_belongs(stored: Rollout, candidate: Candidate, prompt: PreparedPrompt, top_k: int, where: str) -> None:
    """A stored rollout is reused only for the prompt, sample and top-K it was made for."""
    same_teacher_prefix = (stored.teacher_prefix is None) == (prompt.teacher_prefix is None) and (
        prompt.teacher_prefix is None or np.array_equal(stored.teacher_prefix, prompt.teacher_prefix))
    if (stored.source_index, stored.sample_index) != (prompt.source_index, candidate.sample_index) \
            or not np.array_equal(stored.rollout_prefix, prompt.rollout_prefix) or not same_teacher_prefix \
            or (not stored.empty and stored.top_k != top_k):
        raise Rejection("corrupt_rollout", f"rollout {where} is stored under candidate (epoch {candidate.epoch}, "
                        f"cursor {candidate.cursor}) but holds another prompt, sample or top-K", file=where)
