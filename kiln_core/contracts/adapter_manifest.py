"""Kiln's ``adapter_manifest.json``: the content, lineage and training identity of an adapter directory.

Kiln writes it beside the adapter after a successful receipt, when both serving files exist
(``crates/kiln-train/src/adapter_output.rs`` ``write_adapter_manifest_from_train_receipt`` and
``build_adapter_manifest_from_train_receipt``); its schema is ``contracts/kiln-artifacts-v1.schema.json``
``AdapterManifest`` (``additionalProperties: false``). Kiln's ``restore`` copies ``files.*`` from the manifest's
own directory under canonical names, re-hashes them, and verifies ``receipt_hash`` against the copied receipt.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

__all__ = ["ADAPTER_MANIFEST_FILE", "AdapterManifest", "AdapterManifestFiles"]

ADAPTER_MANIFEST_FILE = "adapter_manifest.json"

Sha256 = Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]


def _omit_none(value: Any) -> bool:
    return value is None


class AdapterManifestFiles(BaseModel):
    """The adapter's files, by plain filename in the manifest's directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter_model: NonEmpty = "adapter_model.safetensors"
    adapter_config: NonEmpty = "adapter_config.json"
    train_receipt: NonEmpty | None = None
    """None in kiln-flows: its ``train_receipt.json`` lives in the run directory, one level above ``adapter/``
    (docs/kiln-compatibility.md)."""


class AdapterManifest(BaseModel):
    """``adapter_manifest.json``: what Kiln's schema requires, and the optional records kiln-flows can state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    manifest_type: Literal["kiln_adapter_manifest"] = "kiln_adapter_manifest"
    adapter_name: NonEmpty
    safetensors_hash: Sha256
    config_hash: Sha256
    receipt_hash: Sha256 | None
    parent_adapter: NonEmpty | None
    model_config_hash: Sha256 | None
    training_chat_template_hash: Sha256 | None = Field(default=None, exclude_if=_omit_none)
    base_weight_shard_manifest: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)
    """Kiln's ``BaseWeightShardManifest`` of the student, as the receipt records it."""
    training_precision: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)
    """Kiln's ``TrainingCheckpointPrecision``, as the receipt records it."""
    kiln_commit: NonEmpty | None
    training_data_hash: Sha256 | None
    training_data_source: NonEmpty | None
    training_data_path: NonEmpty | None
    files: AdapterManifestFiles
