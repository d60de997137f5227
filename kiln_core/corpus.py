"""The admitted corpus as the trainer sees it: one ``TrainingExample`` per admitted example.

Admission (``kiln_core.admission``) produces these arrays, materialization
(``kiln_core.materialize``) stores them as Parquet and reads them back. The trainer only ever sees
this module's types, so it never depends on how the corpus was parsed or stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np


@dataclass(frozen=True)
class TrainingExample:
    """One admitted example, in file order.

    Attributes:
        index: 0-based example index (manifest and blank lines not counted).
        line: 1-based physical line of the example in the source file.
        input_ids: ``int32 [L]`` token ids of the rendered conversation.
        action_positions: ``int32 [A]`` strictly increasing target positions q (all ≥ 1); target q is
            scored from logits row q − 1.
        env_positions: ``int32 [E]`` observation (ECHO) target positions, strictly increasing, ≥ 1,
            disjoint from ``action_positions``.
        env_in_warning_prefix: ``bool [E]``; True where the token lies entirely inside the segment's
            first ``warning_prefix_len`` bytes (left out of the ECHO loss when the warning filter is
            on, but still counted in |O|).
        teacher_ids: ``int32 [A, K]`` the first K candidate ids of each teacher token, in file order.
        teacher_logprobs: ``float32 [A, K]`` their logprobs (f32-rounded as Kiln does).
    """

    index: int
    line: int
    input_ids: np.ndarray
    action_positions: np.ndarray
    env_positions: np.ndarray
    env_in_warning_prefix: np.ndarray
    teacher_ids: np.ndarray
    teacher_logprobs: np.ndarray

    @property
    def context_tokens(self) -> int:
        """Tokens that are neither action nor observation targets (Kiln: seq_len − action − env)."""
        return int(self.input_ids.shape[0] - self.action_positions.shape[0] - self.env_positions.shape[0])

    def to_torch(self, device: Any = "cpu") -> dict[str, Any]:
        """The arrays as torch tensors (int64 ids/positions, float32 logprobs) on ``device``."""
        import torch

        return {
            "input_ids": torch.as_tensor(self.input_ids, dtype=torch.long, device=device),
            "action_positions": torch.as_tensor(self.action_positions, dtype=torch.long, device=device),
            "env_positions": torch.as_tensor(self.env_positions, dtype=torch.long, device=device),
            "env_in_warning_prefix": torch.as_tensor(self.env_in_warning_prefix, dtype=torch.bool, device=device),
            "teacher_ids": torch.as_tensor(self.teacher_ids, dtype=torch.long, device=device),
            "teacher_logprobs": torch.as_tensor(self.teacher_logprobs, dtype=torch.float32, device=device),
        }


@dataclass(frozen=True)
class CorpusTables:
    """Flat, columnar form of an admitted corpus (what is written to and read from Parquet).

    Per-example arrays are concatenated; ``*_offsets`` (``int64 [N+1]``) delimit example i's slice as
    ``offsets[i]:offsets[i+1]``. Teacher arrays are ``[total_action_tokens, K]``.
    """

    lines: np.ndarray
    input_ids: np.ndarray
    input_offsets: np.ndarray
    action_positions: np.ndarray
    action_offsets: np.ndarray
    env_positions: np.ndarray
    env_in_warning_prefix: np.ndarray
    env_offsets: np.ndarray
    teacher_ids: np.ndarray
    teacher_logprobs: np.ndarray
    kiln_prompts_sha256: str | None = None
    """Kiln's ``data.content_sha256`` of the corpus (raw hex of its prompt list, set at admission;
    ``kiln_core.kiln_prompts.kiln_prompts_sha256``); None for hand-built tables."""

    @property
    def num_examples(self) -> int:
        return int(self.lines.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.teacher_ids.shape[1])

    def example(self, i: int) -> TrainingExample:
        """Example ``i`` as a ``TrainingExample`` (views, no copies)."""
        a0, a1 = int(self.action_offsets[i]), int(self.action_offsets[i + 1])
        e0, e1 = int(self.env_offsets[i]), int(self.env_offsets[i + 1])
        return TrainingExample(
            index=i,
            line=int(self.lines[i]),
            input_ids=self.input_ids[int(self.input_offsets[i]) : int(self.input_offsets[i + 1])],
            action_positions=self.action_positions[a0:a1],
            env_positions=self.env_positions[e0:e1],
            env_in_warning_prefix=self.env_in_warning_prefix[e0:e1],
            teacher_ids=self.teacher_ids[a0:a1],
            teacher_logprobs=self.teacher_logprobs[a0:a1],
        )

    def __len__(self) -> int:
        return self.num_examples

    def __iter__(self) -> Iterator[TrainingExample]:
        return (self.example(i) for i in range(self.num_examples))

    @classmethod
    def from_examples(cls, examples: Sequence[TrainingExample], top_k: int) -> "CorpusTables":
        """Build flat tables from per-example arrays (tests and small synthetic corpora)."""

        def offsets(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)

        def cat(parts: list[np.ndarray], dtype: Any, shape_tail: tuple[int, ...] = ()) -> np.ndarray:
            if not parts:
                return np.zeros((0, *shape_tail), dtype=dtype)
            return np.concatenate(parts).astype(dtype, copy=False)

        return cls(
            lines=np.asarray([e.line for e in examples], dtype=np.int64),
            input_ids=cat([e.input_ids for e in examples], np.int32),
            input_offsets=offsets([e.input_ids for e in examples]),
            action_positions=cat([e.action_positions for e in examples], np.int32),
            action_offsets=offsets([e.action_positions for e in examples]),
            env_positions=cat([e.env_positions for e in examples], np.int32),
            env_in_warning_prefix=cat([e.env_in_warning_prefix for e in examples], np.bool_),
            env_offsets=offsets([e.env_positions for e in examples]),
            teacher_ids=cat([e.teacher_ids for e in examples], np.int32, (top_k,)).reshape(-1, top_k),
            teacher_logprobs=cat([e.teacher_logprobs for e in examples], np.float32, (top_k,)).reshape(-1, top_k),
        )
