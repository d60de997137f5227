"""The Hugging Face next-token oracle: does eager HF agree with Kiln's or vLLM's disputed token?

A ``kiln.hf-next-token-request.v1`` binds a source revision, exact model bytes, a rendered prompt,
a forced continuation prefix and two candidate next tokens (Kiln's, then vLLM's). The oracle proves
the request is what it claims, runs one independent eager forward pass and records which candidate
the reference model's argmax is (Kiln's ``scripts/qualification/``).

Modules, one job each:

* ``errors`` — ``OracleRejection(rule, message)`` / ``OracleRunError`` and the stable rule names;
* ``request`` — file rules, strict JSON, JSON Schema, pydantic models, cross-field rules;
* ``receipts`` — repository-bound source-receipt checks;
* ``fingerprint`` — the model directory's ``model_identity``;
* ``reference`` — tokenizer re-checks and the eager forward pass (torch imported lazily);
* ``result`` — evidence, verdict, the self-hashed record and its atomic commit;
* ``runner`` — ``run_oracle``: all of the above in order;
* ``make_request`` — build a valid request (and synthetic receipts) from a model directory.

Importing this package does not import torch, transformers or Prefect.

Example:
    >>> from kiln_core.oracle import run_oracle
    >>> outcome = run_oracle("request.json", "./student", dtype="fp32")  # doctest: +SKIP
"""

from kiln_core.contracts.oracle_request import HfNextTokenRequest
from kiln_core.oracle.errors import ALL_RULES, OracleRejection, OracleRunError
from kiln_core.oracle.fingerprint import check_model_identity, fingerprint_model, model_identity
from kiln_core.oracle.make_request import MadeRequest, make_request
from kiln_core.oracle.receipts import check_source_receipts
from kiln_core.oracle.request import LoadedRequest, load_request, validate_request_object
from kiln_core.oracle.result import RESULT_SCHEMA, decide_verdict, read_result, validate_result
from kiln_core.oracle.runner import OracleOutcome, run_oracle, validate_inputs

__all__ = [
    "ALL_RULES",
    "HfNextTokenRequest",
    "LoadedRequest",
    "MadeRequest",
    "OracleOutcome",
    "OracleRejection",
    "OracleRunError",
    "RESULT_SCHEMA",
    "check_model_identity",
    "check_source_receipts",
    "decide_verdict",
    "fingerprint_model",
    "load_request",
    "make_request",
    "model_identity",
    "read_result",
    "run_oracle",
    "validate_inputs",
    "validate_request_object",
    "validate_result",
]
