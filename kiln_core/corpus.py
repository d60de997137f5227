"""The admitted corpus as the trainer sees it: one ``TrainingExample`` per admitted example.

Admission (``kiln_core.admission``) produces these arrays and an ``AdmissionResult``,
materialization (``kiln_core.materialize``) stores them as Parquet and reads them back. The trainer
only ever sees this module's types, so it never depends on how the corpus was parsed or stored; and
both admission and materialization depend on this module, never on each other's internals.

ECHO's two counts, as Kiln defines them (trajectory_mask.rs, train_receipt.rs ``TokenCountReceipt``):

* **|O|** (``observation_tokens``): the token span width of every observation segment, before any
  warning trimming — the ECHO loss divides by it;
* **env tokens**: the env mask after Kiln's warning filter (``env_targets``) — what receipts report
  as ``env_tokens`` / ``env_tokens_after_warning_filter``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kiln_core.contracts.identity import TeacherIdentity


def env_targets_kept(env_in_warning_prefix: np.ndarray, *, warning_filter: bool = True, env_mask_mode: str = "env_only") -> np.ndarray:
    """Which observation tokens Kiln's env mask keeps under a mask config.

    Kiln trims the warning prefix only with ``warning_filter`` on *and* ``env_mask_mode`` ``env_only``;
    its defaults (used when ``echo`` is null) are exactly that.

    Example:
        >>> env_targets_kept(np.array([True, False])).tolist()
        [False, True]
        >>> env_targets_kept(np.array([True, False]), env_mask_mode="full_obs").tolist()
        [True, True]
    """
    if warning_filter and env_mask_mode == "env_only":
        return ~np.asarray(env_in_warning_prefix, dtype=bool)
    return np.ones(len(env_in_warning_prefix), dtype=bool)


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
        env_in_warning_prefix: ``bool [E]``; True where Kiln's warning filter leaves the token out of
            the env mask (it does not overlap the content after ``warning_prefix_len`` bytes).
        teacher_ids: ``int32 [A, K]`` the first K candidate ids of each teacher token, in file order.
        teacher_logprobs: ``float32 [A, K]`` their logprobs (f32-rounded as Kiln does).
        observation_tokens: ECHO's |O|: the observation segments' token span widths before warning
            trimming (Kiln's ``total_obs_len``). Defaults to ``len(env_positions)``.
    """

    index: int
    line: int
    input_ids: np.ndarray
    action_positions: np.ndarray
    env_positions: np.ndarray
    env_in_warning_prefix: np.ndarray
    teacher_ids: np.ndarray
    teacher_logprobs: np.ndarray
    observation_tokens: int = -1

    def __post_init__(self) -> None:
        if self.observation_tokens < 0:
            object.__setattr__(self, "observation_tokens", int(self.env_positions.shape[0]))

    def env_targets(self, *, warning_filter: bool = True, env_mask_mode: str = "env_only") -> np.ndarray:
        """The ECHO targets O' under a mask config (``echo`` null → Kiln's defaults, the arguments' defaults)."""
        keep = env_targets_kept(self.env_in_warning_prefix, warning_filter=warning_filter, env_mask_mode=env_mask_mode)
        return self.env_positions[keep]

    @property
    def context_tokens(self) -> int:
        """Tokens that are neither action targets nor active env targets under Kiln's default mask
        config (Kiln: seq_len − action − env after the warning filter)."""
        return int(self.input_ids.shape[0] - self.action_positions.shape[0] - self.env_targets().shape[0])

    def to_torch(self, device: Any = "cpu") -> dict[str, Any]:
        """The arrays as torch tensors (int64 ids/positions, float32 logprobs) on ``device``, and
        ``observation_tokens`` (|O|) as a plain int."""
        import torch

        return {
            "input_ids": torch.as_tensor(self.input_ids, dtype=torch.long, device=device),
            "action_positions": torch.as_tensor(self.action_positions, dtype=torch.long, device=device),
            "env_positions": torch.as_tensor(self.env_positions, dtype=torch.long, device=device),
            "env_in_warning_prefix": torch.as_tensor(self.env_in_warning_prefix, dtype=torch.bool, device=device),
            "teacher_ids": torch.as_tensor(self.teacher_ids, dtype=torch.long, device=device),
            "teacher_logprobs": torch.as_tensor(self.teacher_logprobs, dtype=torch.float32, device=device),
            "observation_tokens": self.observation_tokens,
        }


@dataclass(frozen=True)
class CorpusTables:
    """Flat, columnar form of an admitted corpus (what is written to and read from Parquet).

    Per-example arrays are concatenated; ``*_offsets`` (``int64 [N+1]``) delimit example i's slice as
    ``offsets[i]:offsets[i+1]``. Teacher arrays are ``[total_action_tokens, K]``.
    ``observation_tokens`` (``int64 [N]``) is ECHO's |O| per example; when not given it is the
    number of env positions of each example.
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
    observation_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.observation_tokens is None:
            object.__setattr__(self, "observation_tokens", np.diff(self.env_offsets).astype(np.int64))

    @property
    def num_examples(self) -> int:
        return int(self.lines.shape[0])

    def env_tokens(self, *, warning_filter: bool = True, env_mask_mode: str = "env_only") -> int:
        """Active env targets over the corpus under a mask config (Kiln's ``env_tokens``)."""
        keep = env_targets_kept(self.env_in_warning_prefix, warning_filter=warning_filter, env_mask_mode=env_mask_mode)
        return int(keep.sum())

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
            observation_tokens=int(self.observation_tokens[i]),
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
            observation_tokens=np.asarray([e.observation_tokens for e in examples], dtype=np.int64),
        )


@dataclass
class AdmissionResult:
    """An admitted corpus.

    Attributes:
        dataset_sha256: ``sha256:`` digest of the exact file bytes.
        source_uri: Where the corpus was read from.
        examples: Number of examples (the manifest does not count).
        action_tokens: Reverse-KL targets over all examples.
        env_tokens: ECHO env targets over all examples after Kiln's default warning filter (Kiln's
            ``env_tokens`` when ``echo`` is null).
        observation_tokens: ECHO's |O| over all examples (observation spans before trimming).
        effective_top_k: The resolved K (16 or 32).
        teacher_identity: The manifest's identity, or None for a corpus without a manifest.
        manifest_line: The exact manifest line, or None.
        materialized: URI of the committed materialization, or None when validating only.
        reused: True when an existing materialization was returned without redoing work.
        tables_loader: Loads the admitted tables (lazily from the materialization when reused).
        record: The ``admission.json`` contents when materialized.
        parser: ``fast``, ``exact`` or ``reused``.
    """

    dataset_sha256: str
    source_uri: str
    examples: int
    action_tokens: int
    env_tokens: int
    effective_top_k: int
    teacher_identity: TeacherIdentity | None
    manifest_line: str | None
    materialized: str | None
    reused: bool
    tables_loader: Callable[[], CorpusTables]
    record: Any = None
    parser: str = "exact"
    observation_tokens: int = 0

    @property
    def tables(self) -> CorpusTables:
        return self.tables_loader()

    def to_json(self) -> dict[str, Any]:
        """The CLI's ``admitted`` object."""
        return {
            "status": "admitted",
            "dataset_sha256": self.dataset_sha256,
            "examples": self.examples,
            "action_tokens": self.action_tokens,
            "env_tokens": self.env_tokens,
            "observation_tokens": self.observation_tokens,
            "effective_top_k": self.effective_top_k,
            "materialized": self.materialized,
        }
