"""One oracle run, end to end: request → receipts → model identity → reference → committed result.

The order is Kiln's (``scripts/qualification/rocm_hf_next_token_oracle.py`` ``run``), minus its host containment: every check that can
reject the input runs before the model is loaded, and nothing is written unless the forward pass
succeeded. The source receipts are checked on every request, as Kiln's ``validate_source_receipts``
always is: against the current directory by default (Kiln runs from its repository root), or the
``receipts_root`` given.

Re-running is idempotent: when ``<root>/oracle/<id>/result.json`` already exists for the same
request sha256, model identity and dtype (and its self-hash and logits file verify), that committed
result is returned unchanged with ``reused=True`` instead of being recomputed. Any other existing
``result.json`` is never overwritten (rule ``result_exists``).

Example:
    >>> outcome = run_oracle("request.json", "./student", out_root="./kiln-data", dtype="fp32")  # doctest: +SKIP
    >>> outcome.record["verdict"]["argmax_candidate"]  # doctest: +SKIP
    'kiln'
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kiln_core.oracle.errors import OracleRejection
from kiln_core.oracle.fingerprint import check_model_identity
from kiln_core.oracle.receipts import check_source_receipts
from kiln_core.oracle.reference import Dtype, check_model_inputs, decode_one, load_tokenizer, run_reference
from kiln_core.oracle.request import LoadedRequest, load_request
from kiln_core.oracle.result import (
    RESULT_FILE,
    build_result,
    logits_artifact_bytes,
    oracle_evidence,
    read_result,
    result_dir,
    write_result,
)


@dataclass(frozen=True)
class OracleOutcome:
    """A committed result.

    Attributes:
        record: The result record (``kiln-flows.hf-next-token-result.v1``).
        result_uri: Where its ``result.json`` lives.
        reused: True when an identical committed result was returned instead of recomputed.
        warnings: Human-readable warnings about the run (none today; kept for callers).
    """

    record: dict[str, Any]
    result_uri: str
    reused: bool
    warnings: tuple[str, ...]


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def validate_inputs(
    request_uri: str, model_dir: str | Path, receipts_root: str | Path | None = None
) -> tuple[LoadedRequest, list[str]]:
    """Every check that needs no model weights loaded: request, receipts, model identity.

    Args:
        request_uri: The request file.
        model_dir: The local model directory the request names.
        receipts_root: Repository root holding the source receipts; None means the current directory.

    Returns:
        The loaded request and the warnings to report.

    Raises:
        OracleRejection: The first failing rule (``receipt_missing`` when a receipt is not there).
    """
    loaded = load_request(request_uri)
    check_source_receipts(loaded.request, Path.cwd() if receipts_root is None else receipts_root)
    check_model_identity(loaded.request.model_identity, model_dir)
    return loaded, []


def _reuse_conflicts(existing: dict[str, Any], loaded: LoadedRequest, dtype: str) -> list[str]:
    """Why a committed result does not answer this run (empty when it does)."""
    conflicts = []
    if existing["request"]["sha256"] != loaded.sha256:
        conflicts.append(f"request sha256 {existing['request']['sha256']} != {loaded.sha256}")
    if existing["model_identity"] != loaded.request.model_identity.model_dump(mode="json"):
        conflicts.append("model_identity differs")
    if existing["runtime"]["dtype"] != dtype:
        conflicts.append(f"dtype {existing['runtime']['dtype']} != {dtype}")
    if not existing["receipts_checked"]:
        # Made by an older kiln-flows that allowed skipping them: it does not answer a checked run.
        conflicts.append("it was made without receipt checks")
    return conflicts


def run_oracle(
    request_uri: str,
    model_dir: str | Path,
    *,
    out_root: str = "./kiln-data",
    dtype: Dtype = "bf16",
    receipts_root: str | Path | None = None,
    device: str | None = None,
) -> OracleOutcome:
    """Validate a request against its model and receipts, run the reference and commit the result.

    Args:
        request_uri: Request file (local path or fsspec URI).
        model_dir: Local model directory named by the request.
        out_root: Root URI; the result goes to ``<root>/oracle/<request id>/``.
        dtype: ``bf16`` (Kiln's) or ``fp32``.
        receipts_root: Repository root holding the source receipts; ``None`` means the current
            directory. The receipts are always checked (``receipts_checked: true``).
        device: ``cuda``/``cpu``; ``None`` picks CUDA when available.

    Returns:
        The committed (or reused) outcome.

    Raises:
        OracleRejection: A contract rule failed, missing receipts included (nothing is written).
        OracleRunError: The forward pass failed (nothing is written).
    """
    started = time.monotonic()
    created_at = _utc_now()
    loaded, warnings = validate_inputs(request_uri, model_dir, receipts_root)
    tokenizer = load_tokenizer(model_dir)
    # Contract rules first: a bad request is reported by its own rule, never as `result_exists`.
    check_model_inputs(model_dir, loaded.request, tokenizer)
    directory = result_dir(out_root, loaded.request.id)

    existing = read_result(out_root, loaded.request.id)
    if existing is not None:
        conflicts = _reuse_conflicts(existing, loaded, dtype)
        if not conflicts:
            return OracleOutcome(existing, f"{directory}/{RESULT_FILE}", True, tuple(warnings))
        raise OracleRejection(
            "result_exists", f"{directory}/{RESULT_FILE} is already committed and refusing to overwrite it: {'; '.join(conflicts)}"
        )

    reference = run_reference(model_dir, loaded.request, dtype=dtype, device=device, tokenizer=tokenizer, inputs_checked=True)
    oracle = oracle_evidence(
        reference.logits,
        [item.model_dump() for item in loaded.request.candidates],
        lambda token: decode_one(tokenizer, token),
    )
    artifact = logits_artifact_bytes(reference, loaded)
    record = build_result(
        loaded,
        reference,
        oracle,
        artifact,
        receipts_checked=True,
        created_at_utc=created_at,
        duration_seconds=time.monotonic() - started,
    )
    uri = write_result(out_root, record, artifact)
    return OracleOutcome(record, uri, False, tuple(warnings))
