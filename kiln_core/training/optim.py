"""Optimizers for the LoRA parameters (Kiln's three kinds), and their state as flat safetensors.

* ``muon``: ``torch.optim.Muon`` (torch ≥ 2.9) with Kiln's defaults (momentum 0.95, Nesterov,
  5 Newton-Schulz iterations, weight decay 0). Muon only takes 2-D matrices; every LoRA parameter
  (``lora_A [r, in]``, ``lora_B [out, r]``) is one, so no fallback optimizer is needed. torch's
  default ``adjust_lr_fn`` ("original": lr·sqrt(max(1, rows/cols))) is used; Kiln's exact per-shape
  scaling is not in the public sources. Note that torch runs the orthogonalization in bf16.
* ``adam_w``: ``torch.optim.AdamW`` with Kiln's defaults (0.9, 0.999, 1e-8, weight decay 0).
* ``sgd``: plain SGD, no momentum, no state (its checkpoint has no ``optimizer.safetensors``).

The learning rate is constant (Kiln: scheduler kind ``constant``), so the step counter alone restores
the schedule. Optimizer state is saved keyed by *stable parameter name* (``<param>::<state key>``),
never by position, so a checkpoint stays valid whatever order parameters are created in.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln_core.contracts.opd_config import AdamWOptimizer, MuonOptimizer, SgdOptimizer

__all__ = ["build_optimizer", "optimizer_state_tensors", "load_optimizer_state", "optimizer_hyperparameters"]

STATE_KEY_SEPARATOR = "::"


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
        return torch.optim.Muon(
            params,
            lr=learning_rate,
            weight_decay=spec.weight_decay,
            momentum=spec.momentum,
            nesterov=spec.nesterov,
            ns_steps=spec.ns_iters,
        )
    if spec.kind == "adam_w":
        return torch.optim.AdamW(
            params,
            lr=learning_rate,
            betas=(spec.beta1, spec.beta2),
            eps=spec.eps,
            weight_decay=spec.weight_decay,
        )
    if spec.kind == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=0.0)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def optimizer_hyperparameters(spec: MuonOptimizer | AdamWOptimizer | SgdOptimizer, learning_rate: float) -> dict[str, Any]:
    """The checkpoint's ``optimizer.hyperparameters``: ``{learning_rate, optimizer: {...}}``."""
    return {"learning_rate": learning_rate, "optimizer": spec.model_dump(mode="json")}


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, parameters: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor as CPU copies keyed ``<param name>::<state key>``.

    Scalar Python numbers in the state (none for Muon/AdamW with default flags) are stored as 0-d
    float64 tensors. Returns ``{}`` for a stateless optimizer (SGD).
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, param in parameters.items():
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                tensor = value.detach().to("cpu", copy=True).contiguous()
            else:
                tensor = torch.tensor(float(value), dtype=torch.float64)
            tensors[f"{name}{STATE_KEY_SEPARATOR}{key}"] = tensor
    return tensors


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    parameters: dict[str, torch.nn.Parameter],
    tensors: dict[str, torch.Tensor],
) -> None:
    """Restore state saved by ``optimizer_state_tensors`` (through ``load_state_dict``, so torch casts
    each tensor to its parameter's device the way it does for its own checkpoints).

    Raises:
        ValueError: a key names an unknown parameter.
    """
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, state_key = key.rpartition(STATE_KEY_SEPARATOR)
        if name not in parameters or not state_key:
            raise ValueError(f"optimizer state entry {key!r} does not name a LoRA parameter")
        per_param.setdefault(name, {})[state_key] = value
    index = {name: i for i, name in enumerate(parameters)}
    current = optimizer.state_dict()
    state = {index[name]: dict(values) for name, values in per_param.items()}
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
