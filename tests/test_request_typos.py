"""A typo in a Kiln request is refused, naming the key and the field it probably meant; ``--kiln-lenient``
keeps Kiln's ignore-unknown-keys parsing, and then says so on stderr and in the receipt.

Both run ``kiln-flows train`` in a subprocess, as a user would.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln_core.synthetic import synthesize_corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 5, "epochs": 1,
          "checkpoint_interval": None, "optimizer": {"kind": "adam_w"}}


@pytest.fixture(scope="module")
def typo_request(tiny_student, tmp_path_factory) -> Path:
    """A request whose config misspells ``learning_rate`` (next to its corpus and teacher manifest)."""
    directory = tmp_path_factory.mktemp("typos")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=2, top_k=16, seed=6)
    (directory / "teacher-manifest.jsonl").write_text((directory / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    request = directory / "typo.json"
    request.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl",
                                   "config": {**CONFIG, "learnign_rate": 0.5}}))
    return request


def train(request: Path, student: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "flows.cli", "train", "--request", str(request), "--adapter", "typo",
            "--student", str(student), "--out", str(out), "--quiet", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def test_a_misspelled_config_key_is_refused_naming_it_and_the_field_it_meant(typo_request, tiny_student, tmp_path):
    done = train(typo_request, tiny_student, tmp_path / "out")
    assert done.returncode == 2, done.stderr
    first = next(line for line in done.stderr.splitlines() if line.strip())
    assert "[invalid_request]" in first and "`config.learnign_rate`" in first, first
    assert "did you mean `learning_rate`?" in first, first
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "runs").exists()  # nothing trained, nothing published


def test_kiln_lenient_trains_as_kiln_would_and_names_each_ignored_key(typo_request, tiny_student, tmp_path):
    done = train(typo_request, tiny_student, tmp_path / "out", "--kiln-lenient", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert any("`config.learnign_rate`" in line and "`learning_rate`" in line for line in warnings), done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    receipt_bytes = Path(result["receipt"]).read_bytes()
    receipt = json.loads(receipt_bytes)
    assert receipt["ignored_request_keys"] == ["config.learnign_rate"]
    assert receipt["config"]["learning_rate"] is None  # the typo did not set it: Kiln's default ran
    assert receipt["hyperparameters"]["learning_rate"] == 1e-5  # adam_w's default
    # the receipt was completed before latest.json, whose digest covers it
    latest = json.loads(Path(result["latest"]).read_text())
    assert latest["receipt_sha256"] == "sha256:" + hashlib.sha256(receipt_bytes).hexdigest()


def test_a_multi_node_job_is_made_by_the_same_door_with_the_same_rule(typo_request, tiny_student, tmp_path):
    """``kiln-flows train --write-job`` (torchrun on several nodes) reads the request the same way, and the job's
    plan carries the ignored key to the receipt rank 0 writes."""
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.engine import spec_from_request

    common = {"adapter": "typo", "student_dir": str(tiny_student), "out_root": str(tmp_path / "out"), "nproc": 2}
    with pytest.raises(ConfigError) as caught:
        spec_from_request(str(typo_request), **common)
    assert (caught.value.code, caught.value.field) == ("invalid_request", "config.learnign_rate")
    run = spec_from_request(str(typo_request), kiln_lenient=True, **common)
    assert any("`config.learnign_rate`" in warning for warning in run.warnings)
    assert run.job(device="cpu").plan.ignored_request_keys == ("config.learnign_rate",)