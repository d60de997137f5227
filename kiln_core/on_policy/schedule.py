"""The on-policy candidate schedule, rollout seeds and the ``rollout-sampling`` RNG stream.

Kiln (``crates/kiln-train/src/opd.rs`` · ``opd_train_to_with_checkpoint_root_and_runtime``,
``OpdCheckpointDescriptor::rng_states``):

* candidates per epoch = kept prompts × S, prompt-major then sample index, no shuffle; the cursor of
  a candidate is ``prepared_index · S + sample_index``;
* S is ``samples_per_prompt`` auto-scaled from the request's prompt count
  (``kiln_core.contracts.opd_config.effective_samples_per_prompt``);
* a candidate's seed is ``seed + global_step + source_index · 1,000,003 + sample_index · 1,000,033``
  in wrapping u64 arithmetic, where ``global_step`` counts committed optimizer steps so far and
  ``source_index`` counts dropped prompts; its i-th sampled token uses ``seed + i``;
* the checkpointed stream is ``{"algorithm": "kiln.opd-rollout-candidate.v1", "seed": <run seed>,
  "position": <consumed candidates>}``; empty rollouts and skipped prompts are consumed too, so the
  position and the step counter are separate numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kiln_core.on_policy.prepare import PreparedPrompts

__all__ = ["Candidate", "ROLLOUT_RNG_ALGORITHM", "ON_POLICY_DATA_SOURCE_KIND", "candidate_seed", "iter_candidates",
           "rollout_rng_state", "token_seed"]

ROLLOUT_RNG_ALGORITHM = "kiln.opd-rollout-candidate.v1"
ROLLOUT_RNG_STREAM = "rollout-sampling"
ON_POLICY_DATA_SOURCE_KIND = "inline-on-policy-opd-candidate-order-v1"
SOURCE_STRIDE = 1_000_003
SAMPLE_STRIDE = 1_000_033
_U64 = 2**64


def candidate_seed(seed: int, global_step: int, source_index: int, sample_index: int) -> int:
    """The rollout seed of one candidate (wrapping u64).

    Example:
        >>> candidate_seed(2**64 - 1, 1, 0, 0)
        0
        >>> candidate_seed(7, 3, 2, 1)
        3000049
    """
    return (seed + global_step + source_index * SOURCE_STRIDE + sample_index * SAMPLE_STRIDE) % _U64


def token_seed(candidate: int, token_index: int) -> int:
    """The seed of the ``token_index``-th sampled token: the candidate seed plus the index (wrapping)."""
    return (candidate + token_index) % _U64


@dataclass(frozen=True)
class Candidate:
    """One scheduled candidate.

    Attributes:
        epoch: 0-based epoch.
        cursor: Position inside the epoch (``prepared_index · S + sample_index``).
        prepared_index: Index among kept prompts.
        source_index: Index in the request's prompt list.
        sample_index: 0-based sample of this prompt.
        skipped: True when the prompt has no prompt/assistant split: consume without sampling.
    """

    epoch: int
    cursor: int
    prepared_index: int
    source_index: int
    sample_index: int
    skipped: bool

    def consumed_after(self, candidates_per_epoch: int) -> int:
        """The stream position once this candidate is consumed (``epoch · per_epoch + cursor + 1``)."""
        return self.epoch * candidates_per_epoch + self.cursor + 1


def iter_candidates(prepared: PreparedPrompts, samples_per_prompt: int, epochs: int, *,
                    start_epoch: int = 0, start_cursor: int = 0) -> Iterator[Candidate]:
    """Every candidate from ``(start_epoch, start_cursor)`` on, in Kiln's order.

    Example:
        >>> [(c.cursor, c.source_index) for c in iter_candidates(prepared, 2, 1)]  # doctest: +SKIP
        [(0, 0), (1, 0), (2, 3), (3, 3)]
    """
    if samples_per_prompt < 1 or epochs < 1:
        raise ValueError("samples_per_prompt and epochs must be at least 1")
    per_epoch = prepared.candidates_per_epoch(samples_per_prompt)
    if not (0 <= start_cursor < per_epoch) or not (0 <= start_epoch <= epochs):
        raise ValueError(f"start (epoch {start_epoch}, cursor {start_cursor}) is outside the schedule")
    for epoch in range(start_epoch, epochs):
        first = start_cursor if epoch == start_epoch else 0
        for cursor in range(first, per_epoch):
            prepared_index, sample_index = divmod(cursor, samples_per_prompt)
            prompt = prepared.prompts[prepared_index]
            yield Candidate(epoch, cursor, prepared_index, prompt.source_index, sample_index, prompt.skipped)


def rollout_rng_state(seed: int, consumed_candidates: int) -> dict[str, int | str]:
    """The checkpoint's ``rng_states["rollout-sampling"]`` entry (``state_file`` is absent).

    Example:
        >>> rollout_rng_state(7, 12)
        {'algorithm': 'kiln.opd-rollout-candidate.v1', 'seed': 7, 'position': 12}
    """
    return {"algorithm": ROLLOUT_RNG_ALGORITHM, "seed": int(seed), "position": int(consumed_candidates)}
