"""How far a student's *own* greedy answers are from what the teacher would say: the on-policy measure.

The held-out table scores the student on the teacher's answers (teacher forcing). What a user reads, and
what on-policy training minimizes, is the student's own text: here the student answers each prompt greedily,
the teacher scores every answer token from the same prefix, and the metrics are

* ``reverse_kl`` — Kiln's top-K renormalized reverse KL (the training loss's formula,
  ``kiln_core.evaluation.evaluate_examples``) at every answer token, with the teacher's top-K there;
* ``top1_agreement`` — how often the student's argmax is the teacher's first choice along its own answer;
* ``teacher_nll`` — nats per token of the student's answer under the teacher (how plausible the teacher finds
  the text; the teacher's own greedy answer scores low here);
* ``answer_tokens`` — mean answer length in tokens (the end-of-sequence token counted when generated).

Example:
    >>> own = own_answer_metrics(student, teacher, prompts, max_new_tokens=32)  # doctest: +SKIP
    >>> own["reverse_kl"] < 1.0  # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kiln_core.corpus import TrainingExample
from kiln_core.evaluation.metrics import evaluate_examples
from kiln_core.evaluation.models import EvalModel, generate_answer_ids

__all__ = ["own_answer_metrics", "teacher_scored_answer"]


def teacher_scored_answer(teacher: EvalModel, prompt_ids: list[int], answer_ids: list[int], top_k: int,
                          index: int = 0) -> tuple[TrainingExample, float]:
    """One answer as a training example scored by ``teacher`` (top-K at every answer token), and the summed
    teacher NLL of its tokens."""
    ids = torch.tensor(prompt_ids + answer_ids, dtype=torch.long, device=teacher.device)
    positions = torch.arange(len(prompt_ids), len(ids), device=teacher.device)
    with torch.no_grad():
        rows = teacher.hidden_states(ids).index_select(0, positions - 1)
        logits = teacher.logit_head.logits(rows)  # [A, V]: the teacher's own logits
        logprobs = torch.log_softmax(logits, dim=-1)  # [A, V]: one short answer at a time
        top = torch.topk(logprobs, top_k, dim=-1)
        nll = -float(logprobs.gather(1, ids.index_select(0, positions)[:, None]).sum())
    example = TrainingExample(
        index=index, line=index + 1, input_ids=ids.cpu().numpy().astype(np.int32),
        action_positions=positions.cpu().numpy().astype(np.int32), env_positions=np.zeros(0, dtype=np.int32),
        env_in_warning_prefix=np.zeros(0, dtype=bool), teacher_ids=top.indices.cpu().numpy().astype(np.int32),
        teacher_logprobs=top.values.cpu().numpy().astype(np.float32))
    return example, nll


def own_answer_metrics(student: EvalModel, teacher: EvalModel, prompts: Sequence[list[dict[str, Any]]], *,
                       max_new_tokens: int = 64, top_k: int = 32) -> dict[str, float | int]:
    """The student's greedy answers to ``prompts``, measured against ``teacher`` (see the module docstring).

    Returns:
        ``reverse_kl``, ``top1_agreement``, ``teacher_nll``, ``answer_tokens`` (means), ``tokens`` and
        ``examples`` (answers with at least one token).
    """
    answers = generate_answer_ids(student, prompts, max_new_tokens=max_new_tokens)
    scored = [teacher_scored_answer(teacher, prompt, answer, top_k, index)
              for index, (prompt, answer) in enumerate(answers) if answer]
    metrics = evaluate_examples(student, (example for example, _ in scored))
    tokens = sum(len(example.action_positions) for example, _ in scored)
    return {"reverse_kl": metrics.reverse_kl, "top1_agreement": metrics.top1_agreement,
            "teacher_nll": sum(nll for _, nll in scored) / tokens if tokens else float("nan"),
            "answer_tokens": tokens / len(answers) if answers else float("nan"),
            "tokens": tokens, "examples": len(scored)}
