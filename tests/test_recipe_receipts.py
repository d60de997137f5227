"""A recipe's records: a spec carrying a ``RecipeRecord`` trains like any other, and its receipt names the recipe.

The record lands in ``train_receipt.json`` (key ``recipe``) before ``latest.json`` pins the receipt's digest,
and Kiln's legacy ``receipt.json`` (``AdapterReceipt``) is written beside the adapter with Kiln's
``source_kind``, teacher descriptor, the whole request as ``hyperparameters`` and the train receipt's seed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from test_pipeline_flow import spec_dict, world  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _record(**changes):
    from kiln_core.contracts.recipe_record import RecipeRecord, TeacherDescriptor

    fields = dict(kind="distill_self", mode="conciseness", name="terse",
                  teacher=TeacherDescriptor(alias="self-terse:Conciseness", model_id="self-terse:Conciseness"),
                  teacher_identity_revision="sha256:" + "ab" * 32, request={"name": "terse", "mode": "conciseness"})
    return RecipeRecord(**{**fields, **changes})


@pytest.mark.fast
def test_the_legacy_receipt_takes_kilns_fields_from_the_record_and_the_train_receipt():
    from types import SimpleNamespace

    from kiln_core.training.receipt import recipe_receipt

    receipt = SimpleNamespace(produced_at="2026-12-02T10:00:00Z", opd=SimpleNamespace(final_opd_loss=0.25),
                              hyperparameters=SimpleNamespace(seed=7), kiln=SimpleNamespace(package_version="0.1.0"))
    legacy = recipe_receipt(_record(), receipt).model_dump(mode="json")
    assert legacy["kiln_version"] == "kiln-flows/0.1.0" and legacy["kernel_versions"] == {"kiln-flows": "0.1.0"}
    assert legacy["schema_version"] == 1 and legacy["adapter"] == "terse" and legacy["seed"] == 7
    assert legacy["source_kind"] == "distill_self" and legacy["produced_at"] == "2026-12-02T10:00:00Z"
    assert legacy["teacher"] == {"alias": "self-terse:Conciseness", "model_id": "self-terse:Conciseness",
                                 "model_version_hash": None, "identity": None}
    assert legacy["hyperparameters"] == {"name": "terse", "mode": "conciseness"}
    assert legacy["diagnostic_summary"] == {"final_loss": 0.25} and legacy["post_eval"] == {}


@pytest.mark.fast
def test_a_spec_never_shows_or_dumps_its_recipe_record(world):  # noqa: F811
    from kiln_core.contracts.pipeline import PipelineSpec, parse_spec

    spec = parse_spec({**spec_dict(world, world.base / "unused"), "adapter": "terse"})
    with_record = spec.model_copy(update={"recipe": _record()})
    assert "recipe" not in PipelineSpec.model_json_schema()["properties"]
    assert "recipe" not in with_record.model_dump() and with_record.recipe.kind == "distill_self"


def test_a_recipe_run_records_itself_in_both_receipts_before_latest_pins_them(world, tmp_path):  # noqa: F811
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    root = tmp_path / "root"
    spec = parse_spec({**spec_dict(world, root), "adapter": "terse"}).model_copy(update={"recipe": _record()})
    result = run_pipeline(spec, LocalStages(handle_signals=False))
    assert result.status == "success"
    receipt_bytes = Path(result.receipt).read_bytes()
    receipt = json.loads(receipt_bytes)
    assert receipt["recipe"] == _record().model_dump(mode="json")
    latest = json.loads(Path(result.latest).read_text())
    assert latest["receipt_sha256"] == "sha256:" + hashlib.sha256(receipt_bytes).hexdigest()
    legacy = json.loads((Path(result.adapter) / "receipt.json").read_text())
    assert legacy["source_kind"] == "distill_self" and legacy["seed"] == receipt["hyperparameters"]["seed"] == 7
    assert legacy["hyperparameters"] == {"name": "terse", "mode": "conciseness"}

    # the same spec again finds the run finished and leaves both records as they were
    again = run_pipeline(spec, LocalStages(handle_signals=False))
    assert again.reused and Path(again.receipt).read_bytes() == receipt_bytes


def test_a_plain_run_has_no_recipe_block_and_no_legacy_receipt(world, tmp_path):  # noqa: F811
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    result = run_pipeline(parse_spec(spec_dict(world, tmp_path / "plain")), LocalStages(handle_signals=False))
    assert result.status == "success"
    assert "recipe" not in json.loads(Path(result.receipt).read_text())
    assert not (Path(result.adapter) / "receipt.json").exists()


@pytest.mark.fast
def test_the_distill_group_names_its_recipes_and_refuses_none(capsys):
    from flows.cli import main

    assert main(["distill"]) == 2
    assert "choose a recipe: self | merge | pump" in capsys.readouterr().err
