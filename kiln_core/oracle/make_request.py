"""Build a valid ``kiln.hf-next-token-request.v1`` from a local model directory.

For requests made by hand (tests, demos, local investigations) there are no real serving receipts,
so this module also writes two small **synthetic** receipts — one per engine — under
``<request dir>/receipts/<id>.{kiln,vllm}.json`` and binds them in ``source``. They are marked
``"synthetic": true`` and carry exactly what the repository-bound checks of
``scripts/qualification/hf_next_token_contract.py`` read
(driver version ``"7"``, the source commit with ``dirty: false``, the run id, the model identity
with its ``path``, one run at concurrency 1 / repeat 0, and an exact output that starts with the
prefix texts plus that engine's candidate), so ``--receipts-root <request dir>`` checks pass.

Everything is derived the way the oracle re-checks it: the model fingerprint, the prompt rendered
with ``enable_thinking=False``, token texts decoded one id at a time, canonical hashes. The request
is validated (schema, cross-field, tokenizer, receipts) before it is written.

Example:
    >>> made = make_request("./student", message="What is two plus two?", prefix_text="Two",
    ...                     kiln_id=17, vllm_id=42, request_id="demo-1", out="req/demo-1.json")  # doctest: +SKIP
    >>> made.request_uri  # doctest: +SKIP
    'req/demo-1.json'
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln_core.canonical import canonical_sha256, self_hash, sha256_prefixed
from kiln_core.contracts.oracle_request import REQUEST_SCHEMA
from kiln_core.oracle.errors import OracleRejection
from kiln_core.oracle.fingerprint import fingerprint_model, model_identity
from kiln_core.oracle.receipts import DRIVER_VERSION, check_source_receipts
from kiln_core.oracle.reference import (
    check_token_range,
    check_tokenization,
    decode_one,
    load_tokenizer,
    model_vocab_size,
    render_prompt_ids,
)
from kiln_core.oracle.request import MAX_REQUEST_BYTES, validate_request_object
from kiln_core.oracle.result import write_local_atomic

SYNTHETIC_RECEIPT_SCHEMA = "kiln-flows.synthetic-serving-receipt.v1"
PLACEHOLDER_COMMIT = "0" * 40


@dataclass(frozen=True)
class MadeRequest:
    """What ``make_request`` wrote.

    Attributes:
        request_uri: The request file.
        receipt_paths: The two synthetic receipts (kiln, vllm).
        receipts_root: The directory to pass as ``--receipts-root``.
        sha256: Canonical SHA-256 of the request.
    """

    request_uri: str
    receipt_paths: tuple[str, str]
    receipts_root: str
    sha256: str


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def synthetic_receipt(
    engine: str, *, identity_with_path: dict[str, Any], source_commit: str, run_id: str, phase: str,
    prompt_token_count: int, exact_content: str,
) -> dict[str, Any]:
    """A minimal serving receipt that satisfies the repository-bound checks (hf_next_token_contract.py), self-hashed."""
    receipt: dict[str, Any] = {
        "schema": SYNTHETIC_RECEIPT_SCHEMA,
        "synthetic": True,
        "driver_version": DRIVER_VERSION,
        "driver_environment": {"repository": {"commit": source_commit, "dirty": False}},
        "workload": {"run_id": run_id, "phase": phase, "profile": "short", "request_index": 0},
        "engine": {"name": engine, "model_identity": identity_with_path},
        "runs": [
            {
                "concurrency": 1,
                "repeat": 0,
                "prompt_token_counts": [prompt_token_count],
                "output_evidence": [
                    {
                        "request_index": 0,
                        "exact_output": {
                            "content_base64": base64.b64encode(exact_content.encode("utf-8")).decode("ascii"),
                            "reasoning_content_base64": "",
                        },
                    }
                ],
            }
        ],
    }
    receipt["receipt_sha256"] = self_hash(receipt, "receipt_sha256")
    return receipt


def make_request(
    model_dir: str | Path,
    *,
    message: str,
    kiln_id: int,
    vllm_id: int,
    request_id: str,
    out: str | Path,
    prefix_ids: list[int] | None = None,
    prefix_text: str | None = None,
    run_id: str = "kiln-flows-local",
    phase: str = "oracle",
    source_commit: str = PLACEHOLDER_COMMIT,
    model_id: str | None = None,
) -> MadeRequest:
    """Build, validate and write a request plus its two synthetic receipts.

    Args:
        model_dir: Local model directory (fingerprinted; its tokenizer renders the prompt).
        message: The single user message.
        kiln_id: Kiln's disputed candidate id.
        vllm_id: vLLM's disputed candidate id (must differ from ``kiln_id``).
        request_id: Request id (``^[a-z0-9][a-z0-9._-]{2,127}$``).
        out: Local path of the request file; receipts go to ``<its dir>/receipts/``.
        prefix_ids: Continuation prefix as ids; exactly one of ``prefix_ids``/``prefix_text``.
        prefix_text: Continuation prefix as text, tokenized without special tokens.
        run_id: ``prompt.generator.run_id`` (and the receipts' ``workload.run_id``).
        phase: ``prompt.generator.phase``.
        source_commit: 40-hex commit recorded in ``source`` and the receipts.
        model_id: ``model_identity.id``; defaults to the model directory's name.

    Returns:
        Paths written and the request's canonical sha256.

    Raises:
        OracleRejection: The inputs cannot make a valid request (rule names as the oracle's).
        ValueError: Both or neither of ``prefix_ids``/``prefix_text``.
    """
    if (prefix_ids is None) == (prefix_text is None):
        raise ValueError("give exactly one of prefix_ids or prefix_text")
    model_dir = Path(model_dir)
    out_path = Path(out)
    root = out_path.parent.absolute()
    tokenizer = load_tokenizer(model_dir)
    if prefix_ids is None:
        prefix_ids = list(tokenizer(prefix_text, add_special_tokens=False)["input_ids"])
    fingerprint = fingerprint_model(model_dir, model_id or model_dir.absolute().name)
    identity = model_identity(fingerprint)

    messages = [{"role": "user", "content": message}]
    prompt_ids = render_prompt_ids(tokenizer, messages)
    prefix = [{"token_id": int(token), "text": decode_one(tokenizer, int(token))} for token in prefix_ids]
    candidates = [
        {"engine": "kiln", "token_id": int(kiln_id), "text": decode_one(tokenizer, int(kiln_id))},
        {"engine": "vllm", "token_id": int(vllm_id), "text": decode_one(tokenizer, int(vllm_id))},
    ]
    input_ids = prompt_ids + [item["token_id"] for item in prefix]
    prefix_texts = "".join(item["text"] for item in prefix)

    receipt_refs: dict[str, dict[str, str]] = {}
    receipt_files: dict[str, tuple[Path, bytes]] = {}
    for candidate in candidates:
        engine = candidate["engine"]
        receipt = synthetic_receipt(
            engine,
            identity_with_path={**identity, "path": fingerprint["path"]},
            source_commit=source_commit,
            run_id=run_id,
            phase=phase,
            prompt_token_count=len(prompt_ids),
            exact_content=prefix_texts + candidate["text"],
        )
        relative = f"receipts/{request_id}.{engine}.json"
        data = _json_bytes(receipt)
        receipt_files[engine] = (root / relative, data)
        receipt_refs[engine] = {"path": relative, "file_sha256": sha256_prefixed(data), "content_sha256": receipt["receipt_sha256"]}

    request = {
        "schema": REQUEST_SCHEMA,
        "id": request_id,
        "source": {"source_commit": source_commit, "kiln_receipt": receipt_refs["kiln"], "vllm_receipt": receipt_refs["vllm"]},
        "model_identity": identity,
        "prompt": {
            "generator": {
                "run_id": run_id,
                "phase": phase,
                "request_index": 0,
                "profile": "short",
                "template_version": "fixed-serving-profiles-v1",
            },
            "messages": messages,
            "add_generation_prompt": True,
            "template_kwargs": {"enable_thinking": False},
            "utf8_sha256": sha256_prefixed(message.encode("utf-8")),
            "token_count": len(prompt_ids),
            "token_ids": prompt_ids,
        },
        "continuation_prefix": prefix,
        "input_token_ids": input_ids,
        "input_token_ids_sha256": canonical_sha256(input_ids),
        "candidates": candidates,
    }
    typed = validate_request_object(request)
    check_token_range(typed, model_vocab_size(model_dir))
    check_tokenization(tokenizer, typed)
    payload = _json_bytes(request)
    if len(payload) > MAX_REQUEST_BYTES:
        raise OracleRejection("file_too_large", f"the request would be {len(payload)} bytes, limit {MAX_REQUEST_BYTES}")

    (root / "receipts").mkdir(parents=True, exist_ok=True)
    for path, data in receipt_files.values():
        write_local_atomic(path, data)
    check_source_receipts(typed, root)
    write_local_atomic(out_path.absolute(), payload)
    return MadeRequest(
        request_uri=str(out_path),
        receipt_paths=(str(receipt_files["kiln"][0]), str(receipt_files["vllm"][0])),
        receipts_root=str(root),
        sha256=canonical_sha256(request),
    )
