"""``tasks.cache`` (``DigestCachePolicy``, where records live, what makes a cached result stale) and
``tasks.artifacts.artifact_key``: plain functions, no server. The flows that reuse or recompute a cached
result are in ``test_pipeline_flow.py`` and ``test_demo.py``."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.admit import ADMIT_CACHE
from tasks.artifacts import artifact_key
from tasks.cache import DigestCachePolicy
from kiln_core.contracts.stage_refs import CorpusRef, InputsRef

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64
STUDENT_A = "sha256:" + "1" * 64
STUDENT_B = "sha256:" + "2" * 64
KEY_RE = re.compile(r"^[a-z0-9-]*$")


def admit_inputs(**overrides):
    """The admit task's inputs, as Prefect hands them to ``compute_key``."""
    values = {
        "inputs": InputsRef(corpus_uri="file:///data/corpus.jsonl", dataset_sha256=DIGEST_A, student_dir="/models/student",
                            student_digest=STUDENT_A, effective_top_k=16),
        "dataset_sha256": DIGEST_A,
        "student_digest": STUDENT_A,
        "effective_top_k": 16,
        "pinned_revision": "sha256:" + "c" * 64,
        "storage_root": "/data/kiln",
        "manifest": {"manifest_line": "{\"schema\":\"kiln.off-policy-distillation-manifest.v1\"}"},
        "kiln_strict": False,
        "storage_options": None,
    }
    values.update(overrides)
    return values


def key_of(policy, inputs, task_ctx=None, flow_parameters=None):
    return policy.compute_key(task_ctx, inputs, flow_parameters or {})


# ---------------------------------------------------------------------------------------------
# DigestCachePolicy


def test_key_is_versioned_sha256():
    key = key_of(ADMIT_CACHE, admit_inputs())
    version, _, digest = key.rpartition("-")
    assert version == ADMIT_CACHE.version == "kiln-flows-admit-v4"
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert key == key_of(ADMIT_CACHE, admit_inputs())


@pytest.mark.parametrize(
    ("name", "other"),
    [
        ("dataset_sha256", DIGEST_B),
        ("student_digest", STUDENT_B),
        ("effective_top_k", 32),
        ("pinned_revision", "sha256:" + "d" * 64),
        ("pinned_revision", None),
        ("storage_root", "/data/other-root"),
    ],
)
def test_key_changes_with_each_named_input(name, other):
    assert name in ADMIT_CACHE.inputs
    assert key_of(ADMIT_CACHE, admit_inputs(**{name: other})) != key_of(ADMIT_CACHE, admit_inputs())


def test_every_named_input_of_the_admit_policy_is_covered():
    assert set(ADMIT_CACHE.inputs) == {"dataset_sha256", "student_digest", "effective_top_k", "pinned_revision",
                                       "storage_root"}


@pytest.mark.parametrize(
    ("name", "other"),
    [
        ("inputs", InputsRef(corpus_uri="s3://elsewhere/corpus.jsonl", dataset_sha256=DIGEST_B, student_dir="/x",
                             student_digest=STUDENT_B, effective_top_k=32)),
        ("manifest", {"manifest_line": "something else entirely"}),
        ("kiln_strict", True),
        ("storage_options", {"s3": {"key": "secret"}}),
        ("an_extra_argument", object()),  # not even JSON-serializable: never looked at
    ],
)
def test_key_ignores_inputs_it_does_not_name(name, other):
    assert name not in ADMIT_CACHE.inputs
    assert key_of(ADMIT_CACHE, admit_inputs(**{name: other})) == key_of(ADMIT_CACHE, admit_inputs())


def test_key_ignores_task_context_and_flow_parameters():
    inputs = admit_inputs()
    plain = key_of(ADMIT_CACHE, inputs)
    ctx_one = SimpleNamespace(task_run=SimpleNamespace(id="run-1", flow_run_id="flow-1"), parameters=inputs)
    ctx_two = SimpleNamespace(task_run=SimpleNamespace(id="run-2", flow_run_id="flow-2"), parameters={})
    assert key_of(ADMIT_CACHE, inputs, ctx_one, {"spec": {"adapter": "a"}}) == plain
    assert key_of(ADMIT_CACHE, inputs, ctx_two, {"spec": {"adapter": "b"}}) == plain


def test_key_distinguishes_types_and_versions():
    policy = DigestCachePolicy(version="v1", inputs=("top_k",))
    assert key_of(policy, {"top_k": 16}) != key_of(policy, {"top_k": "16"})
    assert key_of(policy, {"top_k": 16}) != key_of(DigestCachePolicy(version="v2", inputs=("top_k",)), {"top_k": 16})
    assert key_of(policy, {"top_k": 16}).startswith("v1-")


def test_pydantic_inputs_hash_by_value():
    policy = DigestCachePolicy(version="kiln-flows-materialize-v1", inputs=("corpus",))
    ref = CorpusRef(uri="/data/kiln/corpora/" + "a" * 64, dataset_sha256=DIGEST_A, source_uri="/data/corpus.jsonl",
                    examples=4, action_tokens=100, env_tokens=0, effective_top_k=16, teacher_identity_revision=None)
    same = CorpusRef.model_validate(json.loads(ref.model_dump_json()))
    assert ref is not same
    assert key_of(policy, {"corpus": ref}) == key_of(policy, {"corpus": same})
    assert key_of(policy, {"corpus": ref}) != key_of(policy, {"corpus": ref.model_copy(update={"examples": 5})})


def test_missing_named_input_raises():
    inputs = admit_inputs()
    del inputs["student_digest"]
    with pytest.raises(KeyError, match="student_digest"):
        key_of(ADMIT_CACHE, inputs)


def test_empty_policy_is_still_versioned():
    assert key_of(DigestCachePolicy(version="only"), {"anything": 1}) == key_of(DigestCachePolicy(version="only"), {})


def test_policy_pickles_round_trip(tmp_path):
    configured = ADMIT_CACHE.configure(key_storage=str(tmp_path / "cache-keys"))
    for policy in (ADMIT_CACHE, configured):
        clone = pickle.loads(pickle.dumps(policy))
        assert type(clone) is DigestCachePolicy
        assert clone == policy
        assert (clone.version, clone.inputs) == (ADMIT_CACHE.version, ADMIT_CACHE.inputs)
        assert key_of(clone, admit_inputs()) == key_of(ADMIT_CACHE, admit_inputs())
    assert str(pickle.loads(pickle.dumps(configured)).key_storage) == str(tmp_path / "cache-keys")


_CHILD = """
import json, sys
from tasks.admit import ADMIT_CACHE
from kiln_core.contracts.stage_refs import InputsRef
inputs = json.loads(sys.argv[1])
inputs["inputs"] = InputsRef.model_validate(inputs["inputs"])
print(ADMIT_CACHE.compute_key(None, inputs, {}))
"""


def test_key_is_stable_across_processes():
    inputs = admit_inputs()
    expected = key_of(ADMIT_CACHE, inputs)
    payload = json.dumps({**inputs, "inputs": inputs["inputs"].model_dump(mode="json")})
    keys = set()
    for hash_seed in ("1", "2"):  # different str hashing per process must not matter
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", _CHILD, payload], env=env, capture_output=True, text=True,
                             timeout=300, check=True)
        keys.add(out.stdout.strip().splitlines()[-1])
    assert keys == {expected}


# ---------------------------------------------------------------------------------------------
# artifact_key


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        (("train", "My_Adapter.v2"), "train-my-adapter-v2"),
        (("receipt", "Tiny_Demo.v1"), "receipt-tiny-demo-v1"),
        (("verdict", "teacher data (v2).jsonl"), "verdict-teacher-data-v2-jsonl"),
        (("a__b", "c!!"), "a-b-c"),
        (("-lead", "trail-"), "lead-trail"),
        (("UPPER", "Case"), "upper-case"),
        (("///",), "kiln-flows"),
        (("",), "kiln-flows"),
        (("_", ".", " "), "kiln-flows"),
        (("naïve", "café"), "na-ve-caf"),
    ],
)
def test_artifact_key_examples(parts, expected):
    assert artifact_key(*parts) == expected


def test_artifact_key_length_cap():
    key = artifact_key("x" * 300)
    assert key == "x" * 100
    key = artifact_key("progress", "a-" * 200)
    assert len(key) <= 100 and KEY_RE.fullmatch(key)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=80), min_size=1, max_size=4))
def test_artifact_key_is_always_a_valid_prefect_key(parts):
    key = artifact_key(*parts)
    assert KEY_RE.fullmatch(key), key
    assert 1 <= len(key) <= 100
    assert key == artifact_key(*parts)


def test_artifact_key_is_accepted_by_prefect():
    from prefect.client.schemas.actions import ArtifactCreate

    for parts in (("train-progress", "Tiny_Demo.v1"), ("verdict", "/data/Corpus Final.JSONL"), ("",)):
        key = artifact_key(*parts)
        assert ArtifactCreate(key=key, type="table", data=[]).key == key
    with pytest.raises(ValueError):
        ArtifactCreate(key="tiny_demo.v1", type="table", data=[])


# ---------------------------------------------------------------------------------------------
# Caches are hints: records under the storage root, results checked against storage before reuse


def test_cache_records_and_results_live_under_a_local_storage_root_and_nowhere_for_others(tmp_path):
    from prefect.cache_policies import NO_CACHE

    from tasks.cache import cache_options

    options = cache_options(ADMIT_CACHE, str(tmp_path / "root"), refresh=True)
    assert str(options["cache_policy"].key_storage) == str(tmp_path / "root" / "prefect" / "cache-keys")
    assert options["result_storage"] == tmp_path / "root" / "prefect" / "results"
    assert options["refresh_cache"] is True
    assert key_of(options["cache_policy"], admit_inputs()) == key_of(ADMIT_CACHE, admit_inputs())
    # Prefect keeps results elsewhere only through a saved block: an object store root gets no cache at all
    assert cache_options(ADMIT_CACHE, "memory://kiln-root") == {"cache_policy": NO_CACHE, "persist_result": False}


def test_a_scored_corpus_is_stale_when_missing_or_changed(tmp_path):
    import hashlib

    from kiln_core.contracts.stage_refs import ScoredRef
    from kiln_core.engine.stages import stale_reason

    scored = tmp_path / "scored.jsonl"
    scored.write_bytes(b'{"manifest": 1}\n{"row": 1}\n')
    ref = ScoredRef(uri=str(scored), sha256="sha256:" + hashlib.sha256(scored.read_bytes()).hexdigest(), examples=1,
                    reused=False)
    assert stale_reason(ref) is None
    scored.write_bytes(scored.read_bytes() + b'{"row": 2}\n')
    assert f"{scored} holds sha256:" in stale_reason(ref) and f"the result records {ref.sha256}" in stale_reason(ref)
    scored.unlink()
    assert stale_reason(ref) == f"{scored} does not exist"


def test_a_damaged_materialization_is_stale_and_admitted_again_only_when_asked(tiny_student, tmp_path):
    from kiln_core.contracts.pipeline import TeacherSource
    from kiln_core.engine.stages import (MaterializationMismatch, admit, fingerprint, resolve_manifest, stale_reason,
                                         verify)
    from kiln_core.synthetic import synthesize_corpus

    corpus = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=2, top_k=16, seed=4)
    (tmp_path / "manifest.jsonl").write_text(Path(corpus).read_text().splitlines()[0] + "\n")
    manifest = resolve_manifest(TeacherSource(kind="manifest_file", path=str(tmp_path / "manifest.jsonl")), str(tmp_path))
    inputs = fingerprint(str(corpus), str(tiny_student), 16)
    root = tmp_path / "root"
    ref = admit(inputs, manifest, str(root))
    assert stale_reason(ref) is None

    targets = Path(ref.uri) / "targets.parquet"
    targets.write_bytes(targets.read_bytes()[:-1] + b"\0")  # one byte of storage damage
    assert "does not match admission.json" in stale_reason(ref)
    reused = admit(inputs, manifest, str(root))  # admission alone reuses what is committed, damaged or not
    assert reused.reused and reused.uri == ref.uri
    with pytest.raises(MaterializationMismatch):
        verify(reused)

    again = admit(inputs, manifest, str(root), replace_damaged=True)
    assert not again.reused and again.uri == ref.uri and stale_reason(again) is None
    set_aside = [path.name for path in (root / "corpora").iterdir() if ".damaged-" in path.name]
    assert len(set_aside) == 1 and set_aside[0].startswith("." + Path(ref.uri).name)  # kept for a look, hidden

    assert admit(inputs, manifest, str(root), replace_damaged=True).reused  # an intact one is left alone
    shutil.rmtree(ref.uri)
    assert "not a committed corpus materialization" in stale_reason(ref)
