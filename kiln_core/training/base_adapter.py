"""Warm starts: a published LoRA adapter as the student's weights before step 1 (``config.base_adapter``).

Kiln's semantics (checked in ``ericflo/kiln``):

* ``crates/kiln-train/src/adapter_shape.rs`` · ``resolve_base_adapter_dir``: the value is a directory
  when that path exists, else a name under the server's adapter directory;
  ``validate_base_adapter_compatibility`` then refuses, before the optimizer is built, a rank other
  than the request's ``lora_rank``, other ``target_modules`` and any missing, extra or misshapen
  tensor. ``lora_alpha`` is not compared: the request's alpha scales the loaded weights.
* ``crates/kiln-train/src/train_receipt.rs`` · the failure classifier: an unreadable base adapter is
  ``base_adapter_missing``, a mismatch ``shape_mismatch`` — both written as a failed receipt by the job,
  since Kiln checks at training time, not at submit time.
* The warm start is weights only: a fresh optimizer, fresh RNG streams, step 0. On resume the
  checkpoint's LoRA weights are restored and the base adapter is not loaded again
  (Kiln's ``crates/kiln-train/src/opd.rs``, ``validate_resume``).
* The receipt's ``adapters.base`` is the resolved directory with the ``adapter_model.safetensors``
  digest and size; ``config.base_adapter`` keeps the value as requested.

kiln-flows resolves and checks before any model loads, so every refusal is a ``Rejection`` (exit 2):
``base_adapter_missing`` (Kiln's reason, as a code) and ``base_adapter_mismatch`` (Kiln's
``shape_mismatch``, plus ``lora_alpha``: the step-0 student must *be* the base adapter, so an alpha
that rescales it is refused). How a name is looked up under a storage root is the engine's business
(``kiln_core.engine.base_adapter``); this module reads an adapter directory, checks it against a config
and loads it into a student.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from kiln_core.canonical import sha256_prefixed
from kiln_core.contracts.base_adapter import BaseAdapter
from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.storage import resolve

if TYPE_CHECKING:
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.training.student import Student

__all__ = ["BaseAdapterError", "read_base_adapter", "check_base_adapter_fits", "settle_base_adapter",
           "load_base_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class BaseAdapterError(Rejection):
    """A base adapter that cannot warm-start this run (exit 2): ``base_adapter_missing``, ``base_adapter_mismatch``."""


def read_base_adapter(name: str, adapter_uri: str, *, looked_up: str | None = None) -> BaseAdapter:
    """Read a PEFT adapter directory as the base adapter ``name``.

    Args:
        name: ``config.base_adapter`` as requested.
        adapter_uri: The directory (local path or fsspec URI).
        looked_up: How the directory was found, for the message (e.g. ``runs/warm/latest.json``).

    Raises:
        BaseAdapterError: ``base_adapter_missing`` — no ``adapter_config.json`` or weights there, or a
            config that is not a LoRA adapter's.

    Example:
        >>> base = read_base_adapter("warm", "kiln-data/runs/warm/3f2a9c0d1e2b4a5c/adapter")  # doctest: +SKIP
        >>> base.rank, base.adapter_model_sha256[:7]  # doctest: +SKIP
        (4, 'sha256:')
    """
    where = f" (looked up through {looked_up})" if looked_up else ""
    location = resolve(adapter_uri)
    try:
        config = json.loads(location.child(CONFIG_FILE).read_text())
        weights = location.child(WEIGHTS_FILE).read_bytes()
    except (OSError, ValueError) as error:  # FileNotFoundError, a damaged JSON document
        raise BaseAdapterError("base_adapter_missing", f"base adapter {name!r}: no readable PEFT adapter at "
                               f"{location.uri}{where} ({type(error).__name__}: {error})",
                               field="config.base_adapter", file=location.uri) from None
    try:
        rank, alpha, targets = int(config["r"]), float(config["lora_alpha"]), sorted(config["target_modules"])
        expert_targets = sorted(config.get("target_parameters") or [])
    except (KeyError, TypeError, ValueError):
        raise BaseAdapterError("base_adapter_missing", f"base adapter {name!r}: {location.child(CONFIG_FILE).uri} "
                               "is not a LoRA adapter config (r, lora_alpha, target_modules)",
                               field="config.base_adapter", file=location.child(CONFIG_FILE).uri) from None
    return BaseAdapter(name=name, uri=location.uri, adapter_model_sha256=sha256_prefixed(weights),
                       adapter_model_bytes=len(weights), rank=rank, alpha=alpha, target_modules=targets,
                       target_parameters=expert_targets)


def check_base_adapter_fits(base: BaseAdapter, config: OpdConfig, targets: LoraTargets) -> None:
    """Refuse a base adapter whose shape or scale differs from the run's LoRA (before any model loads).

    Kiln compares the rank and the target modules (``adapter_shape.rs``); kiln-flows compares the
    alpha as well, since ``alpha / rank`` scales every loaded weight. ``targets`` are the student's
    (``kiln_core.training.lora_targets``).

    Raises:
        BaseAdapterError: ``base_adapter_mismatch``, naming the field to change.
    """
    if base.rank != config.lora_rank:
        raise BaseAdapterError("base_adapter_mismatch", f"base adapter rank mismatch: training rank is "
                               f"{config.lora_rank}, adapter {base.name!r} rank is {base.rank} ({base.uri})",
                               field="config.lora_rank")
    if base.alpha != float(config.lora_alpha):
        raise BaseAdapterError("base_adapter_mismatch", f"base adapter lora_alpha mismatch: training lora_alpha is "
                               f"{config.lora_alpha:g}, adapter {base.name!r} has {base.alpha:g}: the warm-started "
                               "student would not be the base adapter", field="config.lora_alpha")
    expected = list(targets.modules)
    if base.target_modules != expected:
        raise BaseAdapterError("base_adapter_mismatch", f"base adapter target_modules mismatch: expected {expected}, "
                               f"adapter {base.name!r} has {base.target_modules}", field="config.base_adapter")
    if base.target_parameters != list(targets.parameters):
        raise BaseAdapterError("base_adapter_mismatch", f"base adapter target_parameters mismatch: expected "
                               f"{list(targets.parameters)}, adapter {base.name!r} has {base.target_parameters}",
                               field="config.base_adapter")


def settle_base_adapter(config: OpdConfig, base: BaseAdapter | None, targets: LoraTargets) -> BaseAdapter | None:
    """The run's base adapter, checked against ``config``: ``base`` when the caller resolved it, else
    ``config.base_adapter`` read as an adapter directory (a name needs the engine's storage root).

    Raises:
        BaseAdapterError: ``base_adapter_missing``, ``base_adapter_mismatch``.
        ConfigError: ``base`` given for a config without ``base_adapter``, or for another one.
    """
    from kiln_core.contracts.names import is_valid_name
    from kiln_core.contracts.opd_config import ConfigError

    value = config.base_adapter
    if value is None:
        if base is not None:
            raise ConfigError(f"a base adapter ({base.name!r}) was given for a config without base_adapter",
                              "config.base_adapter")
        return None
    if base is None:
        if is_valid_name(value):
            raise BaseAdapterError("base_adapter_missing", f"base adapter {value!r} is an adapter name, which is "
                                   "looked up under a storage root: resolve it with kiln_core.engine.base_adapter."
                                   "resolve_base_adapter (kiln-flows train and the pipeline do)",
                                   field="config.base_adapter")
        base = read_base_adapter(value, value)
    elif base.name != value:
        raise ConfigError(f"the resolved base adapter is {base.name!r}, but config.base_adapter is {value!r}",
                          "config.base_adapter")
    check_base_adapter_fits(base, config, targets)
    return base


def load_base_adapter(student: Student, base: BaseAdapter) -> None:
    """Overwrite the student's LoRA parameters with the base adapter's (exact copies; nothing else changes).

    Raises:
        EnvironmentFailure: ``base_adapter_changed`` — the weights are not the bytes the run was planned with.
        BaseAdapterError: ``base_adapter_mismatch`` — a missing, extra or misshapen tensor (another student).
    """
    import torch
    from safetensors.torch import load as load_safetensors

    location = resolve(base.uri)
    data = location.child(WEIGHTS_FILE).read_bytes()
    if sha256_prefixed(data) != base.adapter_model_sha256:
        raise EnvironmentFailure("base_adapter_changed", f"base adapter {base.name!r} at {location.uri} changed since "
                                 f"the run was planned (expected {base.adapter_model_sha256})",
                                 file=location.child(WEIGHTS_FILE).uri)
    tensors = load_safetensors(data)
    params = student.checkpoint_keys()  # PEFT saves the same keys: no adapter slot in the name
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        raise BaseAdapterError("base_adapter_mismatch", f"base adapter {base.name!r} does not fit this student: "
                               f"missing tensors {missing[:3]}, unexpected tensors {extra[:3]}",
                               field="config.base_adapter", file=location.child(WEIGHTS_FILE).uri)
    for key, param in params.items():
        if tuple(tensors[key].shape) != tuple(param.shape):
            raise BaseAdapterError("base_adapter_mismatch", f"base adapter tensor shape mismatch for {key}: expected "
                                   f"{tuple(param.shape)}, found {tuple(tensors[key].shape)}",
                                   field="config.base_adapter", file=location.child(WEIGHTS_FILE).uri)
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(tensors[key].to(device=param.device, dtype=param.dtype))
