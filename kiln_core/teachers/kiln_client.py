"""Fetch a registered teacher's ``off_policy_manifest`` from a Kiln server (``GET /v1/teachers``).

Kiln serves the manifest line verbatim and producers must copy it, never rebuild it
(Kiln's crates/kiln-server/src/api/teachers.rs). So the string goes back to the caller exactly as decoded from
the response; parsing it is only a check. ``TeacherEntry`` is someone else's evolving payload: unknown
fields are ignored here on purpose, and only the fields we select on are checked.

Only transient failures are retried (connection errors, timeouts, 5xx), a bounded number of times
with a short exponential backoff; a 4xx is an answer, not an outage.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kiln_core.contracts.identity import ManifestError, parse_manifest_line
from kiln_core.errors import EnvironmentFailure, KilnFlowsError, Rejection, pick_kind

DEFAULT_KILN_URL = "http://127.0.0.1:8420"
API_KEY_ENV = "KILN_API_KEY"
BODY_EXCERPT_CHARS = 200
_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})

# Codes whose cause is the server or the network rather than the request: the CLI exits 3 for these.
TRANSIENT_CODES = frozenset({"unreachable", "timeout", "server_error"})


class TeacherRegistryError(KilnFlowsError):
    """A teacher lookup that failed; ``code`` is stable, ``message`` says what to do.

    Codes: ``bad_url``, ``unknown_alias``, ``teacher_unusable``, ``no_manifest``, ``invalid_manifest``,
    ``http_error`` (4xx), ``server_error`` (5xx after retries), ``timeout``, ``unreachable``,
    ``malformed_response``. The transient ones (``TRANSIENT_CODES``) construct a
    ``TeacherRegistryFailure`` (an ``EnvironmentFailure``), the others a ``TeacherRegistryRejection``.
    """

    def __new__(cls, code: str | None = None, *args: Any, **kwargs: Any):
        if cls is TeacherRegistryError:
            cls = pick_kind(TeacherRegistryError, code or "", TRANSIENT_CODES)
        return super().__new__(cls)

    def __init__(self, code: str, message: str, *, status: int | None = None) -> None:
        super().__init__(code, message)
        self.status = status

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @property
    def transient(self) -> bool:
        """Whether the failure is the server's or the network's (worth retrying later)."""
        return self.code in TRANSIENT_CODES


class TeacherRegistryRejection(TeacherRegistryError, Rejection):
    """The request was refused (unknown alias, unusable teacher, 4xx, invalid manifest): exit 2."""


class TeacherRegistryFailure(TeacherRegistryError, EnvironmentFailure):
    """The server or the network failed (unreachable, timeout, 5xx): exit 3, retried."""


def _excerpt(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= BODY_EXCERPT_CHARS else text[:BODY_EXCERPT_CHARS] + "…"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib would forward the bearer token to whatever host a 3xx names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102, ANN001
        return None


def _opener(url: str) -> urllib.request.OpenerDirector:
    handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in _LOOPBACK_HOSTS:
        # A local Kiln never sits behind the environment's HTTP proxy.
        handlers.append(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener(*handlers)


def _get_once(url: str, *, timeout: float, api_key: str | None) -> bytes:
    """One GET; raises ``TeacherRegistryError`` with the code that decides whether to retry."""
    headers = {"Accept": "application/json", "User-Agent": "kiln-flows"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, headers=headers, method="GET")
    try:
        with _opener(url).open(request, timeout=timeout) as response:
            return response.read(_MAX_RESPONSE_BYTES)
    except urllib.error.HTTPError as error:
        try:
            body = error.read(4096)
        except (OSError, ValueError):
            body = b""
        code = "server_error" if error.code >= 500 else "http_error"
        raise TeacherRegistryError(
            code, f"GET {url} returned HTTP {error.code}: {_excerpt(body) or '(empty body)'}", status=error.code
        ) from None
    except (TimeoutError, socket.timeout):
        raise TeacherRegistryError("timeout", f"GET {url} timed out after {timeout:g}s") from None
    except urllib.error.URLError as error:
        if isinstance(error.reason, (TimeoutError, socket.timeout)):
            raise TeacherRegistryError("timeout", f"GET {url} timed out after {timeout:g}s") from None
        raise TeacherRegistryError("unreachable", f"cannot reach Kiln at {url}: {error.reason}") from None
    except (ConnectionError, OSError) as error:
        # Resets and broken reads mid-response land here rather than in URLError.
        raise TeacherRegistryError("unreachable", f"connection to {url} failed: {error}") from None


def fetch_teachers(
    base_url: str = DEFAULT_KILN_URL,
    *,
    timeout: float = 10.0,
    retries: int = 3,
    backoff: float = 0.25,
    api_key: str | None = None,
) -> list[dict[str, Any]]:
    """``GET {base_url}/v1/teachers`` and return its ``teachers`` list.

    Args:
        base_url: Kiln server root, e.g. ``http://127.0.0.1:8420``.
        timeout: Seconds per attempt (connect and each read).
        retries: Extra attempts after the first, for transient failures only.
        backoff: First retry delay in seconds; doubles per attempt, capped at 2 s.
        api_key: Bearer token; default: the ``KILN_API_KEY`` environment variable, if set.

    Raises:
        TeacherRegistryError: see the class for codes.

    Example:
        >>> [t["spec"]["alias"] for t in fetch_teachers()]  # doctest: +SKIP
        ['teacher-large@vllm']
    """
    if api_key is None:
        # The client is the boundary where the credential enters; it is never logged or echoed.
        api_key = os.environ.get(API_KEY_ENV) or None
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TeacherRegistryError("bad_url", f"Kiln URL must be http(s)://host[:port], got {base_url!r}")
    url = base_url.rstrip("/") + "/v1/teachers"
    attempt = 0
    while True:
        try:
            body = _get_once(url, timeout=timeout, api_key=api_key)
            break
        except TeacherRegistryError as error:
            if not error.transient or attempt >= retries:
                if error.transient and retries:
                    error.message += f" (after {attempt + 1} attempts)"
                    error.args = (f"{error.code}: {error.message}",)
                raise
            time.sleep(min(2.0, backoff * (2**attempt)))
            attempt += 1
    return _parse_teachers(body, url)


def _parse_teachers(body: bytes, url: str) -> list[dict[str, Any]]:
    try:
        document = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise TeacherRegistryError("malformed_response", f"GET {url} did not return JSON: {_excerpt(body)}") from None
    teachers = document.get("teachers") if isinstance(document, dict) else None
    if not isinstance(teachers, list) or not all(isinstance(entry, dict) for entry in teachers):
        raise TeacherRegistryError("malformed_response", f'GET {url} did not return {{"teachers": [TeacherEntry…]}}')
    return teachers


def _alias_of(entry: dict[str, Any]) -> str | None:
    spec = entry.get("spec")
    alias = spec.get("alias") if isinstance(spec, dict) else None
    return alias if isinstance(alias, str) else None


def select_manifest(teachers: list[dict[str, Any]], alias: str) -> str:
    """Pick ``alias`` from a ``teachers`` list and return its manifest line, validated, unchanged.

    Raises:
        TeacherRegistryError: ``unknown_alias`` (lists the known ones), ``teacher_unusable`` (with
            ``status``/``status_message``), ``no_manifest``, ``invalid_manifest``, ``malformed_response``.

    Example:
        >>> select_manifest(fetch_teachers(), "teacher-large@vllm")  # doctest: +SKIP
        '{"schema":"kiln.off-policy-distillation-manifest.v1","teacher_identity":{...}}'
    """
    matches = [entry for entry in teachers if _alias_of(entry) == alias]
    if not matches:
        known = sorted({name for name in map(_alias_of, teachers) if name is not None})
        raise TeacherRegistryError("unknown_alias", f"no teacher with alias {alias!r}; known aliases: {known}")
    if len(matches) > 1:
        raise TeacherRegistryError("malformed_response", f"the registry lists alias {alias!r} {len(matches)} times")
    entry = matches[0]
    if entry.get("usable") is not True:
        status = entry.get("status")
        detail = entry.get("status_message") or "no status_message given"
        raise TeacherRegistryError(
            "teacher_unusable", f"teacher {alias!r} is not usable (status {status!r}): {detail}"
        )
    manifest = entry.get("off_policy_manifest")
    if not isinstance(manifest, str) or not manifest:
        raise TeacherRegistryError(
            "no_manifest",
            f"teacher {alias!r} has no off_policy_manifest (status {entry.get('status')!r}); "
            "register it with an identity so Kiln can serve one",
        )
    try:
        parse_manifest_line(manifest)
    except ManifestError as error:
        message = f"teacher {alias!r} serves an invalid manifest: {error}"
        raise TeacherRegistryError("invalid_manifest", message) from None
    return manifest


def fetch_off_policy_manifest(
    alias: str,
    base_url: str = DEFAULT_KILN_URL,
    timeout: float = 10.0,
    retries: int = 3,
    *,
    backoff: float = 0.25,
    api_key: str | None = None,
) -> str:
    """The exact ``off_policy_manifest`` line Kiln serves for ``alias``.

    Args:
        alias: The teacher's ``spec.alias``.
        base_url: Kiln server root.
        timeout: Seconds per attempt.
        retries: Extra attempts for connection errors, timeouts and 5xx.
        backoff: First retry delay in seconds (doubles, capped at 2 s).
        api_key: Bearer token; default ``$KILN_API_KEY``.

    Returns:
        The manifest line exactly as served (no trailing newline), after checking it parses as a
        canonical manifest.

    Raises:
        TeacherRegistryError: see the class for codes; ``.transient`` tells outages from bad input.

    Example:
        >>> line = fetch_off_policy_manifest("teacher-large@vllm")  # doctest: +SKIP
        >>> open("teacher-data.jsonl", "w").write(line + "\\n")  # doctest: +SKIP
    """
    teachers = fetch_teachers(base_url, timeout=timeout, retries=retries, backoff=backoff, api_key=api_key)
    return select_manifest(teachers, alias)
