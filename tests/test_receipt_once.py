"""The receipt is written once, passes Kiln's ``validate()``, and Kiln's adapter manifest stands beside the adapter.

Before issue 31, four places wrote ``train_receipt.json``: training created it, then the recipe record, the
ignored request keys and the gate each read it back and rewrote it. Now the trainer leaves its
``training_record.json`` and one composer (``kiln_core.training.receipt.compose_receipt``) writes the receipt
once, after the gate decided (or when nothing follows training), then Kiln's ``adapter_manifest.json``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

import jsonschema
import pytest

from gate_support import training_and_held_out

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ADAPTER = "once"
CONFIG = {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "checkpoint_interval": 2, "seed": 3,
          "learning_rate": 0.01, "lora_rank": 4, "lora_alpha": 8, "optimizer": {"kind": "adam_w"}}

# Kiln's contracts/kiln-artifacts-v1.schema.json (at 40b8a45): ``AdapterManifest`` and the definitions it uses.
# The records it takes from kiln-observability-v1.schema.json are checked by Kiln's own rules instead
# (``kiln_core.contracts.receipt_rules``), so they stand here as objects.
ADAPTER_MANIFEST_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$ref": "#/$defs/AdapterManifest",
    "$defs": {
        "AdapterManifest": {
            "type": "object", "additionalProperties": False,
            "required": ["schema_version", "manifest_type", "adapter_name", "safetensors_hash", "config_hash",
                         "receipt_hash", "parent_adapter", "model_config_hash", "kiln_commit", "training_data_hash",
                         "training_data_source", "training_data_path", "files"],
            "properties": {
                "schema_version": {"const": 1},
                "manifest_type": {"const": "kiln_adapter_manifest"},
                "adapter_name": {"$ref": "#/$defs/AdapterName"},
                "safetensors_hash": {"$ref": "#/$defs/Sha256"},
                "config_hash": {"$ref": "#/$defs/Sha256"},
                "receipt_hash": {"anyOf": [{"$ref": "#/$defs/Sha256"}, {"type": "null"}]},
                "parent_adapter": {"anyOf": [{"$ref": "#/$defs/NonEmptyString"}, {"type": "null"}]},
                "model_config_hash": {"anyOf": [{"$ref": "#/$defs/Sha256"}, {"type": "null"}]},
                "training_chat_template_hash": {"$ref": "#/$defs/Sha256"},
                "base_weight_shard_manifest": {"type": "object"},
                "execution_provenance": {"type": "object"},
                "training_precision": {"$ref": "#/$defs/TrainingCheckpointPrecision"},
                "kiln_commit": {"anyOf": [{"$ref": "#/$defs/NonEmptyString"}, {"type": "null"}]},
                "training_data_hash": {"anyOf": [{"$ref": "#/$defs/Sha256"}, {"type": "null"}]},
                "training_data_source": {"anyOf": [{"$ref": "#/$defs/NonEmptyString"}, {"type": "null"}]},
                "training_data_path": {"anyOf": [{"$ref": "#/$defs/NonEmptyString"}, {"type": "null"}]},
                "files": {"$ref": "#/$defs/AdapterManifestFiles"},
            },
        },
        "AdapterManifestFiles": {
            "type": "object", "additionalProperties": False,
            "required": ["adapter_model", "adapter_config", "train_receipt"],
            "properties": {"adapter_model": {"$ref": "#/$defs/NonEmptyString"},
                           "adapter_config": {"$ref": "#/$defs/NonEmptyString"},
                           "train_receipt": {"anyOf": [{"$ref": "#/$defs/NonEmptyString"}, {"type": "null"}]}},
        },
        "AdapterName": {"type": "string", "minLength": 1,
                        "pattern": "^(?!\\.)(?![\\s\\S]*\\.\\.)(?![\\s\\S]*[\\\\/])[\\s\\S]+$"},
        "Sha256": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
        "NonEmptyString": {"type": "string", "minLength": 1},
        "TrainingCheckpointPrecision": {
            "type": "object", "additionalProperties": False,
            "required": ["parameter_dtype", "optimizer_state_dtype", "activation_dtype", "gradient_dtype",
                         "stochastic_rounding"],
            "properties": {"parameter_dtype": {"$ref": "#/$defs/NonEmptyString"},
                           "optimizer_state_dtype": {"$ref": "#/$defs/NonEmptyString"},
                           "activation_dtype": {"$ref": "#/$defs/NonEmptyString"},
                           "gradient_dtype": {"$ref": "#/$defs/NonEmptyString"},
                           "stochastic_rounding": {"type": "object"}},
        },
    },
}


@pytest.fixture(scope="module")
def corpora(tiny_student, tmp_path_factory) -> Path:
    return training_and_held_out(tiny_student, tmp_path_factory.mktemp("receipt-once"))


def spec_for(corpora: Path, student, root: Path, **extra):
    from kiln_core.contracts.pipeline import parse_spec

    return parse_spec({"teacher": {"kind": "manifest_file", "path": str(corpora / "manifest.jsonl")},
                       "student": str(student), "corpus": str(corpora / "corpus.jsonl"), "storage_root": str(root),
                       "adapter": ADAPTER, "config": CONFIG, **extra})


def recipe():
    from kiln_core.contracts.recipe_record import RecipeRecord, TeacherDescriptor

    return RecipeRecord(kind="distill_self", mode="conciseness", name=ADAPTER,
                        teacher=TeacherDescriptor(alias="self-once:Conciseness", model_id="self-once:Conciseness"),
                        request={"name": ADAPTER, "mode": "conciseness"})


def receipt_writes(run):
    """Run ``run()`` and return what it returned and how many times it wrote a ``train_receipt.json``."""
    from kiln_core import storage

    code, writes = storage.write_bytes_atomic.__code__, []

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code is code and frame.f_locals["location"].uri.endswith("train_receipt.json"):
            writes.append(frame.f_locals["location"].uri)

    sys.setprofile(profile)
    try:
        result = run()
    finally:
        sys.setprofile(None)
    return result, writes


def test_a_gated_recipe_run_with_ignored_keys_writes_its_receipt_once(corpora, tiny_student, tmp_path):
    """Four writers before (training, the recipe, the ignored keys, the gate); one now, after the gate."""
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    spec = spec_for(corpora, tiny_student, tmp_path, quality_gate={"corpus": str(corpora / "heldout.jsonl"),
                                                                   "max_reverse_kl": 1000.0})
    spec = spec.model_copy(update={"recipe": recipe(), "ignored_request_keys": ("config.learnign_rate",)})
    result, writes = receipt_writes(lambda: run_pipeline(spec, LocalStages(handle_signals=False), device="cpu"))
    assert result.status == "success" and result.gate["outcome"] == "promoted"
    assert writes == [result.receipt]

    data = Path(result.receipt).read_bytes()
    receipt = json.loads(data)
    assert receipt["gate_outcome"] == "promoted" and receipt["quality_gate"]["outcome"] == "promoted"
    assert receipt["recipe"]["kind"] == "distill_self" and receipt["ignored_request_keys"] == ["config.learnign_rate"]
    assert json.loads((Path(result.adapter) / "receipt.json").read_text())["source_kind"] == "distill_self"
    assert json.loads(Path(result.latest).read_text())["receipt_sha256"] == "sha256:" + hashlib.sha256(data).hexdigest()

    # the same spec again: finished, decided, nothing rewritten
    again, rewrites = receipt_writes(lambda: run_pipeline(spec, LocalStages(handle_signals=False), device="cpu"))
    assert again.reused and again.gate["outcome"] == "promoted" and rewrites == []
    assert Path(again.receipt).read_bytes() == data


def test_a_failed_run_and_a_run_nothing_follows_write_the_receipt_when_training_ends(corpora, tiny_student, tmp_path):
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    committed: list[int] = []
    stopped, writes = receipt_writes(lambda: run_pipeline(
        spec_for(corpora, tiny_student, tmp_path), LocalStages(handle_signals=False, on_step_committed=committed.append,
                                                                should_cancel=lambda: bool(committed)), device="cpu"))
    assert stopped.status == "cancelled" and writes == [stopped.receipt]
    receipt = json.loads(Path(stopped.receipt).read_text())
    assert (receipt["status"], receipt["failure_reason"]) == ("failed", "cancelled")
    assert not (Path(stopped.run) / "adapter" / "adapter_manifest.json").exists()

    finished, writes = receipt_writes(lambda: run_pipeline(spec_for(corpora, tiny_student, tmp_path),
                                                           LocalStages(handle_signals=False), device="cpu"))
    assert finished.status == "success" and writes == [finished.receipt]  # the failed receipt, replaced once


def test_a_receipt_lost_between_the_training_record_and_the_receipt_is_composed_on_retry(corpora, tiny_student,
                                                                                        tmp_path):
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    spec = spec_for(corpora, tiny_student, tmp_path)
    first = run_pipeline(spec, LocalStages(handle_signals=False), device="cpu")
    adapter = (Path(first.adapter) / "adapter_model.safetensors").read_bytes()
    Path(first.receipt).unlink()  # a crash after training_record.json, before train_receipt.json
    again, writes = receipt_writes(lambda: run_pipeline(spec, LocalStages(handle_signals=False), device="cpu"))
    assert again.reused and again.status == "success" and writes == [again.receipt]  # not trained again
    assert (Path(again.adapter) / "adapter_model.safetensors").read_bytes() == adapter
    assert json.loads(Path(again.receipt).read_text())["loss_history"] == first.loss_history


def test_a_successful_run_has_kilns_adapter_manifest_beside_its_adapter(corpora, tiny_student, tmp_path):
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    result = run_pipeline(spec_for(corpora, tiny_student, tmp_path), LocalStages(handle_signals=False), device="cpu")
    adapter = Path(result.adapter)
    manifest = json.loads((adapter / "adapter_manifest.json").read_text())
    jsonschema.validate(manifest, ADAPTER_MANIFEST_SCHEMA)
    receipt = json.loads(Path(result.receipt).read_text())

    def digest(name: str) -> str:
        return "sha256:" + hashlib.sha256((adapter / name).read_bytes()).hexdigest()

    assert manifest["adapter_name"] == ADAPTER and manifest["safetensors_hash"] == digest("adapter_model.safetensors")
    assert manifest["config_hash"] == digest("adapter_config.json")
    assert manifest["model_config_hash"] == receipt["model"]["config_hash"]
    assert manifest["training_data_hash"] == receipt["training_data"]["sha256"]
    assert manifest["training_data_path"] == receipt["training_data"]["path"]
    assert manifest["base_weight_shard_manifest"] == receipt["model"]["base_weight_shard_manifest"]
    assert manifest["training_precision"] == receipt["runtime"]["training_precision"]
    # the receipt lives one level above adapter/: Kiln's restore copies files.* from the manifest's directory
    assert manifest["files"] == {"adapter_model": "adapter_model.safetensors", "adapter_config": "adapter_config.json",
                                 "train_receipt": None} and manifest["receipt_hash"] is None
    assert "execution_provenance" not in manifest


# ------------------------------------------------------------------------------------------ Kiln's validate()


@pytest.fixture(scope="module")
def kiln_receipt(corpora, tiny_student, tmp_path_factory) -> dict:
    """The receipt of a real tiny run, as the file holds it."""
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    result = run_pipeline(spec_for(corpora, tiny_student, tmp_path_factory.mktemp("kiln-rules")),
                          LocalStages(handle_signals=False), device="cpu")
    return json.loads(Path(result.receipt).read_text())


def broken(receipt: dict, path: str, value) -> dict:
    """``receipt`` with the field at the dotted ``path`` set to ``value`` (``...`` deletes it)."""
    changed = copy.deepcopy(receipt)
    *parents, name = path.split(".")
    node = changed
    for part in parents:
        node = node[part]
    if value is ...:
        del node[name]
    else:
        node[name] = value
    return changed


def reseal(receipt: dict) -> dict:
    """Recompute the execution provenance's own digest, so that a test breaks only the rule it means to."""
    from kiln_core.contracts.receipt_rules import _PROVENANCE_FIELDS, _compact, _declared

    record = receipt["runtime"]["execution_provenance"]
    identity = {name: _declared(record[name], _PROVENANCE_FIELDS.get(name)) for name in _PROVENANCE_FIELDS[""][:-1]}
    record["provenance_sha256"] = "sha256:" + hashlib.sha256(_compact(identity).encode()).hexdigest()
    return receipt


def test_a_real_receipt_passes_every_rule_of_kilns_validate(kiln_receipt):
    from kiln_core.contracts.receipt_rules import receipt_problem

    assert receipt_problem(kiln_receipt) is None
    assert kiln_receipt["model"]["base_weight_shard_manifest"] and kiln_receipt["runtime"]["execution_provenance"]


SHA = "sha256:" + "ab" * 32
KILN_RULES = [
    # validate_envelope
    ("schema_version", 2, "unsupported train-receipt schema_version 2"),
    ("receipt_type", "train_receipt", "invalid train-receipt receipt_type"),
    ("adapter_name", "  ", "train-receipt adapter_name must not be empty"),
    ("produced_at", "2026-05-01 10:00:00", "produced_at must be an RFC3339 timestamp"),  # no offset
    ("produced_at", "2026-13-01T10:00:00Z", "produced_at must be an RFC3339 timestamp"),
    ("failure_message", "boom", "successful train receipt must not carry failure_reason or failure_message"),
    ("failure_reason", "oom", "successful train receipt must not carry failure_reason or failure_message"),
    # validate_training_chat_template_identity
    ("tokenizer.training_chat_template_hash", "ab" * 32, "tokenizer.training_chat_template_hash must use sha256:"),
    ("config_hashes.training_chat_template_hash", "sha256:" + "AB" * 32, "must use sha256:<64 lowercase hex>"),
    # BaseWeightShardManifest::validate
    ("model.base_weight_shard_manifest.total_size_bytes", 1, "base-weight total_size_bytes mismatch"),
    ("model.base_weight_shard_manifest.aggregate_sha256", SHA, "base-weight aggregate_sha256 mismatch"),
    ("model.base_weight_shard_manifest.shards", [], "must contain 1 to 4096 shards"),
    ("model.base_weight_shard_manifest.schema_version", 2, "unsupported base-weight shard manifest schema_version"),
    # ExecutionProvenanceV1::validate
    ("runtime.execution_provenance.provenance_sha256", SHA, "execution provenance digest mismatch"),
    ("runtime.execution_provenance.backend.device", " cpu", "execution backend.device must be non-empty, trimmed"),
    ("runtime.execution_provenance.kernels.contract_sha256", SHA, "execution kernel contract digest mismatch"),
    ("runtime.execution_provenance.kernels.compiled_features", ["b", "a"], "strictly sorted and unique"),
    ("runtime.execution_provenance.model.model_config_sha256", "sha256:xyz", "model.model_config_sha256 must use"),
    ("runtime.execution_provenance.build.extra", "x", "has unknown field(s) ['extra']"),
    # TrainingCheckpointPrecision (deny_unknown_fields; round_to_nearest only)
    ("runtime.training_precision.extra", "x", "training precision has unknown field(s) ['extra']"),
    ("runtime.training_precision.stochastic_rounding", {"mode": "stochastic"}, "must be round_to_nearest"),
]


@pytest.mark.parametrize("path, value, message", KILN_RULES, ids=[f"{path}={value!r}"[:60] for path, value, _ in KILN_RULES])
def test_each_of_kilns_rules_refuses_the_receipt_that_breaks_it(kiln_receipt, path, value, message):
    from kiln_core.contracts.receipt_rules import receipt_problem

    changed = broken(kiln_receipt, path, value)
    if path.startswith("runtime.execution_provenance.") and not path.endswith(("provenance_sha256", "contract_sha256")):
        reseal(changed)  # only the rule under test is broken, not the record's digest
    problem = receipt_problem(changed)
    assert problem is not None and message in problem


def test_the_failure_and_template_rules_kiln_pairs(kiln_receipt):
    from kiln_core.contracts.receipt_rules import receipt_problem

    failed = {**kiln_receipt, "status": "failed", "failure_reason": "  "}
    assert receipt_problem(failed) == "failed train receipt must carry a non-empty failure_reason"
    assert receipt_problem({**failed, "failure_reason": "cancelled", "failure_message": "stopped"}) is None
    agreeing = broken(broken(kiln_receipt, "tokenizer.training_chat_template_hash", SHA),
                      "config_hashes.training_chat_template_hash", SHA)
    assert receipt_problem(agreeing) is None
    differing = broken(agreeing, "config_hashes.training_chat_template_hash", "sha256:" + "cd" * 32)
    assert "tokenizer.training_chat_template_hash" in receipt_problem(differing) and "differs from" in receipt_problem(differing)
    # a null option is what a Kiln reader drops before recomputing the digest: still the same record
    assert receipt_problem(broken(kiln_receipt, "runtime.execution_provenance.build.git_commit", None)) is None


def test_a_receipt_kilns_rules_refuse_is_refused_on_read_and_never_written(kiln_receipt, tmp_path):
    from kiln_core.contracts.training_record import TrainingRecord
    from kiln_core.storage import resolve
    from kiln_core.training.receipt import ReceiptError, compose_receipt, read_receipt, read_training_record

    run = tmp_path / "run"
    run.mkdir()
    (run / "train_receipt.json").write_text(json.dumps(broken(kiln_receipt, "produced_at", "yesterday")))
    with pytest.raises(ReceiptError) as caught:
        read_receipt(str(run))
    assert caught.value.code == "receipt_invalid" and "RFC3339" in caught.value.message

    source = Path(kiln_receipt["adapters"]["output"]["path"]).parent
    record = read_training_record(resolve(str(source)))
    blank = TrainingRecord(facts=record.facts.model_copy(update={"adapter_name": " "}), outcome=record.outcome)
    target = tmp_path / "blank"
    target.mkdir()
    with pytest.raises(ReceiptError, match="adapter_name must not be empty"):
        compose_receipt(resolve(str(target)), record=blank)
    assert not (target / "train_receipt.json").exists()
