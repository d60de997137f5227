"""The optional vLLM teacher backend for on-policy runs, against the loopback fake vLLM server process.

What a user depends on: a vLLM teacher scores a rollout exactly as the local teacher does (same ids in
rank order, logprobs within 1e-4: fp32 on both sides), so a run trains the same first step with either;
a run with it stores rollouts and finishes like any other; a server that is down is an environment
failure (retried by a pipeline), not a rejection.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln_core.errors import EnvironmentFailure
from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherSource
from kiln_core.on_policy.vllm_teacher import VllmRolloutScorer, vllm_teacher_source
from kiln_core.training.on_policy_trainer import train_on_policy
from on_policy_support import chat, request
from plan_support import train_plan
from test_scoring_vllm import manifest_file, server_url, vllm_identity  # noqa: F401 - the fake server fixtures

TOP_K = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


def test_vllm_rows_match_the_local_teacher(tiny_teacher, server_url, vllm_identity):  # noqa: F811
    tokens = np.array([5, 17, 42, 9, 100, 3, 77, 250], dtype=np.int32)
    targets = np.array([2, 3, 5, 7], dtype=np.int32)  # 7 is the last position: the causal-probe path
    remote = VllmRolloutScorer(f"{server_url}/ok", vllm_identity, top_k=TOP_K).score(tokens, targets)
    local = LiveLocalTeacher.load(str(tiny_teacher), identity=vllm_identity, top_k=TOP_K, device="cpu").score(
        tokens, targets)
    assert remote.ids.shape == (4, TOP_K) and remote.ids.dtype == np.int32
    np.testing.assert_array_equal(remote.ids, local.ids)
    np.testing.assert_allclose(remote.logprobs, local.logprobs, atol=1e-4)


def test_an_on_policy_run_with_the_vllm_teacher(tiny_student, tiny_teacher, server_url, vllm_identity,  # noqa: F811
                                                 tmp_path):
    req = request([chat("What is two plus two?"), chat("Name a colour.")], teacher="tiny-teacher",
                  samples_per_prompt=2, max_tokens=4, top_k=TOP_K, lora_rank=4, lora_alpha=8.0, seed=3,
                  learning_rate=2e-2, checkpoint_interval=2, epochs=1)
    def train(teacher, root):
        plan = train_plan(req.config, str(root), "onpol-vllm", prompts=req.prompts, teacher=teacher, device="cpu")
        return train_on_policy(plan, req.prompts, student_dir=str(tiny_student), teacher=teacher)

    remote = train(vllm_teacher_source("tiny-teacher", vllm_identity, f"{server_url}/ok"), tmp_path / "vllm")
    local_teacher = LiveLocalTeacher.load(str(tiny_teacher), identity=vllm_identity, top_k=TOP_K,
                                          teacher_id="tiny-teacher", device="cpu")
    local = train(TeacherSource.loaded(local_teacher, "tiny-teacher"), tmp_path / "local")
    assert remote.status == local.status == "success"
    assert remote.teacher_tokens_scored > 0 and remote.rollouts_sampled == local.rollouts_sampled
    # the first candidate is sampled from the same initial weights: the same tokens, the same rows (±1e-4)
    assert remote.loss_history[0] == pytest.approx(local.loss_history[0], abs=1e-4)


def test_a_server_that_is_down_is_an_environment_failure(vllm_identity):  # noqa: F811
    scorer = VllmRolloutScorer("http://127.0.0.1:9", vllm_identity, top_k=TOP_K, timeout_s=2.0)
    with pytest.raises(EnvironmentFailure) as caught:
        scorer.score(np.array([5, 17, 42], dtype=np.int32), np.array([1, 2], dtype=np.int32))
    assert caught.value.code == "vllm_unreachable"
