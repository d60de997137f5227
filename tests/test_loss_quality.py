"""The opt-in quality losses against naive float64 references written here (full ``[T, V]`` logits).

Tolerance: 1e-5 absolute on values and 1e-5 on gradients (fp32 chunked kernels vs float64 autograd).
"""

from __future__ import annotations

import pytest
import torch

from kiln_core import loss as L
from kiln_core.logit_head import LogitHead
from kiln_core.training import objectives as O
from naive_losses import naive_topk_tail_reverse_kl
from plan_support import train_plan

TOL = 1e-5


def problem(seed=0, rows=7, vocab=300, hidden=16, k=16, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    b = torch.randn(vocab, generator=g) * 0.1 if bias else None
    teacher = torch.log_softmax(torch.randn(rows, vocab, generator=g) * 2, -1)
    ell, ids = teacher.topk(k, -1)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return h, w, b, ids, ell, targets


def naive_full_logprobs(h, w, b):
    z = h.double() @ w.double().T + (0 if b is None else b.double())
    return torch.log_softmax(z, -1)


def naive_ce(h, w, b, targets):
    return -naive_full_logprobs(h, w, b).gather(1, targets[:, None]).mean()


def naive_forward_kl(h, w, b, ids, ell):
    log_q = naive_full_logprobs(h, w, b).gather(1, ids)
    p = torch.softmax(ell.double(), -1)
    return (p * (p.log() - log_q)).sum(-1).mean()


@pytest.mark.parametrize("bias", [False, True])
def test_teacher_token_cross_entropy_matches_naive(bias):
    h, w, b, ids, ell, targets = problem(bias=bias)
    h1 = h.clone().requires_grad_(True)
    value = O.teacher_token_cross_entropy(h1, LogitHead(w, b), targets, chunk_rows=3, chunk_vocab=64)
    value.backward()
    h2 = h.double().clone().requires_grad_(True)
    reference = naive_ce(h2, w, b, targets)
    reference.backward()
    assert abs(float(value) - float(reference)) < TOL
    assert torch.allclose(h1.grad.double(), h2.grad, atol=TOL)


@pytest.mark.parametrize("bias", [False, True])
def test_topk_forward_kl_matches_naive(bias):
    h, w, b, ids, ell, _ = problem(seed=1, bias=bias)
    h1 = h.clone().requires_grad_(True)
    value = O.topk_forward_kl(h1, LogitHead(w, b), ids, ell, chunk_rows=2, chunk_vocab=50)
    value.backward()
    h2 = h.double().clone().requires_grad_(True)
    reference = naive_forward_kl(h2, w, b, ids, ell)
    reference.backward()
    assert float(value) >= 0
    assert abs(float(value) - float(reference)) < TOL
    assert torch.allclose(h1.grad.double(), h2.grad, atol=TOL)


def test_forward_kl_is_zero_only_when_the_student_matches_the_renormalized_teacher():
    """A student whose full softmax IS the teacher's top-K renormalized (no mass elsewhere) scores 0."""
    vocab, k = 40, 16
    ell, ids = torch.log_softmax(torch.randn(1, vocab), -1).topk(k, -1)
    w = torch.eye(vocab)  # hidden = logits directly
    h = torch.full((1, vocab), -1e4)
    h[0, ids[0]] = torch.log_softmax(ell[0], -1)
    assert float(O.topk_forward_kl(h, LogitHead(w), ids, ell)) < 1e-5
    h2 = h.clone()
    outside = next(v for v in range(vocab) if v not in ids[0].tolist())
    h2[0, outside] = 0.0  # some student mass outside the teacher's K ids (0 or 1 may both be among them)
    assert float(O.topk_forward_kl(h2, LogitHead(w), ids, ell)) > 1e-3
    # Kiln's renormalized reverse KL cannot see that mass: it stays ~0.
    assert float(L.topk_reverse_kl(h2, LogitHead(w), ids, ell)) < 1e-5


def test_step_loss_registry_names_every_trainable_loss():
    h, w, b, ids, ell, targets = problem(seed=2)
    assert set(O.STEP_LOSSES) == {"teacher_top_k", "teacher_top_k_tail", "teacher_token_ce", "teacher_top_k_forward",
                                  "teacher_top_k_tail_forward"}
    assert float(O.step_loss("teacher_top_k")(h, LogitHead(w), ids, ell, target_ids=targets)) == pytest.approx(float(L.topk_reverse_kl(h, LogitHead(w), ids, ell)))
    assert float(O.step_loss("teacher_token_ce")(h, LogitHead(w), ids, ell, target_ids=targets)) == pytest.approx(float(naive_ce(h, w, None, targets)), abs=TOL)
    both = O.step_loss("teacher_top_k_tail_forward")(h, LogitHead(w), ids, ell, target_ids=targets)
    assert float(both) == pytest.approx(float(L.topk_tail_reverse_kl(h, LogitHead(w), ids, ell)) + float(naive_forward_kl(h, w, None, ids, ell)), abs=1e-4)
    for unavailable in ("sampled_token", "full_vocab"):
        with pytest.raises(ValueError):
            O.step_loss(unavailable)


@pytest.mark.parametrize("loss", ["teacher_token_ce", "teacher_top_k_forward", "teacher_top_k_tail_forward"])
def test_the_trainer_trains_each_quality_loss_on_the_right_targets(tiny_student, tmp_path, loss):
    """Step 1's loss is the base student's loss on example 0 (LoRA B starts at 0), computed naively."""
    import json

    import numpy as np
    from transformers import AutoModelForCausalLM

    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.training.trainer import train_opd
    from tests.test_trainer import synthetic_tables

    tables = synthetic_tables(n=3)
    config = OpdConfig.model_validate(dict(training_mode="off_policy", top_k=16, lora_rank=4, lora_alpha=8.0, seed=3,
                                           learning_rate=3e-2, checkpoint_interval=None, epochs=3, loss=loss,
                                           optimizer={"kind": "adam_w"}))
    result = train_opd(train_plan(config, str(tmp_path), "quality"), tables, dataset_sha256="sha256:" + "cd" * 32,
                       dataset_path="corpus.jsonl", student_dir=str(tiny_student), teacher_alias="tiny-teacher")
    assert result.status == "success" and np.mean(result.loss_history[-3:]) < np.mean(result.loss_history[:3])
    example = tables.example(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.as_tensor(example.input_ids, dtype=torch.long)[None]).last_hidden_state[0]
    rows = hidden[torch.as_tensor(example.action_positions, dtype=torch.long) - 1]
    w = model.lm_head.weight.detach()
    ids, ell = torch.as_tensor(example.teacher_ids, dtype=torch.long), torch.as_tensor(example.teacher_logprobs)
    targets = torch.as_tensor(example.input_ids[example.action_positions], dtype=torch.long)
    expected = {
        "teacher_token_ce": lambda: naive_ce(rows, w, None, targets),
        "teacher_top_k_forward": lambda: naive_forward_kl(rows, w, None, ids, ell),
        "teacher_top_k_tail_forward": lambda: naive_topk_tail_reverse_kl(rows, w, ids, ell) + naive_forward_kl(rows, w, None, ids, ell),
    }[loss]()
    assert result.loss_history[0] == pytest.approx(float(expected), abs=1e-4)
    receipt = json.loads((tmp_path / "train_receipt.json").read_text())
    assert receipt["opd"]["loss"] == loss
