"""``hf_next_token_oracle``: answer a batch of HF next-token requests and table the verdicts.

Requests run one after another (each loads the model; running them side by side would only multiply
memory). A rejected request is recorded in the table with its rule and the batch continues; a
failed forward pass is recorded too, and the flow ends Failed after the table is published.

Example:
    ```python
    from flows.oracle import hf_next_token_oracle

    refs = hf_next_token_oracle(["req/a.json", "req/b.json"], model_dir="./student", dtype="fp32")
    ```
"""


import re
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from tasks.oracle import OracleRef, run_oracle_request

ARTIFACT_KEY_PREFIX = "hf-next-token-oracle"


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (``^[a-z0-9-]*$``) built from free text.

    Example:
        >>> artifact_key("hf-next-token-oracle", "My Batch_01")
        'hf-next-token-oracle-my-batch-01'
    """
    slug = "-".join(re.sub(r"[^a-z0-9]+", "-", part.lower()).strip("-") for part in parts if part)
    return re.sub(r"-{2,}", "-", slug).strip("-")[:255]


def _row(ref: OracleRef) -> dict[str, object]:
    return {
        "request": ref.request_id or ref.request_uri,
        "status": ref.status,
        "verdict": ref.verdict or "",
        "argmax_token_id": "" if ref.argmax_token_id is None else ref.argmax_token_id,
        "receipts_checked": "" if ref.receipts_checked is None else ref.receipts_checked,
        "rule": ref.rule or "",
        "message": (ref.message or "")[:300],
        "result": ref.result_uri or "",
        "result_sha256": ref.result_sha256 or "",
    }


@flow(name="hf-next-token-oracle", log_prints=False)
def hf_next_token_oracle(
    request_uris: list[str],
    model_dir: str,
    out_root: str = "./kiln-data",
    dtype: Literal["bf16", "fp32"] = "bf16",
    receipts_root: str | None = None,
) -> list[OracleRef]:
    """Run every request against one local model and publish a verdict table.

    Args:
        request_uris: Request files (local paths or fsspec URIs).
        model_dir: Local model directory the requests name.
        out_root: Root URI; each result goes to ``<root>/oracle/<request id>/``.
        dtype: ``bf16`` (Kiln's) or ``fp32``.
        receipts_root: Repository root of the source receipts; ``None`` means the current directory.
            Every request's receipts are checked; a request whose receipts are missing is rejected
            (``receipt_missing``) and the batch continues.

    Returns:
        One ``OracleRef`` per request, in order.

    Raises:
        RuntimeError: After the table is published, when any forward pass failed.
    """
    logger = get_run_logger()
    refs: list[OracleRef] = []
    for uri in request_uris:
        state = run_oracle_request(uri, model_dir, out_root, dtype, receipts_root, return_state=True)
        if state.is_completed():
            refs.append(state.result())
        else:
            error = state.result(raise_on_failure=False)
            refs.append(OracleRef(request_uri=uri, status="failed", message=str(error)))
    counts = {status: sum(ref.status == status for ref in refs) for status in ("ok", "rejected", "failed")}
    verdicts = {name: sum(ref.verdict == name for ref in refs) for name in ("kiln", "vllm", "neither")}
    create_table_artifact(
        key=artifact_key(ARTIFACT_KEY_PREFIX, "verdicts"),
        table=[_row(ref) for ref in refs],
        description=(
            f"HF next-token oracle ({dtype}) over {len(refs)} request(s): "
            f"{counts['ok']} answered (kiln {verdicts['kiln']}, vllm {verdicts['vllm']}, neither {verdicts['neither']}), "
            f"{counts['rejected']} rejected, {counts['failed']} failed."
        ),
    )
    logger.info("oracle batch: %s; verdicts %s", counts, verdicts)
    if counts["failed"]:
        raise RuntimeError(f"{counts['failed']} oracle request(s) failed; see the verdict table")
    return refs
