"""Optimizers for the LoRA parameters (Kiln's three kinds), and their state in Kiln's tensor names.

* ``muon`` — Kiln's Muon, implemented here (``Muon``). Kiln documents it in ``crates/kiln-train/src/lib.rs``
  (``Optimizer``: "keeps a single per-param heavy-ball momentum buffer, takes a (Nesterov) look-ahead,
  and — for the rank-2 LoRA A/B weight matrices — projects it onto the nearest semi-orthogonal matrix
  via a Newton-Schulz iteration before stepping, then rescales by ``sqrt(max(rows, cols))`` so the update
  magnitude is shape-independent") and in ``kiln-model``'s ``runtime_dispatch_muon_step`` ("the RMS-matching
  ``sqrt(max(rows, cols))`` scale, then ``param = param * (1 - lr * weight_decay) - lr * update``").
  So the learning-rate adjustment is ``lr · sqrt(max(rows, cols))`` — not torch's ``original``
  (``sqrt(max(1, rows/cols))``) nor its ``match_rms_adamw`` (``0.2 · sqrt(max(rows, cols))``) — and the
  momentum is heavy-ball (``m ← μm + g``), not torch's EMA. Newton-Schulz runs in fp32 with Jordan's
  coefficients (3.4445, −4.7750, 2.0315), as Kiln's CPU reference does.
* ``adam_w`` — ``torch.optim.AdamW`` (decoupled weight decay), Kiln's defaults.
* ``sgd`` — plain SGD, no momentum, no state (its checkpoint has no ``optimizer.safetensors``).

Checkpoint tensors use Kiln's names (``trainer/optimizer_state.rs``): ``<param key>.adamw.m``,
``.adamw.v``, ``.adamw.step`` and ``<param key>.muon.momentum``, ``.muon.step``; moments in F32, the
step as U32 of shape ``[1]``; ``<param key>`` is Kiln's adapter key (``student.kiln_parameter_key``).
"""

from __future__ import annotations

import math

import torch

from kiln_core.contracts.checkpoint import ResumeError
from kiln_core.contracts.opd_config import AdamWOptimizer, LrSchedule, MuonOptimizer, SgdOptimizer

__all__ = ["Muon", "newton_schulz", "build_optimizer", "scheduled_learning_rate", "set_learning_rate",
           "optimizer_state_tensors", "load_optimizer_state"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(matrix: torch.Tensor, iterations: int) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to ``matrix`` (approximately), in fp32: ``[r, c] -> [r, c]``.

    The input is scaled to unit Frobenius norm (a zero matrix stays zero), then ``iterations`` steps
    of ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ`` on the smaller side.
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.float()
    norm = torch.linalg.vector_norm(x)
    if float(norm) == 0.0:
        return torch.zeros_like(x)
    x = x / norm
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(iterations):
        gram = x @ x.T  # [r, r], r = the smaller dimension
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Kiln's Muon (see the module docstring for the source of each rule).

    Per parameter ``p`` with gradient ``g`` and momentum ``m`` (zeros at first)::

        m ← μ·m + g
        u ← g + μ·m            (Nesterov; else u ← m)
        o ← sqrt(max(rows, cols)) · NewtonSchulz(u)   for 2-D p; o ← u otherwise
        p ← p·(1 − lr·λ) − lr·o

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2, 3)); p.grad = torch.ones(2, 3)
        >>> Muon([p], lr=0.1).step(); p.shape
        torch.Size([2, 3])
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True, ns_iters: int = 5,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_iters=ns_iters,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - documented on the class
        for group in self.param_groups:
            lr, mu, decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                    state["step"] = 0
                momentum = state["momentum"]
                momentum.mul_(mu).add_(grad)
                lookahead = grad.add(momentum, alpha=mu) if group["nesterov"] else momentum
                if p.ndim == 2:
                    update = newton_schulz(lookahead, group["ns_iters"]) * math.sqrt(max(p.shape))
                else:
                    update = lookahead
                if decay:
                    p.mul_(1.0 - lr * decay)
                p.add_(update.to(p.dtype), alpha=-lr)
                state["step"] += 1
        return None


def build_optimizer(
    spec: MuonOptimizer | AdamWOptimizer | SgdOptimizer,
    parameters: dict[str, torch.nn.Parameter],
    learning_rate: float,
) -> torch.optim.Optimizer:
    """Build the optimizer over ``parameters`` (iterated in their dict order, which is sorted by name).

    Example:
        >>> p = {"w": torch.nn.Parameter(torch.zeros(2, 3))}
        >>> type(build_optimizer(MuonOptimizer(), p, 2e-3)).__name__
        'Muon'
    """
    params = list(parameters.values())
    if spec.kind == "muon":
        return Muon(params, lr=learning_rate, momentum=spec.momentum, nesterov=spec.nesterov, ns_iters=spec.ns_iters,
                    weight_decay=spec.weight_decay)
    if spec.kind == "adam_w":
        return torch.optim.AdamW(params, lr=learning_rate, betas=(spec.beta1, spec.beta2), eps=spec.eps,
                                 weight_decay=spec.weight_decay)
    if spec.kind == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=0.0)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def scheduled_learning_rate(learning_rate: float, schedule: LrSchedule | None, step: int, total_steps: int) -> float:
    """The rate optimizer step ``step`` (1-based) of ``total_steps`` trains at (``LrSchedule``; None: constant).

    Warm-up rises linearly to the full rate at step ``warmup_steps``; the decay then goes from the full rate at
    the first step after warm-up toward ``final_lr_ratio`` of it, reached one step past the last.

    Example:
        >>> schedule = LrSchedule(kind="linear", warmup_steps=2, final_lr_ratio=0.0)
        >>> [scheduled_learning_rate(1.0, schedule, s, 6) for s in range(1, 7)]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """
    if schedule is None:
        return learning_rate
    if step <= schedule.warmup_steps:
        return learning_rate * step / schedule.warmup_steps
    decay_steps = max(1, total_steps - schedule.warmup_steps)
    progress = min(1.0, (step - schedule.warmup_steps - 1) / decay_steps)
    shape = 1.0 - progress if schedule.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return learning_rate * (schedule.final_lr_ratio + (1.0 - schedule.final_lr_ratio) * shape)


def set_learning_rate(optimizer: torch.optim.Optimizer, learning_rate: float) -> None:
    """Make every parameter group of ``optimizer`` take its next step at ``learning_rate``."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate


def _u32(value: int) -> torch.Tensor:
    return torch.tensor([int(value)], dtype=torch.uint32)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, keys: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor as a CPU copy under Kiln's name; ``keys`` maps Kiln parameter keys
    to the parameters. Returns ``{}`` for SGD."""
    tensors: dict[str, torch.Tensor] = {}
    for key, param in keys.items():
        state = optimizer.state.get(param)
        if not state:
            continue
        if isinstance(optimizer, Muon):
            tensors[f"{key}.muon.momentum"] = state["momentum"].detach().to("cpu", torch.float32, copy=True).contiguous()
            tensors[f"{key}.muon.step"] = _u32(state["step"])
        elif isinstance(optimizer, torch.optim.AdamW):
            tensors[f"{key}.adamw.m"] = state["exp_avg"].detach().to("cpu", torch.float32, copy=True).contiguous()
            tensors[f"{key}.adamw.v"] = state["exp_avg_sq"].detach().to("cpu", torch.float32, copy=True).contiguous()
            tensors[f"{key}.adamw.step"] = _u32(int(state["step"]))
    return tensors


def load_optimizer_state(optimizer: torch.optim.Optimizer, keys: dict[str, torch.nn.Parameter],
                         tensors: dict[str, torch.Tensor], expected_step: int) -> None:
    """Restore state saved by ``optimizer_state_tensors`` exactly (names, shapes, dtypes and step).

    Raises:
        ResumeError: ``resume_optimizer_tensors`` when the tensor set, a shape or a step differs
            (Kiln: "checkpoint optimizer tensor set mismatch").
    """
    if isinstance(optimizer, torch.optim.SGD):
        if tensors:
            raise ResumeError("resume_optimizer_tensors", "SGD OPD checkpoint unexpectedly contains optimizer state",
                              file="optimizer.safetensors")
        return
    muon = isinstance(optimizer, Muon)
    suffixes = (".muon.momentum", ".muon.step") if muon else (".adamw.m", ".adamw.v", ".adamw.step")
    expected = {key + suffix for key in keys for suffix in suffixes}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise ResumeError("resume_optimizer_tensors", f"checkpoint optimizer tensor set mismatch (missing {missing}, "
                          f"unexpected {extra})", file="optimizer.safetensors")
    for key, param in keys.items():
        step = tensors[f"{key}{suffixes[-1]}"]
        if step.dtype != torch.uint32 or tuple(step.shape) != (1,) or int(step[0]) != expected_step:
            raise ResumeError("resume_optimizer_tensors", f"optimizer step of {key} is {step.tolist()}, expected "
                              f"[{expected_step}] (U32)", file="optimizer.safetensors")
        moments = [tensors[key + suffix] for suffix in suffixes[:-1]]
        if any(m.dtype != torch.float32 or tuple(m.shape) != tuple(param.shape) for m in moments):
            raise ResumeError("resume_optimizer_tensors", f"optimizer state of {key} must be F32 of shape "
                              f"{list(param.shape)}", file="optimizer.safetensors")
        if muon:
            optimizer.state[param] = {"momentum": moments[0].to(param.device).clone(), "step": expected_step}
        else:
            optimizer.state[param] = {"step": torch.tensor(float(expected_step), dtype=torch.float32),
                                      "exp_avg": moments[0].to(param.device).clone(),
                                      "exp_avg_sq": moments[1].to(param.device).clone()}
