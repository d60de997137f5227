"""The optional vLLM rollout backend, against the fake vLLM server as a real process serving the student.

What a user depends on: greedy rollouts from the server are the local sampler's (so the per-step LoRA
sync serves exactly the trainer's weights at every step, and the adapter comes out byte for byte the
same); sampled rollouts are valid ids without EOS; a crash and a retry reuse what was committed and end
where an uninterrupted run ends; a server that is down is an environment failure (exit 3, retried),
a refusal or a malformed answer is a rejection with its own code, a LoRA rank above the server's limit
says which flag to change.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.on_policy.store import RolloutStore
from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherSource
from kiln_core.on_policy.vllm_rollouts import request_body, vllm_rollout_backend
from kiln_core.training.on_policy_trainer import train_on_policy
from on_policy_support import chat, request
from plan_support import split_plan_options, train_plan

SERVER = Path(__file__).with_name("fake_vllm_server.py")
TOP_K = 16
ALIAS = "tiny-teacher"
PROMPTS = [chat("What is two plus two?"), chat("Name a colour."), chat("Say hi.")]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


def start_server(args: list[str], log: Path, env: dict | None = None):
    """The fake server as a subprocess; returns (process, base URL)."""
    with open(log, "w") as stderr:  # a file, not a pipe: an unread pipe could block the server
        process = subprocess.Popen([sys.executable, str(SERVER), "--port", "0", *args], stdout=subprocess.PIPE,
                                   stderr=stderr, text=True, env=env)
    port: list[str] = []
    reader = threading.Thread(target=lambda: port.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=120)
    if not port or not port[0].strip():
        process.kill()
        raise RuntimeError(f"fake vLLM server did not start: {log.read_text()[-2000:]}")
    return process, f"http://127.0.0.1:{int(port[0])}"


def stop_server(process) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def student_server(tiny_student, tmp_path_factory):
    process, url = start_server(["--student", str(tiny_student)], tmp_path_factory.mktemp("fake-vllm") / "server.log")
    try:
        yield url
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def teacher(tiny_teacher) -> TeacherSource:
    from kiln_core.identity.local_teacher import local_teacher_identity

    identity = local_teacher_identity(str(tiny_teacher), max_top_k=32, device_kind="cpu")
    return TeacherSource.loaded(LiveLocalTeacher.load(str(tiny_teacher), identity=identity, top_k=TOP_K, device="cpu"),
                                ALIAS)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats").json()


def run(student, teacher, root: Path, *, temperature: float, backend=None, **kwargs):
    req = request(PROMPTS, teacher=ALIAS, samples_per_prompt=2, max_tokens=6, top_k=TOP_K, lora_rank=4,
                  lora_alpha=8.0, seed=11, learning_rate=5e-2, checkpoint_interval=2, epochs=1, temperature=temperature)
    plan_options, hooks = split_plan_options({"device": "cpu", **kwargs})
    plan = train_plan(req.config, str(root), "vllm-roll", prompts=req.prompts, teacher=teacher, **plan_options)
    return train_on_policy(plan, req.prompts, student_dir=str(student), teacher=teacher, rollout_backend=backend,
                           **hooks)


def adapter_bytes(root: Path) -> bytes:
    return (root / "adapter" / "adapter_model.safetensors").read_bytes()


def rollouts_of(result) -> list:
    return RolloutStore(result.rollout_root).audit(result.rollout_run_key)


def test_greedy_vllm_rollouts_equal_the_local_ones_and_the_adapter_is_byte_identical(
        tiny_student, teacher, student_server, tmp_path):
    before = stats(student_server)
    remote = run(tiny_student, teacher, tmp_path / "vllm", temperature=0.0,
                 backend=vllm_rollout_backend(f"{student_server}/ok", sync_dir=str(tmp_path / "sync")))
    local = run(tiny_student, teacher, tmp_path / "local", temperature=0.0)
    assert remote.status == local.status == "success" and remote.steps == local.steps == 6
    remote_rollouts, local_rollouts = rollouts_of(remote), rollouts_of(local)
    assert [r.key for r in remote_rollouts] == [r.key for r in local_rollouts]
    for a, b in zip(remote_rollouts, local_rollouts):
        np.testing.assert_array_equal(a.sampled_ids, b.sampled_ids)
    # the weights change every step: later rollouts differ from the first ones of the same prompt
    assert any(not np.array_equal(a.sampled_ids, b.sampled_ids)
               for a, b in zip(remote_rollouts[0::2], remote_rollouts[1::2]))
    assert adapter_bytes(tmp_path / "vllm") == adapter_bytes(tmp_path / "local")
    # one load per served step (before the first rollout and after each step that preceded a rollout),
    # each unloaded again; nothing is left on the server or in the sync directory
    after = stats(student_server)
    assert after["loaded"] - before["loaded"] == remote.steps
    assert after["unloaded"] - before["unloaded"] == remote.steps and after["held"] == []
    assert after["rollouts"] - before["rollouts"] == remote.rollouts_sampled == 6
    assert list((tmp_path / "sync").iterdir()) == []
    opd = json.loads((tmp_path / "vllm" / "train_receipt.json").read_text())["opd"]
    assert opd["rollout_backend"] == "vllm" and opd["teacher_backend"] == "local"
    assert json.loads((tmp_path / "local" / "train_receipt.json").read_text())["opd"]["rollout_backend"] == "local"
    assert remote_rollouts[0].metadata["rollout_backend"] == "vllm"


class Crash(RuntimeError):
    pass


def crash_after(step: int):
    def hook(committed: int) -> None:
        if committed == step:
            raise Crash(f"crash after step {step}")
    return hook


def test_sampled_rollouts_are_valid_and_a_retry_reuses_the_committed_ones(tiny_student, tiny_student_vocab,
                                                                         teacher, student_server, tmp_path):
    from kiln_core.training.checkpoint import latest_checkpoint

    eos = set(tiny_student_vocab["eos"])

    def backend(name: str):
        return vllm_rollout_backend(f"{student_server}/ok", sync_dir=str(tmp_path / name / "sync"))

    straight = run(tiny_student, teacher, tmp_path / "straight", temperature=1.0, backend=backend("straight"))
    assert straight.status == "success" and straight.steps > 0
    for rollout in rollouts_of(straight):
        ids = rollout.sampled_ids.tolist()
        assert all(0 <= t < tiny_student_vocab["size"] for t in ids) and not eos & set(ids) and len(ids) <= 6

    with pytest.raises(Crash):
        run(tiny_student, teacher, tmp_path / "crashed", temperature=1.0, backend=backend("crashed"),
            on_step_committed=crash_after(3))
    committed = RolloutStore(str(tmp_path / "crashed" / "rollouts")).audit(straight.rollout_run_key)
    checkpoint = latest_checkpoint(str(tmp_path / "crashed"), "vllm-roll")
    assert checkpoint is not None and len(committed) >= 3
    served = stats(student_server)["rollouts"]
    retry = run(tiny_student, teacher, tmp_path / "crashed", temperature=1.0, backend=backend("crashed"),
                resume_checkpoint=checkpoint)
    # the rollout of step 3 was committed before the crash: read back, not sampled again
    assert retry.rollouts_reused == 1 and retry.rollouts_sampled == 6 - len(committed)
    assert stats(student_server)["rollouts"] - served == retry.rollouts_sampled
    # the retry ends where the uninterrupted run ends (the fake server samples deterministically per seed)
    assert adapter_bytes(tmp_path / "crashed") == adapter_bytes(tmp_path / "straight")
    assert [r.sampled_ids.tolist() for r in rollouts_of(retry)] == [r.sampled_ids.tolist() for r in rollouts_of(straight)]


@pytest.fixture(scope="module")
def tiny_student_vocab(tiny_student) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from kiln_core.on_policy.render import kiln_eos_token_ids

    return {"size": AutoConfig.from_pretrained(str(tiny_student)).vocab_size,
            "eos": kiln_eos_token_ids(AutoTokenizer.from_pretrained(str(tiny_student)))}


def test_a_server_that_is_down_is_an_environment_failure(tiny_student, teacher, tmp_path):
    with pytest.raises(EnvironmentFailure) as caught:
        run(tiny_student, teacher, tmp_path, temperature=1.0,
            backend=vllm_rollout_backend("http://127.0.0.1:9", sync_dir=str(tmp_path / "sync"), timeout_s=2.0))
    assert caught.value.code == "vllm_unreachable"
    assert json.loads((tmp_path / "train_receipt.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("scenario, code", [
    ("rollout-bad-request", "vllm_rollout_request"),
    ("rollout-bad-token", "vllm_rollout_response"),
    ("rollout-no-token-ids", "vllm_rollout_response"),
    ("lora-rank-2", "vllm_lora_rank_exceeded"),
])
def test_refusals_and_malformed_answers_are_rejections(tiny_student, teacher, student_server, tmp_path, scenario,
                                                        code):
    with pytest.raises(Rejection) as caught:
        run(tiny_student, teacher, tmp_path, temperature=1.0,
            backend=vllm_rollout_backend(f"{student_server}/{scenario}", sync_dir=str(tmp_path / "sync")))
    assert caught.value.code == code
    if scenario == "lora-rank-2":
        assert "--max-lora-rank 4" in caught.value.message


def test_a_server_error_is_an_environment_failure(tiny_student, teacher, student_server, tmp_path):
    with pytest.raises(EnvironmentFailure) as caught:
        run(tiny_student, teacher, tmp_path, temperature=1.0,
            backend=vllm_rollout_backend(f"{student_server}/rollout-server-error", sync_dir=str(tmp_path / "sync")))
    assert caught.value.code == "vllm_http_error"


def test_a_server_without_runtime_lora_updates_is_named(tiny_student, teacher, tiny_teacher, tmp_path):
    """A server started without LoRA loading (here: the scoring-only fake) answers 404 on the load route."""
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.contracts.identity import build_manifest_line

    manifest = tmp_path / "manifest.jsonl"
    identity = local_teacher_identity(str(tiny_teacher), max_top_k=32, device_kind="cpu")
    manifest.write_text(build_manifest_line(identity) + "\n", encoding="utf-8")
    process, url = start_server(["--teacher", str(tiny_teacher), "--manifest", str(manifest)], tmp_path / "log")
    try:
        with pytest.raises(Rejection) as caught:
            run(tiny_student, teacher, tmp_path / "run", temperature=1.0,
                backend=vllm_rollout_backend(f"{url}/ok", sync_dir=str(tmp_path / "sync")))
    finally:
        stop_server(process)
    assert caught.value.code == "vllm_lora_updates_disabled"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in caught.value.message


def test_the_api_key_comes_from_the_environment(tiny_student, teacher, tmp_path, monkeypatch):
    import os

    process, url = start_server(["--student", str(tiny_student)], tmp_path / "log",
                                env={**os.environ, "VLLM_API_KEY": "s3cret-key"})
    try:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        with pytest.raises(Rejection) as caught:  # no key: the server refuses the first LoRA load
            run(tiny_student, teacher, tmp_path / "no-key", temperature=1.0,
                backend=vllm_rollout_backend(f"{url}/ok", sync_dir=str(tmp_path / "sync")))
        assert caught.value.code == "vllm_lora_load" and "401" in caught.value.message
        monkeypatch.setenv("VLLM_API_KEY", "s3cret-key")
        result = run(tiny_student, teacher, tmp_path / "key", temperature=1.0,
                     backend=vllm_rollout_backend(f"{url}/ok", sync_dir=str(tmp_path / "sync")))
    finally:
        stop_server(process)
    assert result.status == "success"
    assert "s3cret-key" not in (tmp_path / "key" / "train_receipt.json").read_text()


def test_greedy_requests_send_no_penalties_and_sampled_ones_send_kilns_rule():
    from kiln_core.on_policy.sampler import SamplingParams

    greedy = request_body("l", [1], params=SamplingParams.for_rollouts(temperature=0.0, top_p=0.9), max_tokens=3,
                          eos_token_ids=[2], seed=1)
    sampled = request_body("l", [1], params=SamplingParams.for_rollouts(temperature=0.7, top_p=0.9), max_tokens=3,
                           eos_token_ids=[2], seed=1)
    assert (greedy["presence_penalty"], greedy["repetition_penalty"], greedy["frequency_penalty"]) == (0.0, 1.0, 0.0)
    assert {k: sampled[k] for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                    "repetition_penalty", "seed", "stop_token_ids", "return_token_ids")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": 1, "stop_token_ids": [2], "return_token_ids": True}


def test_plain_http_to_a_remote_host_is_refused_before_any_model_loads(tmp_path):
    with pytest.raises(Rejection) as caught:
        vllm_rollout_backend("http://10.0.0.5:8000", sync_dir=str(tmp_path))
    assert caught.value.code == "invalid_option"
