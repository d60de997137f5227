"""Held-out evaluation of a distilled student (docs/architecture.md, decision 11).

* ``evaluate_examples`` / ``evaluate_tables`` — top-K reverse KL, full-vocabulary top-1 agreement and
  teacher-token NLL over action tokens; callable by the trainer (a held-out slice every N steps) and
  by the post-training gate.
* ``admit_eval_corpus`` — a held-out corpus, admitted as training admits, checked for another
  teacher, another vocabulary and overlap with the training corpus.
* ``load_eval_model`` / ``generate_answers`` — a student with or without a PEFT adapter; greedy answers.
"""

from kiln_core.evaluation.corpus import admit_eval_corpus, check_no_overlap, prompt_key
from kiln_core.evaluation.metrics import EvalMetrics, evaluate_examples, evaluate_tables
from kiln_core.evaluation.models import EvalInputError, EvalModel, generate_answers, load_eval_model

__all__ = [
    "EvalInputError",
    "EvalMetrics",
    "EvalModel",
    "admit_eval_corpus",
    "check_no_overlap",
    "evaluate_examples",
    "evaluate_tables",
    "generate_answers",
    "load_eval_model",
    "prompt_key",
]
