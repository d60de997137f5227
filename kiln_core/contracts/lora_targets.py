"""The layers a student's LoRA adapts, as plans, checkpoints and receipts record them.

Resolving them from a model is ``kiln_core.training.lora_targets``' business; this is the record: the names of the
linear modules PEFT wraps (``LoraConfig.target_modules``) and the paths of the 3-D expert tensors it adapts
(``target_parameters``), each sorted.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KILN_LORA_TARGETS", "LoraTargets"]

KILN_LORA_TARGETS = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
"""Kiln's adapter targets (the Llama/Qwen projections), sorted as ``adapter_config.json`` writes them."""


class LoraTargets(BaseModel):
    """A student's LoRA targets, sorted.

    Attributes:
        modules: Names of the linear modules PEFT wraps (``q_proj``, ``qkv_proj``, ``gate_up_proj``, ...).
        parameters: Paths, inside a decoder layer, of the 3-D expert tensors PEFT adapts
            (``mlp.experts.gate_up_proj``); empty for a model without such tensors.

    Example:
        >>> LoraTargets(modules=KILN_LORA_TARGETS).is_kiln_default
        True
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    modules: tuple[str, ...]
    parameters: tuple[str, ...] = Field(default=(), exclude_if=lambda value: not value)

    @property
    def is_kiln_default(self) -> bool:
        """Exactly Kiln's seven projections: nothing to record beside Kiln's own fields."""
        return self.modules == KILN_LORA_TARGETS and not self.parameters

    def describe(self) -> str:
        """One line for people: ``down_proj, gate_up_proj, o_proj, qkv_proj``."""
        return ", ".join([*self.modules, *self.parameters])
