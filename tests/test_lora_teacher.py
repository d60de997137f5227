"""A local teacher wearing a LoRA (``teachers register ALIAS BASE --adapter NAME|DIR``): Kiln's identity rule,
pinned at registration, refused at use once the adapter is rewritten, and scored as the base plus the adapter.

What a user depends on: the identity is the bare base's with ``adapter = {name, weights_sha256,
config_sha256}`` in its place; a published adapter NAME resolves through ``latest.json``; the alias is
immutable; scoring with the alias gives the rows of the base model wearing that LoRA (checked against PEFT
loaded here, independently); a rewritten adapter file is refused with ``teacher_adapter_changed`` before any
teacher weights load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln_core.canonical import sha256_prefixed
from kiln_core.contracts.latest import LatestPointer, encode_latest
from kiln_core.contracts.teachers import REGISTRY_FILE
from kiln_core.identity.hashing import IdentityHashError, adapter_config_sha256, adapter_weights_sha256
from kiln_core.scoring import ScoringError, score_examples
from kiln_core.teachers.local_registry import (LocalRegistryError, get_local_teacher, list_local_teachers,
                                               register_local_teacher)
from kiln_core.teachers.lora_teacher import TeacherAdapterError

TOP_K = 16
EXAMPLES = [
    {"messages": [{"role": "user", "content": "What is two plus two?"}], "teacher_response": "Two plus two is four."},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"}], "teacher_response": "Paris."},
]


def write_lora(base_dir: Path, directory: Path, *, seed: int) -> Path:
    """A PEFT LoRA for ``base_dir`` with random A and B (so it changes the logits), whose config names a base
    path that does not exist: the registry, not the adapter's config, says which base it sits on."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(directory))
    adapter_config = json.loads((directory / "adapter_config.json").read_text(encoding="utf-8"))
    adapter_config["base_model_name_or_path"] = "/nowhere/base-model"
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config), encoding="utf-8")
    (directory / "README.md").unlink(missing_ok=True)
    return directory


@pytest.fixture(scope="module")
def lora(tiny_teacher, tmp_path_factory) -> Path:
    return write_lora(tiny_teacher, tmp_path_factory.mktemp("loras") / "rust-helper", seed=5)


@pytest.fixture(scope="module")
def other_lora(tiny_teacher, tmp_path_factory) -> Path:
    return write_lora(tiny_teacher, tmp_path_factory.mktemp("loras") / "rust-helper", seed=6)


@pytest.fixture(scope="module")
def examples_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("examples") / "examples.jsonl"
    path.write_text("".join(json.dumps(example) + "\n" for example in EXAMPLES), encoding="utf-8")
    return path


def publish(root: Path, name: str, adapter_dir: Path) -> None:
    """``<root>/runs/<name>/latest.json`` naming ``adapter_dir``, as the publish stage writes it."""
    latest = root / "runs" / name / "latest.json"
    latest.parent.mkdir(parents=True, exist_ok=True)
    weights = adapter_dir / "adapter_model.safetensors"
    run = adapter_dir.parent
    latest.write_bytes(encode_latest(LatestPointer(
        adapter=str(adapter_dir), receipt=str(run / "train_receipt.json"), receipt_sha256="sha256:" + "1" * 64,
        run=str(run), adapter_model_sha256=sha256_prefixed(weights.read_bytes()) if weights.exists() else "sha256:0",
        dataset_sha256=None, produced_at="2026-01-01T00:00:00+00:00")))


def test_the_identity_is_the_base_identity_with_the_adapter_in_its_place(tmp_path, tiny_teacher, lora):
    bare = register_local_teacher(tmp_path / "bare", "teacher", tiny_teacher, device_kind="cpu")
    worn = register_local_teacher(tmp_path / "lora", "teacher", tiny_teacher, adapter=str(lora), device_kind="cpu")
    assert worn.identity["adapter"] == {"name": "rust-helper", "weights_sha256": adapter_weights_sha256(lora),
                                        "config_sha256": adapter_config_sha256(lora)}
    assert {**worn.identity, "adapter": None} == bare.identity  # served_model_id included: the base's
    assert bare.identity["adapter"] is None and list(worn.identity) == list(bare.identity)
    assert worn.identity_revision != bare.identity_revision
    assert worn.teacher_dir == str(tiny_teacher.resolve()) and worn.adapter_dir == str(lora.resolve())
    assert get_local_teacher(tmp_path / "lora", "teacher") == worn
    # A bare entry is written as before LoRA teachers existed: no adapter_dir key.
    stored = json.loads((tmp_path / "bare" / REGISTRY_FILE).read_text(encoding="utf-8"))["teachers"][0]
    assert "adapter_dir" not in stored
    stored = json.loads((tmp_path / "lora" / REGISTRY_FILE).read_text(encoding="utf-8"))["teachers"][0]
    assert stored["adapter_dir"] == str(lora.resolve())


def test_registering_again_is_a_no_op_and_the_alias_is_immutable(tmp_path, tiny_teacher, lora, other_lora):
    root = tmp_path / "root"
    first = register_local_teacher(root, "t", tiny_teacher, adapter=str(lora), device_kind="cpu")
    assert register_local_teacher(root, "t", tiny_teacher, adapter=str(lora), device_kind="cpu") == first
    for adapter in (str(other_lora), None):  # another LoRA's bytes, or the bare base, under the same alias
        with pytest.raises(LocalRegistryError) as caught:
            register_local_teacher(root, "t", tiny_teacher, adapter=adapter, device_kind="cpu")
        assert caught.value.code == "alias_exists" and first.identity_revision in caught.value.message
    assert [entry.alias for entry in list_local_teachers(root)] == ["t"]


def test_a_published_adapter_name_resolves_through_latest_json(tmp_path, tiny_teacher, lora):
    root = tmp_path / "root"
    run_adapter = tmp_path / "runs-copy" / "run1" / "adapter"
    shutil.copytree(lora, run_adapter)
    publish(root, "helper", run_adapter)
    entry = register_local_teacher(root, "helper-teacher", tiny_teacher, adapter="helper", device_kind="cpu")
    assert entry.adapter_dir == str(run_adapter)
    assert entry.identity["adapter"]["name"] == "helper"  # the NAME, not the directory's basename
    assert entry.identity["adapter"]["weights_sha256"] == adapter_weights_sha256(lora)


@pytest.mark.parametrize("case", ["unpublished name", "missing directory", "no weights", "pointer to nothing"])
def test_an_adapter_that_is_not_there_is_refused_with_kilns_message(tmp_path, tiny_teacher, lora, case):
    root = tmp_path / "root"
    value, where = "nope", str(root / "runs" / "nope" / "latest.json")
    if case == "missing directory":
        value = where = str(tmp_path / "absent" / "lora")
    elif case == "no weights":
        partial = tmp_path / "partial"
        partial.mkdir()
        shutil.copy(lora / "adapter_config.json", partial)
        value = where = str(partial)
    elif case == "pointer to nothing":  # published, then its run directory was removed
        where = str(tmp_path / "gone" / "adapter")
        publish(root, "nope", Path(where))
    with pytest.raises(TeacherAdapterError) as caught:
        register_local_teacher(root, "t", tiny_teacher, adapter=value, device_kind="cpu")
    assert caught.value.code == "teacher_adapter_not_found"
    assert caught.value.message.startswith(f"teacher adapter `{value}` not found at {where}")
    assert caught.value.message.endswith("— train or upload it first")
    assert not (root / REGISTRY_FILE).exists()


def test_a_directory_whose_name_is_no_adapter_name_or_a_base_that_is_an_adapter_is_refused(tmp_path, tiny_teacher, lora):
    spaced = tmp_path / "my lora"
    shutil.copytree(lora, spaced)
    with pytest.raises(TeacherAdapterError) as caught:
        register_local_teacher(tmp_path / "root", "t", tiny_teacher, adapter=str(spaced), device_kind="cpu")
    assert caught.value.code == "invalid_adapter_name" and "'my lora'" in caught.value.message
    # A base directory that is itself a PEFT adapter already wears one: refused, not stacked.
    adapter_base = tmp_path / "adapter-base"
    shutil.copytree(lora, adapter_base)
    config = json.loads((adapter_base / "adapter_config.json").read_text(encoding="utf-8"))
    (adapter_base / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(tiny_teacher)}))
    with pytest.raises(IdentityHashError) as caught:
        register_local_teacher(tmp_path / "root", "t", adapter_base, adapter=str(lora), device_kind="cpu")
    assert caught.value.code == "bad_adapter"
    assert not (tmp_path / "root" / REGISTRY_FILE).exists()


def _reference_rows(base_dir: Path, lora_dir: Path | None, student_dir: Path, scored: Path) -> list[list[list[int]]]:
    """Top-K ids at every target of every scored row, from the base (wearing the LoRA when given) loaded here
    with transformers and PEFT directly, positions from the student's tokenization of the rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln_core.scoring.examples import iter_examples
    from kiln_core.tokenization import encode_conversations, load_student_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="eager")
    if lora_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(lora_dir))
    model.eval()
    student = load_student_tokenizer(student_dir)
    encoded = encode_conversations(student, [example.conversation for example in iter_examples(str(scored))])
    rows = []
    for enc in encoded:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(enc.input_ids[None].astype(np.int64))).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        rows.append([torch.topk(logprobs[q - 1], TOP_K).indices.tolist() for q in enc.action_positions.tolist()])
    return rows


def _scored_top_ids(path: Path) -> list[list[list[int]]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[1:]]
    return [[[c["token_id"] for c in token["top_logprobs"]] for token in row["teacher_tokens"]] for row in rows]


def test_scoring_with_the_lora_teacher_is_the_base_wearing_the_adapter(tmp_path, tiny_teacher, tiny_student, lora,
                                                                       examples_file):
    root = tmp_path / "root"
    worn = register_local_teacher(root, "worn", tiny_teacher, adapter=str(lora), device_kind="cpu")
    register_local_teacher(root, "bare", tiny_teacher, device_kind="cpu")
    outs = {}
    for alias in ("worn", "bare"):
        outs[alias] = tmp_path / f"{alias}.jsonl"
        result = score_examples(str(examples_file), teacher_alias=alias, registry_root=str(root),
                                student_dir=str(tiny_student), top_k=TOP_K, out_uri=str(outs[alias]), device="cpu")
    assert outs["worn"].read_text(encoding="utf-8").splitlines()[0] == worn.off_policy_manifest
    worn_ids, bare_ids = _scored_top_ids(outs["worn"]), _scored_top_ids(outs["bare"])
    assert worn_ids != bare_ids
    assert worn_ids == _reference_rows(tiny_teacher, lora, tiny_student, outs["worn"])
    assert bare_ids == _reference_rows(tiny_teacher, None, tiny_student, outs["bare"])
    assert result.examples == len(EXAMPLES)


def test_the_on_policy_teacher_wears_the_pinned_adapter(tmp_path, tiny_teacher, lora):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kiln_core.contracts.identity import TeacherIdentity
    from kiln_core.on_policy.teacher import TeacherSource

    entry = register_local_teacher(tmp_path, "worn", tiny_teacher, adapter=str(lora), device_kind="cpu")
    identity = TeacherIdentity.model_validate(entry.identity)
    teacher = TeacherSource.local("worn", identity, entry.teacher_dir, device="cpu", dtype="float32",
                                  adapter_dir=entry.adapter_dir).load(TOP_K)
    tokens, targets = np.array([1, 5, 9, 4, 7, 3]), np.array([2, 3, 5])
    rows = teacher.score(tokens, targets)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_teacher), dtype=torch.float32,
                                                                               attn_implementation="eager"), str(lora))
    with torch.no_grad():
        logits = reference.eval()(input_ids=torch.tensor(tokens[None])).logits[0]
    expected = [torch.topk(torch.log_softmax(logits[q - 1], dim=-1), TOP_K).indices.tolist() for q in targets]
    assert rows.ids.tolist() == expected


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Any attempt to load teacher weights fails the test."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("teacher weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_a_rewritten_adapter_is_refused_at_use_before_any_weights_load(tmp_path, tiny_teacher, tiny_student, lora,
                                                                       other_lora, examples_file):
    from kiln_core.contracts.identity import TeacherIdentity
    from kiln_core.contracts.pipeline import TeacherSource as SpecTeacher
    from kiln_core.engine.stages import resolve_manifest
    from kiln_core.on_policy.teacher import LiveLocalTeacher

    root, copy = tmp_path / "root", tmp_path / "rust-helper"
    shutil.copytree(lora, copy)
    entry = register_local_teacher(root, "worn", tiny_teacher, adapter=str(copy), device_kind="cpu")
    shutil.copy(other_lora / "adapter_model.safetensors", copy / "adapter_model.safetensors")  # rewritten in place

    expected = (f"teacher 'worn' is pinned to adapter 'rust-helper', but the exact registered content could not be "
                f"loaded from {copy}")
    out = tmp_path / "out.jsonl"
    with pytest.raises(ScoringError) as caught:
        score_examples(str(examples_file), teacher_alias="worn", registry_root=str(root), student_dir=str(tiny_student),
                       top_k=TOP_K, out_uri=str(out), device="cpu")
    assert caught.value.code == "teacher_adapter_changed" and caught.value.exit_code == 2
    assert caught.value.message.startswith(expected) and "weights_sha256" in caught.value.message
    assert caught.value.message.endswith("re-register after any adapter rewrite") and not out.exists()
    with pytest.raises(TeacherAdapterError) as caught:  # the pipeline's manifest stage (both sources)
        resolve_manifest(SpecTeacher(kind="local_registry", alias="worn"), str(root))
    assert caught.value.code == "teacher_adapter_changed"
    with pytest.raises(TeacherAdapterError) as caught:  # the on-policy loader checks again before PEFT loads it
        LiveLocalTeacher.load(entry.teacher_dir, identity=TeacherIdentity.model_validate(entry.identity), top_k=TOP_K,
                              teacher_id="worn", device="cpu", adapter_dir=entry.adapter_dir)
    assert caught.value.code == "teacher_adapter_changed"
    (copy / "adapter_config.json").unlink()  # a deleted file is refused the same way
    with pytest.raises(ScoringError) as caught:
        score_examples(str(examples_file), teacher_alias="worn", registry_root=str(root), student_dir=str(tiny_student),
                       top_k=TOP_K, out_uri=str(out), device="cpu")
    assert caught.value.code == "teacher_adapter_changed" and "adapter_config.json" in caught.value.message


def test_the_refusal_comes_before_weights_load(tmp_path, tiny_teacher, tiny_student, lora, other_lora, examples_file,
                                               no_weight_loading):
    root, copy = tmp_path / "root", tmp_path / "rust-helper"
    shutil.copytree(lora, copy)
    register_local_teacher(root, "worn", tiny_teacher, adapter=str(copy), device_kind="cpu")
    shutil.copy(other_lora / "adapter_config.json", copy / "adapter_config.json")
    (copy / "adapter_config.json").write_text((copy / "adapter_config.json").read_text() + " ", encoding="utf-8")
    with pytest.raises(ScoringError) as caught:
        score_examples(str(examples_file), teacher_alias="worn", registry_root=str(root), student_dir=str(tiny_student),
                       top_k=TOP_K, out_uri=str(tmp_path / "out.jsonl"), device="cpu")
    assert caught.value.code == "teacher_adapter_changed" and "config_sha256" in caught.value.message


def test_an_entry_naming_an_adapter_dir_without_an_adapter_identity_is_corrupt(tmp_path, tiny_teacher, lora):
    register_local_teacher(tmp_path, "bare", tiny_teacher, device_kind="cpu")
    path = tmp_path / REGISTRY_FILE
    document = json.loads(path.read_text(encoding="utf-8"))
    document["teachers"][0]["adapter_dir"] = str(lora)
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(LocalRegistryError) as caught:
        get_local_teacher(tmp_path, "bare")
    assert caught.value.code == "corrupt_registry" and "adapter" in caught.value.message


def test_cli_register_with_an_adapter_and_list(tmp_path, tiny_teacher, lora, capsys):
    from flows.cli import main

    root = str(tmp_path / "data")
    assert main(["teachers", "register", "worn", str(tiny_teacher), "--adapter", str(lora), "--out", root,
                 "--device", "cpu", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["adapter_dir"] == str(lora.resolve()) and entry["identity"]["adapter"]["name"] == "rust-helper"
    assert main(["teachers", "register", "bare", str(tiny_teacher), "--out", root, "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["teachers", "list", "--out", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("\tADAPTER")
    assert lines[1].startswith("worn\t") and lines[1].endswith(f"\trust-helper weights:{adapter_weights_sha256(lora)}")
    assert lines[2].startswith("bare\t") and lines[2].endswith("\t-")

    assert main(["teachers", "register", "other", str(tiny_teacher), "--adapter", "never-published", "--out", root,
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "teacher_adapter_not_found" in err and "teacher adapter `never-published` not found at" in err
    assert main(["teachers", "register", "worn", str(tiny_teacher), "--out", root, "--device", "cpu"]) == 2
    assert "alias_exists" in capsys.readouterr().err
