"""Kiln's ``TrainReceipt::validate()``: the rules a ``train_receipt.json`` must pass, on write and on read.

Kiln runs them before it writes a receipt (``write_to_adapter_dir``, before the adapter manifest) and after it
reads one (``read_from_adapter_dir``); kiln-flows does both too (``kiln_core.training.receipt.compose_receipt``,
``kiln_core.training.receipt.read_receipt``). Transcribed from Kiln's code:

* ``crates/kiln-train/src/train_receipt.rs`` — ``validate_envelope`` (schema version 1, receipt type
  ``kiln_train_receipt``, a non-blank adapter name, an RFC 3339 ``produced_at``, a success without failure
  fields, a failure with a non-blank ``failure_reason``) and ``validate_training_chat_template_identity``
  (every present training chat-template hash is ``sha256:<64 lowercase hex>`` and they agree across
  ``tokenizer``, ``config_hashes`` and ``runtime.execution_provenance.model``); the SFT ingestion rules do not
  apply to an OPD receipt (it carries no ``data.sft_ingestion``);
* ``crates/kiln-core/src/model_provenance.rs`` — ``BaseWeightShardManifest::validate``;
* ``crates/kiln-core/src/execution_provenance.rs`` — ``ExecutionProvenanceV1::validate`` (field rules, the
  kernel contract digest, the record's own digest; every struct denies unknown fields).

``runtime.training_precision`` is Kiln's ``TrainingCheckpointPrecision``: its five fields, no others (``deny_unknown
_fields``). Its ``validate()`` body is not in Kiln's public sources; the one rule Kiln documents is checked: the
server admits only ``stochastic_rounding: {"mode": "round_to_nearest"}``.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from datetime import datetime
from typing import Any

__all__ = ["receipt_problem"]

_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
# RFC 3339 date-time (chrono's parse_from_rfc3339): full date, "T" (or "t"/space), time with optional fraction,
# and a mandatory offset ("Z" or ±hh:mm).
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")
_MAX_TEXT_BYTES = 512
_MAX_KERNEL_ENTRIES = 64
_MAX_FEATURES = 64
_MAX_SHARDS = 4096
_PROVENANCE_FIELDS = {
    "": ("schema_version", "provenance_type", "backend", "build", "model", "precision", "kernels", "configuration",
         "provenance_sha256"),
    "backend": ("name", "device", "numerical_runtime_sha256"),
    "build": ("package_version", "target", "executable_sha256", "git_commit", "source_tree_sha256", "source_dirty"),
    "model": ("model_config_sha256", "tokenizer_vocab_sha256", "tokenizer_config_sha256", "chat_template_sha256",
              "training_chat_template_sha256"),
    "precision": ("inference_dtype", "training_policy"),
    "kernels": ("contract_type", "versions", "compiled_features", "contract_sha256"),
    "configuration": ("effective_server_config_sha256", "effective_environment_sha256"),
}
_PRECISION_FIELDS = ("parameter_dtype", "optimizer_state_dtype", "activation_dtype", "gradient_dtype",
                     "stochastic_rounding")


class _Broken(Exception):
    """One broken rule (its message is Kiln's, or says which rule)."""


def receipt_problem(document: dict[str, Any]) -> str | None:
    """The first of Kiln's ``validate()`` rules a receipt document breaks, or None.

    Args:
        document: The receipt as JSON (``TrainReceipt.model_dump(mode="json", by_alias=True)``, or the file parsed).

    Example:
        >>> receipt_problem({"schema_version": 1, "receipt_type": "kiln_train_receipt", "adapter_name": " ",
        ...                  "produced_at": "2026-01-02T03:04:05Z", "status": "success"})
        'train-receipt adapter_name must not be empty'
    """
    try:
        _envelope(document)
        _training_chat_template_identity(document)
        manifest = (document.get("model") or {}).get("base_weight_shard_manifest")
        if manifest is not None:
            _base_weight_shard_manifest(manifest)
        runtime = document.get("runtime") or {}
        if runtime.get("execution_provenance") is not None:
            _execution_provenance(runtime["execution_provenance"])
        if runtime.get("training_precision") is not None:
            _training_precision(runtime["training_precision"])
    except _Broken as broken:
        return str(broken)
    return None


def _ensure(condition: bool, message: str) -> None:
    if not condition:
        raise _Broken(message)


def _envelope(document: dict[str, Any]) -> None:
    """``TrainReceipt::validate_envelope``."""
    _ensure(document.get("schema_version") == 1,
            f"unsupported train-receipt schema_version {document.get('schema_version')}; expected 1")
    _ensure(document.get("receipt_type") == "kiln_train_receipt",
            f"invalid train-receipt receipt_type {document.get('receipt_type')!r}; expected \"kiln_train_receipt\"")
    _ensure(isinstance(document.get("adapter_name"), str) and document["adapter_name"].strip() != "",
            "train-receipt adapter_name must not be empty")
    _ensure(_is_rfc3339(document.get("produced_at")), "train-receipt produced_at must be an RFC3339 timestamp")
    reason, message = document.get("failure_reason"), document.get("failure_message")
    if document.get("status") == "success":
        _ensure(reason is None and message is None,
                "successful train receipt must not carry failure_reason or failure_message")
    else:
        _ensure(isinstance(reason, str) and reason.strip() != "",
                "failed train receipt must carry a non-empty failure_reason")


def _is_rfc3339(value: Any) -> bool:
    if not isinstance(value, str) or not _RFC3339.fullmatch(value):
        return False
    try:
        datetime.fromisoformat(value.replace("z", "Z").replace("Z", "+00:00"))
    except ValueError:  # a well-formed shape with an impossible date or time
        return False
    return True


def _training_chat_template_identity(document: dict[str, Any]) -> None:
    """``TrainReceipt::validate_training_chat_template_identity``."""
    provenance = (document.get("runtime") or {}).get("execution_provenance") or {}
    values = {
        "tokenizer.training_chat_template_hash": (document.get("tokenizer") or {}).get("training_chat_template_hash"),
        "config_hashes.training_chat_template_hash":
            (document.get("config_hashes") or {}).get("training_chat_template_hash"),
        "runtime.execution_provenance.model.training_chat_template_sha256":
            (provenance.get("model") or {}).get("training_chat_template_sha256"),
    }
    for field, value in values.items():
        if value is not None:
            _sha256(field, value)
    present = [(field, value) for field, value in values.items() if value is not None]
    for index, (left_name, left) in enumerate(present):
        for right_name, right in present[index + 1:]:
            _ensure(left == right, f"{left_name} ({left}) differs from {right_name} ({right})")


def _sha256(label: str, value: Any) -> None:
    _ensure(isinstance(value, str) and _SHA256.fullmatch(value) is not None,
            f"{label} must use sha256:<64 lowercase hex>")


def _text(label: str, value: Any) -> None:
    """Kiln's ``validate_text``: non-empty, trimmed, at most 512 bytes, no control characters."""
    _ensure(isinstance(value, str) and value != "" and value.strip() == value
            and len(value.encode("utf-8")) <= _MAX_TEXT_BYTES and not any(_is_control(c) for c in value),
            f"execution {label} must be non-empty, trimmed, bounded text")


def _is_control(character: str) -> bool:
    """Rust's ``char::is_control``: the Unicode general category Cc."""
    code = ord(character)
    return code < 0x20 or 0x7F <= code < 0xA0


def _only(value: Any, allowed: tuple[str, ...], what: str) -> dict[str, Any]:
    """Kiln parses these records with ``deny_unknown_fields``: an unknown key refuses the whole receipt."""
    _ensure(isinstance(value, dict), f"{what} must be an object")
    unknown = sorted(set(value) - set(allowed))
    _ensure(not unknown, f"{what} has unknown field(s) {unknown}")
    return value


def _base_weight_shard_manifest(manifest: Any) -> None:
    """``BaseWeightShardManifest::validate`` (``model_provenance.rs``)."""
    _only(manifest, ("schema_version", "manifest_type", "aggregate_algorithm", "aggregate_sha256",
                     "total_size_bytes", "shards"), "base-weight shard manifest")
    _ensure(manifest.get("schema_version") == 1, "unsupported base-weight shard manifest schema_version")
    _ensure(manifest.get("manifest_type") == "kiln.base-weight-shards.v1", "invalid base-weight shard manifest_type")
    _ensure(manifest.get("aggregate_algorithm") == "kiln.base-model-content.v1",
            "unsupported base-weight aggregate_algorithm")
    shards = manifest.get("shards")
    _ensure(isinstance(shards, list) and 0 < len(shards) <= _MAX_SHARDS,
            "base-weight shard manifest must contain 1 to 4096 shards")
    previous = None
    for shard in shards:
        _only(shard, ("filename", "size_bytes", "sha256"), "base-weight shard")
        name = shard.get("filename")
        _ensure(isinstance(name, str) and 0 < len(name.encode()) <= 255 and name.endswith(".safetensors")
                and re.fullmatch(r"[A-Za-z0-9._-]+", name) is not None,
                f"base-weight shard filename must be one portable .safetensors filename: {name!r}")
        _ensure(isinstance(shard.get("size_bytes"), int) and shard["size_bytes"] > 0,
                f"base-weight shard {name!r} must not be empty")
        _sha256("base-weight shard sha256", shard.get("sha256"))
        _ensure(previous is None or previous < name, "base-weight shard filenames must be unique and strictly sorted")
        previous = name
    _ensure(manifest.get("total_size_bytes") == sum(shard["size_bytes"] for shard in shards),
            "base-weight total_size_bytes mismatch")
    _sha256("base-weight aggregate_sha256", manifest.get("aggregate_sha256"))
    records = sorted((bytes.fromhex(shard["sha256"][7:]), shard["size_bytes"]) for shard in shards)
    digest = hashlib.sha256(b"kiln.base-model-content.v1\0" + struct.pack("<Q", len(records)))
    for raw, size in records:
        digest.update(struct.pack("<Q", size) + raw)
    _ensure(manifest["aggregate_sha256"] == "sha256:" + digest.hexdigest(), "base-weight aggregate_sha256 mismatch")


def _execution_provenance(record: Any) -> None:
    """``ExecutionProvenanceV1::validate`` (``execution_provenance.rs``): fields, kernels, then the record digest."""
    _only(record, _PROVENANCE_FIELDS[""], "execution provenance")
    parts = {name: _only(record.get(name), allowed, f"execution provenance {name}")
             for name, allowed in _PROVENANCE_FIELDS.items() if name}
    _ensure(record.get("schema_version") == 1, "unsupported execution provenance schema_version")
    _ensure(record.get("provenance_type") == "kiln.execution-provenance.v1", "invalid execution provenance_type")
    backend, build, model, precision = parts["backend"], parts["build"], parts["model"], parts["precision"]
    for label, value in (("backend.name", backend.get("name")), ("backend.device", backend.get("device")),
                         ("build.package_version", build.get("package_version")), ("build.target", build.get("target")),
                         ("precision.inference_dtype", precision.get("inference_dtype")),
                         ("precision.training_policy", precision.get("training_policy"))):
        _text(label, value)
    if build.get("git_commit") is not None:
        _text("build.git_commit", build["git_commit"])
    required = (("backend.numerical_runtime_sha256", backend.get("numerical_runtime_sha256")),
                ("build.executable_sha256", build.get("executable_sha256")),
                ("model.model_config_sha256", model.get("model_config_sha256")),
                ("model.tokenizer_vocab_sha256", model.get("tokenizer_vocab_sha256")),
                ("model.tokenizer_config_sha256", model.get("tokenizer_config_sha256")),
                ("configuration.effective_server_config_sha256",
                 parts["configuration"].get("effective_server_config_sha256")),
                ("configuration.effective_environment_sha256", parts["configuration"].get("effective_environment_sha256")))
    for label, value in required:
        _sha256(f"execution {label}", value)
    for label, value in (("build.source_tree_sha256", build.get("source_tree_sha256")),
                         ("model.chat_template_sha256", model.get("chat_template_sha256")),
                         ("model.training_chat_template_sha256", model.get("training_chat_template_sha256"))):
        if value is not None:
            _sha256(f"execution {label}", value)
    _kernels(parts["kernels"])
    _sha256("execution provenance_sha256", record.get("provenance_sha256"))
    # The digest covers every other field in Kiln's declaration order whatever the file's order, absent options
    # left out (serde's skip_serializing_if): a null a Kiln reader drops changes what it recomputes.
    identity = {name: _declared(record[name], _PROVENANCE_FIELDS.get(name)) for name in _PROVENANCE_FIELDS[""][:-1]}
    expected = "sha256:" + hashlib.sha256(_compact(identity).encode("utf-8")).hexdigest()
    _ensure(record["provenance_sha256"] == expected, "execution provenance digest mismatch: manifest has "
            f"{record['provenance_sha256']}, expected {expected}")


def _kernels(kernels: dict[str, Any]) -> None:
    _ensure(kernels.get("contract_type") == "kiln.kernel-contract.v1", "invalid execution kernel contract_type")
    versions, features = kernels.get("versions"), kernels.get("compiled_features")
    _ensure(isinstance(versions, dict) and 0 < len(versions) <= _MAX_KERNEL_ENTRIES,
            "execution kernel versions must contain 1..=64 entries")
    _ensure(isinstance(features, list) and len(features) <= _MAX_FEATURES,
            "execution compiled_features exceeds the 64-entry limit")
    for name, version in versions.items():
        _text("kernel version name", name)
        _text("kernel version value", version)
    for feature in features:
        _text("compiled feature", feature)
    _ensure(all(left < right for left, right in zip(features, features[1:])),
            "execution compiled_features must be strictly sorted and unique")
    _sha256("execution kernel contract_sha256", kernels.get("contract_sha256"))
    sorted_versions = dict(sorted(versions.items()))  # a BTreeMap serializes in key order
    expected = "sha256:" + hashlib.sha256(
        _compact(["kiln.kernel-contract.v1", sorted_versions, features]).encode("utf-8")).hexdigest()
    _ensure(kernels["contract_sha256"] == expected, "execution kernel contract digest mismatch")


def _training_precision(precision: Any) -> None:
    _only(precision, _PRECISION_FIELDS, "training precision")
    missing = [name for name in _PRECISION_FIELDS if name not in precision]
    _ensure(not missing, f"training precision lacks {missing}")
    for name in _PRECISION_FIELDS[:-1]:
        _ensure(isinstance(precision[name], str) and precision[name] != "", f"training precision {name} must be a dtype")
    _ensure(precision["stochastic_rounding"] == {"mode": "round_to_nearest"},
            "training precision stochastic_rounding must be round_to_nearest")


def _declared(value: Any, fields: tuple[str, ...] | None) -> Any:
    """A provenance part as serde writes it: its fields in declaration order, absent options left out, a map
    (``kernels.versions``, a ``BTreeMap``) in key order."""
    if fields is None:
        return value
    ordered = {name: value[name] for name in fields if value.get(name) is not None}
    if "versions" in ordered:
        ordered["versions"] = dict(sorted(ordered["versions"].items()))
    return ordered


def _compact(value: Any) -> str:
    """serde_json's compact encoding (raw UTF-8, no spaces)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
