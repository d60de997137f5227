"""Rejections of the post-training eval gate: one ``PostEvalRejection`` per rule, codes never renamed.

Every bad input here is a ``kiln_core.errors.Rejection`` (exit 2, never retried; docs/architecture.md,
decision 10). Where Kiln has a message for the rule, the message is Kiln's text (cited where it is raised).
"""

from __future__ import annotations

from kiln_core.errors import Rejection

POST_EVAL_CODES = (
    # PostEvalConfig and its submit-time rules (api/training.rs · validate_post_eval_suite)
    "post_eval_invalid_config",
    "post_eval_min_accuracy_out_of_range",
    "post_eval_train_set_eval_gated",
    "post_eval_suite_not_installed",
    # held-out overlap at admission (api/training.rs · contamination_error)
    "post_eval_overlap",
    # suites and the registry (kiln-eval/src/suite.rs, kiln-server/src/eval/registry.rs)
    "eval_suite_not_found",
    "eval_suite_unreadable",
    "eval_suite_invalid",
    "eval_suite_name_invalid",
    "eval_suite_exists",
    "eval_scorer_unsupported",
    # the adapter a gate would promote does not match its receipt (as tasks/publish.py checks)
    "adapter_receipt_mismatch",
)


class PostEvalRejection(Rejection):
    """A post_eval config, suite or training corpus that breaks one rule.

    Attributes:
        code: One of ``POST_EVAL_CODES``.
        message: The rule, in Kiln's words where Kiln has them.
    """

    def __init__(self, code: str, message: str, *, line: int | None = None, field: str | None = None,
                 file: str | None = None) -> None:
        if code not in POST_EVAL_CODES:
            raise ValueError(f"unknown post_eval code {code!r}")
        super().__init__(code, message, line=line, field=field, file=file)
