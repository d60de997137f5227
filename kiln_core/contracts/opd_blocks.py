"""The nested blocks of Kiln's ``OpdConfig``: the optimizer, Stable-OPD and ECHO (``crates/kiln-train/src/opd.rs``,
``lib.rs`` ``Optimizer``, ``EchoConfig``).

Each block has Kiln's fields and defaults. The optimizer denies unknown keys, as Kiln's serde enum does;
the Stable-OPD and ECHO blocks accept and ignore them, as Kiln's structs do (a request's unknown keys
are then refused by ``kiln_core.contracts.unknown_keys`` unless ``--kiln-lenient`` asks for Kiln's way).
``kiln_core.contracts.opd_config`` re-exports every name, so ``OpdConfig`` and its blocks import from one place.

Example:
    >>> EchoConfig.model_validate({"lambda": 0.2}).lambda_
    0.2
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["MuonOptimizer", "AdamWOptimizer", "SgdOptimizer", "Optimizer", "StableOpdOff", "StableOpdAuto",
           "StableOpdManual", "StableOpd", "EchoConfig", "LrSchedule", "UnitInterval"]


# Every field's docstring is its one-line description in the JSON schema (use_attribute_docstrings),
# so the Prefect UI's run form shows the same text a reader of this file sees: what it does, its
# unit, and Kiln's default. tests/test_form_schema.py counts fields without one (goal: none).


class _Strict(BaseModel):
    # Our base for nested blocks whose unknown keys Kiln ignores (echo, stable_opd).
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True,
                              use_attribute_docstrings=True)


class _StrictForbid(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, use_attribute_docstrings=True)


UnitInterval = Annotated[float, Field(ge=0.0, lt=1.0)]


class MuonOptimizer(_StrictForbid):
    """Muon (Kiln's default OPD optimizer). Learning rate default 2e-3."""

    model_config = ConfigDict(title="Muon")  # merged with the base class config

    kind: Literal["muon"] = "muon"
    """Optimizer: muon (Kiln's default)."""
    momentum: UnitInterval = 0.95
    """Momentum coefficient, in [0, 1). Kiln default: 0.95."""
    nesterov: bool = True
    """Use Nesterov momentum. Kiln default: true."""
    ns_iters: int = Field(default=5, ge=1, le=20)
    """Newton-Schulz orthogonalization iterations per step, 1 to 20. Kiln default: 5."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """Decoupled weight decay per step (0 or more). Kiln default: 0."""


class AdamWOptimizer(_StrictForbid):
    """AdamW. Learning rate default 1e-5."""

    model_config = ConfigDict(title="AdamW")  # merged with the base class config

    kind: Literal["adam_w"] = "adam_w"
    """Optimizer: adam_w."""
    beta1: UnitInterval = 0.9
    """Decay rate of the first-moment (mean) estimate, in [0, 1). Kiln default: 0.9."""
    beta2: UnitInterval = 0.999
    """Decay rate of the second-moment (variance) estimate, in [0, 1). Kiln default: 0.999."""
    eps: float = Field(default=1e-8, gt=0.0)
    """Added to the denominator for numerical stability (above 0). Kiln default: 1e-8."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """Decoupled weight decay per step (0 or more). Kiln default: 0."""


class SgdOptimizer(_StrictForbid):
    """Plain SGD without momentum (no optimizer state). Learning rate default 1e-5."""

    model_config = ConfigDict(title="SGD")  # merged with the base class config

    kind: Literal["sgd"] = "sgd"
    """Optimizer: sgd (no momentum, no state)."""


Optimizer = Annotated[Union[MuonOptimizer, AdamWOptimizer, SgdOptimizer], Field(discriminator="kind")]


class StableOpdOff(_Strict):
    """Stable-OPD off (Kiln's default; the only mode that runs today)."""

    model_config = ConfigDict(title="Off")  # merged with the base class config

    mode: Literal["off"] = "off"
    """Stable-OPD mode: off."""


class StableOpdAuto(_Strict):
    """Stable-OPD with Kiln's automatic coefficients (refused at submit: not wired into the loss)."""

    model_config = ConfigDict(title="Auto")  # merged with the base class config

    mode: Literal["auto"]
    """Stable-OPD mode: auto."""


class StableOpdManual(_Strict):
    """Stable-OPD with explicit coefficients (refused at submit: not wired into the loss)."""

    model_config = ConfigDict(title="Manual")  # merged with the base class config

    mode: Literal["manual"]
    """Stable-OPD mode: manual."""
    kl_beta: float
    """Weight of the KL term (unitless)."""
    sft_lambda: float
    """Weight of the supervised term (unitless)."""


StableOpd = Annotated[Union[StableOpdOff, StableOpdAuto, StableOpdManual], Field(discriminator="mode")]


class EchoConfig(_Strict):
    """ECHO env cross-entropy term (off for OPD unless present)."""

    model_config = ConfigDict(title="ECHO")  # merged with the base class config

    lambda_: float = Field(default=0.05, alias="lambda")
    """λ, the weight of the environment cross-entropy term (unitless; 0 disables it). Kiln default: 0.05."""
    env_mask_mode: Literal["env_only", "full_obs"] = "env_only"
    """env_only drops warning-prefix tokens when warning_filter is on; full_obs keeps every observation token. Kiln default: env_only."""
    warning_filter: bool = True
    """Trim a tool response's warning prefix from the observation tokens. Kiln default: true."""

    @field_validator("lambda_")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("echo.lambda must be finite")
        return value


class LrSchedule(_StrictForbid):
    """kiln-flows extension: warm-up, then a decay of the learning rate over the run's optimizer steps.

    Kiln trains at a constant rate; a config without this block keeps exactly that. Step s (1-based) of a run
    of T optimizer steps trains at learning_rate times a factor: s / warmup_steps during warm-up, then from 1
    down toward final_lr_ratio (linear or cosine) over the remaining steps. The factor depends on s and T only,
    so a resumed run trains at the same rates as an uninterrupted one.
    """

    model_config = ConfigDict(title="Learning-rate schedule")  # merged with the base class config

    kind: Literal["linear", "cosine"] = "cosine"
    """Decay after warm-up: linear or cosine (half period), from the full rate down to final_lr_ratio × it."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps whose rate rises linearly to the full rate (count; 0 = none)."""
    final_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """The rate the decay approaches at the last step, as a fraction of learning_rate (0 to 1)."""
