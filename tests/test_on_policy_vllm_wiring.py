"""Choosing vLLM for an on-policy run: the spec's ``vllm:`` block and ``kiln-flows train --vllm-rollouts``.

What a user depends on: a request trained from the command line with ``--vllm-rollouts`` (and
``--vllm-teacher``) samples on the server and says so in its receipt; a server that is down ends the
command with exit 3 and names the code; a ``vllm:`` block is refused for a corpus (it is already scored)
and where the server could not read the LoRA, before any work.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from flows.cli import main
from kiln_core.contracts.pipeline import SpecError, parse_spec
from on_policy_support import chat
from test_on_policy_cli import ALIAS, root  # noqa: F401 - a storage root with the tiny teacher registered
from test_on_policy_vllm_rollouts import start_server, stop_server

PROMPTS = [chat("What is two plus two?"), chat("Name a colour.")]
CONFIG = {"samples_per_prompt": 2, "max_tokens": 4, "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 5,
          "learning_rate": 2e-2, "checkpoint_interval": 2, "epochs": 1}
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


@pytest.fixture(scope="module")
def server(root, tiny_student, tiny_teacher, tmp_path_factory):  # noqa: F811
    """One fake server: the student with LoRA loading, and the registered teacher's identity for scoring."""
    from kiln_core.teachers.local_registry import get_local_teacher

    directory = tmp_path_factory.mktemp("vllm-server")
    manifest = directory / "manifest.jsonl"
    manifest.write_text(get_local_teacher(str(root), ALIAS).off_policy_manifest + "\n", encoding="utf-8")
    process, url = start_server(["--student", str(tiny_student), "--teacher", str(tiny_teacher),
                                 "--manifest", str(manifest)], directory / "server.log")
    try:
        yield url
    finally:
        stop_server(process)


def kiln_flows(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def write_request(directory: Path) -> str:
    path = directory / "request.json"
    path.write_text(json.dumps({"teacher": ALIAS, "prompts": PROMPTS, "config": CONFIG}))
    return str(path)


def test_train_with_vllm_rollouts_and_teacher_end_to_end(root, server, tiny_student, tmp_path):  # noqa: F811
    before = httpx.get(f"{server}/stats").json()
    done = kiln_flows("train", "--request", write_request(tmp_path), "--adapter", "vllm-cli", "--student",
                      str(tiny_student), "--out", str(root), "--vllm-rollouts", f"{server}/ok", "--vllm-teacher",
                      f"{server}/ok", "--vllm-sync-dir", str(tmp_path / "sync"), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "success" and result["steps"] >= 1
    receipt = json.loads((Path(result["run"]) / "train_receipt.json").read_text())
    assert receipt["opd"]["training_mode"] == "on_policy"
    assert receipt["opd"]["rollout_backend"] == "vllm" and receipt["opd"]["teacher_backend"] == "vllm"
    after = httpx.get(f"{server}/stats").json()
    assert after["rollouts"] - before["rollouts"] == 4 and after["held"] == []  # 2 prompts × 2 samples, cleaned up
    assert "vllm-cli" in result["adapter"] and list((tmp_path / "sync").iterdir()) == []


def test_a_rollout_server_that_is_down_exits_3_naming_the_code(root, tiny_student, tmp_path):  # noqa: F811
    done = kiln_flows("train", "--request", write_request(tmp_path), "--adapter", "vllm-down", "--student",
                      str(tiny_student), "--out", str(root), "--vllm-rollouts", "http://127.0.0.1:9")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "vllm_unreachable" in done.stderr and "Traceback" not in done.stderr


def test_sync_dir_without_a_rollout_server_is_refused(root, tiny_student, tmp_path, capsys):  # noqa: F811
    code = main(["train", "--request", write_request(tmp_path), "--adapter", "vllm-bad", "--student",
                 str(tiny_student), "--out", str(root), "--vllm-sync-dir", str(tmp_path)])
    assert code == 2 and "--vllm-sync-dir needs --vllm-rollouts" in capsys.readouterr().err


SPEC = {"teacher": {"kind": "local_registry", "alias": ALIAS}, "student": "./student", "adapter": "a"}


def test_an_on_policy_spec_takes_the_block_and_dumps_it():
    spec = parse_spec({**SPEC, "prompts": "p.jsonl", "vllm": {"rollouts_url": "http://127.0.0.1:8000"}})
    assert spec.vllm.rollouts_url == "http://127.0.0.1:8000" and spec.vllm.teacher_url is None
    assert spec.config.training_mode == "on_policy"
    assert parse_spec(spec.model_dump(mode="json")).vllm == spec.vllm  # a dumped spec (the form's) round-trips


@pytest.mark.parametrize("spec, field", [
    ({**SPEC, "corpus": "c.jsonl", "vllm": {"rollouts_url": "http://127.0.0.1:8000"}}, "vllm"),
    ({**SPEC, "prompts": "p.jsonl", "vllm": {}}, "vllm.rollouts_url"),
    ({**SPEC, "prompts": "p.jsonl", "vllm": {"rollouts_url": "http://127.0.0.1:8000", "sync_dir": "s3://b/x"}},
     "vllm.sync_dir"),
    ({**SPEC, "prompts": "p.jsonl", "storage_root": "s3://bucket/root", "vllm": {"rollouts_url": "https://v:8000"}},
     "vllm.sync_dir"),
    ({**SPEC, "prompts": "p.jsonl", "vllm": {"rollouts_url": "http://127.0.0.1:8000", "api_key": "x"}},
     "vllm.api_key"),
])
def test_a_vllm_block_is_refused_where_it_cannot_work(spec, field):
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert caught.value.code == "invalid_spec" and caught.value.field == field, caught.value.message


@pytest.mark.integration
def test_the_flow_samples_on_vllm_from_a_spec_block(prefect_harness, server, tiny_student, tiny_teacher, tmp_path):
    """``opd_distill`` (what ``kiln-flows run SPEC`` and the UI start) with a ``vllm:`` block."""
    from flows.opd_distill import opd_distill

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    before = httpx.get(f"{server}/stats").json()
    spec = parse_spec({"teacher": {"kind": "local_dir", "path": str(tiny_teacher)}, "prompts": str(prompts),
                       "student": str(tiny_student), "storage_root": str(tmp_path / "root"), "adapter": "vllm-flow",
                       "config": {"training_mode": "on_policy", **CONFIG},
                       "vllm": {"rollouts_url": f"{server}/ok"}})
    state = opd_distill(spec, return_state=True)
    assert state.is_completed(), f"{state.type}: {state.message}"
    summary = state.result()
    receipt = json.loads((Path(summary["run"]) / "train_receipt.json").read_text())
    assert receipt["opd"]["rollout_backend"] == "vllm" and receipt["opd"]["teacher_backend"] == "local"
    assert httpx.get(f"{server}/stats").json()["rollouts"] - before["rollouts"] == 4
    assert (Path(summary["run"]) / "vllm-sync").is_dir()  # the default sync directory: inside the run directory


def test_the_resume_command_keeps_the_vllm_servers():
    import argparse
    import shlex

    from flows.commands.train import add_arguments, resume_command

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--request", "r.json", "--adapter", "a", "--student", "s", "--vllm-rollouts",
                              "http://127.0.0.1:8000", "--vllm-sync-dir", "/shared/sync"])
    argv = shlex.split(resume_command(args, "a-checkpoint-step-00000002.kiln-checkpoint"))
    assert argv[argv.index("--vllm-rollouts") + 1] == "http://127.0.0.1:8000"
    assert argv[argv.index("--vllm-sync-dir") + 1] == "/shared/sync" and "--vllm-teacher" not in argv
