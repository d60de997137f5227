"""Prefect for the interactive commands (``run``, ``demo``, ``serve``): offline and Ctrl-C safe.

* ``offline_settings()`` turns off what would phone home or print errors on a machine without
  internet: server analytics, SDK analytics (``DO_NOT_TRACK``), resource-metric telemetry.
* ``start_local_api()`` starts Prefect's temporary API server — when ``PREFECT_API_URL`` is not set —
  **in a session of its own**. Prefect starts it in the caller's process group, so the terminal's
  Ctrl-C (SIGINT to the whole foreground group) killed the server too, and the run then retried its
  training task against a dead API for minutes and exited 1. Detached, the server outlives the
  Ctrl-C; training stops at the next step boundary, the run ends ``cancelled``, and the server is
  stopped when the command exits (and, on Linux, when the command's process dies any other way).
  When ``PREFECT_API_URL`` is set, it checks that something answers there instead
  (``prefect_api_unreachable``, exit 3, naming the address, not Prefect's bare ``RuntimeError`` later).

* ``hide_rejection_tracebacks()`` keeps Prefect's run logs to one line for a rejected input: its
  task and flow loggers log a failure with the whole traceback, which for bad input (a ``Rejection``)
  says nothing the rule and place do not.
* ``links_to_the_default_ui()`` makes every link a command prints (Prefect's "View at …", the served
  deployment's, the demo's) open the UI the server's root opens: Prefect 3.9's root opens its new UI
  (``/v2/…``) while the links it prints, built from ``PREFECT_UI_URL``, open the old one. The server
  says which UI its root opens (``/ui-settings``); the links follow it.

All are called before the flow runs; none imports anything heavy until needed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator

OFFLINE_SETTINGS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # a cold API runs its migrations first
    "TOKENIZERS_PARALLELISM": "false",
}


def offline_settings() -> None:
    """Set the offline defaults (an explicit environment value wins). Call before importing Prefect."""
    for name, value in OFFLINE_SETTINGS.items():
        os.environ.setdefault(name, value)


class _RejectionWithoutTraceback:
    """A logging filter: a record about a ``Rejection`` keeps its message and loses its traceback."""

    def filter(self, record) -> bool:
        from kiln_core.errors import Rejection

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, Rejection):
            record.exc_info, record.exc_text = None, None
        return True


def hide_rejection_tracebacks() -> None:
    """Install the filter on Prefect's task-run and flow-run loggers (once)."""
    import logging

    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RejectionWithoutTraceback) for f in logger.filters):
            logger.addFilter(_RejectionWithoutTraceback())


def ui_root(ui_url: str | None, api_url: str | None) -> str | None:
    """The server's address a browser opens (never ``…/api``, which answers "Page not found" there).

    Example:
        >>> ui_root(None, "http://127.0.0.1:4200/api")
        'http://127.0.0.1:4200'
        >>> ui_root("http://127.0.0.1:4200/v2", "http://127.0.0.1:4200/api")
        'http://127.0.0.1:4200'
    """
    base = (ui_url or (api_url or "").removesuffix("/").removesuffix("/api")).rstrip("/")
    return base.removesuffix("/v2") or None


def default_ui_url(root: str, timeout: float = 3.0) -> str | None:
    """The base URL of the UI the server's root opens (``<root>/v2`` for Prefect 3.9's default), asked of the
    server's ``/ui-settings``; None when it does not answer (an older server, no UI)."""
    import httpx

    try:
        settings = httpx.get(f"{root}/ui-settings", timeout=timeout).json()
        base = settings[f"{settings['default_ui']}_base_url"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return root + (base.rstrip("/") if isinstance(base, str) else "")


@contextlib.contextmanager
def links_to_the_default_ui() -> Iterator[str | None]:
    """Within the block, links Prefect and kiln-flows print open the UI the server's root opens; yields
    that UI's base URL (None without a server that says). Runs this process starts within it inherit it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    root = ui_root(PREFECT_UI_URL.value(), PREFECT_API_URL.value()) if PREFECT_API_URL.value() else None
    base = default_ui_url(root) if root else None
    if base is None:
        yield PREFECT_UI_URL.value()
        return
    # The flow-run processes `serve` starts print the same links; the variable is put back when the block
    # ends, so a process that goes on (a notebook, a test session) keeps no link to a server that is gone.
    before = os.environ.get("PREFECT_UI_URL")
    os.environ["PREFECT_UI_URL"] = base
    try:
        with temporary_settings(updates={PREFECT_UI_URL: base}):
            yield base
    finally:
        if before is None:
            os.environ.pop("PREFECT_UI_URL", None)
        else:
            os.environ["PREFECT_UI_URL"] = before


def start_local_api() -> float | None:
    """Start the temporary API in its own session unless ``PREFECT_API_URL`` is set.

    Returns:
        Seconds the server took to start (part of Prefect's overhead), or None when a configured API
        is used.
    """
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        check_api_reachable(PREFECT_API_URL.value())
        return None
    if SubprocessASGIServer._instances.get(None) is not None:
        return None
    server = object.__new__(_detached_server_class())  # bypass the per-port instance lookup of __new__
    server.__init__(None)
    SubprocessASGIServer._instances[None] = server  # what Prefect's clients pick up (as its test harness does)
    started = time.perf_counter()
    server.start()
    return time.perf_counter() - started


API_CHECK_TIMEOUT_SECONDS = 5.0


def check_api_reachable(api_url: str, timeout: float = API_CHECK_TIMEOUT_SECONDS) -> None:
    """Refuse to start a flow against a ``PREFECT_API_URL`` where nothing answers (a stopped server): Prefect
    would fail later with a bare ``RuntimeError``. Any HTTP answer counts as reachable (Prefect Cloud answers
    ``/health`` without credentials with 401); only a refused, unresolvable or silent address is not.

    Raises:
        EnvironmentFailure: ``prefect_api_unreachable`` (exit 3), naming PREFECT_API_URL and the address.
    """
    import urllib.error
    import urllib.parse
    import urllib.request

    from kiln_core.errors import EnvironmentFailure

    try:
        urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # something answered
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        address = urllib.parse.urlsplit(api_url).netloc or api_url
        raise EnvironmentFailure("prefect_api_unreachable", f"no Prefect API answers at {address} "
                                 f"(PREFECT_API_URL={api_url}: {reason}); start the server (`prefect server start`), "
                                 "or unset PREFECT_API_URL to run on a temporary local API") from None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the atexit stop still applies


_DETACHED: type | None = None


def _detached_server_class() -> type:
    """The subclass, built on first use so that importing this module does not import Prefect's server."""
    global _DETACHED
    if _DETACHED is None:
        _DETACHED = _make_detached_server_class()
    return _DETACHED


def _make_detached_server_class() -> type:
    from prefect.server.api.server import SubprocessASGIServer

    class DetachedServer(SubprocessASGIServer):
        """Prefect's temporary API server, in a new session (not in the terminal's process group)."""

        def _run_uvicorn_command(self):
            # The command of SubprocessASGIServer._run_uvicorn_command (prefect 3.9, server/api/server.py),
            # with start_new_session so that a Ctrl-C in the terminal does not reach the server.
            import subprocess

            import prefect
            from prefect.settings import get_current_settings

            server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
            return subprocess.Popen(
                args=[sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                      "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                      "--log-level", "error", "--lifespan", "on"],
                env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )

    return DetachedServer

