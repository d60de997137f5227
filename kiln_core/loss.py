"""The student losses, memory-bounded: Kiln's top-K reverse KL, ECHO env cross-entropy, and the tail variant.

Every function here works on ONE sequence (Kiln: one sequence per optimizer step) and takes the
student's final normed hidden rows plus its ``LogitHead`` (``kiln_core.logit_head``: the LM head and the
model's own logit post-processing), never the logits. The reason is memory: at V = 248,320 a ``[T, V]``
fp32 logits tensor costs about 1 GiB per 1,000 rows, and autograd keeps one more of the same size for
its gradient. So:

* ``topk_reverse_kl`` (the default loss, Kiln's crates/kiln-opd-loss-kernel/src/lib.rs) computes
  the student logit only at the teacher's K ids, in row chunks, and recomputes the gathered head
  rows in backward instead of saving them. Peak extra memory is one ``[chunk_rows, K, H]`` chunk.
* ``echo_env_cross_entropy`` and ``topk_tail_reverse_kl`` need the full-vocabulary logsumexp; they
  compute it over ``[chunk_rows, chunk_vocab]`` tiles and recompute the tiles in backward.

All softmax/KL math runs in fp32 whatever the input dtype (Kiln scores in f32). Gradients come back
in the dtype of the corresponding input. The plain full-logits references these are checked against
live in ``tests/naive_losses.py``, written separately.
"""

from __future__ import annotations

import math

import torch

from kiln_core.logit_head import LogitHead

__all__ = [
    "topk_reverse_kl",
    "echo_env_cross_entropy",
    "topk_tail_reverse_kl",
    "compose_step_loss",
]


# ---------------------------------------------------------------------------------------------
# Building blocks


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(a))`` for ``a < 0``, stable at both ends (Mächler 2012).

    Each branch gets its input clamped into its own region so that the branch torch.where drops
    cannot produce inf/NaN gradients.
    """
    ln_half = -math.log(2.0)
    near_zero = torch.log(-torch.expm1(a.clamp_min(ln_half)))
    far = torch.log1p(-torch.exp(a.clamp_max(ln_half)))
    return torch.where(a > ln_half, near_zero, far)


def _renormalized_reverse_kl(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p̂ ‖ q̂) with both sides renormalized over the K ids: ``[T, K], [T, K] -> [T]``."""
    log_p = torch.log_softmax(student_logits.float(), dim=-1)  # s - logsumexp_S(s)
    log_q = torch.log_softmax(teacher_logprobs.float(), dim=-1)  # ℓ - logsumexp_S(ℓ)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _tail_reverse_kl(log_q_s, log_q_tail, teacher_logprobs, tail_floor) -> torch.Tensor:
    """Per-row (K+1)-bucket KL(q ‖ p): ``Σ_S q log(q/p) + q⊥ log(q⊥/p⊥)``, p = exp(raw ℓ)."""
    ell = teacher_logprobs.float()  # [T, K]
    cap = math.log1p(-tail_floor)  # log Σ p ≤ cap  <=>  p⊥ ≥ tail_floor
    log_p_tail = _log1mexp(torch.logsumexp(ell, dim=-1).clamp_max(cap))  # [T]
    head = (log_q_s.exp() * (log_q_s - ell)).sum(-1)
    return head + log_q_tail.exp() * (log_q_tail - log_p_tail)


def _check_rows(hidden, head, ids, chunk_rows, name="teacher_ids"):
    if hidden.dim() != 2 or head.weight.dim() != 2 or hidden.shape[1] != head.weight.shape[1]:
        raise ValueError(
            f"hidden must be [T, H] and the head's weight [V, H]; "
            f"got {tuple(hidden.shape)} and {tuple(head.weight.shape)}"
        )
    if ids.shape[0] != hidden.shape[0] or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name} must be int32/int64 with {hidden.shape[0]} rows; got {ids.dtype} {tuple(ids.shape)}"
        )
    if head.bias is not None and tuple(head.bias.shape) != (head.weight.shape[0],):
        raise ValueError(f"the head's bias must be [V={head.weight.shape[0]}]; got {tuple(head.bias.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")


def _check_topk(hidden, head, teacher_ids, teacher_logprobs, chunk_rows):
    _check_rows(hidden, head, teacher_ids, chunk_rows)
    if teacher_ids.dim() != 2 or teacher_logprobs.shape != teacher_ids.shape:
        raise ValueError(
            f"teacher_ids and teacher_logprobs must both be [T, K]; "
            f"got {tuple(teacher_ids.shape)} and {tuple(teacher_logprobs.shape)}"
        )
    if hidden.shape[0] == 0:
        raise ValueError("no action targets: the top-K loss is a mean over at least one target")


# ---------------------------------------------------------------------------------------------
# Public losses


def topk_reverse_kl(
    hidden: torch.Tensor,
    head: LogitHead,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """Kiln's default OPD loss: top-K reverse KL on the teacher's support, mean over targets.

    For each action target q, scored from student row t = q − 1, with S_t the teacher's K ids:
    ``s_v`` = the student's own logit of v (``head.gathered``: the LM head and the model's soft cap or scale) for
    v ∈ S_t only; ``log p̂ = s − logsumexp_S(s)``, ``log q̂ = ℓ − logsumexp_S(ℓ)``; ``KL_t = Σ_S p̂ (log p̂ − log q̂)``.
    No tail bucket, no temperature. ``[T, V]`` logits are never formed; extra memory is one ``[chunk_rows, K, H]``
    gather in forward and again in backward. ``grad_W`` is allocated only if ``head.weight.requires_grad``
    (a LoRA student's frozen head costs nothing).

    Args:
        hidden: final normed hidden rows already aligned to the targets, ``[T_a, H]`` (fp32/bf16).
        head: the student's ``LogitHead`` (``kiln_core.logit_head``).
        teacher_ids: the teacher's K token ids per target, ``[T_a, K]`` int32/int64, file order.
        teacher_logprobs: the teacher's raw full-vocabulary logprobs at those ids, ``[T_a, K]``.
        chunk_rows: targets processed per chunk; trades peak memory for kernel launches.

    Returns:
        Scalar fp32 tensor: mean of KL_t over the T_a targets.

    Raises:
        ValueError: on mismatched shapes, non-integer ids, or T_a == 0.

    Example:
        >>> h = torch.randn(5, 8, requires_grad=True); head = LogitHead(torch.randn(50, 8))
        >>> ids = torch.stack([torch.randperm(50)[:16] for _ in range(5)])
        >>> ell = torch.log_softmax(torch.randn(5, 16), -1).sort(-1, descending=True).values
        >>> topk_reverse_kl(h, head, ids, ell).backward()
    """
    _check_topk(hidden, head, teacher_ids, teacher_logprobs, chunk_rows)
    s = head.gathered(hidden, teacher_ids, chunk_rows=chunk_rows)  # [T, K]
    return _renormalized_reverse_kl(s, teacher_logprobs).mean()


def echo_env_cross_entropy(
    hidden_rows: torch.Tensor,
    head: LogitHead,
    target_ids: torch.Tensor,
    observation_count: int,
    *,
    chunk_rows: int = 1024,
    chunk_vocab: int = 8192,
) -> torch.Tensor:
    """ECHO env cross-entropy: ``(1/|O|) · Σ_{t∈O'} −log softmax_full(z_t)[x_t]``.

    The rows are the eligible observation rows O' (env mask after warning-prefix filtering), each
    already shifted to predict its target; ``observation_count`` is |O|, counted BEFORE filtering,
    so this is a sum over O' divided by |O|, not a mean over O' (Kiln echo.rs). The full-vocab
    logsumexp is computed over ``[chunk_rows, chunk_vocab]`` tiles, recomputed in backward, so no
    ``[rows, V]`` tensor exists; backward yields ``(1/|O|)·(softmax − onehot)`` per row.

    Args:
        hidden_rows: hidden rows for O', ``[R, H]``; R may be 0.
        head: the student's ``LogitHead``.
        target_ids: the observed next token per row, ``[R]`` int32/int64.
        observation_count: |O| ≥ R, and > 0 whenever R > 0.
        chunk_rows: rows per logit tile.
        chunk_vocab: vocabulary entries per logit tile.

    Returns:
        Scalar fp32 tensor. With R == 0 it is a zero still connected to ``hidden_rows``, so a
        composed loss can always call ``backward``.

    Raises:
        ValueError: on mismatched shapes or an ``observation_count`` smaller than R.

    Example:
        >>> h = torch.randn(3, 8, requires_grad=True); head = LogitHead(torch.randn(50, 8))
        >>> echo_env_cross_entropy(h, head, torch.tensor([4, 7, 9]), observation_count=5).backward()
    """
    if target_ids.dim() != 1:
        raise ValueError(f"target_ids must be [R]; got {tuple(target_ids.shape)}")
    _check_rows(hidden_rows, head, target_ids, chunk_rows, name="target_ids")
    n_rows = hidden_rows.shape[0]
    if observation_count < n_rows or (n_rows > 0 and observation_count <= 0):
        raise ValueError(
            f"observation_count (|O| = {observation_count}) must be >= the {n_rows} eligible rows"
        )
    if n_rows == 0:
        return hidden_rows.float().sum() * 0.0
    lse = head.logsumexp(hidden_rows, chunk_rows=chunk_rows, chunk_vocab=chunk_vocab)  # [R]
    target = head.gathered(hidden_rows, target_ids[:, None], chunk_rows=chunk_rows)
    return (lse - target[:, 0]).sum() / observation_count


def topk_tail_reverse_kl(
    hidden: torch.Tensor,
    head: LogitHead,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    chunk_rows: int = 1024,
    chunk_vocab: int = 8192,
    tail_floor: float = 1e-12,
) -> torch.Tensor:
    """Opt-in ``teacher_top_k_tail`` loss (docs/architecture.md, decision 4): (K+1)-bucket reverse KL.

    ``KL_t = Σ_{v∈S} q_v log(q_v/p_v) + q⊥ log(q⊥/p⊥)`` where q is the student's FULL-vocabulary
    softmax (``log q_v = s_v − LSE_full``), ``p_v = exp(ℓ_v)`` the raw teacher probabilities (not
    renormalized), ``p⊥ = 1 − Σ_S p`` and ``q⊥ = 1 − Σ_S q = 1 − exp(lse_S(s) − LSE_full)``, both
    computed with log1mexp and floored at ``tail_floor`` (so ``log 0`` never reaches the gradient).
    Not Kiln's objective: Kiln discards the tail (``crates/kiln-opd-loss-kernel/src/lib.rs``).

    Args:
        hidden, head, teacher_ids, teacher_logprobs: as in `topk_reverse_kl`.
        chunk_rows: rows per chunk (gather and full-vocab tiles).
        chunk_vocab: vocabulary entries per full-vocab tile.
        tail_floor: lower bound of both tail masses, in probability.

    Returns:
        Scalar fp32 tensor: mean of KL_t over the T_a targets.

    Example:
        >>> h = torch.randn(5, 8, requires_grad=True); head = LogitHead(torch.randn(50, 8))
        >>> ids = torch.stack([torch.randperm(50)[:16] for _ in range(5)])
        >>> ell = torch.log_softmax(torch.randn(5, 50), -1).topk(16).values
        >>> topk_tail_reverse_kl(h, head, ids, ell).backward()
    """
    _check_topk(hidden, head, teacher_ids, teacher_logprobs, chunk_rows)
    s = head.gathered(hidden, teacher_ids, chunk_rows=chunk_rows)  # [T, K]
    lse_full = head.logsumexp(hidden, chunk_rows=chunk_rows, chunk_vocab=chunk_vocab)  # [T]
    log_q_s = s - lse_full[:, None]  # student full-vocab log-probs at S
    log_mass_s = torch.logsumexp(s, dim=-1) - lse_full  # log Σ_S q ≤ 0
    log_q_tail = _log1mexp(log_mass_s.clamp_max(math.log1p(-tail_floor)))
    return _tail_reverse_kl(log_q_s, log_q_tail, teacher_logprobs, tail_floor).mean()


def compose_step_loss(
    kl_mean: torch.Tensor,
    env_ce: torch.Tensor | None = None,
    echo_lambda: float = 0.0,
    observation_count: int = 0,
) -> tuple[torch.Tensor, bool]:
    """The step loss ``kl_mean + λ·env_ce``, and whether the ECHO term counted.

    Kiln adds the ECHO term only when λ ≠ 0 and the sequence has observation tokens (|O| > 0;
    ``crates/kiln-opd-loss-kernel/src/lib.rs``). When it does not fire, the KL tensor is returned as is,
    so an off ECHO config changes neither the value nor the graph. A fired term whose O' was emptied by the warning
    filter adds ``λ·0`` (``echo_env_cross_entropy`` returns a connected zero).

    Args:
        kl_mean: scalar from `topk_reverse_kl` (or the tail variant).
        env_ce: scalar from `echo_env_cross_entropy`, or None when ECHO is not configured.
        echo_lambda: λ from ``config.echo.lambda``; 0.0 when ECHO is off.
        observation_count: |O|, the sequence's observation tokens before warning filtering.

    Returns:
        ``(loss, echo_fired)``.

    Raises:
        ValueError: if the term should fire but ``env_ce`` is None.

    Example:
        >>> compose_step_loss(torch.tensor(0.5), torch.tensor(2.0), 0.05, observation_count=3)
        (tensor(0.6000), True)
    """
    if echo_lambda == 0.0 or observation_count <= 0:
        return kl_mean, False
    if env_ce is None:
        raise ValueError("ECHO is on (lambda != 0, observation tokens exist) but env_ce was not computed")
    return kl_mean + echo_lambda * env_ce, True
