"""Plain references for the training losses, written from the definitions, not from ``kiln_core``.

Each one materializes the full ``[T, V]`` logits (so it is only usable at test sizes), turns them
into probabilities with an explicit max-shifted ``exp`` and division, and writes the divergence as
the sum in its definition. Everything runs in fp32 and stays differentiable, so tests compare both
values and gradients.
"""

from __future__ import annotations

import torch


def full_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = hidden.float() @ weight.float().t()  # [T, V]
    return logits if bias is None else logits + bias.float()


def normalize(scores: torch.Tensor) -> torch.Tensor:
    """Rows of ``exp(scores)`` divided by their sum."""
    weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    return weights / weights.sum(dim=-1, keepdim=True)


def naive_topk_reverse_kl(hidden, head_weight, teacher_ids, teacher_logprobs, *, head_bias=None):
    """mean over rows of KL(p̂ ‖ q̂): both distributions restricted to the teacher's K ids and renormalized."""
    student = normalize(full_logits(hidden, head_weight, head_bias).gather(1, teacher_ids.long()))  # [T, K]
    teacher = torch.exp(teacher_logprobs.float())
    teacher = teacher / teacher.sum(dim=-1, keepdim=True)
    return (student * (torch.log(student) - torch.log(teacher))).sum(dim=-1).mean()


def naive_echo_env_cross_entropy(hidden_rows, head_weight, target_ids, observation_count, *, head_bias=None):
    """(1/|O|) · Σ over rows of −log softmax(logits)[target]."""
    probabilities = normalize(full_logits(hidden_rows, head_weight, head_bias))  # [R, V]
    picked = probabilities.gather(1, target_ids.long()[:, None])[:, 0]
    return -torch.log(picked).sum() / observation_count


def naive_topk_tail_reverse_kl(hidden, head_weight, teacher_ids, teacher_logprobs, *, head_bias=None, tail_floor=1e-12):
    """mean over rows of Σ_S q log(q/p) + q⊥ log(q⊥/p⊥); q the student's full softmax, p = exp(raw logprobs),
    the tails 1 − (mass on S), each at least ``tail_floor``."""
    q_full = normalize(full_logits(hidden, head_weight, head_bias))
    q = q_full.gather(1, teacher_ids.long())  # [T, K]
    p = torch.exp(teacher_logprobs.float())
    q_tail = torch.clamp(1.0 - q.sum(dim=-1), min=tail_floor)
    p_tail = torch.clamp(1.0 - p.sum(dim=-1), min=tail_floor)
    support = (q * (torch.log(q) - torch.log(p))).sum(dim=-1)
    return (support + q_tail * (torch.log(q_tail) - torch.log(p_tail))).mean()


def reverse_kl_from_logits(logits, teacher_ids, teacher_logprobs):
    """Kiln's top-K reverse KL of whole logit rows ``[T, V]`` (e.g. transformers' own ``model(...).logits``):
    mean over rows of KL(p̂ ‖ q̂), both restricted to the teacher's K ids and renormalized."""
    student = normalize(logits.float().gather(1, teacher_ids.long()))
    teacher = normalize(teacher_logprobs.float())
    return (student * (torch.log(student) - torch.log(teacher))).sum(dim=-1).mean()


def softcapped_scaled_logits(hidden, weight, bias=None, *, scale=1.0, softcap=None):
    """``cap · tanh(scale · (hidden · Wᵀ + b) / cap)`` written out: Cohere's and Granite's scale, Gemma's soft cap."""
    logits = full_logits(hidden, weight, bias) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits
