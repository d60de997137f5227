"""Warm starts (``config.base_adapter``): what a name or a directory resolves to, every refusal, and the
step-0 student.

What a user depends on: a published adapter name resolves to that adapter's ``latest.json`` adapter
(an adapter directory also works); the run key follows the base adapter's content, not its name; a
missing or mismatching base adapter is refused with a stable code before any corpus work or model load;
and the warm-started student before its first step *is* the base adapter — the same logits, fp32,
tolerance 0, as the published adapter loaded with the evaluation loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln_core.canonical import sha256_prefixed
from kiln_core.contracts.latest import LatestPointer, encode_latest
from kiln_core.contracts.lora_targets import KILN_LORA_TARGETS, LoraTargets
from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.engine.base_adapter import plan_base_adapter, resolve_base_adapter
from kiln_core.errors import EnvironmentFailure
from kiln_core.training.base_adapter import BaseAdapterError, load_base_adapter, settle_base_adapter
from kiln_core.training.student import load_student

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

RANK, ALPHA = 4, 8.0
KILN_TARGETS = LoraTargets(modules=KILN_LORA_TARGETS)  # the tiny Qwen3 student's


def write_adapter(student_dir: Path, directory: Path, *, seed: int = 11, rank: int = RANK, alpha: float = ALPHA) -> Path:
    """A PEFT adapter directory for the tiny student with non-zero A and B (so it changes the logits)."""
    student = load_student(student_dir, rank=rank, alpha=alpha, seed=seed, device="cpu", precision="fp32")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in student.lora_parameters.items():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    directory.mkdir(parents=True)
    for name, data in student.peft_adapter_files().items():
        (directory / name).write_bytes(data)
    return directory


def publish(root: Path, name: str, adapter_dir: Path) -> Path:
    """``<root>/runs/<name>/latest.json`` pointing at ``adapter_dir``, as the publish stage writes it."""
    latest = root / "runs" / name / "latest.json"
    latest.parent.mkdir(parents=True, exist_ok=True)
    digest = sha256_prefixed((adapter_dir / "adapter_model.safetensors").read_bytes())
    latest.write_bytes(encode_latest(pointer_to(adapter_dir, digest)))
    return latest


def pointer_to(adapter_dir: Path, digest: str) -> LatestPointer:
    """A ``latest.json`` document naming ``adapter_dir`` (its run and receipt need not exist here)."""
    run = adapter_dir.parent
    return LatestPointer(adapter=str(adapter_dir), receipt=str(run / "train_receipt.json"),
                         receipt_sha256="sha256:" + "1" * 64, run=str(run), adapter_model_sha256=digest,
                         dataset_sha256="sha256:" + "2" * 64, produced_at="2026-01-01T00:00:00+00:00")


@pytest.fixture(scope="module")
def adapter(tiny_student, tmp_path_factory) -> Path:
    return write_adapter(tiny_student, tmp_path_factory.mktemp("base") / "adapter")


def config(**overrides) -> OpdConfig:
    return OpdConfig(training_mode="off_policy", lora_rank=RANK, lora_alpha=ALPHA, **overrides)


def test_a_name_resolves_to_its_latest_published_adapter(adapter, tmp_path):
    publish(tmp_path, "warm", adapter)
    base = resolve_base_adapter("warm", str(tmp_path))
    assert base.name == "warm" and base.uri == str(adapter)
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    assert base.adapter_model_sha256 == sha256_prefixed(weights) and base.adapter_model_bytes == len(weights)
    assert (base.rank, base.alpha) == (RANK, ALPHA)
    assert base.receipt_record() == {"path": str(adapter), "adapter_model_sha256": sha256_prefixed(weights),
                                     "adapter_model_bytes": len(weights)}


def test_a_directory_or_uri_is_taken_as_the_adapter_itself(adapter, tmp_path, monkeypatch):
    assert resolve_base_adapter(str(adapter), str(tmp_path)).uri == str(adapter)
    monkeypatch.chdir(adapter.parent)
    assert resolve_base_adapter("./adapter", str(tmp_path)).uri == str(adapter)  # relative: the working directory
    assert resolve_base_adapter(adapter.as_uri(), str(tmp_path)).adapter_model_bytes > 0
    # the trainer, given no resolved adapter, reads a directory itself (a name needs a storage root)
    assert settle_base_adapter(config(base_adapter=str(adapter)), None, KILN_TARGETS).uri == str(adapter)
    with pytest.raises(BaseAdapterError) as error:
        settle_base_adapter(config(base_adapter="warm"), None, KILN_TARGETS)
    assert error.value.code == "base_adapter_missing" and "storage root" in error.value.message


def test_a_missing_base_adapter_names_what_was_looked_up_where(adapter, tmp_path):
    with pytest.raises(BaseAdapterError) as error:
        resolve_base_adapter("never-published", str(tmp_path))
    latest = tmp_path / "runs" / "never-published" / "latest.json"
    assert error.value.code == "base_adapter_missing" and error.value.exit_code == 2
    assert error.value.field == "config.base_adapter" and str(latest) in error.value.message
    with pytest.raises(BaseAdapterError) as error:
        resolve_base_adapter(str(tmp_path / "nowhere"), str(tmp_path))
    assert error.value.code == "base_adapter_missing" and str(tmp_path / "nowhere") in error.value.message
    # latest.json points at an adapter that is gone
    gone = tmp_path / "gone"
    gone.mkdir()
    (tmp_path / "runs" / "ghost").mkdir(parents=True)
    (tmp_path / "runs" / "ghost" / "latest.json").write_bytes(encode_latest(pointer_to(gone, "sha256:00")))
    with pytest.raises(BaseAdapterError) as error:
        resolve_base_adapter("ghost", str(tmp_path))
    assert error.value.code == "base_adapter_missing" and "latest.json" in error.value.message


@pytest.mark.parametrize("change, place", [
    (lambda pointer: {key: value for key, value in pointer.items() if key != "adapter_model_sha256"},
     "adapter_model_sha256"),
    (lambda pointer: {**pointer, "adapter_path": "/elsewhere"}, "adapter_path"),
    (lambda pointer: {**pointer, "adapter": 7}, "adapter"),
])
def test_a_latest_json_that_is_not_a_pointer_is_refused_naming_the_field(adapter, tmp_path, change, place):
    latest = publish(tmp_path, "warm", adapter)
    latest.write_text(json.dumps(change(json.loads(latest.read_text()))))
    with pytest.raises(BaseAdapterError) as error:
        resolve_base_adapter("warm", str(tmp_path))
    assert (error.value.code, error.value.field, error.value.file) == ("base_adapter_missing", "config.base_adapter",
                                                                       str(latest))
    assert f"field `{place}`" in error.value.message


def test_bytes_that_are_not_the_published_ones_are_an_environment_failure(adapter, tmp_path):
    latest = publish(tmp_path, "warm", adapter)
    pointer = json.loads(latest.read_text())
    latest.write_text(json.dumps({**pointer, "adapter_model_sha256": "sha256:" + "0" * 64}))
    with pytest.raises(EnvironmentFailure) as error:
        resolve_base_adapter("warm", str(tmp_path))
    assert error.value.code == "base_adapter_changed" and error.value.exit_code == 3


@pytest.mark.parametrize("overrides, field, fragment", [
    ({"lora_rank": 8, "lora_alpha": 16.0}, "config.lora_rank", "training rank is 8, adapter 'warm' rank is 4"),
    ({"lora_alpha": 4.0}, "config.lora_alpha", "lora_alpha mismatch"),
])
def test_a_base_adapter_of_another_rank_or_alpha_is_refused(adapter, tmp_path, overrides, field, fragment):
    publish(tmp_path, "warm", adapter)
    with pytest.raises(BaseAdapterError) as error:
        plan_base_adapter(OpdConfig(training_mode="off_policy", base_adapter="warm",
                                    **{"lora_rank": RANK, "lora_alpha": ALPHA, **overrides}), str(tmp_path), KILN_TARGETS)
    assert (error.value.code, error.value.field) == ("base_adapter_mismatch", field) and fragment in error.value.message


def test_a_base_adapter_with_other_target_modules_is_refused(adapter, tmp_path):
    other = tmp_path / "attention-only"
    other.mkdir()
    (other / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**adapter_config, "target_modules": ["q_proj", "v_proj"]}))
    with pytest.raises(BaseAdapterError) as error:
        plan_base_adapter(config(base_adapter=str(other)), str(tmp_path), KILN_TARGETS)
    assert error.value.code == "base_adapter_mismatch" and "target_modules mismatch" in error.value.message


def test_tensors_that_do_not_fit_the_student_are_refused(adapter, tiny_student, tmp_path):
    """Same rank, alpha and targets, but another student's shapes (a model with a wider MLP)."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-student"
    other.mkdir()
    (other / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = sorted(name for name in tensors if "down_proj.lora_A" in name)[0]
    tensors[key] = torch.zeros(RANK, tensors[key].shape[1] + 1)
    save_file(tensors, other / "adapter_model.safetensors")
    base = plan_base_adapter(config(base_adapter=str(other)), str(tmp_path), KILN_TARGETS)
    student = load_student(tiny_student, rank=RANK, alpha=ALPHA, seed=1, device="cpu", precision="fp32")
    with pytest.raises(BaseAdapterError) as error:
        load_base_adapter(student, base)
    assert error.value.code == "base_adapter_mismatch" and key in error.value.message


def test_weights_that_changed_after_planning_are_not_loaded(adapter, tiny_student, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (copy / name).write_bytes((adapter / name).read_bytes())
    base = plan_base_adapter(config(base_adapter=str(copy)), str(tmp_path), KILN_TARGETS)
    write_adapter(tiny_student, tmp_path / "replacement", seed=99)
    (copy / "adapter_model.safetensors").write_bytes((tmp_path / "replacement" / "adapter_model.safetensors").read_bytes())
    student = load_student(tiny_student, rank=RANK, alpha=ALPHA, seed=1, device="cpu", precision="fp32")
    with pytest.raises(EnvironmentFailure) as error:
        load_base_adapter(student, base)
    assert error.value.code == "base_adapter_changed"


def test_the_warm_started_student_before_step_1_is_the_published_adapter(adapter, tiny_student, tmp_path):
    """Logits of the student the trainer starts from equal the evaluation loader's, fp32, tolerance 0."""
    from kiln_core.evaluation.models import load_eval_model
    from kiln_core.training.distributed.world import World
    from kiln_core.training.lifecycle import new_progress, start_student
    from kiln_core.contracts.stage_refs import TrainPlan
    from kiln_core.training.plan import build_plan
    from kiln_core.training.progress import Clock
    from kiln_core.storage import resolve

    publish(tmp_path, "warm", adapter)
    cfg = config(base_adapter="warm", seed=1234)  # a seed other than the adapter's: A is overwritten too
    run_dir = resolve(str(tmp_path / "runs" / "warmed" / "key"))
    train_plan = TrainPlan.for_config(cfg, run_dir.uri, "warmed", resume=None, device="cpu", precision="fp32",
                                      base_adapter=resolve_base_adapter("warm", str(tmp_path)))
    plan = build_plan(train_plan, data=_data_plan(tiny_student), run_dir=run_dir, basename=None,
                      student_dir=str(tiny_student), teacher_alias="t", world=World.current())
    assert plan.facts.base_adapter["path"] == str(adapter)
    student, optimizer = start_student(plan, str(tiny_student), new_progress(plan), gradient_checkpointing=False,
                                       clock=Clock())
    assert all(not state for state in optimizer.state.values())  # weights only: the optimizer starts fresh
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    reference = load_eval_model(tiny_student, adapter, device="cpu")
    with torch.no_grad():
        warm = student.model(input_ids=ids).logits
        published = reference.model(input_ids=ids).logits
        cold = load_student(tiny_student, rank=RANK, alpha=ALPHA, seed=1234, device="cpu",
                            precision="fp32").model(input_ids=ids).logits
    assert warm.dtype == published.dtype == torch.float32
    assert torch.equal(warm, published)
    assert not torch.equal(cold, published)  # the adapter matters: a cold student is another model


def _data_plan(student_dir: Path):
    """The smallest off-policy data side a plan needs (one example, no teacher identity)."""
    from kiln_core.identity.hashing import model_vocab_size
    from kiln_core.training import checkpoint as ckpt
    from kiln_core.training.data_identity import teacher_capabilities
    from kiln_core.training.plan import DataPlan, Schedule
    from kiln_core.contracts.training_record import TRAINING_DATA_SOURCE

    schedule = Schedule(1, 1, 1, 1)
    return DataPlan(schedule=schedule,
                    binding=ckpt.DataBinding(source_kind=ckpt.OFF_POLICY_SOURCE_KIND, content_sha256="0" * 64,
                                             item_count=1),
                    capabilities=teacher_capabilities("t", model_vocab_size(student_dir), 16, None),
                    teacher_identity=None, teacher_content_revision="sha256:" + "0" * 64, prepared_source_indices=[0],
                    examples_read=1, examples_filtered=0,
                    training_data=(TRAINING_DATA_SOURCE, "corpus.jsonl", "sha256:" + "0" * 64))
