"""The two ways an oracle run ends without a result: a rejected input, or a failed run.

The CLI maps them onto its exit codes (2 and 3) and the flow onto its verdict table, so every rule
name below is part of the public contract and is never renamed.
"""

from __future__ import annotations

from typing import Any

from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.strict_json import STRICT_JSON_RULES

# Stable rule names, grouped by the stage that raises them.
FILE_RULES = ("file_not_found", "file_too_large", "not_regular_file")
SCHEMA_RULES = ("schema_violation",)
CROSS_FIELD_RULES = (
    "input_tokens_mismatch",
    "input_hash_mismatch",
    "token_count_mismatch",
    "utf8_hash_mismatch",
    "candidate_order",
    "candidates_equal",
    "unsafe_path",
    "weight_paths_unsorted",
)
RECEIPT_RULES = ("receipt_missing", "receipt_unreadable", "receipt_mismatch")
MODEL_RULES = (
    "model_invalid",
    "model_identity_mismatch",
    "token_id_out_of_range",
    "prompt_render_mismatch",
    "token_text_mismatch",
)
OUTPUT_RULES = ("result_exists",)
ALL_RULES = FILE_RULES + STRICT_JSON_RULES + SCHEMA_RULES + CROSS_FIELD_RULES + RECEIPT_RULES + MODEL_RULES + OUTPUT_RULES


class OracleRejection(Rejection, ValueError):
    """A request (or the model/receipts it names) that does not satisfy the contract.

    Attributes:
        rule: One of ``ALL_RULES``.
        message: One sentence naming the field or place that failed.

    Example:
        >>> raise OracleRejection("candidates_equal", "candidates[0].token_id == candidates[1].token_id == 7")
        Traceback (most recent call last):
        ...
        kiln_core.oracle.errors.OracleRejection: candidates_equal: candidates[0].token_id == candidates[1].token_id == 7
    """

    def __init__(self, rule: str, message: str) -> None:
        if rule not in ALL_RULES:
            raise ValueError(f"unknown oracle rule {rule!r}")
        super().__init__(rule, message)
        self.rule = rule

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"

    def as_record(self) -> dict[str, Any]:
        """The CLI's one-line rejection record (``to_json()``: the rule is its ``code``)."""
        return self.to_json()


class OracleRunError(EnvironmentFailure, RuntimeError):
    """The reference forward pass itself failed (load error, non-finite logits, wrong shape)."""

    def __init__(self, message: str, code: str = "oracle_run_failed") -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return self.message
