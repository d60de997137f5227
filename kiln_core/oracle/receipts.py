"""Repository-bound source-receipt checks of Kiln's
``scripts/qualification/hf_next_token_contract.py`` (``validate_request``).

A request names the two serving receipts (Kiln's and vLLM's) that produced its disputed candidates.
Given the repository root that holds them, these checks prove the receipts are the exact files the
request was built from and that they describe the same source commit, prompt, model and divergence.

Kiln's ``validate_source_receipts`` is followed check for check, with two deliberate differences:
a symlink anywhere below the repository root is refused (Kiln checks only the last component), and
integers are compared by type as well as value (``true`` is not ``1``).

Rules: ``receipt_missing`` (no file at the receipt's path under the root), ``receipt_unreadable``
(symlink, not regular, too large, not strict JSON) and ``receipt_mismatch`` (any hash or field that
disagrees with the request), each naming the engine.

Example:
    >>> check_source_receipts(loaded.request, "/repo")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from typing import Any

from kiln_core.canonical import sha256_prefixed
from kiln_core.contracts.oracle_request import HfNextTokenRequest, ReceiptReference
from kiln_core.oracle.errors import OracleRejection
from kiln_core.oracle.request import read_regular_file
from kiln_core.strict_json import StrictJsonError, loads_strict

MAX_RECEIPT_BYTES = 16 << 20
DRIVER_VERSION = "7"


def _is_int(value: Any, expected: int) -> bool:
    return type(value) is int and value == expected


def read_receipt(repo_root: str | Path, reference: ReceiptReference, engine: str) -> tuple[bytes, dict[str, Any]]:
    """Read and strict-parse one receipt below ``repo_root`` (no symlinks on the way).

    Raises:
        OracleRejection: ``receipt_missing`` or ``receipt_unreadable``.
    """
    current = Path(repo_root)
    for part in Path(reference.path).parts:
        current = current / part
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                raise OracleRejection("receipt_unreadable", f"{engine} receipt path {reference.path} passes through a symlink")
        except FileNotFoundError:
            raise OracleRejection(
                "receipt_missing",
                f"{engine} receipt {reference.path} does not exist under the receipts root {repo_root}: source receipts "
                f"are always checked; run from the repository that holds them or pass --receipts-root",
            ) from None
    try:
        data = read_regular_file(str(current), MAX_RECEIPT_BYTES, what=f"{engine} receipt")
    except OracleRejection as error:
        raise OracleRejection("receipt_unreadable", error.message) from None
    try:
        receipt = loads_strict(data)
    except StrictJsonError as error:
        raise OracleRejection("receipt_unreadable", f"{engine} receipt {reference.path}: {error}") from None
    if not isinstance(receipt, dict):
        raise OracleRejection("receipt_unreadable", f"{engine} receipt {reference.path} is not a JSON object")
    return data, receipt


def _decode_base64_text(value: Any, where: str) -> str:
    try:
        return base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, TypeError, ValueError) as error:
        raise OracleRejection("receipt_mismatch", f"{where} is not strict base64 of UTF-8 text: {error}") from None


def check_receipt(request: HfNextTokenRequest, engine: str, repo_root: str | Path) -> None:
    """Run the eight repository-bound checks on one engine's receipt.

    Raises:
        OracleRejection: ``receipt_missing``, ``receipt_unreadable`` or ``receipt_mismatch`` naming
            ``engine`` and the field.
    """
    reference: ReceiptReference = getattr(request.source, f"{engine}_receipt")
    data, receipt = read_receipt(repo_root, reference, engine)

    def mismatch(message: str) -> OracleRejection:
        return OracleRejection("receipt_mismatch", f"{engine} receipt {reference.path}: {message}")

    actual_file = sha256_prefixed(data)
    if actual_file != reference.file_sha256:
        raise mismatch(f"file bytes hash to {actual_file}, request says {reference.file_sha256}")
    # Kiln compares with the stored self-hash; it does not recompute it (hf_next_token_contract.py).
    if receipt.get("receipt_sha256") != reference.content_sha256:
        raise mismatch(f"receipt_sha256 is {receipt.get('receipt_sha256')}, request says {reference.content_sha256}")
    if receipt.get("driver_version") != DRIVER_VERSION:
        raise mismatch(f"driver_version is {receipt.get('driver_version')!r}, expected {DRIVER_VERSION!r}")
    environment = receipt.get("driver_environment")
    repository = environment.get("repository") if isinstance(environment, dict) else None
    if not isinstance(repository, dict) or repository.get("commit") != request.source.source_commit:
        raise mismatch("driver_environment.repository.commit differs from source.source_commit")
    if repository.get("dirty") is not False:
        raise mismatch("driver_environment.repository.dirty must be false")
    workload = receipt.get("workload")
    if not isinstance(workload, dict) or workload.get("run_id") != request.prompt.generator.run_id:
        raise mismatch("workload.run_id differs from prompt.generator.run_id")
    engine_section = receipt.get("engine")
    identity = engine_section.get("model_identity") if isinstance(engine_section, dict) else None
    if not isinstance(identity, dict):
        raise mismatch("engine.model_identity is missing")
    identity = {key: value for key, value in identity.items() if key != "path"}
    if identity != request.model_identity.model_dump(mode="json"):
        raise mismatch("engine.model_identity (without path) differs from the request's model_identity")

    runs = receipt.get("runs")
    if not isinstance(runs, list) or len(runs) != 1 or not isinstance(runs[0], dict):
        raise mismatch("runs must hold exactly one measured run")
    run = runs[0]
    counts = run.get("prompt_token_counts")
    expected_count = len(request.prompt.token_ids)
    if not (_is_int(run.get("concurrency"), 1) and _is_int(run.get("repeat"), 0)):
        raise mismatch("runs[0] must have concurrency 1 and repeat 0")
    if not (isinstance(counts, list) and len(counts) == 1 and _is_int(counts[0], expected_count)):
        raise mismatch(f"runs[0].prompt_token_counts must be [{expected_count}]")
    rows = run.get("output_evidence")
    if not isinstance(rows, list) or len(rows) != 1 or not isinstance(rows[0], dict):
        raise mismatch("runs[0].output_evidence must hold exactly one row")
    exact = rows[0].get("exact_output")
    if not isinstance(exact, dict) or set(exact) != {"content_base64", "reasoning_content_base64"}:
        raise mismatch("output_evidence[0].exact_output must have exactly content_base64 and reasoning_content_base64")
    content = _decode_base64_text(exact["content_base64"], f"{engine} receipt exact_output.content_base64")
    reasoning = _decode_base64_text(exact["reasoning_content_base64"], f"{engine} receipt exact_output.reasoning_content_base64")
    if reasoning != "":
        raise mismatch("exact_output reasoning must be empty")
    expected_start = "".join(token.text for token in request.continuation_prefix) + request.candidate(engine).text
    if not content.startswith(expected_start):
        raise mismatch(f"exact_output content does not start with the prefix texts + {engine} candidate {expected_start!r}")


def check_source_receipts(request: HfNextTokenRequest, repo_root: str | Path) -> None:
    """Check the Kiln receipt, then the vLLM receipt, against ``repo_root``.

    Raises:
        OracleRejection: ``receipt_missing``, ``receipt_unreadable`` or ``receipt_mismatch``.
    """
    for engine in ("kiln", "vllm"):
        check_receipt(request, engine, repo_root)
