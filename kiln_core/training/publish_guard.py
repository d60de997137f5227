"""The publish guard: a run whose weights or loss diverged is never published (DESIGN.md decision 15).

It runs after the last optimizer step, before the PEFT adapter directory is written (so before the
receipt says ``success`` and before anything can move ``latest.json``), in both training loops
(``train_opd``, ``train_on_policy``) through ``kiln_core.training.finish.publish_final_adapter``. Three
rules, each a plain function of what the run holds at that point:

* ``non_finite_weight`` — every value of every LoRA tensor is finite.
* ``weight_bound`` — the largest ``|w|`` of the trained LoRA is at most ``WEIGHT_GROWTH_LIMIT`` times
  the largest ``|w|`` the run started from: the bound of PEFT's Kaiming-uniform init of ``lora_A``
  (``1/sqrt(in_features)``: ``lora_B`` starts at zero), or a warm start's base adapter when that is larger.
  The reference is computed from the shapes and the base adapter, never from a checkpoint, so a resumed
  run is held to the same start as the run that began it.
* ``loss_diverged`` — every loss of the run's history is finite, and the mean of its last window
  (``LOSS_WINDOW_FRACTION`` of the steps, at least one) is not above ``LOSS_GROWTH_LIMIT`` times the mean
  of its first window while also ``LOSS_MIN_RISE`` nats or more above it (both must hold: a run that
  starts near zero loss may double it without diverging).

The thresholds and the measurements that chose them (every existing training test, tiny and SmolLM2
runs, at each optimizer's usual rates and at absurd ones) are in ``docs/publish-guard.md``: normal runs
sit orders of magnitude inside every bound, the ``learning_rate: 1e10`` run orders of magnitude outside.

A tripped guard ends the run with ``training_diverged`` (a ``failed`` receipt whose ``publish_guard``
block holds the rule, the measured values and the thresholds; exit 3): no adapter directory is written,
``latest.json`` is untouched and the periodic checkpoints stay for inspection. (The final state is not
saved as one more checkpoint: a checkpoint after the last step of the last epoch is not a valid Kiln
checkpoint — its next epoch would exceed ``epochs``.) ``config.publish_guard: false`` (a
kiln-flows extension of the request's and the spec's config) turns it off; the receipt then says so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch

from kiln_core.errors import RUN_FAILURE_CODES

__all__ = ["GUARD_CODE", "WEIGHT_GROWTH_LIMIT", "LOSS_GROWTH_LIMIT", "LOSS_MIN_RISE", "LOSS_WINDOW_FRACTION",
           "GuardCheck", "check_weights_finite", "check_weight_bound", "check_loss", "fresh_lora_bound",
           "reference_max_abs", "guard_verdict", "GuardTripped", "guard_before_publish"]

GUARD_CODE = RUN_FAILURE_CODES[0]  # training_diverged

WEIGHT_GROWTH_LIMIT = 1000.0
"""Largest trained ``|w|`` over largest starting ``|w|`` (see docs/publish-guard.md for the measurements)."""
LOSS_GROWTH_LIMIT = 10.0
"""Last window's mean loss over the first window's."""
LOSS_MIN_RISE = 1.0
"""Nats the last window's mean must also be above the first window's."""
LOSS_WINDOW_FRACTION = 0.1
"""Each window is this fraction of the run's steps (at least one step)."""


@dataclass(frozen=True)
class GuardCheck:
    """One rule's outcome: what was measured against which threshold."""

    rule: str
    passed: bool
    measured: dict[str, Any]
    threshold: dict[str, Any]
    message: str

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _json_float(value: float) -> float | str:
    """A float for the receipt (strict JSON has no NaN or infinity: those are written as text)."""
    return value if math.isfinite(value) else str(value)


def check_weights_finite(tensors: Mapping[str, torch.Tensor]) -> GuardCheck:
    """Rule ``non_finite_weight``: no NaN or infinity in any LoRA tensor."""
    bad = {name: int((~torch.isfinite(t.detach())).sum()) for name, t in tensors.items()}
    bad = {name: count for name, count in bad.items() if count}
    total = sum(bad.values())
    first = next(iter(sorted(bad)), None)
    message = (f"{total} non-finite LoRA weight value(s), first in {first}" if total
               else "every LoRA weight is finite")
    return GuardCheck("non_finite_weight", total == 0, {"non_finite_values": total, "first_tensor": first},
                      {"non_finite_values": 0}, message)


def max_abs(tensors: Mapping[str, torch.Tensor]) -> float:
    """The largest finite ``|w|`` over ``tensors`` (non-finite values are ``non_finite_weight``'s)."""
    largest = 0.0
    for tensor in tensors.values():
        values = tensor.detach().float().abs()
        values = values[torch.isfinite(values)]
        if values.numel():
            largest = max(largest, float(values.max()))
    return largest


def fresh_lora_bound(tensors: Mapping[str, torch.Tensor]) -> float:
    """The largest ``|w|`` a freshly initialized LoRA can hold: PEFT's ``kaiming_uniform_(a=sqrt(5))``
    draws ``lora_A`` from ``U(-1/sqrt(in_features), 1/sqrt(in_features))`` and ``lora_B`` is zero
    (``kiln_core.training.student._seeded_lora_init``)."""
    bounds = [1.0 / math.sqrt(t.shape[1]) for name, t in tensors.items() if ".lora_A." in name and t.dim() == 2]
    return max(bounds, default=0.0)


def reference_max_abs(tensors: Mapping[str, torch.Tensor], base_adapter_tensors: Mapping[str, torch.Tensor] | None) -> float:
    """What the run started from: the fresh init's bound, or a warm start's largest ``|w|`` when larger."""
    reference = fresh_lora_bound(tensors)
    if base_adapter_tensors:
        reference = max(reference, max_abs(base_adapter_tensors))
    return reference


def check_weight_bound(tensors: Mapping[str, torch.Tensor], reference: float,
                       limit: float = WEIGHT_GROWTH_LIMIT) -> GuardCheck:
    """Rule ``weight_bound``: the largest trained ``|w|`` is at most ``limit`` × ``reference``."""
    largest = max_abs(tensors)
    bound = limit * reference
    ratio = largest / reference if reference > 0 else math.inf
    passed = largest <= bound
    message = (f"largest LoRA weight |w| {largest:.4g} is {ratio:.3g}x the largest at the start ({reference:.4g}); "
               f"the limit is {limit:g}x ({bound:.4g})")
    return GuardCheck("weight_bound", passed,
                      {"max_abs_weight": _json_float(largest), "start_max_abs_weight": reference,
                       "ratio": _json_float(ratio)},
                      {"max_ratio": limit, "max_abs_weight": bound}, message)


def check_loss(loss_history: Sequence[float], *, growth_limit: float = LOSS_GROWTH_LIMIT,
               min_rise: float = LOSS_MIN_RISE, window_fraction: float = LOSS_WINDOW_FRACTION) -> GuardCheck:
    """Rule ``loss_diverged``: every loss finite, and the last window not far above the first.

    Diverged when ``last > growth_limit × first`` and ``last − first ≥ min_rise``, with ``first`` and
    ``last`` the mean losses of the first and last ``max(1, round(window_fraction × steps))`` steps.
    """
    threshold = {"max_ratio": growth_limit, "min_rise": min_rise, "window_fraction": window_fraction}
    losses = [float(value) for value in loss_history]
    bad = [step for step, value in enumerate(losses, start=1) if not math.isfinite(value)]
    if bad:
        return GuardCheck("loss_diverged", False, {"steps": len(losses), "first_non_finite_step": bad[0]}, threshold,
                          f"the loss is non-finite at step {bad[0]}")
    if not losses:
        return GuardCheck("loss_diverged", True, {"steps": 0}, threshold, "no optimizer step: nothing to compare")
    window = max(1, round(window_fraction * len(losses)))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    ratio = last / first if first > 0 else (math.inf if last > 0 else 1.0)
    passed = not (ratio > growth_limit and last - first >= min_rise)
    message = (f"mean loss of the last {window} step(s) {last:.4g} vs the first {window} {first:.4g} "
               f"(ratio {ratio:.3g}, rise {last - first:.4g}); diverged above {growth_limit:g}x and {min_rise:g} nats")
    return GuardCheck("loss_diverged", passed,
                      {"steps": len(losses), "window": window, "first_window_mean": first,
                       "last_window_mean": last, "ratio": _json_float(ratio), "rise": last - first}, threshold, message)


def guard_verdict(tensors: Mapping[str, torch.Tensor], loss_history: Sequence[float],
                  base_adapter_tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Every rule over a run's final LoRA and loss history: the receipt's ``publish_guard`` block.

    Example:
        >>> import torch
        >>> guard_verdict({"x.lora_A.w": torch.full((4, 16), 0.1)}, [2.0, 1.5])["verdict"]
        'passed'
    """
    checks = [check_weights_finite(tensors), check_weight_bound(tensors, reference_max_abs(tensors, base_adapter_tensors)),
              check_loss(loss_history)]
    tripped = [check for check in checks if not check.passed]
    return {"enabled": True, "verdict": "tripped" if tripped else "passed",
            "rules": [check.rule for check in tripped], "checks": [check.record() for check in checks]}


class GuardTripped(Exception):
    """Raised by ``guard_before_publish`` when a rule fails (the trainers' ``StopTraining`` wraps it)."""


def _base_adapter_tensors(base_adapter: Any) -> dict[str, torch.Tensor] | None:
    """The warm start's LoRA tensors (read again from its pinned file), or None without one."""
    if base_adapter is None:
        return None
    from safetensors.torch import load as load_safetensors

    from kiln_core.storage import resolve
    from kiln_core.training.base_adapter import WEIGHTS_FILE

    return load_safetensors(resolve(base_adapter.uri).child(WEIGHTS_FILE).read_bytes())


def guard_before_publish(*, enabled: bool, tensors: Mapping[str, torch.Tensor], loss_history: Sequence[float],
                         base_adapter: Any) -> dict[str, Any]:
    """Check the run before its adapter is published; returns the receipt's ``publish_guard`` block.

    Args:
        enabled: ``config.publish_guard``; False records ``{"enabled": false, "verdict": "off"}`` and checks nothing.
        tensors: The trained LoRA tensors.
        loss_history: The run's losses, one per optimizer step (a resumed run's whole history).
        base_adapter: The warm start (``RunPlan.base_adapter``), or None.

    Raises:
        GuardTripped: a rule failed; ``args[0]`` is the message, ``args[1]`` the block.
    """
    if not enabled:
        return {"enabled": False, "verdict": "off", "rules": [], "checks": []}
    block = guard_verdict(tensors, loss_history, _base_adapter_tensors(base_adapter))
    if block["verdict"] == "tripped":
        failed = [check for check in block["checks"] if not check["passed"]]
        block["code"] = GUARD_CODE
        message = ("the publish guard refused to publish the adapter: "
                   + "; ".join(f"{check['rule']}: {check['message']}" for check in failed)
                   + "; nothing was published, latest.json did not move, the checkpoints are kept "
                   "(config.publish_guard: false publishes such a run)")
        raise GuardTripped(message, block)
    return block
