"""Scoring through a vLLM server under Kiln's prompt-logprobs contract (crates/kiln-train/src/remote_teacher.rs).

One ``POST {base}/v1/completions`` per example, body exactly::

    {"model": served_model_id, "prompt": [token ids], "max_tokens": 1, "temperature": 0.0,
     "prompt_logprobs": K, "n": 1, "stream": false, "add_special_tokens": false}

``prompt_logprobs[p]`` scores prompt token p from row p − 1, so the prompt is the example's ids up
to its last target; when a target's row is the prompt's final row, the last token is appended once
more as a causal probe. The response is accepted only if it repeats the pinned identity's
fingerprint and satisfies every structural rule Kiln's ``remote_teacher.rs`` checks; each violation
raises ``ScoringError("vllm_response")`` naming the rule. The rows kept are the candidates in rank
order 1..K, excluding an extra observed token, converted to f32.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.scoring.examples import ScoreRequest, ScoringError
from kiln_core.scoring.local import MASS_TOLERANCE
from kiln_core.scoring.writer import ScoredRows

FINGERPRINT_PREFIX = "kiln-teacher-v1"
DEFAULT_TIMEOUT_S = 60.0
_EXCERPT_CHARS = 400


def teacher_fingerprint(identity: TeacherIdentity) -> str:
    """The ``system_fingerprint`` a vLLM teacher serving ``identity`` returns (Kiln's ``teacher_identity.rs``).

    ``kiln-teacher-v1.`` + unpadded base64url(canonical identity bytes) + ``.`` + hex SHA-256 of them.

    Example:
        >>> teacher_fingerprint(identity).split(".")[0]  # doctest: +SKIP
        'kiln-teacher-v1'
    """
    canonical = identity.canonical_json().encode("utf-8")
    encoded = base64.urlsafe_b64encode(canonical).rstrip(b"=").decode("ascii")
    return f"{FINGERPRINT_PREFIX}.{encoded}.{hashlib.sha256(canonical).hexdigest()}"


def completions_url(base_url: str) -> str:
    """``{base}/v1/completions``; plain HTTP only to a loopback host (bodies carry the corpus).

    Example:
        >>> completions_url("http://127.0.0.1:8000/")
        'http://127.0.0.1:8000/v1/completions'
    """
    parts = urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScoringError("invalid_option", f"--vllm URL {base_url!r} must be an http(s) URL with a host")
    if parts.scheme == "http" and not _is_loopback(parts.hostname):
        raise ScoringError("invalid_option", f"--vllm URL {base_url!r}: use https unless the host is loopback")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ScoringError("invalid_option", f"--vllm URL {base_url!r} must not carry credentials, a query or a fragment")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/completions"):
        path = path + "/completions" if path.endswith("/v1") else path + "/v1/completions"
    return f"{parts.scheme}://{parts.netloc}{path}"


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class VllmTeacher:
    """A vLLM server pinned to one teacher identity.

    Args:
        base_url: Server base URL (``http://127.0.0.1:8000``).
        identity: The pinned identity; its fingerprint must come back on every response.
        served_model: The model name to request; must equal ``identity.served_model_id``.
        concurrency: Requests in flight at once (one per example).
        timeout_s: Seconds per request.

    Example:
        >>> teacher = VllmTeacher("http://127.0.0.1:8000", identity, "teacher")  # doctest: +SKIP
        >>> rows = teacher.score([ScoreRequest(1, ids, positions)], top_k=16)  # doctest: +SKIP
    """

    def __init__(
        self,
        base_url: str,
        identity: TeacherIdentity,
        served_model: str,
        *,
        concurrency: int = 8,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        import httpx

        if served_model != identity.served_model_id:
            raise ScoringError(
                "teacher_mismatch",
                f"--served-model {served_model!r} does not match the pinned identity's served_model_id "
                f"{identity.served_model_id!r}",
            )
        self.url = completions_url(base_url)
        self.identity = identity
        self.served_model = served_model
        self.fingerprint = teacher_fingerprint(identity)
        self.concurrency = max(1, concurrency)
        # Redirects stay off: a prompt body must never be replayed to another endpoint.
        self._client = httpx.Client(timeout=timeout_s, follow_redirects=False)

    def close(self) -> None:
        self._client.close()

    def score(self, requests: list[ScoreRequest], top_k: int) -> list[ScoredRows]:
        """Score each example with its own request (``concurrency`` at a time); results in order."""
        if len(requests) == 1 or self.concurrency == 1:
            return [self.score_one(r, top_k) for r in requests]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            return list(pool.map(lambda r: self.score_one(r, top_k), requests))

    def score_one(self, request: ScoreRequest, top_k: int) -> ScoredRows:
        """Build, check, send and validate one example's request."""
        sent = self._sent_tokens(request, top_k)
        body = {
            "model": self.served_model,
            "prompt": sent,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": top_k,
            "n": 1,
            "stream": False,
            "add_special_tokens": False,
        }
        response = self._post(body, request.line)
        try:
            ranked = parse_response(response, sent, top_k, self.identity, self.fingerprint, self.served_model)
        except ScoringError as error:
            raise ScoringError(error.code, error.message, line=request.line) from None
        rows = [ranked[int(q)] for q in request.positions]
        return ScoredRows(
            target_ids=np.asarray([r[0] for r in rows], dtype=np.int64),
            target_logprobs=np.asarray([r[1] for r in rows], dtype=np.float32),
            top_ids=np.asarray([r[2] for r in rows], dtype=np.int64).reshape(len(rows), top_k),
            top_logprobs=np.asarray([r[3] for r in rows], dtype=np.float32).reshape(len(rows), top_k),
        )

    def _sent_tokens(self, request: ScoreRequest, top_k: int) -> list[int]:
        # Kiln sends the example's exact ids. A target q is scored by row q − 1, so the final row
        # (T − 1) is needed only for a position past the end; then the last token is appended once
        # more as a causal probe, which exposes that row without changing it.
        ids = request.input_ids.tolist()
        sent = ids
        if int(request.positions[-1]) - 1 == len(ids) - 1:
            sent = ids + [ids[-1]]
        if len(sent) + 1 > self.identity.max_model_len:  # + the one generated token vLLM requires
            raise ScoringError(
                "context_too_long",
                f"needs context {len(sent) + 1} (prompt + 1 generated token); the teacher's max_model_len is "
                f"{self.identity.max_model_len}",
                line=request.line,
            )
        candidates = (len(sent) - 1) * min(top_k + 1, self.identity.vocab_size)
        if candidates > self.identity.max_prompt_logprob_candidates:
            raise ScoringError(
                "vllm_request",
                f"the response may hold {candidates} prompt-logprob candidates; the teacher's "
                f"max_prompt_logprob_candidates is {self.identity.max_prompt_logprob_candidates}",
                line=request.line,
            )
        return sent

    def _post(self, body: dict[str, Any], line: int) -> Any:
        import httpx

        try:
            response = self._client.post(self.url, json=body)
        except httpx.TimeoutException:
            raise ScoringError("vllm_unreachable", f"POST {self.url} timed out", line=line) from None
        except httpx.HTTPError as error:
            raise ScoringError("vllm_unreachable", f"POST {self.url} failed: {error}", line=line) from None
        if response.status_code != 200:
            excerpt = response.text[:_EXCERPT_CHARS]
            code = "vllm_http_error" if response.status_code >= 500 else "vllm_response"
            raise ScoringError(code, f"POST {self.url} -> HTTP {response.status_code}: {excerpt}", line=line)
        try:
            return json.loads(response.content, object_pairs_hook=_strict_object, parse_constant=_no_constant)
        except ValueError as error:
            raise ScoringError("vllm_response", f"vLLM response is not strict JSON: {error}", line=line) from None


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate JSON object key {key!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON number {name}")


def _bad(message: str) -> ScoringError:
    return ScoringError("vllm_response", f"invalid vLLM response: {message}")


def parse_response(
    response: Any, sent: list[int], top_k: int, identity: TeacherIdentity, fingerprint: str, served_model: str
) -> dict[int, tuple[int, float, list[int], list[float]]]:
    """Validate a completions response and return its rows by target position.

    Returns:
        ``{p: (observed id, observed f32 logprob, top-K ids, top-K f32 logprobs)}`` for every
        ``p`` in ``1..len(sent)-1`` (the row ``p - 1`` scores ``sent[p]``).

    Raises:
        ScoringError: ``vllm_response`` naming the first violated rule.
    """
    if not isinstance(response, dict):
        raise _bad("the body is not a JSON object")
    got = response.get("system_fingerprint")
    if got != fingerprint:
        raise _bad(f"system_fingerprint {_describe_fingerprint(got)} does not match the pinned teacher "
                   f"{identity.identity_revision()}")
    if response.get("object") != "text_completion":
        raise _bad(f"`object` is {response.get('object')!r}, not 'text_completion'")
    if response.get("model") != served_model:
        raise _bad(f"`model` {response.get('model')!r} does not match the requested model {served_model!r}")
    usage = response.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not _is_uint(prompt_tokens):
        raise _bad("missing integer `usage.prompt_tokens`")
    if prompt_tokens != len(sent):
        raise _bad(f"usage.prompt_tokens is {prompt_tokens}; {len(sent)} token ids were sent")
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise _bad(f"`choices` must hold exactly one choice, got {len(choices) if isinstance(choices, list) else choices!r}")
    choice = choices[0]
    if not isinstance(choice, dict) or choice.get("index") != 0 or isinstance(choice.get("index"), bool):
        raise _bad("choices[0].index is not integer zero")
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list):
        raise _bad("missing array `choices[0].prompt_logprobs`")
    if len(entries) != len(sent):
        raise _bad(f"choices[0].prompt_logprobs has {len(entries)} entries; {len(sent)} token ids were sent")
    if entries[0] is not None:
        raise _bad("choices[0].prompt_logprobs[0] must be null")
    vocab_size = identity.vocab_size
    return {p: _parse_entry(entries[p], p, sent[p], top_k, vocab_size) for p in range(1, len(sent))}


def _describe_fingerprint(value: Any) -> str:
    """Say which identity a wrong fingerprint names, when it decodes to one."""
    if not isinstance(value, str):
        return f"{value!r}"
    parts = value.split(".")
    if len(parts) == 3 and parts[0] == FINGERPRINT_PREFIX:
        try:
            raw = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
            return f"(teacher sha256:{hashlib.sha256(raw).hexdigest()})"
        except ValueError:
            pass
    return f"{value[:80]!r}"


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(entry: Any, p: int, observed: int, top_k: int, vocab_size: int):
    """One ``prompt_logprobs[p]`` object → (observed id, its f32 logprob, ranked ids, ranked f32 logprobs)."""
    where = f"prompt_logprobs[{p}]"
    if not isinstance(entry, dict):
        raise _bad(f"{where} is not an object")
    candidates = []  # (id, source f64 logprob, rank)
    mass = 0.0
    for key, value in entry.items():
        token_id, logprob, rank = _parse_candidate(where, key, value, vocab_size)
        mass += math.exp(logprob)
        candidates.append((token_id, logprob, rank))
    if mass > 1.0 + MASS_TOLERANCE:
        raise _bad(f"{where} candidate probability mass {mass:.9f} exceeds 1 + 32·eps")
    observed_entry = next((c for c in candidates if c[0] == observed), None)
    if observed_entry is None:
        raise _bad(f"{where} does not contain the observed token id {observed}")
    if len(candidates) not in (top_k, top_k + 1):
        raise _bad(f"{where} has {len(candidates)} entries; expected {top_k} (observed token selected) "
                   f"or {top_k + 1} (observed token extra)")
    # Cardinality, not the observed rank, says whether the observed token was selected: with ties an
    # unselected observed token can still carry a rank within 1..K.
    selected = len(candidates) == top_k
    if selected and observed_entry[2] > top_k:
        raise _bad(f"{where} has {top_k} entries but the observed token's rank {observed_entry[2]} is outside the top {top_k}")
    by_rank: dict[int, tuple[int, float, int]] = {}
    for candidate in candidates:
        if not selected and candidate[0] == observed:
            continue
        if candidate[2] > top_k:
            raise _bad(f"{where} holds non-observed token {candidate[0]} with rank {candidate[2]} outside the top {top_k}")
        if candidate[2] in by_rank:
            raise _bad(f"{where} repeats top-k rank {candidate[2]}")
        by_rank[candidate[2]] = candidate
    missing = [rank for rank in range(1, top_k + 1) if rank not in by_rank]
    if missing:
        raise _bad(f"{where} is missing top-k rank {missing[0]}")
    ranked = [by_rank[rank] for rank in range(1, top_k + 1)]
    for before, after in zip(ranked, ranked[1:]):
        if before[1] < after[1]:
            raise _bad(f"{where} logprobs increase from rank {before[2]} ({before[1]}) to rank {after[2]} ({after[1]})")
    if not selected:
        rank, logprob = observed_entry[2], observed_entry[1]
        if rank <= top_k and logprob != ranked[rank - 1][1]:
            raise _bad(f"{where} extra observed token has rank {rank} but does not tie the selected rank-{rank} logprob")
        if rank > top_k and logprob > ranked[-1][1]:
            raise _bad(f"{where} observed token (rank {rank}) has a higher logprob than rank {top_k}")
    ids = [c[0] for c in ranked]
    logprobs32 = np.asarray([c[1] for c in ranked], dtype=np.float32)
    # Admission's row rules, after the f32 conversion (opd.rs): what we write, admission accepts.
    if len(set(ids)) != top_k or np.any(np.diff(logprobs32) > 0) or not np.isfinite(logprobs32).all():
        raise _bad(f"{where} top-{top_k} row is not unique and non-increasing after f32 conversion")
    if np.exp(logprobs32.astype(np.float64)).sum() > 1.0 + MASS_TOLERANCE:
        raise _bad(f"{where} top-{top_k} f32 probability mass exceeds 1 + 32·eps")
    return observed, float(np.float32(observed_entry[1])), ids, logprobs32.tolist()


def _parse_candidate(where: str, key: str, value: Any, vocab_size: int) -> tuple[int, float, int]:
    if not key.isascii() or not key.isdigit() or str(int(key)) != key:
        raise _bad(f"{where} token key {key!r} is not a canonical decimal token id")
    token_id = int(key)
    if token_id >= vocab_size:
        raise _bad(f"{where} token id {token_id} is outside vocab_size {vocab_size}")
    if not isinstance(value, dict):
        raise _bad(f"{where}[{key!r}] is not an object")
    logprob = value.get("logprob")
    if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
        raise _bad(f"{where}[{key!r}].logprob is not a JSON number")
    logprob = float(logprob)
    if not math.isfinite(logprob) or not math.isfinite(float(np.float32(logprob))):
        raise _bad(f"{where}[{key!r}].logprob {logprob!r} is not finite in f32")
    if logprob > 0.0:
        raise _bad(f"{where}[{key!r}].logprob {logprob!r} is positive")
    rank = value.get("rank")
    if not _is_uint(rank):
        raise _bad(f"{where}[{key!r}].rank is missing or not an unsigned integer")
    if not 1 <= rank <= vocab_size:
        raise _bad(f"{where}[{key!r}].rank {rank} is outside 1..{vocab_size}")
    return token_id, logprob, rank
