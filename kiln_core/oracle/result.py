"""``kiln-flows.hf-next-token-result.v1``: reading the logits, assembling, hashing and committing a result.

A result directory is ``<root>/oracle/<request id>/`` (docs/storage.md) and holds exactly:

* ``logits.safetensors`` — tensors ``input_ids`` (I64 ``[1, N]``) and ``logits`` (F32 ``[V]``) plus
  string metadata (schema, attention route, dtype, library versions, the input ids as compact JSON);
* ``result.json`` — the record, written **last**: its presence is the commit. Readers ignore a
  directory without it.

Conventions taken from Kiln (``scripts/qualification/rocm_hf_next_token_oracle.py``,
``crates/kiln-model/examples/rocm_hf_path_attribution.rs``): argmax ties go to the lowest index;
top-10 is sorted by value descending then index ascending; a candidate's rank is 1 + the number of
strictly greater logits (ties share the better rank); ``logits_sha256`` hashes the float32
little-endian vector; ``result_sha256`` is the canonical self-hash. We add ``logprob``
(``log_softmax`` in float32) and allow an exact top tie (margin ``0``) instead of rejecting it.

One writer per result directory is assumed: the "never overwrite" check runs before the forward
pass, so two concurrent runs of the same request id into the same root can still race.

Example:
    >>> record = read_result("./kiln-data", "first-divergence-v1")  # doctest: +SKIP
    >>> record["verdict"]["argmax_candidate"]  # doctest: +SKIP
    'vllm'
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Callable

from kiln_core.canonical import canonical_sha256, self_hash, sha256_prefixed
from kiln_core.oracle.errors import OracleRejection
from kiln_core.oracle.reference import ATTENTION_IMPLEMENTATION, SEED, ReferenceOutput
from kiln_core.oracle.request import LoadedRequest, schema_validator
from kiln_core.storage import is_local_uri
from kiln_core.strict_json import StrictJsonError, loads_strict

RESULT_SCHEMA = "kiln-flows.hf-next-token-result.v1"
RESULT_SCHEMA_FILE = "hf-next-token-result-v1.schema.json"
LOGITS_SCHEMA = "kiln-flows.hf-full-logits.v1"
RESULT_FILE = "result.json"
LOGITS_FILE = "logits.safetensors"
TOP_K = 10
_TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}


# ---------------------------------------------------------------------------------------- evidence


def logits_sha256(logits) -> str:
    """SHA-256 of a float32 logits tensor's raw little-endian bytes (``sha256:`` prefixed)."""
    vector = logits.detach().cpu().float().contiguous().numpy().astype("<f4", copy=False)
    return sha256_prefixed(vector.tobytes())


def oracle_evidence(logits, request_candidates: list[dict[str, Any]], decode: Callable[[int], str]) -> dict[str, Any]:
    """Read argmax, top-10, margin and both candidates' logit/logprob/rank off the logits.

    Args:
        logits: float32 tensor ``[V]``.
        request_candidates: ``[{engine, token_id, text}, ...]`` in request order.
        decode: Decodes one id alone (``reference.decode_one`` bound to the tokenizer).

    Returns:
        The ``oracle`` section of the result.
    """
    import numpy as np
    import torch

    values = logits.detach().cpu().float().contiguous()
    array = values.numpy()
    logprobs = torch.log_softmax(values, dim=-1).numpy()
    vocab = int(array.shape[0])
    order = np.lexsort((np.arange(vocab), -array))  # value desc, then index asc
    argmax = int(order[0])  # equals np.argmax: the lowest index among maxima
    top = [int(index) for index in order[:TOP_K]]
    margin = float(array[top[0]]) - float(array[top[1]]) if vocab > 1 else 0.0
    candidates = []
    for item in request_candidates:
        token = int(item["token_id"])
        candidates.append(
            {
                "engine": item["engine"],
                "token_id": token,
                "text": item["text"],
                "logit": float(array[token]),
                "logprob": float(logprobs[token]),
                "rank": 1 + int((array > array[token]).sum()),
            }
        )
    return {
        "vocab": vocab,
        "argmax": argmax,
        "argmax_text": decode(argmax),
        "top_tokens": [{"token_id": index, "text": decode(index), "logit": float(array[index])} for index in top],
        "top_logit_margin": margin,
        "candidate_tokens": candidates,
        "logits_sha256": logits_sha256(values),
    }


def decide_verdict(argmax: int, candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict rule of ``rocm_hf_next_token_oracle.py``: the engine whose candidate is the argmax;
    ``neither`` for none (or, in principle, both).

    Example:
        >>> decide_verdict(7, [{"engine": "kiln", "token_id": 3}, {"engine": "vllm", "token_id": 7}])
        {'argmax_candidate': 'vllm', 'argmax_token_id': 7, 'candidate_attribution_complete': True}
    """
    matches = [item["engine"] for item in candidates if item["token_id"] == argmax]
    winner = matches[0] if len(matches) == 1 else "neither"
    return {"argmax_candidate": winner, "argmax_token_id": argmax, "candidate_attribution_complete": winner != "neither"}


def logits_artifact_bytes(reference: ReferenceOutput, loaded: LoadedRequest) -> bytes:
    """The ``logits.safetensors`` bytes: ``input_ids`` I64 ``[1, N]`` and ``logits`` F32 ``[V]``."""
    import torch
    from safetensors.torch import save

    tensors = {
        "input_ids": torch.tensor([reference.input_ids], dtype=torch.int64),
        "logits": reference.logits.detach().cpu().float().contiguous(),
    }
    metadata = {
        "schema": LOGITS_SCHEMA,
        "attention_implementation": ATTENTION_IMPLEMENTATION,
        "dtype": _TORCH_DTYPE_NAMES[reference.dtype],
        "torch_version": reference.torch_version,
        "transformers_version": reference.transformers_version,
        "input_token_ids": json.dumps(reference.input_ids, separators=(",", ":")),
        "request_id": loaded.request.id,
        "request_sha256": loaded.sha256,
    }
    return save(tensors, metadata=metadata)


# ------------------------------------------------------------------------------------------ record


def build_result(
    loaded: LoadedRequest,
    reference: ReferenceOutput,
    oracle: dict[str, Any],
    artifact: bytes,
    *,
    receipts_checked: bool,
    created_at_utc: str,
    duration_seconds: float,
) -> dict[str, Any]:
    """Assemble the record, add its self-hash and validate it against the shipped schema."""
    from kiln_core import __version__

    request = loaded.request
    record: dict[str, Any] = {
        "schema": RESULT_SCHEMA,
        "created_at_utc": created_at_utc,
        "duration_seconds": max(float(duration_seconds), 1e-6),
        "receipts_checked": receipts_checked,
        "request": {
            "id": request.id,
            "sha256": loaded.sha256,
            "input_token_count": len(reference.input_ids),
            "input_token_ids_sha256": canonical_sha256(reference.input_ids),
            "source": loaded.document["source"],
        },
        "model_identity": request.model_identity.model_dump(mode="json"),
        "runtime": {
            "kiln_flows_version": __version__,
            "python_version": platform.python_version(),
            "torch_version": reference.torch_version,
            "transformers_version": reference.transformers_version,
            "device": reference.device.split(":")[0],
            "device_name": reference.device_name,
            "dtype": reference.dtype,
            "attention_implementation": ATTENTION_IMPLEMENTATION,
            "use_cache": False,
            "deterministic_algorithms": True,
            "tf32_allowed": False,
            "float32_matmul_precision": "highest",
            "seed": SEED,
        },
        "oracle": oracle,
        "reference_artifact": {"path": LOGITS_FILE, "bytes": len(artifact), "sha256": sha256_prefixed(artifact)},
        "verdict": decide_verdict(oracle["argmax"], oracle["candidate_tokens"]),
    }
    record["result_sha256"] = self_hash(record, "result_sha256")
    validate_result(record)
    return record


def validate_result(record: Any) -> None:
    """Check a record against the result schema and recompute its self-hash.

    Raises:
        ValueError: Naming the first schema error or the hash mismatch.
    """
    errors = sorted(schema_validator(RESULT_SCHEMA_FILE).iter_errors(record), key=lambda e: list(e.absolute_path))
    if errors:
        where = "/".join(str(part) for part in errors[0].absolute_path) or "(root)"
        raise ValueError(f"result does not match {RESULT_SCHEMA} at {where}: {errors[0].message[:200]}")
    expected = self_hash(record, "result_sha256")
    if record["result_sha256"] != expected:
        raise ValueError(f"result_sha256 is {record['result_sha256']}, the record hashes to {expected}")
    if record["verdict"] != decide_verdict(record["oracle"]["argmax"], record["oracle"]["candidate_tokens"]):
        raise ValueError("verdict does not follow from oracle.argmax and the candidates")


def result_json_bytes(record: dict[str, Any]) -> bytes:
    """On-disk form: indent 2, sorted keys, ASCII, trailing newline (as Kiln writes results)."""
    return (json.dumps(record, indent=2, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


# ---------------------------------------------------------------------------------------- storage


def result_dir(out_root: str, request_id: str) -> str:
    """``<root>/oracle/<request id>`` for a local path or any fsspec URI."""
    return f"{str(out_root).rstrip('/')}/oracle/{request_id}"



def write_local_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``kiln_core.storage.write_bytes_atomic``)."""
    from kiln_core.storage import resolve, write_bytes_atomic

    write_bytes_atomic(resolve(str(path)), data)


def write_result(out_root: str, record: dict[str, Any], artifact: bytes) -> str:
    """Commit a result: the logits first, ``result.json`` last. Returns the ``result.json`` URI.

    Local disk: temp name + fsync + ``os.replace`` + directory fsync for each file. Object stores:
    ``pipe_file`` of the logits, then of ``result.json`` (the commit object).
    """
    directory = result_dir(out_root, record["request"]["id"])
    payload = result_json_bytes(record)
    if is_local_uri(directory):
        local = Path(directory.removeprefix("file://"))
        local.mkdir(parents=True, exist_ok=True)
        write_local_atomic(local / LOGITS_FILE, artifact)
        write_local_atomic(local / RESULT_FILE, payload)
        return str(local / RESULT_FILE)
    import fsspec

    fs, path = fsspec.core.url_to_fs(directory)
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(f"{path}/{LOGITS_FILE}", artifact)
    fs.pipe_file(f"{path}/{RESULT_FILE}", payload)
    return f"{directory}/{RESULT_FILE}"


def _read_bytes(uri: str) -> bytes | None:
    if is_local_uri(uri):
        path = Path(uri.removeprefix("file://"))
        return path.read_bytes() if path.is_file() else None
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    return fs.cat_file(path) if fs.exists(path) else None


def read_result(out_root: str, request_id: str) -> dict[str, Any] | None:
    """The committed result for ``request_id`` under ``out_root``, or ``None`` when there is none.

    Raises:
        OracleRejection: ``result_exists`` when a ``result.json`` is there but is not a valid,
            self-consistent result whose logits file matches (we never overwrite it).
    """
    directory = result_dir(out_root, request_id)
    data = _read_bytes(f"{directory}/{RESULT_FILE}")
    if data is None:
        return None
    try:
        record = loads_strict(data)
        validate_result(record)
    except (StrictJsonError, ValueError, KeyError, TypeError) as error:
        raise OracleRejection("result_exists", f"{directory}/{RESULT_FILE} exists but is not a valid result ({error}); refusing to overwrite") from None
    artifact = _read_bytes(f"{directory}/{LOGITS_FILE}")
    if artifact is None or sha256_prefixed(artifact) != record["reference_artifact"]["sha256"]:
        raise OracleRejection("result_exists", f"{directory}/{LOGITS_FILE} is missing or does not match result.json; refusing to overwrite")
    return record
