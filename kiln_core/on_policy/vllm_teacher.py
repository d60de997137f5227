"""An optional on-policy teacher backend: a vLLM server scores the student's rollouts.

Kiln scores on-policy rollouts with a ``LiveLocalTeacher`` in the training process and refuses a
remote teacher for ``training_mode: "on_policy"`` (``crates/kiln-server/src/api/training.rs`` ·
``require_remote_teacher_off_policy``). kiln-flows keeps that default (``kiln_core.on_policy.teacher``);
this module is an extension for a trainer that wants the teacher on a vLLM server (a larger teacher
than fits beside the student, or a faster one): ``VllmRolloutScorer`` answers the trainer's
``RolloutScorer.score(tokens, target_positions, top_k)`` with one Kiln prompt-logprobs request
(``kiln_core.scoring.vllm.VllmTeacher``: the exact request body, the pinned identity's
``system_fingerprint`` checked on every response, every structural rule of Kiln's ``remote_teacher.rs``),
then the same row check as the local teacher (``check_teacher_rows``). The rows therefore mean what a
local teacher's mean: raw full-vocabulary logprobs of the K best ids, rank order, ties to the lower id.

A vLLM server down mid-run is an ``EnvironmentFailure`` (``vllm_unreachable``, ``vllm_http_error``): the
run fails with a receipt and a retry resumes from its newest checkpoint, reading committed rollouts back.

Rollouts can come from a vLLM server as well: ``kiln_core.on_policy.vllm_rollouts`` (the LoRA is
reloaded there after every optimizer step).

Example:
    >>> source = vllm_teacher_source("tiny-teacher", identity, "http://127.0.0.1:8000")  # doctest: +SKIP
    >>> train_on_policy(plan, prompts, student_dir="student", teacher=source)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.errors import Rejection
from kiln_core.on_policy.teacher import TeacherRows, TeacherSource, check_teacher_rows

__all__ = ["VllmRolloutScorer", "vllm_teacher_source"]


class VllmRolloutScorer:
    """A ``RolloutScorer`` over a vLLM server pinned to ``identity``.

    Args:
        base_url: The server's base URL (``http://127.0.0.1:8000``; loopback or https, as for scoring).
        identity: The pinned teacher identity; the server must serve ``identity.served_model_id`` and
            return its fingerprint.
        top_k: Default K.
        teacher_id: The alias in messages and receipts.
        timeout_s: Seconds per request.
    """

    receipt_label = "vllm"

    def __init__(self, base_url: str, identity: TeacherIdentity, *, top_k: int, teacher_id: str = "teacher",
                 timeout_s: float | None = None) -> None:
        from kiln_core.scoring.vllm import DEFAULT_TIMEOUT_S, VllmTeacher

        cap = min(identity.max_top_k, identity.vocab_size)
        if not 0 < top_k <= cap:
            raise Rejection("top_k_exceeds_identity", f"vLLM teacher top_k {top_k} exceeds identity max_top_k {cap}",
                            field="config.top_k")
        self.client = VllmTeacher(base_url, identity, identity.served_model_id, concurrency=1,
                                  timeout_s=timeout_s or DEFAULT_TIMEOUT_S)
        self.identity, self.top_k, self.teacher_id = identity, top_k, teacher_id

    def score(self, tokens: Any, target_positions: Any, top_k: int | None = None) -> TeacherRows:
        """Top-K teacher logprobs at ``target_positions`` of ``tokens`` (target q from row q − 1).

        Raises:
            Rejection: ``invalid_rollout`` for targets Kiln's ``validate_logit_request`` refuses;
                ``teacher_output`` for rows that break Kiln's row rules; a ``ScoringError`` rejection
                for a response that breaks the prompt-logprobs contract.
            EnvironmentFailure: the server is unreachable or answers 5xx (``ScoringError``).
        """
        from kiln_core.scoring.examples import ScoreRequest

        k = self.top_k if top_k is None else top_k
        ids = np.asarray(tokens, dtype=np.int32)
        positions = np.asarray(target_positions, dtype=np.int32)
        if positions.size == 0 or positions.min() < 1 or positions.max() >= ids.shape[0] \
                or np.any(np.diff(positions) <= 0):
            raise Rejection("invalid_rollout", "target positions must be strictly increasing and unique, at least 1 "
                            f"and below the token length {ids.shape[0]}")
        rows = self.client.score_one(ScoreRequest(0, ids, positions), k)
        result = TeacherRows(ids=rows.top_ids.astype(np.int32), logprobs=rows.top_logprobs.astype(np.float32))
        check_teacher_rows(result, k, self.identity.vocab_size, self.teacher_id)
        return result

    def close(self) -> None:
        self.client.close()


def vllm_teacher_source(alias: str, identity: TeacherIdentity, base_url: str, *,
                        timeout_s: float | None = None) -> TeacherSource:
    """A ``TeacherSource`` whose scorer is a vLLM server (connected once every refusal has passed)."""
    return TeacherSource(alias, identity, lambda top_k: VllmRolloutScorer(base_url, identity, top_k=top_k,
                                                                         teacher_id=alias, timeout_s=timeout_s))
