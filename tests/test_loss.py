"""The memory-bounded losses against the naive full-logits references, and the references by hand.

Tolerances (fp32): loss values `rtol=1e-5`; gradients normwise relative error
``‖ours − ref‖ / ‖ref‖ ≤ 1e-5``. bf16 inputs are compared with the fp32 reference run on the same
(bf16-valued) inputs upcast to fp32: loss `rtol=1e-4`, gradients normwise `≤ 1e-2` (they come back
in bf16, whose unit roundoff is 2**-9 ≈ 2e-3).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kiln_core.logit_head import LogitHead
from kiln_core.loss import compose_step_loss, echo_env_cross_entropy, topk_reverse_kl, topk_tail_reverse_kl
from naive_losses import naive_echo_env_cross_entropy, naive_topk_reverse_kl, naive_topk_tail_reverse_kl

T, H, V = 37, 16, 211
RTOL = 1e-5


def make_inputs(k: int, *, seed: int = 0, bias: bool = False, train_head: bool = False, rows: int = T):
    """Random hidden/head plus a teacher top-K: unique ids per row, raw logprobs sorted descending."""
    torch.manual_seed(seed)
    hidden = torch.randn(rows, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.5).requires_grad_(train_head)
    head_bias = torch.randn(V, requires_grad=True) if bias else None
    teacher_logits = torch.randn(rows, V) * 2.0
    top = torch.log_softmax(teacher_logits, dim=-1)
    ids = torch.rand(rows, V).argsort(dim=-1)[:, :k]  # k distinct ids per row (without replacement)
    logprobs, order = top.gather(1, ids).sort(dim=-1, descending=True)
    return hidden, weight, ids.gather(1, order), logprobs, head_bias


def grads(loss, tensors):
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    return torch.autograd.grad(loss, wanted)


def assert_grads_close(ours, ref, tol=RTOL):
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert rel <= tol, f"normwise relative gradient error {rel:.2e} > {tol:.0e}"


def largest_tensor_seen(fn) -> int:
    """numel of the largest tensor any aten op receives during ``fn()`` (forward AND backward)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return max(math.prod(s) for e in prof.events() for s in e.input_shapes if s)


# --------------------------------------------------------------------------------------------
# The references, checked by hand on tiny cases


def tiny_case():
    """H=1, V=3, one target: student logits (0, ln 3, 0), teacher ids (0, 1) with p = (0.5, 0.25)."""
    hidden = torch.ones(1, 1, requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(3.0)], [0.0]])
    ids = torch.tensor([[0, 1]])
    logprobs = torch.log(torch.tensor([[0.5, 0.25]]))
    return hidden, weight, ids, logprobs


def test_topk_reverse_kl_by_hand():
    # Renormalized over S: student p̂ = (1/4, 3/4); teacher q̂ = (2/3, 1/3).
    expected = 0.25 * math.log(0.25 / (2 / 3)) + 0.75 * math.log(0.75 / (1 / 3))
    args = tiny_case()
    assert naive_topk_reverse_kl(*args).item() == pytest.approx(expected, rel=RTOL)
    hidden, weight, ids, logprobs = args
    assert topk_reverse_kl(hidden, LogitHead(weight), ids, logprobs).item() == pytest.approx(expected, rel=RTOL)


def test_tail_reverse_kl_by_hand():
    # Full softmax of (0, ln 3, 0): q = (0.2, 0.6) on S, q⊥ = 0.2; teacher p = (0.5, 0.25), p⊥ = 0.25.
    expected = 0.2 * math.log(0.2 / 0.5) + 0.6 * math.log(0.6 / 0.25) + 0.2 * math.log(0.2 / 0.25)
    args = tiny_case()
    assert naive_topk_tail_reverse_kl(*args).item() == pytest.approx(expected, rel=RTOL)
    hidden, weight, ids, logprobs = args
    assert topk_tail_reverse_kl(hidden, LogitHead(weight), ids, logprobs).item() == pytest.approx(expected, rel=RTOL)


def test_echo_by_hand():
    # Row 0 predicts id 1 with p = 0.6; |O| = 2 observation tokens, one filtered out by the warning.
    hidden, weight, _, _ = tiny_case()
    expected = -math.log(0.6) / 2
    assert naive_echo_env_cross_entropy(hidden, weight, torch.tensor([1]), 2).item() == pytest.approx(expected, rel=RTOL)
    assert echo_env_cross_entropy(hidden, LogitHead(weight), torch.tensor([1]), 2).item() == pytest.approx(expected, rel=RTOL)


# --------------------------------------------------------------------------------------------
# topk_reverse_kl vs naive


@pytest.mark.parametrize("k", [16, 32])
@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 1024])  # 8 does not divide T=37; 1024 > T
@pytest.mark.parametrize("train_head", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_topk_matches_naive(k, chunk_rows, train_head, bias):
    hidden, weight, ids, logprobs, head_bias = make_inputs(k, bias=bias, train_head=train_head)
    ours = topk_reverse_kl(hidden, LogitHead(weight, head_bias), ids, logprobs, chunk_rows=chunk_rows)
    ref = naive_topk_reverse_kl(hidden, weight, ids, logprobs, head_bias=head_bias)
    assert ours.item() > 0.1  # a real, non-trivial KL
    assert ours.item() == pytest.approx(ref.item(), rel=RTOL)
    inputs = (hidden, weight, head_bias)
    assert_grads_close(grads(ours, inputs), grads(ref, inputs))


def test_topk_accepts_int32_ids():
    hidden, weight, ids, logprobs, _ = make_inputs(16)
    a = topk_reverse_kl(hidden, LogitHead(weight), ids.int(), logprobs, chunk_rows=5)
    assert a.item() == pytest.approx(naive_topk_reverse_kl(hidden, weight, ids, logprobs).item(), rel=RTOL)


def test_topk_frozen_head_allocates_no_head_gradient():
    hidden, weight, ids, logprobs, _ = make_inputs(32)
    loss = topk_reverse_kl(hidden, LogitHead(weight), ids, logprobs, chunk_rows=8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    assert weight.grad is None and hidden.grad is not None
    names = {e.name for e in prof.events()}
    assert "aten::index_add_" not in names and "aten::zeros_like" not in names


@pytest.mark.parametrize("k", [16, 32])
def test_topk_never_sees_full_logits_or_full_gather(k):
    hidden, weight, ids, logprobs, _ = make_inputs(k)
    ours = largest_tensor_seen(lambda: topk_reverse_kl(hidden, LogitHead(weight), ids, logprobs, chunk_rows=8).backward())
    assert ours < min(T * V, T * k * H)  # W itself (V*H) is the biggest thing an op may touch
    # The probe can fail: the naive reference trips it.
    naive = largest_tensor_seen(lambda: naive_topk_reverse_kl(hidden, weight, ids, logprobs).backward())
    assert naive >= T * V


def test_topk_bf16_inputs_match_fp32_reference():
    hidden, weight, ids, logprobs, head_bias = make_inputs(32, bias=True, train_head=True)
    h16, w16, b16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight, head_bias))
    h32, w32, b32 = (t.detach().float().requires_grad_() for t in (h16, w16, b16))
    ours = topk_reverse_kl(h16, LogitHead(w16, b16), ids, logprobs, chunk_rows=10)
    ref = naive_topk_reverse_kl(h32, w32, ids, logprobs, head_bias=b32)
    assert ours.dtype == torch.float32
    assert ours.item() == pytest.approx(ref.item(), rel=1e-4)
    g16 = grads(ours, (h16, w16, b16))
    assert [g.dtype for g in g16] == [torch.bfloat16] * 3
    assert_grads_close(g16, grads(ref, (h32, w32, b32)), tol=1e-2)


@pytest.mark.parametrize("which", ["echo", "tail"])
def test_full_vocab_losses_bf16_inputs_match_fp32_reference(which):
    hidden, weight, ids, logprobs, head_bias = make_inputs(16, bias=True, train_head=True)
    h16, w16, b16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight, head_bias))
    h32, w32, b32 = (t.detach().float().requires_grad_() for t in (h16, w16, b16))
    if which == "echo":
        ours = echo_env_cross_entropy(h16, LogitHead(w16, b16), ids[:, 0], 40, chunk_rows=8, chunk_vocab=50)
        ref = naive_echo_env_cross_entropy(h32, w32, ids[:, 0], 40, head_bias=b32)
    else:
        ours = topk_tail_reverse_kl(h16, LogitHead(w16, b16), ids, logprobs, chunk_rows=8, chunk_vocab=50)
        ref = naive_topk_tail_reverse_kl(h32, w32, ids, logprobs, head_bias=b32)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-4)
    assert_grads_close(grads(ours, (h16, w16, b16)), grads(ref, (h32, w32, b32)), tol=1e-2)


def test_topk_is_zero_when_student_matches_teacher_on_support():
    hidden, weight, ids, _, _ = make_inputs(16)
    # Teacher = the student's own full-vocab log-softmax at S: equal after renormalization.
    logprobs = torch.log_softmax(hidden.detach() @ weight.T, dim=-1).gather(1, ids)
    loss = topk_reverse_kl(hidden, LogitHead(weight), ids, logprobs, chunk_rows=8)
    assert abs(loss.item()) < 1e-6
    (g,) = grads(loss, (hidden,))
    assert g.abs().max().item() < 1e-6


def test_topk_rejects_bad_shapes():
    hidden, weight, ids, logprobs, _ = make_inputs(16)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        topk_reverse_kl(hidden, LogitHead(weight), ids, logprobs[:, :8])
    with pytest.raises(ValueError, match="int32/int64"):
        topk_reverse_kl(hidden, LogitHead(weight), ids.float(), logprobs)
    with pytest.raises(ValueError, match="no action targets"):
        topk_reverse_kl(hidden[:0], LogitHead(weight), ids[:0], logprobs[:0])


# --------------------------------------------------------------------------------------------
# ECHO env cross-entropy vs naive


@pytest.mark.parametrize("train_head", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunks", [(7, 50), (20, 211), (1024, 8192)])  # 7 ∤ 20, 50 ∤ 211
def test_echo_matches_naive_with_warning_filter(train_head, bias, chunks):
    hidden, weight, ids, _, head_bias = make_inputs(16, bias=bias, train_head=train_head, rows=20)
    targets = ids[:, 0]
    observation_count = 27  # |O| before the warning filter > the 20 eligible rows
    ours = echo_env_cross_entropy(
        hidden, LogitHead(weight, head_bias), targets, observation_count, chunk_rows=chunks[0], chunk_vocab=chunks[1]
    )
    ref = naive_echo_env_cross_entropy(hidden, weight, targets, observation_count, head_bias=head_bias)
    mean_over_rows = naive_echo_env_cross_entropy(hidden, weight, targets, 20, head_bias=head_bias)
    assert ours.item() == pytest.approx(ref.item(), rel=RTOL)
    assert ours.item() == pytest.approx(mean_over_rows.item() * 20 / 27, rel=RTOL)  # sum/|O|, not mean over O'
    inputs = (hidden, weight, head_bias)
    assert_grads_close(grads(ours, inputs), grads(ref, inputs))


def test_echo_tiles_never_see_full_logits():
    hidden, weight, ids, _, _ = make_inputs(16, rows=20)
    args = (hidden, weight, ids[:, 0], 20)
    ours = largest_tensor_seen(lambda: echo_env_cross_entropy(hidden, LogitHead(weight), ids[:, 0], 20, chunk_rows=7,
                                                              chunk_vocab=50).backward())
    assert ours < 20 * V
    assert largest_tensor_seen(lambda: naive_echo_env_cross_entropy(*args).backward()) >= 20 * V


def test_echo_zero_rows_is_connected_zero():
    hidden, weight, _, _, _ = make_inputs(16, rows=0)
    loss = echo_env_cross_entropy(hidden, LogitHead(weight), torch.zeros(0, dtype=torch.long), observation_count=3)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert hidden.grad is not None and hidden.grad.shape == (0, H)


def test_echo_rejects_count_below_rows():
    hidden, weight, ids, _, _ = make_inputs(16, rows=4)
    with pytest.raises(ValueError, match="observation_count"):
        echo_env_cross_entropy(hidden, LogitHead(weight), ids[:, 0], observation_count=3)


# --------------------------------------------------------------------------------------------
# Tail variant vs naive


@pytest.mark.parametrize("k", [16, 32])
@pytest.mark.parametrize("train_head,bias,chunks", [(False, False, (8, 50)), (True, True, (37, 64)), (True, False, (1024, 8192))])
def test_tail_matches_naive(k, train_head, bias, chunks):
    hidden, weight, ids, logprobs, head_bias = make_inputs(k, bias=bias, train_head=train_head)
    ours = topk_tail_reverse_kl(
        hidden, LogitHead(weight, head_bias), ids, logprobs, chunk_rows=chunks[0], chunk_vocab=chunks[1]
    )
    ref = naive_topk_tail_reverse_kl(hidden, weight, ids, logprobs, head_bias=head_bias)
    assert ours.item() == pytest.approx(ref.item(), rel=RTOL)
    # Differs from the renormalized default: the tail bucket is really there.
    assert abs(ours.item() - naive_topk_reverse_kl(hidden, weight, ids, logprobs, head_bias=head_bias).item()) > 1e-2
    inputs = (hidden, weight, head_bias)
    assert_grads_close(grads(ours, inputs), grads(ref, inputs))


def test_tail_is_zero_when_student_matches_teacher_and_finite_when_support_is_everything():
    hidden, weight, ids, _, _ = make_inputs(16)
    logprobs = torch.log_softmax(hidden.detach() @ weight.T, dim=-1).gather(1, ids)
    loss = topk_tail_reverse_kl(hidden, LogitHead(weight), ids, logprobs, chunk_rows=8, chunk_vocab=50)
    assert abs(loss.item()) < 1e-6
    # S = the whole vocabulary: both tails are 0, floored; loss and gradients must stay finite.
    hidden2, weight2 = hidden[:2].detach().requires_grad_(), weight[:16]
    ids2 = torch.arange(16).expand(2, 16)
    teacher = torch.log_softmax(torch.randn(2, 16), dim=-1)
    loss2 = topk_tail_reverse_kl(hidden2, LogitHead(weight2), ids2, teacher)
    loss2.backward()
    assert torch.isfinite(loss2) and torch.isfinite(hidden2.grad).all()
    ref = naive_topk_reverse_kl(hidden2, weight2, ids2, teacher)  # no tail left: same as renormalized
    assert loss2.item() == pytest.approx(ref.item(), rel=1e-4, abs=1e-6)


# --------------------------------------------------------------------------------------------
# Step composition


def test_compose_step_loss():
    kl, env = torch.tensor(0.5), torch.tensor(2.0)
    loss, fired = compose_step_loss(kl, env, 0.05, observation_count=3)
    assert fired and loss.item() == pytest.approx(0.6)
    assert compose_step_loss(kl, env, 0.0, observation_count=3) == (kl, False)  # lambda 0
    assert compose_step_loss(kl, None, 0.05, observation_count=0) == (kl, False)  # no env tokens
    with pytest.raises(ValueError, match="env_ce"):
        compose_step_loss(kl, None, 0.05, observation_count=3)
