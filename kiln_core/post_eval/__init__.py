"""Kiln's post-training eval gate (``post_eval``) for kiln-flows: suites, scorers, statistics.

The wire formats live in ``kiln_core.contracts.post_eval``: ``config`` (``PostEvalConfig`` and Kiln's
submit-time rules), ``suite`` (suites, examples, generation settings, aggregation; ``wire`` encodes them
as serde does), ``scorers`` (grading one completion; ``answer_parsing`` holds the parsing helpers) and
``errors``. What a gate outcome does to the adapter on storage is the engine's (``kiln_core.engine.fate``).

Read in this order:

* ``identity`` — Kiln's suite and effective-generation hashes.
* ``registry`` — suites stored under ``<storage root>/.eval/suites/<name>/``.
* ``overlap``  — a ``held-out`` suite must not overlap the training data.
* ``reduce``   — k completions → one outcome per example; suite metrics.
* ``stats``    — per-completion seeds, exact sign test, Wilson interval.
* ``gate``     — paired evidence, the decision ladder, outcomes and their aggregation.
* ``runner``   — generation with a local transformers student (+ PEFT adapter); imports torch.
* ``evaluate`` — ``run_post_eval``: the whole post-training evaluation.

The engine wires it in a few calls (``apply_gate_outcome`` and its receipt block: ``kiln_core.engine.fate``)::

    config = parse_post_eval_config(request.post_eval)
    registry = SuiteRegistry.for_storage_root(storage_root)
    validate_post_eval_config(config, registry)                       # at submit time
    suite = registry.load(config.suite)
    check_training_overlap(config, suite, map(conversation_from_opd_example, corpus_rows))  # admission
    ...train...
    result = run_post_eval(config, suite, student_dir=..., candidate_adapter=train.adapter_uri,
                           candidate_name=adapter, auto_load_on_pass=request.config.auto_load,
                           seed=train.effective_seed)
    fate = apply_gate_outcome(run_dir, adapter, result.outcome, result.evidence,
                              verdict=result.verdict) if result.gated else None
    block = post_eval_receipt_block(result, fate)  # the receipt's typed ``post_eval`` (a ``GateDecision`` part)

Nothing here imports Prefect; only ``runner`` (and ``run_post_eval`` when called) imports torch.
"""

from kiln_core.contracts.post_eval.config import PostEvalConfig, parse_post_eval_config, validate_post_eval_config
from kiln_core.contracts.post_eval.errors import POST_EVAL_CODES, PostEvalRejection
from kiln_core.post_eval.evaluate import PostEvalResult, run_post_eval
from kiln_core.post_eval.gate import (GATE_OUTCOMES, PostEvalGateEvidence, aggregate_gate_outcome,
                                      evaluate_paired_promotion, merge_gate_evidence)
from kiln_core.post_eval.overlap import check_training_overlap, conversation_from_opd_example
from kiln_core.post_eval.registry import SuiteRegistry
from kiln_core.post_eval.stats import derive_eval_completion_seed, sign_test_p_value, wilson_interval
from kiln_core.post_eval.identity import effective_generation_sha256, suite_sha256
from kiln_core.contracts.post_eval.suite import EvalSuite, load_suite

__all__ = [
    "POST_EVAL_CODES", "PostEvalRejection", "PostEvalConfig", "parse_post_eval_config", "validate_post_eval_config",
    "EvalSuite", "load_suite", "suite_sha256", "effective_generation_sha256", "SuiteRegistry", "check_training_overlap",
    "conversation_from_opd_example", "derive_eval_completion_seed", "sign_test_p_value", "wilson_interval",
    "GATE_OUTCOMES", "PostEvalGateEvidence", "evaluate_paired_promotion", "aggregate_gate_outcome",
    "merge_gate_evidence", "PostEvalResult", "run_post_eval",
]
