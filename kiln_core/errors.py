"""The error model: every failure kiln-flows raises on purpose is one of two kinds.

* ``Rejection`` — bad input (a corpus, request, spec, model directory, checkpoint that does not
  match). It carries a stable ``code``, the place (``line`` and/or ``field``, ``file``) and a message
  naming the rule. The CLI exits 2, flows fail fast and never retry: the same input fails again.
* ``EnvironmentFailure`` — the world failed (storage or network unreachable, timed out, refused
  credentials). The CLI exits 3 with a one-line message, Prefect retries the task.

Nothing else is meant to escape to a user; anything that does is a bug (exit 3 "failed" with the
receipt saying ``training_error``), never exit 1 with a traceback.

Admission rejects a corpus with exactly one ``AdmissionError``; its ``code`` is one of
``ADMISSION_CODES`` and never renamed (docs/architecture.md, decision 2). ``line`` is the 1-based physical line
of the file (blank lines counted), or ``None`` for file-level rules.

The mapping, everywhere:

=========================  ==========  ====================================  ========================
kind                       CLI exit    Prefect task                          JSON ``status``
=========================  ==========  ====================================  ========================
``Rejection``              2           failed at once, never retried         ``rejected``
``EnvironmentFailure``     3           retried (bounded), then failed        ``failed``
anything else (a bug)      3           retried, then failed                  ``failed``
=========================  ==========  ====================================  ========================

Every error class of the package subclasses one of the two (``ConfigError``, ``ManifestError``,
``TokenizationError``, ``OracleRejection``, … are rejections). A class whose codes mix both causes
(``ScoringError``, ``TeacherRegistryError``) picks its kind from the code when it is constructed:
``ScoringError("vllm_unreachable", …)`` is an ``EnvironmentFailure``, ``ScoringError("no_examples",
…)`` a ``Rejection``. ``kiln-flows`` prints ``error.describe()`` (or ``to_json()`` with ``--json``)
and exits with ``error.exit_code``; the Prefect tasks use ``retry_unless_rejected`` as their
``retry_condition_fn``. An exception that is neither — a bug — exits 3 with one line
(``--debug`` or ``KILN_FLOWS_DEBUG=1`` prints the traceback).
"""

from __future__ import annotations

from typing import Any

# The exit codes of every ``kiln-flows`` command, defined once (``flows.cli`` lists them in ``--help``).
EXIT_OK = 0
EXIT_REJECTED = 2
EXIT_FAILED = 3
EXIT_HELD_BACK = 4

EXIT_CODES = (
    (EXIT_OK, "success"),
    (EXIT_REJECTED, "rejected input: a request, spec, corpus, model or option broke a rule (nothing was run); "
                    "also a usage error"),
    (EXIT_FAILED, "failed: the run failed or was cancelled (Ctrl-C), storage or network failed, another "
                  "identical run is in progress (run_in_progress), or an unexpected error"),
    (EXIT_HELD_BACK, "train and run only: trained, but the post_eval/quality_gate held the adapter back "
                     "(latest.json did not move)"),
)


class KilnFlowsError(Exception):
    """Base of both kinds. ``code`` is stable (never renamed); ``message`` says what to fix.

    Attributes:
        code: Stable machine-readable name of the rule or failure.
        message: Human-readable explanation, without the place prefix.
        line: 1-based physical line of ``file`` the error is about, or None.
        field: Dotted path of the offending field (``config.top_k``, ``spec.adapter``), or None.
        file: The file (path or URI) the error is about, or None.
    """

    status = "failed"
    exit_code = EXIT_FAILED
    retryable = True

    def __init__(self, code: str, message: str, *, line: int | None = None, field: str | None = None,
                 file: str | None = None) -> None:
        self.code = code
        self.message = message
        self.line = line
        self.field = field
        self.file = file
        super().__init__(self.describe())

    def describe(self) -> str:
        """``[code] <place>: message`` on one line."""
        place = self.place()
        return f"[{self.code}] {place + ': ' if place else ''}{self.message}"

    def place(self) -> str:
        """Where the error is: ``corpus.jsonl line 3``, ``field config.top_k``, or ''."""
        parts = []
        if self.file:
            parts.append(str(self.file))
        if self.line is not None:
            parts.append(f"line {self.line}")
        if self.field:
            parts.append(f"field {self.field}")
        return " ".join(parts)

    def __str__(self) -> str:
        return self.describe()

    def to_json(self) -> dict[str, Any]:
        """The one JSON error object every CLI command and flow result uses (same keys everywhere)."""
        # The class's kind, not an instance attribute of the same name (TeacherRegistryError.status is HTTP's).
        payload: dict[str, Any] = {"status": type(self).status, "code": self.code, "line": self.line,
                                   "field": self.field, "message": self.message}
        if self.file is not None:
            payload["file"] = self.file
        return payload

    def __reduce__(self):
        # Subclasses have their own constructor signatures; rebuild from the attributes instead, so an
        # error survives pickling (Prefect stores a failed task's exception with its state).
        return _restore, (type(self), dict(self.__dict__), self.args)


def _restore(cls: type, state: dict[str, Any], args: tuple) -> KilnFlowsError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


def pick_kind(base: type, code: str, environment_codes: frozenset[str]) -> type:
    """The subclass of a mixed error class ``base`` for ``code``: its ``…Failure`` child when the code
    names an environment failure, its ``…Rejection`` child otherwise (see ``ScoringError``)."""
    wanted = EnvironmentFailure if code in environment_codes else Rejection
    for child in base.__subclasses__():
        if issubclass(child, wanted):
            return child
    raise TypeError(f"{base.__name__} has no {wanted.__name__} subclass")


class Rejection(KilnFlowsError):
    """Bad input: exit 2, never retried (docs/architecture.md, decision 10)."""

    status = "rejected"
    exit_code = EXIT_REJECTED
    retryable = False


class EnvironmentFailure(KilnFlowsError):
    """Storage or network failure: exit 3, retried by Prefect (docs/architecture.md, decision 10)."""

    status = "failed"
    exit_code = EXIT_FAILED
    retryable = True


def is_rejection(error: BaseException | None) -> bool:
    """True for bad input (never worth a retry)."""
    return isinstance(error, Rejection)


ADMISSION_CODES = (
    "file_not_found",
    "file_unreadable",
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
    "nesting_too_deep",
    "overlapping_masks",
    "target_at_position_zero",
    "input_token_out_of_range",
)


# Student and teacher model directories (``kiln_core.identity``): a file that does not parse (a truncated
# safetensors shard, a config.json that is not a JSON object), named in the error's ``file``; a model
# file that is a symlink, except a Hugging Face cache snapshot's links into its own ``blobs/``.
MODEL_UNREADABLE = "model_unreadable"
MODEL_FILE_CODES = (MODEL_UNREADABLE, "symlink")


class TokenizationError(Rejection, ValueError):
    """A student directory or an example that cannot be rendered or tokenized (a rejection everywhere:
    the CLI and the pipeline alike)."""

    def __init__(self, message: str, code: str = "invalid_student") -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return self.message


RUN_FAILURE_CODES = (
    "training_diverged",
)
"""Codes of a run that trained but must not be published: exit 3, the receipt ``failed`` (with Kiln's
``training_error`` as its ``failure_reason`` and our block naming the code), ``latest.json`` untouched,
the checkpoints kept. ``training_diverged``: the publish guard found non-finite or runaway LoRA weights,
or a diverged loss (``kiln_core.training.publish_guard``; ``config.publish_guard: false`` turns it off)."""


class AdmissionError(Rejection):
    """A corpus rejected by one admission rule.

    Attributes:
        code: Stable rule name from ``ADMISSION_CODES`` (or ``SHARD_SET_CODES`` for a set of shards).
        line: 1-based physical line, or ``None`` for file-level rules.
        message: Human-readable explanation naming the example and token index where they apply.
        file: The shard the rule is about when a set of shards was admitted; None for one file.
    """

    def __init__(self, code: str, line: int | None, message: str, *, file: str | None = None) -> None:
        if code not in ADMISSION_CODES and code not in SHARD_SET_CODES:
            raise ValueError(f"unknown admission code {code!r}")
        super().__init__(code, message, line=line, file=file)


SHARD_SET_CODES = (
    "shard_set_empty",
    "shard_index_invalid",
    "shard_path_unsafe",
    "shard_missing",
    "shard_unlisted",
    "shard_digest_mismatch",
    "shard_identity_mismatch",
    "shard_duplicate_conflict",
)
"""Rules of a corpus given as an ordered set of shards (``kiln_core.admission.shards``), on top of every
shard's own verdict (``ADMISSION_CODES``, the shard named in the error's ``file``):

* ``shard_set_empty`` — the directory holds no ``*.jsonl`` file, or the index lists no shard;
* ``shard_index_invalid`` — the index file is not a valid ``kiln-flows.corpus-shards.v1`` document;
* ``shard_path_unsafe`` — an index entry escapes the index's directory (absolute, ``..``), or a shard
  (or a directory on its way) is a symlink;
* ``shard_missing`` — an indexed shard does not exist;
* ``shard_unlisted`` — a ``*.jsonl`` file in the directory of an index that the index does not list (a directory
  with an ``index.json`` is read through it, whole);
* ``shard_digest_mismatch`` — a shard's bytes no longer match the index's ``sha256``/``size_bytes``;
* ``shard_identity_mismatch`` — a shard's manifest line is not byte-identical to the first shard's;
* ``shard_duplicate_conflict`` — the same exact token sequence in two shards with different teacher rows
  (the cross-shard form of ``conflicting_duplicate_row``)."""
