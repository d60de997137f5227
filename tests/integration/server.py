"""A real ``prefect server start`` subprocess, its workers, and small API helpers for integration tests.

Everything runs in child processes with their own ``PREFECT_HOME`` (SQLite) and the scheduler
enabled; the test process itself never points its Prefect settings at this server — it talks to it
with explicit ``httpx`` calls only, so it cannot interfere with the session's ``prefect_harness``.
Each child writes its output to a log file; ``tails()`` returns the ends of all of them for failure
messages.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))

# Settings the session conftest sets for in-process harness tests that must not leak into the real
# server or its workers (the whole point here is a scheduler that runs).
_HARNESS_ONLY = (
    "PREFECT_API_URL",
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED",
    "PREFECT_LOGGING_TO_API_ENABLED",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
    "PREFECT_API_DATABASE_CONNECTION_URL",
    "PREFECT_PROFILE",
    "PREFECT_UI_URL",  # the harness's address: links printed against the real server must be its own
)

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 1.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class PrefectServer:
    """A ``prefect server start`` child process plus the workers and CLI calls made against it.

    Args:
        root: Scratch directory: ``home/`` (PREFECT_HOME and SQLite), ``storage/`` (results), logs.
        port: Port for the API and UI (a free one when omitted).
    """

    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.url}/api"
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self.http = httpx.Client(base_url=self.api_url, timeout=60)

    # -- environments -------------------------------------------------------------------------
    def base_env(self) -> dict[str, str]:
        """Environment shared by the server and its clients: isolated home, no telemetry."""
        env = {k: v for k, v in os.environ.items() if k not in _HARNESS_ONLY}
        home = self.root / "home"
        env.update(
            {
                "PREFECT_HOME": str(home),
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(self.root / "storage"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
                "PREFECT_API_DATABASE_TIMEOUT": "60",
                "PREFECT_CLI_WRAP_LINES": "false",
                "COLUMNS": "200",
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def client_env(self, **extra: str) -> dict[str, str]:
        """Environment for CLI calls and workers: the API URL of this server, nothing ephemeral."""
        env = self.base_env()
        env.update({"PREFECT_API_URL": self.api_url, "PREFECT_SERVER_EPHEMERAL_ENABLED": "false"})
        env.update(extra)
        return env

    # -- processes ----------------------------------------------------------------------------
    def spawn(self, name: str, args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
        """Start a child in its own process group, logging to ``logs/<name>.log``."""
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(
            args, cwd=str(cwd or REPO_ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        self._procs.append((name, proc))
        return proc

    def start(self, timeout: float = 240) -> "PrefectServer":
        """Start the server with the scheduler on and wait until ``/api/health`` answers."""
        env = self.base_env()
        env.update(
            {
                "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "true",
                "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
                "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "true",
                "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_ENABLED": "true",
                "PREFECT_UI_ENABLED": "true",
                "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
                "PREFECT_UI_API_URL": self.api_url,
                "PREFECT_API_LOG_RETRYABLE_ERRORS": "true",
            }
        )
        proc = self.spawn(
            "server", [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)], env
        )

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {proc.returncode}\n{self.tails()}")
            try:
                return self.http.get("/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout, interval=1.0, what="prefect server /api/health")
        return self

    def cli(self, args: list[str], timeout: float = 300, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
        """Run ``prefect <args>`` against this server; raise with its output when it fails."""
        done = subprocess.run(
            [PREFECT, *args], cwd=str(cwd or REPO_ROOT), env=self.client_env(**env), capture_output=True,
            text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        with open(self.logs / "cli.log", "a", encoding="utf-8") as log:
            log.write(f"$ prefect {' '.join(args)}\n{done.stdout}\n{done.stderr}\n(exit {done.returncode})\n")
        if done.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def start_worker(self, pool: str, name: str, cwd: Path, limit: int = 1, **env: str) -> subprocess.Popen:
        """``prefect worker start --pool POOL`` (process type) against this server, run in ``cwd``.

        Flow runs inherit the worker's working directory, so relative paths in parameters (the
        yaml's defaults) resolve under ``cwd``, never inside the repository.
        """
        return self.spawn(
            f"worker-{name}",
            [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--name", name, "--limit", str(limit)],
            self.client_env(PREFECT_WORKER_QUERY_SECONDS="2", **env),
            cwd=cwd,
        )

    def stop(self) -> None:
        """Stop workers first, then the server: SIGTERM to each process group, SIGKILL if needed."""
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        for _, proc in reversed(self._procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        self.http.close()

    def tails(self, lines: int = 60) -> str:
        """The last ``lines`` lines of every child's log, for assertion messages."""
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
            parts.append(f"----- {path.name} (last {len(text)} lines) -----\n" + "\n".join(text))
        return "\n".join(parts)

    # -- API ------------------------------------------------------------------------------------
    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """One JSON API call; raises with the response body on an HTTP error.

        503 (SQLite busy: the server marks it retryable) and 429 are retried with backoff, as the
        Prefect client does; a busy two-core box with a scheduler, a worker and a flow run all
        writing to one SQLite file hits them.
        """
        for attempt in range(8):
            response = self.http.request(method, path, **kwargs)
            if response.status_code not in (429, 503):
                break
            time.sleep(min(2**attempt, 10))
        if response.status_code >= 400:
            raise AssertionError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response.json() if response.content else None

    def deployment(self, flow_name: str, deployment_name: str) -> dict[str, Any]:
        return self.api("GET", f"/deployments/name/{flow_name}/{deployment_name}")

    def find_deployment(self, flow_name: str, deployment_name: str) -> dict[str, Any] | None:
        """The deployment, or None while it does not exist yet."""
        response = self.http.get(f"/deployments/name/{flow_name}/{deployment_name}")
        return response.json() if response.status_code == 200 else None

    def create_run(self, deployment: dict[str, Any], parameters: dict[str, Any], name: str) -> dict[str, Any]:
        """Create a flow run with custom parameters: the body the V2 UI's Custom run form posts."""
        details = {"deferred": False, "untrackable_result": False, "pause_reschedule": False}
        body = {
            "name": name,
            "work_queue_name": None,
            "empirical_policy": {"resuming": False, "max_retries": 0, "retry_delay_seconds": 0},
            "state": {"type": "SCHEDULED", "state_details": details},
            "tags": deployment.get("tags") or [],
            "enforce_parameter_schema": deployment.get("enforce_parameter_schema", True),
            "parameters": parameters,
        }
        return self.api("POST", f"/deployments/{deployment['id']}/create_flow_run", json=body)

    def cancel(self, flow_run_id: str) -> dict[str, Any]:
        """Request cancellation as the UI's Cancel button does (forced CANCELLING)."""
        body = {"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}
        return self.api("POST", f"/flow_runs/{flow_run_id}/set_state", json=body)

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        return self.api("GET", f"/flow_runs/{flow_run_id}")

    def wait_for_state(self, flow_run_id: str, types: set[str], timeout: float) -> dict[str, Any]:
        """Poll a flow run until its state type is in ``types`` (or terminal); return the run."""

        def reached():
            run = self.flow_run(flow_run_id)
            state = (run.get("state") or {}).get("type")
            return run if state in types or state in TERMINAL else None

        try:
            return wait_for(reached, timeout, interval=2.0, what=f"flow run {flow_run_id} in {sorted(types)}")
        except TimeoutError as error:
            run = self.flow_run(flow_run_id)
            raise AssertionError(f"{error}; last state {run.get('state')}\n{self.tails()}") from None

    def runs_of(self, deployment_id: str, state_types: list[str] | None = None) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"deployments": {"id": {"any_": [deployment_id]}}, "limit": 200}
        if state_types:
            body["flow_runs"] = {"state": {"type": {"any_": state_types}}}
        return self.api("POST", "/flow_runs/filter", json=body)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
