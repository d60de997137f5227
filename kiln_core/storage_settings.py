"""Storage settings of the product: run-scoped credentials, S3 timeouts and retries, error kinds.

Credentials: s3fs reads the environment / AWS config, or the caller passes ``storage_options`` — as an
argument, or for a whole run with ``storage_options_scope`` (a context variable: two runs in one
process each see their own, and fsspec's process-wide ``fsspec.config.conf`` is never written).

Timeouts are settings of the product, applied to every ``s3://`` location ``kiln_core.storage.resolve``
returns (the caller's own ``config_kwargs`` win): ``KILN_FLOWS_STORAGE_CONNECT_TIMEOUT`` (seconds,
default 10), ``KILN_FLOWS_STORAGE_READ_TIMEOUT`` (seconds, default 60) and
``KILN_FLOWS_STORAGE_MAX_ATTEMPTS`` (attempts per request, botocore's ``standard`` retry mode, default
3; s3fs's own retry loop is set to one pass so the attempts are not multiplied). Writes go out without
``Expect: 100-continue``: aiohttp waits for the ``100 Continue`` with no timeout, so a frozen endpoint
would hang every PUT forever (observed with aiobotocore 3.10 / aiohttp 3.14). A frozen or unreachable
endpoint therefore fails each request after a bounded time with a ``StorageFailure``
(``EnvironmentFailure``: exit 3, retried by Prefect); a URI whose protocol is unknown or whose package
is not installed is a ``StorageRejection`` (exit 2).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Iterator

from kiln_core.errors import EnvironmentFailure, Rejection

CONNECT_TIMEOUT_ENV = "KILN_FLOWS_STORAGE_CONNECT_TIMEOUT"
READ_TIMEOUT_ENV = "KILN_FLOWS_STORAGE_READ_TIMEOUT"
MAX_ATTEMPTS_ENV = "KILN_FLOWS_STORAGE_MAX_ATTEMPTS"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0
DEFAULT_MAX_ATTEMPTS = 3
S3_PROTOCOLS = ("s3", "s3a")


class StorageRejection(Rejection, ValueError):
    """A storage URI kiln-flows cannot use as given: unknown protocol (``unknown_protocol``), the package
    for it is not installed (``storage_package_missing``), not a URI at all (``invalid_uri``), a bucket
    that does not exist (``storage_bucket_missing``), or a root that is a file (``out_not_directory``)."""

    def __init__(self, code: str, message: str, *, file: str | None = None, field: str | None = None) -> None:
        super().__init__(code, message, file=file, field=field)


class StorageFailure(EnvironmentFailure, OSError):
    """Storage that did not answer or refused: timeout, unreachable, no credentials, permission
    denied (code ``storage_error``). Exit 3; Prefect retries the task."""

    def __init__(self, message: str, *, file: str | None = None, code: str = "storage_error",
                 field: str | None = None) -> None:
        super().__init__(code, message, file=file, field=field)

    def __str__(self) -> str:
        return self.describe()


def as_environment_failure(error: BaseException) -> EnvironmentFailure | None:
    """``error`` as an ``EnvironmentFailure`` when it is a storage or network failure, else None.

    Covers ``OSError`` (permission denied, read-only file system, connection refused, …), timeouts,
    and the exceptions of botocore and aiohttp (no credentials, endpoint unreachable, read timeout)
    that fsspec backends let through untranslated.
    """
    if isinstance(error, EnvironmentFailure):
        return error
    module = type(error).__module__ or ""
    network = module.startswith(("botocore", "aiobotocore", "aiohttp", "urllib3", "httpx", "requests"))
    if isinstance(error, (OSError, TimeoutError)) or network:
        where = getattr(error, "filename", None)
        detail = str(error) or type(error).__name__
        failure = StorageFailure(f"{type(error).__name__}: {detail}", file=str(where) if where else None)
        failure.__cause__ = error
        return failure
    return None


# ---------------------------------------------------------------------------------------------
# Run-scoped options and product defaults

_SCOPED_OPTIONS: contextvars.ContextVar[dict[str, dict[str, Any]]] = contextvars.ContextVar(
    "kiln_flows_storage_options", default={})


@contextlib.contextmanager
def storage_options_scope(per_protocol: dict[str, dict[str, Any]] | None) -> Iterator[None]:
    """Use ``per_protocol`` fsspec options (``{"s3": {"key": …, "secret": …}}``) for every ``resolve``
    in this context (thread, Prefect task) until the block ends; explicit arguments still win.

    Example:
        >>> from kiln_core.storage import resolve
        >>> with storage_options_scope({"memory": {}}):
        ...     resolve("memory://bucket/x").uri
        'memory://bucket/x'
    """
    merged = dict(_SCOPED_OPTIONS.get())
    for protocol, options in (per_protocol or {}).items():
        merged[protocol] = {**merged.get(protocol, {}), **dict(options)}
    token = _SCOPED_OPTIONS.set(merged)
    try:
        yield
    finally:
        _SCOPED_OPTIONS.reset(token)


def _setting(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        number = float(value)
    except ValueError:
        raise StorageRejection("invalid_storage_setting", f"{name}={value!r} is not a number") from None
    if number <= 0:
        raise StorageRejection("invalid_storage_setting", f"{name}={value!r} must be positive")
    return number


def s3_client_settings() -> dict[str, Any]:
    """The botocore ``config_kwargs`` kiln-flows applies to S3 (timeouts, bounded retries)."""
    return {
        "connect_timeout": _setting(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT),
        "read_timeout": _setting(READ_TIMEOUT_ENV, DEFAULT_READ_TIMEOUT),
        "retries": {"max_attempts": int(_setting(MAX_ATTEMPTS_ENV, DEFAULT_MAX_ATTEMPTS)), "mode": "standard"},
    }


_NO_CONTINUE_SESSIONS: dict[tuple[tuple[str, str], ...], Any] = {}


def _session_without_expect_continue() -> Any:
    """An aiobotocore session without botocore's handler that adds ``Expect: 100-continue`` to PUTs
    (see the module docstring), one per AWS environment: a botocore session resolves credentials,
    region and endpoint from ``AWS_*`` variables once and caches them, so a session is shared only
    while those are unchanged. Sharing keeps fsspec's instance cache working (it keys instances by
    their constructor arguments)."""
    import aiobotocore.session
    import botocore.handlers

    key = tuple(sorted((name, value) for name, value in os.environ.items() if name.startswith("AWS_")))
    session = _NO_CONTINUE_SESSIONS.get(key)
    if session is None:
        session = aiobotocore.session.AioSession()
        session.unregister("before-call.s3", botocore.handlers.add_expect_header)
        _NO_CONTINUE_SESSIONS[key] = session
    return session


def effective_options(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fsspec options ``resolve`` uses for ``uri``: product defaults, then the run's scoped options
    for its protocol, then ``storage_options``."""
    protocol = uri.split("://", 1)[0] if "://" in uri else "file"
    options = dict(_SCOPED_OPTIONS.get().get(protocol, {}))
    options.update(storage_options or {})
    if protocol in S3_PROTOCOLS:
        options["config_kwargs"] = {**s3_client_settings(), **dict(options.get("config_kwargs") or {})}
        if "session" not in options and "profile" not in options:
            options["session"] = _session_without_expect_continue()
    return options
