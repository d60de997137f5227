"""Errors that carry a stable, machine-readable code.

Admission rejects a corpus with exactly one ``AdmissionError``; its ``code`` is one of
``ADMISSION_CODES`` and never renamed (DESIGN.md decision 2). ``line`` is the 1-based physical line
of the file (blank lines counted), or ``None`` for file-level rules.
"""

from __future__ import annotations

ADMISSION_CODES = (
    "file_not_found",
    "not_regular_file",
    "file_too_large",
    "invalid_utf8",
    "invalid_json",
    "not_an_object",
    "invalid_record",
    "manifest_not_first",
    "manifest_not_canonical",
    "manifest_invalid",
    "manifest_missing",
    "identity_mismatch",
    "vocab_size_mismatch",
    "top_k_exceeds_identity",
    "top_k_unsupported",
    "no_examples",
    "empty_messages",
    "empty_response",
    "no_action_tokens",
    "token_count_mismatch",
    "token_id_mismatch",
    "too_few_candidates",
    "token_id_out_of_range",
    "non_finite_logprob",
    "positive_logprob",
    "duplicate_candidate",
    "not_non_increasing",
    "mass_exceeds_one",
    "conflicting_duplicate_row",
)


class AdmissionError(Exception):
    """A corpus rejected by one admission rule.

    Attributes:
        code: Stable rule name from ``ADMISSION_CODES``.
        line: 1-based physical line, or ``None`` for file-level rules.
        message: Human-readable explanation naming the example and token index where they apply.
    """

    def __init__(self, code: str, line: int | None, message: str) -> None:
        if code not in ADMISSION_CODES:
            raise ValueError(f"unknown admission code {code!r}")
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"[{code}] {where}{message}")
        self.code = code
        self.line = line
        self.message = message

    def to_json(self) -> dict[str, object]:
        """The CLI's rejection object."""
        return {"status": "rejected", "code": self.code, "line": self.line, "message": self.message}
