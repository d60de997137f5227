"""``kiln.hf-next-token-request.v1``: loading, schema validation and the cross-field rules.

A request is accepted only after four gates, each with stable rejection rules
(Kiln's ``scripts/qualification/hf_next_token_contract.py`` ``validate_request``/``load_request``):

1. the file: a regular, non-symlink file of at most 262,144 bytes (``file_not_found``,
   ``not_regular_file``, ``file_too_large``);
2. strict JSON (``invalid_json``, ``duplicate_key``, ``non_finite_number``, and
   ``nesting_too_deep`` for 128 nested containers or more, serde_json's limit; see
   ``kiln_core.strict_json``);
3. the shipped JSON Schema, draft 2020-12, plus the strict pydantic models of
   ``kiln_core.contracts.oracle_request`` (``schema_violation``; a swapped engine order is reported as ``candidate_order``);
4. the rules that span fields (``unsafe_path``, ``weight_paths_unsorted``, ``utf8_hash_mismatch``,
   ``token_count_mismatch``, ``input_tokens_mismatch``, ``input_hash_mismatch``,
   ``candidate_order``, ``candidates_equal``).

Checks that need the model directory, the tokenizer or the source receipts live in
``fingerprint``, ``reference`` and ``receipts``. This module imports neither torch nor transformers.

Example:
    >>> loaded = load_request("requests/first-divergence.json")  # doctest: +SKIP
    >>> loaded.request.candidates[0].engine, loaded.sha256[:7]  # doctest: +SKIP
    ('kiln', 'sha256:')
"""

from __future__ import annotations

import functools
import json
import os
import stat
from dataclasses import dataclass
from importlib import resources
from pathlib import PurePosixPath
from typing import Any

from pydantic import ValidationError

from kiln_core.canonical import canonical_sha256, sha256_prefixed
from kiln_core.contracts.oracle_request import HfNextTokenRequest
from kiln_core.oracle.errors import OracleRejection
from kiln_core.storage import is_local_uri
from kiln_core.strict_json import NestingTooDeep, StrictJsonError, check_nesting, loads_strict

REQUEST_SCHEMA_FILE = "hf-next-token-request-v1.schema.json"
MAX_REQUEST_BYTES = 262_144


@dataclass(frozen=True)
class LoadedRequest:
    """A request that passed every file, JSON, schema and cross-field gate.

    Attributes:
        request: Typed access to the fields.
        document: The parsed JSON object exactly as read (what the hashes cover).
        sha256: Canonical SHA-256 of ``document`` (``hf_next_token_contract.py``): the request's identity.
        uri: Where it was read from.
    """

    request: HfNextTokenRequest
    document: dict[str, Any]
    sha256: str
    uri: str


# ---------------------------------------------------------------------------------------------- schema


def load_schema(filename: str) -> dict[str, Any]:
    """Read one of the JSON Schemas shipped in ``kiln_core/schemas`` (a fresh dict each call)."""
    text = resources.files("kiln_core").joinpath("schemas", filename).read_text(encoding="utf-8")
    return json.loads(text)


@functools.cache
def schema_validator(filename: str):
    """A cached ``Draft202012Validator`` for a shipped schema (schemas are immutable package data)."""
    from jsonschema import Draft202012Validator

    schema = load_schema(filename)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _json_path(parts) -> str:
    return "$" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts)


def _schema_rejection(errors: list) -> OracleRejection:
    from jsonschema.exceptions import best_match

    engine_order = [
        error for error in errors
        if error.validator == "const" and list(error.absolute_path)[:1] == ["candidates"]
        and list(error.absolute_path)[2:] == ["engine"]
    ]
    if engine_order and len(engine_order) == len(errors):
        return OracleRejection("candidate_order", "candidates must be ordered [kiln, vllm] by `engine`")
    error = best_match(errors)
    message = error.message if len(error.message) <= 200 else error.message[:200] + "…"
    return OracleRejection("schema_violation", f"{_json_path(error.absolute_path)}: {message}")


def validate_schema(document: Any) -> HfNextTokenRequest:
    """Validate against the shipped JSON Schema, then build the strict pydantic model.

    Raises:
        OracleRejection: ``schema_violation`` (or ``candidate_order`` for a swapped engine pair).
    """
    errors = list(schema_validator(REQUEST_SCHEMA_FILE).iter_errors(document))
    if errors:
        raise _schema_rejection(errors)
    try:
        return HfNextTokenRequest.model_validate(document)
    except ValidationError as error:
        # Reached for what JSON Schema allows but the contract does not, e.g. 1.0 as a token id.
        first = error.errors()[0]
        raise OracleRejection("schema_violation", f"{_json_path(first['loc'])}: {first['msg']}") from None


# ---------------------------------------------------------------------------------------- cross-field


def is_normalized_relative(path: str) -> bool:
    """True for a normalized, relative POSIX path without ``..``, backslashes or NUL.

    Example:
        >>> [is_normalized_relative(p) for p in ["a/b.json", "./a", "a//b", "a/", "/a", "a/../b"]]
        [True, False, False, False, False, False]
    """
    pure = PurePosixPath(path)
    return (
        bool(pure.parts)
        and not pure.is_absolute()
        and ".." not in pure.parts
        and str(pure) == path
        and "\\" not in path
        and "\x00" not in path
    )


def check_cross_fields(request: HfNextTokenRequest) -> None:
    """Enforce the rules JSON Schema cannot express, in the order of Kiln's validator
    (``scripts/qualification/hf_next_token_contract.py`` · ``validate_request``).

    Raises:
        OracleRejection: The first rule that fails, naming the field.
    """
    for name in ("kiln_receipt", "vllm_receipt"):
        path = getattr(request.source, name).path
        if not is_normalized_relative(path):
            raise OracleRejection("unsafe_path", f"source.{name}.path {path!r} is not a normalized relative path")
    paths = [item.path for item in request.model_identity.weight_files]
    for index, path in enumerate(paths):
        if not is_normalized_relative(path):
            raise OracleRejection(
                "unsafe_path", f"model_identity.weight_files[{index}].path {path!r} is not a safe relative path"
            )
    if paths != sorted(set(paths)):
        raise OracleRejection("weight_paths_unsorted", "model_identity.weight_files paths must be strictly sorted and unique")

    prompt = request.prompt
    expected_utf8 = sha256_prefixed(prompt.messages[0].content.encode("utf-8"))
    if prompt.utf8_sha256 != expected_utf8:
        raise OracleRejection(
            "utf8_hash_mismatch", f"prompt.utf8_sha256 is {prompt.utf8_sha256}, messages[0].content hashes to {expected_utf8}"
        )
    if prompt.token_count != len(prompt.token_ids):
        raise OracleRejection(
            "token_count_mismatch", f"prompt.token_count is {prompt.token_count}, prompt.token_ids has {len(prompt.token_ids)}"
        )
    expected_ids = list(prompt.token_ids) + [token.token_id for token in request.continuation_prefix]
    if list(request.input_token_ids) != expected_ids:
        raise OracleRejection(
            "input_tokens_mismatch", "input_token_ids must equal prompt.token_ids followed by continuation_prefix token ids"
        )
    expected_hash = canonical_sha256(expected_ids)
    if request.input_token_ids_sha256 != expected_hash:
        raise OracleRejection(
            "input_hash_mismatch", f"input_token_ids_sha256 is {request.input_token_ids_sha256}, the ids hash to {expected_hash}"
        )
    engines = [item.engine for item in request.candidates]
    if engines != ["kiln", "vllm"]:
        raise OracleRejection("candidate_order", f"candidates engines are {engines}, expected ['kiln', 'vllm']")
    kiln, vllm = request.candidates
    if kiln.token_id == vllm.token_id:
        raise OracleRejection("candidates_equal", f"candidates[0].token_id == candidates[1].token_id == {kiln.token_id}")


def validate_request_object(document: Any) -> HfNextTokenRequest:
    """Schema + cross-field validation of an already-parsed request object.

    Example:
        >>> validate_request_object({"schema": "kiln.hf-next-token-request.v1"})
        Traceback (most recent call last):
        ...
        kiln_core.oracle.errors.OracleRejection: schema_violation: $: 'id' is a required property
    """
    request = validate_schema(document)
    check_cross_fields(request)
    return request


# ------------------------------------------------------------------------------------------ loading



def read_regular_file(path: str, max_bytes: int, *, what: str = "request") -> bytes:
    """Read a local regular, non-symlink file of at most ``max_bytes`` bytes.

    The size is checked on the open descriptor and the read is bounded, so a file that grows after
    the ``stat`` still cannot exceed the limit.

    Raises:
        OracleRejection: ``file_not_found``, ``not_regular_file`` or ``file_too_large``.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise OracleRejection("file_not_found", f"{what} file {path} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        raise OracleRejection("not_regular_file", f"{what} file {path} is {kind}")
    if info.st_size > max_bytes:
        raise OracleRejection("file_too_large", f"{what} file {path} is {info.st_size} bytes, limit {max_bytes}")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    descriptor = os.open(path, flags)
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OracleRejection("not_regular_file", f"{what} file {path} changed type while opening")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OracleRejection("file_too_large", f"{what} file {path} exceeds {max_bytes} bytes")
    return data


def read_request_bytes(uri: str) -> bytes:
    """Read a request from a local path or an fsspec URI under Kiln's file rules (``load_request``)."""
    if is_local_uri(uri):
        return read_regular_file(uri.removeprefix("file://"), MAX_REQUEST_BYTES)
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise OracleRejection("file_not_found", f"request {uri} does not exist") from None
    if info.get("type") != "file":
        raise OracleRejection("not_regular_file", f"request {uri} is not a file")
    if (info.get("size") or 0) > MAX_REQUEST_BYTES:
        raise OracleRejection("file_too_large", f"request {uri} is {info['size']} bytes, limit {MAX_REQUEST_BYTES}")
    data = fs.cat_file(path)
    if len(data) > MAX_REQUEST_BYTES:
        raise OracleRejection("file_too_large", f"request {uri} exceeds {MAX_REQUEST_BYTES} bytes")
    return data


def parse_request_bytes(data: bytes, uri: str = "<bytes>") -> LoadedRequest:
    """Strict-parse and validate request bytes; the canonical hash covers the parsed object."""
    try:
        document = loads_strict(data)
        check_nesting(document, where="the request")  # serde_json's limit: Kiln's readers refuse it too
    except StrictJsonError as error:
        raise OracleRejection(error.rule, f"request {uri}: {error.message}") from None
    except NestingTooDeep as error:
        raise OracleRejection("nesting_too_deep", f"request {uri}: {error.message}") from None
    request = validate_request_object(document)
    return LoadedRequest(request=request, document=document, sha256=canonical_sha256(document), uri=uri)


def load_request(uri: str) -> LoadedRequest:
    """Load and fully validate one request file (gates 1-4 of this module).

    Args:
        uri: Local path, ``file://`` URI, or any fsspec URI (``memory://``, ``s3://``).

    Returns:
        The validated request, its parsed document and canonical ``sha256``.

    Raises:
        OracleRejection: With the stable rule name of the first gate that fails.

    Example:
        >>> load_request("missing.json")
        Traceback (most recent call last):
        ...
        kiln_core.oracle.errors.OracleRejection: file_not_found: request file missing.json does not exist
    """
    return parse_request_bytes(read_request_bytes(uri), uri)
