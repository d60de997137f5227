"""Prefect task over ``kiln_core.oracle.run_oracle``: one request in, one small verdict ref out.

A rejected request is an *answer*, not a crash: the task returns a ref with ``status="rejected"`` and
the rule, so a batch keeps going and the table shows why. A failed forward pass raises
``OracleRunError`` so Prefect marks the task failed (and may retry it).

Example:
    ```python
    from prefect import flow
    from tasks.oracle import run_oracle_request

    @flow
    def one(request_uri: str, model_dir: str):
        return run_oracle_request(request_uri, model_dir, dtype="fp32")
    ```
"""

from __future__ import annotations

from typing import Literal

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict


class OracleRef(BaseModel):
    """The small result a task hands back; the record itself stays in storage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_uri: str
    """The request file the task was given."""
    status: Literal["ok", "rejected", "failed"]
    """``ok`` committed (or reused), ``rejected`` a contract rule failed, ``failed`` the run failed."""
    request_id: str | None = None
    """The request's id, when it could be read."""
    verdict: Literal["kiln", "vllm", "neither"] | None = None
    """``verdict.argmax_candidate`` of the result."""
    argmax_token_id: int | None = None
    """The reference argmax id."""
    result_uri: str | None = None
    """Where ``result.json`` lives."""
    result_sha256: str | None = None
    """The result's self-hash."""
    receipts_checked: bool | None = None
    """Whether the source receipts were checked."""
    reused: bool = False
    """True when an identical committed result was returned."""
    rule: str | None = None
    """The rejection rule, for ``rejected``."""
    message: str | None = None
    """The rejection or failure message."""


# The model is loaded fresh inside each call, and results already dedupe on disk by request sha;
# a Prefect cache would only hide a re-check of the model bytes.
@task(name="hf-next-token-oracle-request", cache_policy=NO_CACHE)
def run_oracle_request(
    request_uri: str,
    model_dir: str,
    out_root: str = "./kiln-data",
    dtype: Literal["bf16", "fp32"] = "bf16",
    receipts_root: str | None = None,
) -> OracleRef:
    """Run one oracle request and return its verdict ref.

    Args:
        request_uri: Request file (local path or fsspec URI).
        model_dir: Local model directory named by the request.
        out_root: Root URI of the results (``<root>/oracle/<id>/``).
        dtype: ``bf16`` or ``fp32``.
        receipts_root: Repository root of the source receipts; ``None`` means the worker's current
            directory. They are always checked; missing ones reject the request (``receipt_missing``).

    Returns:
        ``OracleRef`` with ``status`` ``ok`` or ``rejected``.

    Raises:
        OracleRunError: The forward pass failed.
    """
    from kiln_core.oracle import OracleRejection, run_oracle

    logger = get_run_logger()
    try:
        outcome = run_oracle(request_uri, model_dir, out_root=out_root, dtype=dtype, receipts_root=receipts_root)
    except OracleRejection as error:
        logger.warning("request %s rejected [%s]: %s", request_uri, error.rule, error.message)
        return OracleRef(request_uri=request_uri, status="rejected", rule=error.rule, message=error.message)
    for warning in outcome.warnings:
        logger.warning("%s: %s", request_uri, warning)
    record = outcome.record
    logger.info(
        "request %s: verdict %s (argmax %s)", record["request"]["id"], record["verdict"]["argmax_candidate"], record["oracle"]["argmax"]
    )
    return OracleRef(
        request_uri=request_uri,
        status="ok",
        request_id=record["request"]["id"],
        verdict=record["verdict"]["argmax_candidate"],
        argmax_token_id=record["verdict"]["argmax_token_id"],
        result_uri=outcome.result_uri,
        result_sha256=record["result_sha256"],
        receipts_checked=record["receipts_checked"],
        reused=outcome.reused,
    )
