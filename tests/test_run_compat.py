"""Existing runs keep their run keys and their checkpoint bytes.

A run key names the run directory a retry finds (``kiln_core.engine.runs``), and a checkpoint's
``checkpoint_manifest.json`` and ``kiln_flows_state.json`` are what a resume compares. Both are
contracts with runs already on storage: the digests below were computed on the tree before the
run's settings were resolved into one model (issue 31), and a refactor that changes them strands
every existing run. They are compatibility pins, not expected outputs of a computation.

The fixtures are deterministic: the tiny student's weights come from a seed, the corpus from a seed,
the teacher is the corpus's synthetic manifest (no library version in it), and training is bitwise
exact on CPU with one thread. What is not part of the contract is taken out before hashing: the
creation time, and the execution provenance (it digests the kiln-flows sources themselves, so every
edit changes it; a resume compares it with the running process, not with a pin).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kiln_core.synthetic import synthesize_corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE_CONFIG = {"training_mode": "off_policy", "top_k": 20, "epochs": 1, "checkpoint_interval": 2, "learning_rate": 0.01,
               "lora_rank": 4, "lora_alpha": 8, "optimizer": {"kind": "adam_w"}}

# The run keys of fixed specs (seed left null: the seed is derived from the key), on the tree before issue 31.
PINNED_RUN_KEYS = {
    "default": "5419c04e403181fd",
    "seeded": "d8d02d8c175fddf9",
    "two_ranks": "26f32e8582fc98c2",
    "schedule_and_packing": "24c3393b46717ba9",
    "tail_loss": "9cd0ba4a29ae290b",
}
VARIANTS = {
    "default": {},
    "seeded": {"config": {"seed": 11}},
    "two_ranks": {"distributed": {"nproc": 2}},
    "schedule_and_packing": {"config": {"lr_schedule": {"kind": "cosine", "warmup_steps": 1}, "pack_sequences": True,
                                        "sequences_per_step": 2}},
    "tail_loss": {"config": {"loss": "teacher_top_k_tail"}},
}
# sha256 of each checkpoint file of the fixed tiny run (step 2), volatile fields removed (module docstring).
PINNED_CHECKPOINT_DIGESTS = {
    "default": {"checkpoint_manifest.json": "ee3ef24e52c670eee2d1d7ced002a7b1902b2b3bc418b4d147447fb230de77f2",
                "kiln_flows_state.json": "c2108dd3cf694d205f3348c6899a1c53a9979b44825a42dc29a451f477aa34ef"},
    "tail_loss": {"checkpoint_manifest.json": "9fd5a409cedc766152d01abfaedd0c06d89f68141976ecdd82bd59783decbcdc",
                  "kiln_flows_state.json": "4341f082e34e055e1e76b455037dff3a7c5b406e6f7c9b01a7231310c0ba1257"},
}


@pytest.fixture(scope="module")
def corpus(tiny_student, tmp_path_factory) -> Path:
    return synthesize_corpus(tiny_student, tmp_path_factory.mktemp("compat") / "corpus.jsonl", n_examples=4, top_k=16,
                             seed=0)


def spec_of(variant: str, student: Path, corpus: Path, root: Path):
    from kiln_core.contracts.pipeline import parse_spec

    overrides = VARIANTS[variant]
    return parse_spec({
        "teacher": {"kind": "manifest_file", "path": str(corpus)}, "student": str(student), "corpus": str(corpus),
        "storage_root": str(root), "adapter": "compat",
        "config": {**BASE_CONFIG, **overrides.get("config", {})},
        **{key: value for key, value in overrides.items() if key != "config"},
    })


@pytest.mark.parametrize("variant", sorted(PINNED_RUN_KEYS))
def test_a_fixed_spec_keeps_its_run_key(variant, tiny_student, corpus, tmp_path):
    from kiln_core.engine.pipeline import prepare

    ready = prepare(spec_of(variant, tiny_student, corpus, tmp_path), device="cpu")
    assert ready.plan.inputs_key == PINNED_RUN_KEYS[variant]
    assert ready.plan.run_uri.rstrip("/").endswith(f"/runs/compat/{PINNED_RUN_KEYS[variant]}")


def normalized_digest(name: str, data: bytes) -> str:
    """The file's sha256 with what is not part of the contract taken out (module docstring)."""
    if name == "checkpoint_manifest.json":
        manifest = json.loads(data)
        manifest["created_at"] = None
        manifest["auxiliary_state"]["execution_provenance"] = None
        data = json.dumps(manifest, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("variant", sorted(PINNED_CHECKPOINT_DIGESTS))
def test_a_fixed_tiny_run_writes_the_same_checkpoint_bytes(variant, tiny_student, corpus, tmp_path):
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    result = run_pipeline(spec_of(variant, tiny_student, corpus, tmp_path), LocalStages(handle_signals=False),
                          device="cpu")
    assert result.status == "success"
    checkpoint = Path(result.run) / "compat-checkpoint-step-00000002.kiln-checkpoint"
    digests = {name: normalized_digest(name, (checkpoint / name).read_bytes()) for name in PINNED_CHECKPOINT_DIGESTS[variant]}
    assert digests == PINNED_CHECKPOINT_DIGESTS[variant]
