"""The README's worked examples run as written: a newcomer copies them after ``kiln-flows demo``.

Each test takes one shell block out of README.md, lays out what the demo leaves behind (its tiny
models and examples under ``./kiln-data``, built by the demo's own ``prepare_demo``, fewer examples)
and runs the block with bash in a fresh directory, ``kiln-flows`` being this interpreter's CLI. If
the README's commands, request fields or paths stop working, these tests fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.demo import prepare_demo

REPO = Path(__file__).resolve().parent.parent
# The demo writes 16 examples; the README's commands do not depend on the count, and 4 train 4x faster.
DEMO_EXAMPLES = 4

pytestmark = pytest.mark.slow


def readme_block(containing: str) -> str:
    """The one ```bash block of README.md whose text contains ``containing``."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = [block for block in re.findall(r"^```bash\n(.*?)^```$", readme, flags=re.S | re.M) if containing in block]
    assert len(blocks) == 1, f"README.md has {len(blocks)} bash blocks containing {containing!r}, expected 1"
    return blocks[0]


def run_after_demo(block: str, workdir: Path) -> subprocess.CompletedProcess:
    """Run ``block`` with bash in ``workdir``, where the demo's models and examples already are."""
    prepare_demo(str(workdir / "kiln-data"), DEMO_EXAMPLES)
    script = 'kiln-flows() { "$KILN_FLOWS_PYTHON" -m flows.cli "$@"; }\n' + block
    env = dict(os.environ)
    env.update({
        "KILN_FLOWS_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",  # tiny matrices: one thread is the fastest on a shared machine
    })
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=900)


def published_receipt(root: Path, adapter: str) -> dict:
    """The receipt ``runs/<adapter>/latest.json`` points at (it exists only after a successful publish)."""
    latest = json.loads((root / "runs" / adapter / "latest.json").read_text(encoding="utf-8"))
    assert Path(latest["adapter"], "adapter_model.safetensors").is_file()
    return json.loads(Path(latest["receipt"]).read_text(encoding="utf-8"))


def test_off_policy_request_example_trains_and_publishes(tmp_path):
    block = readme_block("kiln-flows train --request offpolicy-request.json")
    done = run_after_demo(block, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    request = json.loads((tmp_path / "offpolicy-request.json").read_text(encoding="utf-8"))
    assert request["dataset_path"] and request["config"]["training_mode"] == "off_policy"
    receipt = published_receipt(tmp_path / "kiln-data", "tiny-offpolicy")
    assert receipt["status"] == "success"
    corpus = tmp_path / request["dataset_path"]  # relative to the request file, as the README says
    assert receipt["training_data"]["sha256"] == "sha256:" + hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert receipt["opd"]["top_k"] == request["config"]["top_k"]


def follow_the_corpus_comment(spec: str) -> str:
    """deployments/example-pipeline.yaml as its ``corpus:`` comment says to edit it for Example 1's corpus: the
    commented-out ``teacher:`` and ``corpus:`` lines replace the teacher block and the ``examples:`` line."""
    lines = spec.splitlines()
    replacements = [line[2:] for line in lines if line.startswith(("# teacher:", "# corpus:"))]
    assert replacements, "the example spec's comment names no corpus (and teacher) to use"
    kept, in_teacher = [], False
    for line in lines:
        if line.startswith("teacher:"):
            in_teacher = True
            continue
        if in_teacher and line.startswith((" ", "\t")):
            continue
        in_teacher = False
        if not line.startswith("examples:"):
            kept.append(line)
    return "\n".join(replacements + kept) + "\n"


def test_the_example_spec_trains_on_example_1s_corpus_as_its_comment_says(tmp_path):
    """The README's Example 1 corpus under deployments/example-pipeline.yaml's own commented ``corpus:`` line:
    scored by the teacher registered as ``tiny-teacher``, it is pinned to that alias (a ``local_dir`` teacher
    is another identity: ``identity_mismatch``), and the comment says so."""
    spec = follow_the_corpus_comment((REPO / "deployments" / "example-pipeline.yaml").read_text(encoding="utf-8"))
    (tmp_path / "pipeline.yaml").write_text(spec, encoding="utf-8")
    block = readme_block("kiln-flows train --request offpolicy-request.json")
    done = run_after_demo(block + "\nkiln-flows run pipeline.yaml\n", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    receipt = published_receipt(tmp_path / "kiln-data", "example")
    corpus = tmp_path / "teacher-data.jsonl"
    assert receipt["training_data"]["sha256"] == "sha256:" + hashlib.sha256(corpus.read_bytes()).hexdigest()


def test_on_policy_request_example_is_small_and_trains(tmp_path):
    block = readme_block("kiln-flows train --request onpolicy-request.json")
    done = run_after_demo(block, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    request = json.loads((tmp_path / "onpolicy-request.json").read_text(encoding="utf-8"))
    receipt = published_receipt(tmp_path / "kiln-data", "tiny-onpolicy")
    assert receipt["status"] == "success" and receipt["opd"]["training_mode"] == "on_policy"
    # sized by the request, not by Kiln's auto-scaling (64 samples per prompt below 50 prompts)
    candidates = len(request["prompts"]) * request["config"]["samples_per_prompt"]
    assert receipt["opd"]["samples_per_prompt"] == request["config"]["samples_per_prompt"] and candidates <= 8


def test_distill_self_example_trains_with_the_privileged_teacher_and_lists_recipes(tmp_path):
    block = readme_block("kiln-flows distill self --request self.json")
    done = run_after_demo(block, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    request = json.loads((tmp_path / "self.json").read_text(encoding="utf-8"))
    receipt = published_receipt(tmp_path / "kiln-data", request["name"])
    assert receipt["status"] == "success" and receipt["data"]["examples_trained"] == request["config"]["epochs"]
    assert (receipt["recipe"]["kind"], receipt["recipe"]["mode"]) == ("distill_self", "conciseness")
    assert "merge-my-loras" in done.stdout  # recipe list --all shows Kiln's built-ins, each with why it cannot run
    told = done.stdout + done.stderr
    assert "1 prompt," in told and "1 prompts" not in told  # the request has one prompt
