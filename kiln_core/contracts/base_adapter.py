"""A resolved base adapter (``config.base_adapter``) as the plan and the receipt carry it: the directory a
warm start loads and the digest of its weights.

Kiln's receipt ``adapters.base`` (``crates/kiln-train/src/train_receipt.rs``) records the same three facts;
reading and checking an adapter directory is ``kiln_core.training.base_adapter``'s business.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["BaseAdapter"]


class BaseAdapter(BaseModel):
    """A resolved base adapter, pinned by content.

    Attributes:
        name: ``config.base_adapter`` as requested (an adapter name or a directory).
        uri: The PEFT adapter directory it resolved to.
        adapter_model_sha256: ``sha256:`` of ``adapter_model.safetensors`` — what the run key and the
            receipt record, and what loading checks again.
        adapter_model_bytes: Size of ``adapter_model.safetensors``.
        rank, alpha, target_modules, target_parameters: From ``adapter_config.json`` (sorted).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    uri: str
    adapter_model_sha256: str
    adapter_model_bytes: int
    rank: int
    alpha: float
    target_modules: list[str]
    target_parameters: list[str] = []

    def receipt_record(self) -> dict[str, Any]:
        """Kiln's receipt ``adapters.base``: ``{path, adapter_model_sha256, adapter_model_bytes}``."""
        return {"path": self.uri, "adapter_model_sha256": self.adapter_model_sha256,
                "adapter_model_bytes": self.adapter_model_bytes}
