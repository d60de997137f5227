"""Kiln's Muon against a plain float64 reference written from Kiln's documentation, and optimizer state
in Kiln's tensor names.

The reference (``naive_muon``) follows ``crates/kiln-train/src/lib.rs`` (``Optimizer``) and kiln-model's
``runtime_dispatch_muon_step`` doc: heavy-ball momentum ``m ← μm + g``, Nesterov look-ahead ``g + μm``,
Newton-Schulz on 2-D parameters (coefficients 3.4445, −4.7750, 2.0315, input scaled to unit Frobenius
norm, ``X ← aX + bAX + cA²X`` with ``A = XXᵀ``), the update scaled by ``sqrt(max(rows, cols))``, then
``p ← p(1 − lr·λ) − lr·update``. It runs in float64 without the transposition trick; the product runs
in float32. Tolerance: ``rtol=1e-4, atol=1e-6`` after several steps (float32 rounding through five
Newton-Schulz iterations).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from kiln_core.contracts.opd_config import AdamWOptimizer, MuonOptimizer
from kiln_core.training.checkpoint import ResumeError
from kiln_core.training.optim import Muon, build_optimizer, load_optimizer_state, optimizer_state_tensors


def naive_newton_schulz(u: np.ndarray, iterations: int) -> np.ndarray:
    a, b, c = 3.4445, -4.7750, 2.0315
    norm = math.sqrt(float((u * u).sum()))
    if norm == 0.0:
        return np.zeros_like(u)
    x = u / norm
    for _ in range(iterations):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ gram @ x)
    return x


def naive_muon(p0: np.ndarray, grads: list[np.ndarray], *, lr: float, momentum: float, nesterov: bool,
               ns_iters: int, weight_decay: float) -> np.ndarray:
    p, m = p0.astype(np.float64).copy(), np.zeros(p0.shape)
    for g in grads:
        g = g.astype(np.float64)
        m = momentum * m + g
        u = g + momentum * m if nesterov else m
        update = naive_newton_schulz(u, ns_iters) * math.sqrt(max(p.shape)) if p.ndim == 2 else u
        p = p * (1.0 - lr * weight_decay) - lr * update
    return p


def run_muon(p0: torch.Tensor, grads: list[torch.Tensor], **hyper) -> torch.Tensor:
    param = torch.nn.Parameter(p0.clone())
    optimizer = Muon([param], **hyper)
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    return param.detach()


@pytest.mark.parametrize("shape", [(4, 16), (16, 4), (6, 6), (5,)])  # LoRA A, LoRA B, square, a vector
@pytest.mark.parametrize("nesterov, weight_decay", [(True, 0.0), (False, 0.0), (True, 0.1)])
def test_muon_matches_the_reference(shape, nesterov, weight_decay):
    generator = torch.Generator().manual_seed(sum(shape) * 7 + int(nesterov))
    p0 = torch.randn(shape, generator=generator)
    grads = [torch.randn(shape, generator=generator) for _ in range(4)]
    hyper = dict(lr=2e-3, momentum=0.95, nesterov=nesterov, ns_iters=5, weight_decay=weight_decay)
    ours = run_muon(p0, grads, **hyper)
    reference = naive_muon(p0.numpy(), [g.numpy() for g in grads], **hyper)
    np.testing.assert_allclose(ours.numpy(), reference, rtol=1e-4, atol=1e-6)


def test_the_update_is_scaled_by_sqrt_of_the_larger_dimension():
    # One step from momentum zero with Nesterov off: p1 - p0 = -lr · sqrt(max(r, c)) · NS(g).
    g = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    step = run_muon(torch.zeros(4, 64), [g], lr=1.0, momentum=0.0, nesterov=False, ns_iters=5, weight_decay=0.0)
    orthogonalized = naive_newton_schulz(g.numpy().astype(np.float64), 5)
    ratio = -step.numpy() / orthogonalized
    np.testing.assert_allclose(ratio, math.sqrt(64), rtol=1e-4)
    # An orthogonalized 4×64 update has RMS about 1/sqrt(64) per entry: Kiln's scale brings it to ~1.
    rms = float(step.square().mean().sqrt())
    assert 0.5 < rms < 1.5, rms


def test_a_zero_gradient_leaves_the_matrix_unchanged():
    p0 = torch.randn(3, 5)
    assert torch.equal(run_muon(p0, [torch.zeros(3, 5)], lr=0.1), p0)


@pytest.mark.parametrize("spec, names", [(MuonOptimizer(), ("muon.momentum", "muon.step")),
                                         (AdamWOptimizer(), ("adamw.m", "adamw.v", "adamw.step"))])
def test_state_round_trips_in_kilns_tensor_names_and_continues_exactly(spec, names):
    torch.manual_seed(0)
    keys = {"layers.0.q_proj.lora_A.weight": torch.nn.Parameter(torch.randn(4, 8)),
            "layers.0.q_proj.lora_B.weight": torch.nn.Parameter(torch.randn(8, 4))}
    grads = [{k: torch.randn_like(p) for k, p in keys.items()} for _ in range(3)]

    def step(optimizer, params, g):
        for k, p in params.items():
            p.grad = g[k].clone()
        optimizer.step()

    optimizer = build_optimizer(spec, keys, 1e-2)
    for g in grads[:2]:
        step(optimizer, keys, g)
    tensors = load(save(optimizer_state_tensors(optimizer, keys)))
    assert set(tensors) == {f"{k}.{n}" for k in keys for n in names}
    assert all(tensors[f"{k}.{names[-1]}"].dtype == torch.uint32 and tensors[f"{k}.{names[-1]}"].tolist() == [2] for k in keys)
    restored_params = {k: torch.nn.Parameter(p.detach().clone()) for k, p in keys.items()}
    restored = build_optimizer(spec, restored_params, 1e-2)
    load_optimizer_state(restored, restored_params, tensors, expected_step=2)
    step(optimizer, keys, grads[2])
    step(restored, restored_params, grads[2])
    for k in keys:
        assert torch.equal(keys[k], restored_params[k])  # bit for bit

    with pytest.raises(ResumeError, match="expected \\[3\\]") as caught:
        load_optimizer_state(build_optimizer(spec, restored_params, 1e-2), restored_params, tensors, expected_step=3)
    assert caught.value.code == "resume_optimizer_tensors"
    extra = dict(tensors, **{"stray.muon.step": torch.tensor([2], dtype=torch.uint32)})
    with pytest.raises(ResumeError, match="optimizer tensor set mismatch"):
        load_optimizer_state(build_optimizer(spec, restored_params, 1e-2), restored_params, extra, expected_step=2)
