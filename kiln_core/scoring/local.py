"""Scoring with a local Hugging Face teacher: transformers on this machine's CPU or GPU.

For each action target q of an example the teacher's distribution is read from logits row q − 1
(Kiln's crates/kiln-opd-loss-kernel/src/lib.rs): the full-vocabulary ``log_softmax`` of that row, computed in fp32
whatever the model dtype, gives the observed token's logprob and the top-K candidates (descending,
ties → lower id first). These are ``raw_logprobs``: no temperature, no renormalization.

Examples are batched with right padding and an attention mask. Causal attention means a real token
never attends to the padding after it, so a padded row equals the unpadded one up to floating-point
reduction order (tested). Only the rows that are targets are projected onto the vocabulary when the
model supports ``logits_to_keep`` masks, so memory is ``targets × vocab`` rather than
``batch × length × vocab``; fp32 ``log_softmax`` then runs in chunks of rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln_core.scoring.examples import ScoreRequest, ScoringError
from kiln_core.scoring.writer import ScoredRows

# Admission's sparse-mass bound (opd.rs): Σ exp(top-K logprobs) ≤ 1 + 32·f32::EPSILON, summed in f64.
MASS_TOLERANCE = 32.0 * float(np.finfo(np.float32).eps)
# Rows per fp32 log_softmax: bounds the [rows, vocab] fp32 temporaries (256 × 152k × 4 B ≈ 156 MB).
LOG_SOFTMAX_CHUNK_ROWS = 256
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    """fp32 on CPU (exact, and bf16 matmuls are slow there), bf16 on CUDA."""
    return "bfloat16" if device == "cuda" else "float32"


def top_k_sorted(logprobs: Any, k: int) -> tuple[Any, Any]:
    """Top-``k`` of each row in rank order: descending value, ties broken by the lower id.

    ``torch.topk`` does not order ties, and bf16 teachers produce many exact ties, so the order is
    made deterministic here: the K selected entries are sorted by id, then stably by value. A row
    whose K-th value is tied with entries outside the selection is redone exactly from all entries
    at or above that value.

    Args:
        logprobs: ``float32 [n, V]`` tensor.
        k: Candidates per row (≤ V).

    Returns:
        ``(ids int64 [n, k], values float32 [n, k])`` tensors.

    Example:
        >>> import torch
        >>> ids, values = top_k_sorted(torch.tensor([[0.0, 1.0, 1.0, -1.0]]), 2)
        >>> ids.tolist(), values.tolist()
        ([[1, 2]], [[1.0, 1.0]])
    """
    import torch

    values, ids = torch.topk(logprobs, k, dim=-1)
    by_id = torch.argsort(ids, dim=-1)
    ids, values = ids.gather(-1, by_id), values.gather(-1, by_id)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    kth = values[:, -1:]
    at_or_above = (logprobs >= kth).sum(dim=-1)
    for row in torch.nonzero(at_or_above > k).flatten().tolist():
        candidates = torch.nonzero(logprobs[row] >= kth[row]).flatten()  # ascending ids
        row_values, row_order = torch.sort(logprobs[row, candidates], descending=True, stable=True)
        ids[row] = candidates[row_order[:k]]
        values[row] = row_values[:k]
    return ids, values


def rows_from_logprobs(logprobs: Any, target_ids: Any, k: int) -> ScoredRows:
    """Target logprobs and ranked top-K of fp32 log-softmax rows, checked against admission's rules.

    Raises:
        ScoringError: ``teacher_output`` for non-finite values or a top-K mass above 1 + 32·eps.
    """
    top_ids, top_values = top_k_sorted(logprobs, k)
    target_values = logprobs.gather(-1, target_ids[:, None])[:, 0]
    rows = ScoredRows(
        target_ids=target_ids.cpu().numpy().astype(np.int64),
        target_logprobs=target_values.cpu().numpy().astype(np.float32),
        top_ids=top_ids.cpu().numpy().astype(np.int64),
        top_logprobs=top_values.cpu().numpy().astype(np.float32),
    )
    check_rows(rows)
    return rows


def check_rows(rows: ScoredRows) -> None:
    """The admission row rules a correct teacher always satisfies; a failure means broken numerics."""
    if not (np.isfinite(rows.top_logprobs).all() and np.isfinite(rows.target_logprobs).all()):
        raise ScoringError("teacher_output", "the teacher produced non-finite logprobs (NaN/inf logits?)")
    mass = np.exp(rows.top_logprobs.astype(np.float64)).sum(axis=-1)
    if mass.size and mass.max() > 1.0 + MASS_TOLERANCE:
        raise ScoringError(
            "teacher_output", f"top-K probability mass {mass.max():.9f} exceeds 1 + 32·eps; the logits are unusable"
        )


class LocalTeacher:
    """A loaded transformers causal LM that scores batches of ``ScoreRequest``.

    Example:
        >>> teacher = LocalTeacher.load("./teacher", vocab_size=400)  # doctest: +SKIP
        >>> rows = teacher.score([ScoreRequest(1, ids, positions)], top_k=16)  # doctest: +SKIP
    """

    def __init__(self, model: Any, device: str, vocab_size: int) -> None:
        self.model = model
        self.device = device
        self.vocab_size = vocab_size

    @classmethod
    def load(
        cls,
        teacher_dir: str,
        *,
        vocab_size: int,
        dtype: str | None = None,
        attn_implementation: str = "eager",
        device: str | None = None,
        adapter_dir: str | None = None,
        alias: str | None = None,
        identity: Any = None,
    ) -> "LocalTeacher":
        """Load the teacher's weights (the expensive step: call it after every cheap check).

        Args:
            teacher_dir: Model directory (or PEFT adapter directory, loaded through transformers).
            vocab_size: Expected logit width (the student's ``vocab_size``).
            dtype: ``float32`` / ``bfloat16`` / ``float16``; default fp32 on CPU, bf16 on CUDA.
            attn_implementation: ``eager`` or ``sdpa``.
            device: ``cpu`` or ``cuda``; default: CUDA when available.
            adapter_dir: A registered LoRA teacher's adapter: applied to the base in ``teacher_dir`` once its
                digests are checked against ``identity.adapter`` (``load_pinned_adapter``; needs ``alias`` and
                ``identity``).
            alias, identity: The registry alias and pinned ``TeacherIdentity`` of a LoRA teacher.

        Raises:
            ScoringError: ``teacher_invalid`` (does not load), ``teacher_adapter_changed`` (the adapter is not
                the pinned one).
        """
        import torch
        from transformers import AutoModelForCausalLM

        from kiln_core.identity.model_files import check_model_files

        device = device or default_device()
        dtype = dtype or default_dtype(device)
        check_model_files(teacher_dir, role="teacher")  # a truncated shard: model_unreadable, naming the file
        try:
            model = AutoModelForCausalLM.from_pretrained(
                teacher_dir,
                dtype=getattr(torch, _TORCH_DTYPES[dtype]),
                attn_implementation=attn_implementation,
                local_files_only=True,
            )
        except (OSError, ValueError, KeyError) as error:
            raise ScoringError("teacher_invalid", f"cannot load the teacher model in {teacher_dir}: {error}") from None
        if adapter_dir is not None:
            from kiln_core.teachers.lora_teacher import TeacherAdapterError, load_pinned_adapter

            try:
                model = load_pinned_adapter(model, alias=alias or teacher_dir, identity=identity, adapter_dir=adapter_dir)
            except TeacherAdapterError as error:
                raise ScoringError(error.code, error.message) from None
        model.eval()
        model.to(device)
        return cls(model, device, vocab_size)

    def score(self, requests: list[ScoreRequest], top_k: int) -> list[ScoredRows]:
        """Score a batch of examples in one padded forward pass.

        Returns:
            One ``ScoredRows`` per request, in order.
        """
        import torch

        lengths = [int(r.input_ids.shape[0]) for r in requests]
        width = max(lengths)
        ids = torch.zeros((len(requests), width), dtype=torch.long)  # pad id 0: masked, never read
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        keep = torch.zeros((len(requests), width), dtype=torch.bool)
        for b, request in enumerate(requests):
            ids[b, : lengths[b]] = torch.from_numpy(request.input_ids.astype(np.int64))
            mask[b, : lengths[b]] = 1
            keep[b, torch.from_numpy(request.positions.astype(np.int64) - 1)] = True  # row q-1 scores q
        with torch.inference_mode():
            logits = self._target_logits(ids.to(self.device), mask.to(self.device), keep.to(self.device))
            if logits.shape[-1] != self.vocab_size:
                raise ScoringError(
                    "teacher_mismatch",
                    f"the teacher's logits are {logits.shape[-1]} wide, the student's vocab_size is {self.vocab_size}",
                )
            # [N, V] rows in (example, position) order, the order of keep's True entries.
            targets = torch.cat([torch.from_numpy(r.input_ids[r.positions].astype(np.int64)) for r in requests])
            chunks = []
            for start in range(0, logits.shape[0], LOG_SOFTMAX_CHUNK_ROWS):
                block = torch.log_softmax(logits[start : start + LOG_SOFTMAX_CHUNK_ROWS].float(), dim=-1)
                chunk_targets = targets[start : start + LOG_SOFTMAX_CHUNK_ROWS].to(block.device)
                chunks.append(rows_from_logprobs(block, chunk_targets, top_k))
        return _split_rows(_concat_rows(chunks), [int(r.positions.shape[0]) for r in requests])

    def _target_logits(self, ids: Any, mask: Any, keep: Any) -> Any:
        """``[N, V]`` logits of the kept rows, projecting only those rows when the model allows it."""
        expected = int(keep.sum())
        try:
            logits = self.model(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False).logits
            if logits.dim() == 2 and logits.shape[0] == expected:
                return logits
        except (TypeError, IndexError, ValueError):
            pass  # an architecture without boolean logits_to_keep: project every row instead
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return logits[keep]


def _concat_rows(chunks: list[ScoredRows]) -> ScoredRows:
    return ScoredRows(
        target_ids=np.concatenate([c.target_ids for c in chunks]),
        target_logprobs=np.concatenate([c.target_logprobs for c in chunks]),
        top_ids=np.concatenate([c.top_ids for c in chunks]),
        top_logprobs=np.concatenate([c.top_logprobs for c in chunks]),
    )


def _split_rows(rows: ScoredRows, counts: list[int]) -> list[ScoredRows]:
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [
        ScoredRows(
            target_ids=rows.target_ids[a:b],
            target_logprobs=rows.target_logprobs[a:b],
            top_ids=rows.top_ids[a:b],
            top_logprobs=rows.top_logprobs[a:b],
        )
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
