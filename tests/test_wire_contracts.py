"""Wire formats are the floor: each file kiln-flows writes has one strict model in ``kiln_core.contracts``.

What a user depends on: the files of a run (``latest.json``, ``train_receipt.json``, the checkpoint's
manifest, loop state and extension, the eval curve inside them, ``admission.json``, ``teachers.json``)
keep their exact bytes — ``latest.json`` pins the receipt's digest, the manifest pins every file's —
and parse back through their model into the same bytes; and whoever reads or writes one of them finds
its model in one place, ``kiln_core.contracts``.
"""

from __future__ import annotations

import json
import shutil
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from kiln_core.contracts.latest import LATEST_FILE, LatestPointer, decode_latest, encode_latest
from test_eval_watch import adam, held_out
from test_trainer import run

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

RUN_KEY = "3f2a9c0d1e2b4a5c"


@pytest.fixture(scope="module")
def watched_run(tiny_student, tmp_path_factory) -> Path:
    """One real watched training run with checkpoints: adapter, receipt with its eval curve, checkpoints."""
    root = tmp_path_factory.mktemp("wire") / "runs" / "demo" / RUN_KEY
    result = run(tiny_student, root, adam(3e-3, checkpoint_interval=4), eval_watch=held_out(stop_on_divergence=False))
    assert result.status == "success" and result.eval_curve is not None
    return root


def test_latest_json_bytes_are_the_published_ones_and_round_trip(watched_run, tmp_path):
    from kiln_core.canonical import sha256_prefixed
    from kiln_core.engine.publish import latest_pointer, write_latest

    run_dir = tmp_path / "runs" / "demo" / RUN_KEY
    shutil.copytree(watched_run, run_dir)
    written = write_latest(str(run_dir))
    data = (run_dir.parent / LATEST_FILE).read_bytes()
    assert written.uri == str(run_dir.parent / LATEST_FILE)
    receipt_bytes = (run_dir / "train_receipt.json").read_bytes()
    receipt = json.loads(receipt_bytes)
    # the document as publication wrote it before the model existed: these keys in this order, indent 2
    expected = json.dumps({
        "adapter": str(run_dir / "adapter"),
        "receipt": str(run_dir / "train_receipt.json"),
        "receipt_sha256": sha256_prefixed(receipt_bytes),
        "run": str(run_dir),
        "adapter_model_sha256": sha256_prefixed((run_dir / "adapter" / "adapter_model.safetensors").read_bytes()),
        "dataset_sha256": receipt["training_data"]["sha256"],
        "produced_at": receipt["produced_at"],
    }, indent=2).encode("utf-8")
    assert data == expected and not data.endswith(b"\n")
    pointer = decode_latest(data)
    assert pointer == latest_pointer(str(run_dir)) and encode_latest(pointer) == data


@pytest.mark.parametrize("change", [
    lambda document: {key: value for key, value in document.items() if key != "receipt_sha256"},
    lambda document: {**document, "extra": 1},
    lambda document: {**document, "run": None},
])
def test_latest_pointer_is_strict(change):
    document = dict(adapter="/r/a", receipt="/r/t", receipt_sha256="sha256:0", run="/r", adapter_model_sha256="sha256:1",
                    dataset_sha256=None, produced_at="2026-01-01T00:00:00+00:00")
    assert decode_latest(json.dumps(document)) == LatestPointer(**document)
    with pytest.raises(ValidationError):
        decode_latest(json.dumps(change(document)))


def test_the_receipt_and_its_eval_curve_round_trip_byte_for_byte(watched_run):
    from kiln_core.contracts.eval_curve import EvalCurve
    from kiln_core.contracts.receipt import TrainReceipt, encode_receipt

    data = (watched_run / "train_receipt.json").read_bytes()
    receipt = TrainReceipt.model_validate_json(data)
    assert encode_receipt(receipt) == data
    curve = json.loads(data)["eval_curve"]
    assert len(curve["points"]) > 1  # a watched run: the curve is really in the file
    assert EvalCurve.model_validate_json(json.dumps(curve)) == receipt.eval_curve


def test_every_checkpoint_file_round_trips_byte_for_byte(watched_run):
    from kiln_core.contracts.checkpoint import (
        EXTENSION_FILE,
        LOOP_STATE_FILE,
        MANIFEST_FILE,
        CheckpointManifest,
        KilnFlowsState,
        OpdLoopState,
    )
    from kiln_core.training.checkpoint.write import pretty_json

    checkpoints = sorted(watched_run.glob("*.kiln-checkpoint"))
    assert checkpoints, "the watched run wrote no checkpoint"
    for checkpoint in checkpoints:
        for name, model in ((MANIFEST_FILE, CheckpointManifest), (LOOP_STATE_FILE, OpdLoopState),
                            (EXTENSION_FILE, KilnFlowsState)):
            data = (checkpoint / name).read_bytes()
            assert pretty_json(model.model_validate_json(data)) == data, f"{checkpoint.name}/{name}"
        assert KilnFlowsState.model_validate_json((checkpoint / EXTENSION_FILE).read_bytes()).eval_curve is not None


def test_admission_json_round_trips_byte_for_byte(tiny_student, tmp_path):
    from kiln_core.admission import admit_corpus
    from kiln_core.contracts.admission import COMMIT_FILE, AdmissionRecord
    from kiln_core.synthetic import synthesize_corpus
    from kiln_core.tokenization import load_student_tokenizer

    corpus = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=3, top_k=32, seed=5)
    result = admit_corpus(str(corpus), str(tiny_student), student=load_student_tokenizer(tiny_student),
                          out_root=str(tmp_path / "root"), top_k=32)
    data = (Path(result.materialized) / COMMIT_FILE).read_bytes()
    assert AdmissionRecord.model_validate_json(data).model_dump_json(indent=2).encode("utf-8") == data


def test_teachers_json_round_trips_byte_for_byte(tiny_teacher, tmp_path):
    from kiln_core.contracts.teachers import REGISTRY_FILE, LocalTeachersFile, encode_teachers
    from kiln_core.teachers.local_registry import register_local_teacher

    register_local_teacher(tmp_path, "tiny", tiny_teacher, device_kind="cpu")
    data = (tmp_path / REGISTRY_FILE).read_bytes()
    assert encode_teachers(LocalTeachersFile.model_validate(json.loads(data)).teachers) == data
    with pytest.raises(ValidationError):  # an unknown top-level key is not a teachers.json
        LocalTeachersFile.model_validate({**json.loads(data), "extra": []})


def _models(hint: object) -> list[type[BaseModel]]:
    """The pydantic models a type hint names (through ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return [hint]
    if isinstance(hint, (types.UnionType, types.GenericAlias)) or typing.get_origin(hint) is not None:
        return [model for argument in typing.get_args(hint) for model in _models(argument)]
    return []


def _wire_models() -> dict[str, list[type[BaseModel]]]:
    """Each wire file kiln-flows writes → the models its own reader or writer uses (found from the code)."""
    from kiln_core.engine.publish import latest_pointer
    from kiln_core.materialize import Materialization
    from kiln_core.oracle.request import LoadedRequest, validate_request_object
    from kiln_core.teachers import local_registry
    from kiln_core.training.checkpoint.load import LoadedCheckpoint
    from kiln_core.training.receipt import (adapter_manifest, build_receipt, read_receipt, read_training_record,
                                            write_training_record)

    loaded = typing.get_type_hints(LoadedCheckpoint)
    receipt = typing.get_type_hints(read_receipt)["return"]
    return {
        "train_receipt.json": _models(receipt) + _models(typing.get_type_hints(build_receipt)["return"]),
        "training_record.json": (_models(typing.get_type_hints(read_training_record)["return"])
                                 + _models(typing.get_type_hints(write_training_record)["record"])),
        "adapter_manifest.json": _models(typing.get_type_hints(adapter_manifest)["return"]),
        "latest.json": _models(typing.get_type_hints(latest_pointer)["return"]),
        "checkpoint_manifest.json": _models(loaded["manifest"]),
        "opd_loop_state.json": _models(loaded["loop_state"]),
        "kiln_flows_state.json": _models(loaded["extension"]),
        "eval_curve (receipt, kiln_flows_state.json)": (_models(typing.get_type_hints(receipt)["eval_curve"])
                                                        + _models(typing.get_type_hints(loaded["extension"])["eval_curve"])),
        "admission.json": _models(typing.get_type_hints(Materialization)["record"]),
        "teachers.json": (_models(typing.get_type_hints(local_registry._read_entries)["return"])
                          + [local_registry.LocalTeachersFile]),
        "oracle request (kiln.hf-next-token-request.v1)": (
            _models(typing.get_type_hints(validate_request_object)["return"])
            + _models(typing.get_type_hints(LoadedRequest)["request"])),
    }


def test_every_wire_file_is_read_and_written_through_a_model_in_contracts():
    found = _wire_models()
    for wire_file, models in found.items():
        assert models, f"{wire_file}: no pydantic model found where the pipeline reads or writes it"
        for model in models:
            assert model.__module__.startswith("kiln_core.contracts."), f"{wire_file}: {model.__qualname__} " \
                f"lives in {model.__module__}, not in kiln_core.contracts"


def test_the_stage_refs_prefect_persists_are_contracts():
    """What each pipeline stage returns (persisted by Prefect as JSON, shipped to a training worker) is a
    wire format too: the refs and the plan, down to the base adapter the plan carries."""
    from kiln_core import engine

    stage_refs = [engine.ManifestRef, engine.InputsRef, engine.CorpusRef, engine.TrainPlan, engine.TrainRef,
                  engine.PublishRef, engine.PipelineResult]
    for model in stage_refs + [typing.get_type_hints(engine.TrainPlan)["base_adapter"].__args__[0]]:
        assert model.__module__.startswith("kiln_core.contracts."), f"{model.__qualname__} lives in {model.__module__}"
