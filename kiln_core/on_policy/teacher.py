"""Teacher scoring of rollouts: a local transformers teacher with Kiln's ``LiveLocalTeacher`` semantics.

Kiln (``crates/kiln-train/src/opd.rs`` · ``LiveLocalTeacher``, ``forward_topk_at_positions``,
``select_validated_topk_logprob_row``; ``crates/kiln-train/src/logit_source.rs`` ·
``validate_logit_request``, ``target_token_positions_to_logits_rows``, ``validate_topk_logprob_row``):

* the teacher needs a pinned identity whose ``vocab_size`` equals the model's logit width and whose
  ``max_top_k`` is at least K;
* one forward per candidate over the teacher's sequence (no cache, detached); target q is scored from
  row q − 1; targets are strictly increasing, ≥ 1 and inside the sequence; every input id is below
  the vocabulary size;
* each scored row is the full-vocabulary log-softmax in f32; any entry that is non-finite or > 0
  refuses the row; the row is sorted descending, ties broken by the lower id, and its first K kept;
* the returned rows pass Kiln's row check: K unique ids below the vocabulary, finite values ≤ 0,
  non-increasing, probability mass ≤ 1 + 32·f32::EPSILON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.errors import Rejection
from kiln_core.on_policy.prepare import CandidateSequences, check_target_pairs

__all__ = ["LiveLocalTeacher", "RolloutScorer", "TeacherRows", "TeacherSource", "check_teacher_rows"]

MASS_TOLERANCE = 32.0 * float(np.finfo(np.float32).eps)
LOG_SOFTMAX_CHUNK_ROWS = 256  # bounds the [rows, vocab] fp32 temporaries


@dataclass(frozen=True)
class TeacherRows:
    """The teacher's top-K for each target, in target order.

    Attributes:
        ids: ``int32 [A, K]`` candidate ids, rank order.
        logprobs: ``float32 [A, K]`` raw full-vocabulary logprobs.
    """

    ids: np.ndarray
    logprobs: np.ndarray


class RolloutScorer(Protocol):
    """What the trainer asks of a teacher: top-K rows at the targets of a sequence (``LiveLocalTeacher``)."""

    def score(self, tokens: Any, target_positions: Any, top_k: int | None = None) -> TeacherRows:
        ...


@dataclass(frozen=True)
class TeacherSource:
    """A pinned teacher the trainer loads once every refusal has passed.

    Attributes:
        alias: The request's ``teacher`` (Kiln's ``teacher_id`` in capabilities and receipts).
        identity: Its pinned ``kiln.teacher-identity.v1``: the plan needs only this.
        load: Called once with the effective top-K; returns the scorer.

    Example:
        >>> source = TeacherSource.local("tiny-teacher", identity, "./teacher")  # doctest: +SKIP
        >>> source.load(32).score(tokens, targets).ids.shape  # doctest: +SKIP
        (5, 32)
    """

    alias: str
    identity: TeacherIdentity
    load: Callable[[int], RolloutScorer]

    @classmethod
    def local(cls, alias: str, identity: TeacherIdentity, teacher_dir: str, *, device: str | None = None,
              dtype: str | None = None, adapter_dir: str | None = None) -> "TeacherSource":
        """A registered local teacher model (a LoRA teacher: the base in ``teacher_dir`` wearing the pinned
        adapter in ``adapter_dir``), loaded with ``LiveLocalTeacher.load`` when training starts."""
        return cls(alias, identity, lambda top_k: LiveLocalTeacher.load(
            teacher_dir, identity=identity, top_k=top_k, teacher_id=alias, device=device, dtype=dtype,
            adapter_dir=adapter_dir))

    @classmethod
    def loaded(cls, teacher: "LiveLocalTeacher", alias: str | None = None) -> "TeacherSource":
        """An already loaded teacher (self-distillation, tests); its identity must allow the run's top-K."""

        def use(top_k: int) -> LiveLocalTeacher:
            if teacher.identity.max_top_k < top_k:
                raise Rejection("top_k_exceeds_identity", f"live local teacher top_k {top_k} exceeds identity "
                                f"max_top_k {teacher.identity.max_top_k}", field="config.top_k")
            return teacher

        return cls(alias or teacher.teacher_id, teacher.identity, use)


class LiveLocalTeacher:
    """A loaded teacher model that scores any token sequence at the requested targets.

    Example:
        >>> teacher = LiveLocalTeacher.load("./teacher", identity=identity, top_k=16)  # doctest: +SKIP
        >>> rows = teacher.score(np.array([1, 5, 9, 4]), np.array([2, 3]))  # doctest: +SKIP
        >>> rows.ids.shape  # doctest: +SKIP
        (2, 16)
    """

    def __init__(self, model: Any, *, identity: TeacherIdentity, top_k: int, teacher_id: str = "teacher") -> None:
        self.model = model
        self.identity = identity
        self.teacher_id = teacher_id
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        if identity.vocab_size != self.vocab_size:
            raise Rejection("vocab_size_mismatch", f"live local teacher identity vocab_size {identity.vocab_size} "
                            f"does not match model vocab_size {self.vocab_size}", field="teacher")
        if identity.max_top_k < top_k:
            raise Rejection("top_k_exceeds_identity", f"live local teacher top_k {top_k} exceeds identity max_top_k "
                            f"{identity.max_top_k}", field="config.top_k")
        self.top_k = top_k

    @classmethod
    def load(cls, teacher_dir: str, *, identity: TeacherIdentity, top_k: int, teacher_id: str = "teacher",
             dtype: str | None = None, device: str | None = None,
             attn_implementation: str = "eager", adapter_dir: str | None = None) -> "LiveLocalTeacher":
        """Load the teacher's weights (call it after every cheap check has passed).

        ``adapter_dir``: a registered LoRA teacher's adapter, applied to the base in ``teacher_dir`` once its
        digests are checked against ``identity.adapter`` (``kiln_core.teachers.lora_teacher``).

        Raises:
            Rejection: ``teacher_invalid`` when the directory does not load as a causal LM,
                ``teacher_adapter_changed`` when the adapter is not the pinned one, or the identity checks
                of the constructor.
        """
        import torch
        from transformers import AutoModelForCausalLM

        from kiln_core.identity.model_files import check_model_files
        from kiln_core.scoring.local import default_device, default_dtype

        device = device or default_device()
        check_model_files(teacher_dir, role="teacher")  # a truncated shard: model_unreadable, naming the file
        try:
            model = AutoModelForCausalLM.from_pretrained(
                teacher_dir, dtype=getattr(torch, dtype or default_dtype(device)),
                attn_implementation=attn_implementation, local_files_only=True,
            )
        except (OSError, ValueError, KeyError) as error:
            raise Rejection("teacher_invalid", f"cannot load the teacher model in {teacher_dir}: {error}",
                            field="teacher") from None
        if adapter_dir is not None:
            from kiln_core.teachers.lora_teacher import load_pinned_adapter

            model = load_pinned_adapter(model, alias=teacher_id, identity=identity, adapter_dir=adapter_dir)
        model.eval()
        model.to(device)
        return cls(model, identity=identity, top_k=top_k, teacher_id=teacher_id)

    def score_candidate(self, sequences: CandidateSequences) -> TeacherRows:
        """Score one candidate's sampled tokens in the teacher's own sequence (after the pairing check)."""
        check_target_pairs(sequences)
        return self.score(sequences.teacher_ids, sequences.teacher_positions)

    def score(self, tokens: Any, target_positions: Any, top_k: int | None = None) -> TeacherRows:
        """Top-K teacher logprobs for the given target positions of ``tokens``.

        Raises:
            Rejection: ``invalid_rollout`` for a request Kiln's ``validate_logit_request`` refuses;
                ``teacher_output`` when the teacher's numbers break the row rules.
        """
        import torch

        k = self.top_k if top_k is None else top_k
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(target_positions, dtype=np.int64)
        self._check_request(tokens, positions, k)
        device = next(self.model.parameters()).device
        rows = torch.as_tensor(positions - 1, device=device)
        with torch.inference_mode():
            ids = torch.as_tensor(tokens, device=device)[None]
            logits = self._row_logits(ids, rows)
            top_ids, top_values = [], []
            for start in range(0, logits.shape[0], LOG_SOFTMAX_CHUNK_ROWS):
                block = torch.log_softmax(logits[start: start + LOG_SOFTMAX_CHUNK_ROWS].float(), dim=-1)
                self._check_full_rows(block, start)
                block_ids, block_values = _top_k_ranked(block, k)
                top_ids.append(block_ids.cpu())
                top_values.append(block_values.cpu())
        result = TeacherRows(ids=torch.cat(top_ids).numpy().astype(np.int32),
                             logprobs=torch.cat(top_values).numpy().astype(np.float32))
        check_teacher_rows(result, k, self.vocab_size, self.teacher_id)
        return result

    def _check_request(self, tokens: np.ndarray, positions: np.ndarray, k: int) -> None:
        if tokens.size == 0:
            raise Rejection("invalid_rollout", "tokens must not be empty")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise Rejection("invalid_rollout", f"token id {int(tokens.max())} is outside vocab_size {self.vocab_size}")
        cap = min(self.identity.max_top_k, self.vocab_size)
        if not 0 < k <= cap:
            raise Rejection("invalid_rollout", f"top_k {k} must be in 1..={cap}")
        if positions.size == 0:
            raise Rejection("invalid_rollout", "a rollout to score needs at least one target")
        if positions.min() < 1 or positions.max() >= tokens.shape[0] or np.any(np.diff(positions) <= 0):
            raise Rejection("invalid_rollout", "target positions must be strictly increasing and unique, at least 1 "
                            f"(position 0 has no preceding logits row) and below the token length {tokens.shape[0]}")

    def _row_logits(self, ids: Any, rows: Any) -> Any:
        """``[A, V]`` logits of the scored rows, projecting only those rows when the model allows it."""
        try:
            logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=rows).logits[0]
            if logits.shape[0] == rows.shape[0]:
                return logits
        except (TypeError, IndexError, ValueError):
            pass  # an architecture without tensor logits_to_keep: project every row instead
        return self.model(input_ids=ids, use_cache=False).logits[0, rows]

    def _check_full_rows(self, block: Any, first_row: int) -> None:
        import torch

        bad = ~torch.isfinite(block) | (block > 0)
        if bool(bad.any()):
            row, token = (int(v) for v in torch.nonzero(bad)[0])
            raise Rejection("teacher_output", f"teacher {self.teacher_id!r} row {first_row + row} token {token} has "
                            f"invalid logprob {float(block[row, token])!r}", field="teacher")


def _top_k_ranked(logprobs: Any, k: int) -> tuple[Any, Any]:
    from kiln_core.scoring.local import top_k_sorted  # descending, ties → lower id, exact at the K-th tie

    return top_k_sorted(logprobs, k)


def check_teacher_rows(rows: TeacherRows, top_k: int, vocab_size: int, teacher_id: str = "teacher") -> None:
    """Kiln's ``validate_topk_logprob_row`` over every row.

    Raises:
        Rejection: ``teacher_output`` naming the first broken row and rule.
    """
    ids, values = rows.ids, rows.logprobs
    if ids.ndim != 2 or ids.shape != values.shape or ids.shape[1] != top_k:
        raise Rejection("teacher_output", f"teacher {teacher_id!r} rows have shape {ids.shape}/{values.shape}, "
                        f"expected [targets, {top_k}]")
    problems = [
        ((ids < 0) | (ids >= vocab_size)).any(axis=1), "has a token id outside vocab_size",
        np.array([np.unique(row).size != top_k for row in ids], dtype=bool), "contains a duplicate token id",
        (~np.isfinite(values) | (values > 0)).any(axis=1), "has a non-finite or positive logprob",
        (np.diff(values, axis=1) > 0).any(axis=1), "logprobs are not non-increasing",
        np.exp(values.astype(np.float64)).sum(axis=1) > 1.0 + MASS_TOLERANCE, "sparse probability mass exceeds 1",
    ]
    for bad, rule in zip(problems[::2], problems[1::2]):
        if bad.any():
            raise Rejection("teacher_output", f"teacher {teacher_id!r} row {int(np.flatnonzero(bad)[0])} {rule}")
