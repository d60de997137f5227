"""Held-out distillation metrics of a student on an admitted teacher-scored corpus.

Three means over every action token (target q scored from row q − 1, as in training):

* ``reverse_kl`` — Kiln's loss (``kiln_core.loss.topk_reverse_kl``): student and teacher
  both renormalized over the teacher's K ids of that row, KL(student ‖ teacher);
* ``top1_agreement`` — the student's argmax over the WHOLE vocabulary equals the teacher's first
  candidate (the one thing the renormalized loss cannot see: student mass outside the K ids);
* ``teacher_token_nll`` — −log of the student's full-vocabulary probability of the corpus token
  (``echo_env_cross_entropy`` with |O| = the row count is exactly that mean).

Memory is bounded as in training: the KL gathers K logits per row, the NLL uses the tiled
full-vocabulary logsumexp, and the argmax projects ``chunk_rows`` rows at a time, so no ``[T, V]``
tensor exists beyond one ``[chunk_rows, V]`` chunk.

Every logit is the model's own (``LogitHead``: the LM head and the model's soft cap or scale).

``evaluate_examples`` takes any model with ``hidden_states(ids) -> [L, H]`` and ``logit_head`` — the trainer's ``Student`` as it trains (a small held-out slice every N steps), or an
``EvalModel`` loaded from a directory and an optional PEFT adapter (``kiln-flows eval``, the gate).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Protocol

import torch

from kiln_core.corpus import CorpusTables, TrainingExample
from kiln_core.logit_head import LogitHead
from kiln_core.loss import echo_env_cross_entropy, topk_reverse_kl

__all__ = ["EvalMetrics", "HiddenStateModel", "evaluate_examples", "evaluate_tables"]

DEFAULT_CHUNK_ROWS = 256


class HiddenStateModel(Protocol):
    """What evaluation needs of a model (``kiln_core.training.student.Student`` satisfies it)."""

    device: torch.device

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    @property
    def logit_head(self) -> LogitHead: ...


@dataclass(frozen=True)
class EvalMetrics:
    """Means over ``tokens`` action tokens of ``examples`` examples."""

    reverse_kl: float
    top1_agreement: float
    teacher_token_nll: float
    tokens: int
    examples: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_tables(model: HiddenStateModel, tables: CorpusTables, *, limit: int | None = None,
                    chunk_rows: int = DEFAULT_CHUNK_ROWS) -> EvalMetrics:
    """``evaluate_examples`` over the first ``limit`` examples of an admitted corpus (all by default).

    Example:
        >>> metrics = evaluate_tables(load_eval_model("student"), admission.tables)  # doctest: +SKIP
        >>> round(metrics.top1_agreement, 3)  # doctest: +SKIP
        0.412
    """
    count = tables.num_examples if limit is None else min(limit, tables.num_examples)
    return evaluate_examples(model, (tables.example(i) for i in range(count)), chunk_rows=chunk_rows)


def evaluate_examples(model: HiddenStateModel, examples: Iterable[TrainingExample], *,
                      chunk_rows: int = DEFAULT_CHUNK_ROWS) -> EvalMetrics:
    """The three metrics of ``model`` over ``examples`` (no gradients; the model's mode is kept).

    Args:
        model: Anything with ``hidden_states``, ``logit_head`` and ``device``.
        examples: Admitted examples (``CorpusTables.example(i)``).
        chunk_rows: Action rows projected onto the full vocabulary at once.

    Returns:
        ``EvalMetrics``; an empty input gives NaN means and ``tokens == 0``.
    """
    kl_sum = nll_sum = 0.0
    agree = tokens = count = 0
    with torch.no_grad():
        for example in examples:
            batch = example.to_torch(model.device)
            rows = model.hidden_states(batch["input_ids"]).index_select(0, batch["action_positions"] - 1)  # [A, H]
            n = int(rows.shape[0])
            if n == 0:
                continue
            head = model.logit_head
            targets = batch["input_ids"].index_select(0, batch["action_positions"])  # the corpus tokens
            kl_sum += float(topk_reverse_kl(rows, head, batch["teacher_ids"], batch["teacher_logprobs"],
                                            chunk_rows=chunk_rows)) * n
            nll_sum += float(echo_env_cross_entropy(rows, head, targets, n, chunk_rows=chunk_rows)) * n
            agree += int((head.argmax(rows, chunk_rows=chunk_rows) == batch["teacher_ids"][:, 0]).sum())
            tokens += n
            count += 1
    if tokens == 0:
        return EvalMetrics(math.nan, math.nan, math.nan, 0, count)
    return EvalMetrics(kl_sum / tokens, agree / tokens, nll_sum / tokens, tokens, count)

