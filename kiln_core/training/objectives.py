"""The losses ``config.loss`` chooses, with one signature the trainer calls (``step_loss``).

Kiln's ``teacher_top_k`` (the default) and the tail variant live in ``loss.py``. This module adds
the opt-in *quality* losses (issue 14 item 5, ``bench/distill_quality.py``): Kiln's renormalized
top-K KL cannot see student mass outside the teacher's K ids, so the student never learns to put
its argmax where the teacher's is. These add full-vocabulary terms, with the same memory bound as
``loss.py`` (tiles of ``[chunk_rows, chunk_vocab]``, recomputed in backward; never ``[T, V]``).
"""

from __future__ import annotations

import torch

from kiln_core.logit_head import LogitHead
from kiln_core.loss import _check_topk, echo_env_cross_entropy, topk_reverse_kl, topk_tail_reverse_kl

__all__ = ["teacher_token_cross_entropy", "topk_forward_kl", "STEP_LOSSES", "step_loss"]


def teacher_token_cross_entropy(
    hidden: torch.Tensor,
    head: LogitHead,
    target_ids: torch.Tensor,
    *,
    chunk_rows: int = 1024,
    chunk_vocab: int = 8192,
) -> torch.Tensor:
    """``loss: "teacher_token_ce"`` (SFT): mean full-vocabulary cross-entropy of the corpus tokens.

    ``(1/T) Σ_t −log softmax_full(z_t)[x_t]`` where x_t is the corpus (teacher's) token of target t.
    It is `echo_env_cross_entropy` with |O| = T, so it shares that function's memory bound.

    Example:
        >>> h = torch.randn(3, 8, requires_grad=True); head = LogitHead(torch.randn(50, 8))
        >>> teacher_token_cross_entropy(h, head, torch.tensor([4, 7, 9])).backward()
    """
    if hidden.shape[0] == 0:
        raise ValueError("no action targets: the cross-entropy is a mean over at least one target")
    return echo_env_cross_entropy(hidden, head, target_ids, int(hidden.shape[0]), chunk_rows=chunk_rows,
                                  chunk_vocab=chunk_vocab)


def topk_forward_kl(
    hidden: torch.Tensor,
    head: LogitHead,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    chunk_rows: int = 1024,
    chunk_vocab: int = 8192,
) -> torch.Tensor:
    """``loss: "teacher_top_k_forward"``: forward KL from the teacher's top-K to the FULL student softmax.

    ``KL_t = Σ_{v∈S} p̂_v (log p̂_v − log q_v)`` with ``p̂ = softmax_S(ℓ)`` (the teacher renormalized
    over its K ids) and ``log q_v = s_v − LSE_full`` (the student's full-vocabulary log-probability).
    Its gradient is the soft-label cross-entropy's: it raises the student's mass on S, in the
    teacher's proportions, against every other token — the term Kiln's loss lacks. Always ≥ 0.

    Example:
        >>> h = torch.randn(5, 8, requires_grad=True); head = LogitHead(torch.randn(50, 8))
        >>> ids = torch.stack([torch.randperm(50)[:16] for _ in range(5)])
        >>> ell = torch.log_softmax(torch.randn(5, 50), -1).topk(16).values
        >>> topk_forward_kl(h, head, ids, ell).backward()
    """
    _check_topk(hidden, head, teacher_ids, teacher_logprobs, chunk_rows)
    s = head.gathered(hidden, teacher_ids, chunk_rows=chunk_rows)  # [T, K]
    lse_full = head.logsumexp(hidden, chunk_rows=chunk_rows, chunk_vocab=chunk_vocab)  # [T]
    log_p = torch.log_softmax(teacher_logprobs.float(), dim=-1)
    return (log_p.exp() * (log_p - (s - lse_full[:, None]))).sum(-1).mean()


# `config.loss` → the step's KL term. Every entry takes (hidden, head, teacher_ids, teacher_logprobs,
# *, target_ids); the target ids are the corpus tokens of the rows.
def _kiln(h, head, ids, lp, *, target_ids=None):
    return topk_reverse_kl(h, head, ids, lp)


def _tail(h, head, ids, lp, *, target_ids=None):
    return topk_tail_reverse_kl(h, head, ids, lp)


def _sft(h, head, ids, lp, *, target_ids=None):
    return teacher_token_cross_entropy(h, head, target_ids)


def _forward(h, head, ids, lp, *, target_ids=None):
    return topk_forward_kl(h, head, ids, lp)


def _tail_plus_forward(h, head, ids, lp, *, target_ids=None):
    return topk_tail_reverse_kl(h, head, ids, lp) + topk_forward_kl(h, head, ids, lp)


STEP_LOSSES = {
    "teacher_top_k": _kiln,  # Kiln's loss, the default
    "teacher_top_k_tail": _tail,
    "teacher_token_ce": _sft,
    "teacher_top_k_forward": _forward,
    "teacher_top_k_tail_forward": _tail_plus_forward,
}


def step_loss(name: str):
    """The KL term of ``config.loss`` ``name`` with the uniform signature the trainer calls.

    Raises:
        ValueError: a loss without a training implementation (``sampled_token``, ``full_vocab``).

    Example:
        >>> step_loss("teacher_top_k").__name__
        '_kiln'
    """
    try:
        return STEP_LOSSES[name]
    except KeyError:
        raise ValueError(f"loss {name!r} has no training implementation") from None
