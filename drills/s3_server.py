"""A real S3 endpoint for tests and drills: moto's standalone server as a subprocess on loopback.

Nothing is patched in-process (no ``mock_aws``): s3fs, boto3 and the trainer talk HTTP to a separate
process, so connection errors, restarts and stalls behave as they would against a real object store.

How the endpoint and credentials reach s3fs (s3fs 2026.9 / aiobotocore 3.10 / botocore 1.43, checked):

* ``S3Server.environment()`` gives ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_DEFAULT_REGION`` and ``AWS_ENDPOINT_URL_S3``. s3fs passes ``endpoint_url=None`` to botocore
  unless told otherwise, and botocore (>= 1.31) then honours ``AWS_ENDPOINT_URL_S3`` from the
  environment, so a plain ``fsspec.filesystem("s3")`` / ``resolve("s3://...")`` reaches the server with
  no fsspec configuration at all: both the endpoint and the credentials come from the environment.
  The environment is read when an ``S3FileSystem`` instance creates its client, so call
  ``clear_s3fs_cache()`` after changing it (s3fs caches instances by their constructor kwargs).
* ``S3Server.storage_options()`` gives the same thing as fsspec options
  (``{"key", "secret", "client_kwargs": {"endpoint_url"}}``): what a Prefect ``Secret`` block holds
  under its ``"s3"`` key, what ``fsspec.config.conf["s3"]`` may hold, or ``storage_options=`` takes.

moto keeps its state in memory: ``restart()`` brings the server back on the *same* port (clients keep
their endpoint URL) but with no buckets or objects; ``pause()``/``resume()`` (SIGSTOP/SIGCONT) make it
stall without losing state. Both are for fault tests.

Example:
    >>> with running_s3_server() as server:  # doctest: +SKIP
    ...     server.create_bucket("kiln-test")
    ...     with aws_environment(server):
    ...         resolve("s3://kiln-test/x").fs.pipe("kiln-test/x/a", b"1")
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

DUMMY_ACCESS_KEY_ID = "testing-kiln-access-key"
DUMMY_SECRET_ACCESS_KEY = "testing-kiln-secret-key"
DUMMY_REGION = "us-east-1"

# Every variable through which botocore could find credentials, an endpoint or a region; removed by
# ``without_aws_environment`` so a test can prove that credentials came from somewhere else.
AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class S3Server:
    """moto's standalone S3 server (``python -m moto.server``) as a subprocess on one fixed port."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, log_path: str | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="kiln-moto-"), "moto.log")
        self.process: subprocess.Popen | None = None
        self.access_key = DUMMY_ACCESS_KEY_ID
        self.secret_key = DUMMY_SECRET_ACCESS_KEY
        self.region = DUMMY_REGION

    # ---- lifecycle ------------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 60.0) -> "S3Server":
        """Start the server and wait until it answers HTTP (raises with the server log on failure)."""
        if self.running:
            return self
        env = {k: v for k, v in os.environ.items() if k not in AWS_VARIABLES}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C in the test terminal must not reach it first
            )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.process.returncode}:\n{self.log_tail()}")
            if self._answers():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"moto server on {self.endpoint_url} not ready after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2) as response:
                response.read()
            return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer means the server is up
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)  # a paused server cannot handle SIGTERM
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

    def restart(self, timeout: float = 60.0, downtime: float = 0.0) -> None:
        """Stop and start again on the same port (moto's state — buckets, objects — is lost)."""
        self.stop()
        if downtime:
            time.sleep(downtime)
        deadline = time.monotonic() + timeout
        while not _port_free(self.host, self.port):  # the old socket may linger for a moment
            if time.monotonic() > deadline:
                raise TimeoutError(f"port {self.port} still busy after stopping moto")
            time.sleep(0.1)
        self.start(max(1.0, deadline - time.monotonic()))

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections are accepted by the kernel but never answered."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as handle:
                return handle.read().decode("utf-8", "replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- clients and configuration -------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        """Environment variables that point botocore (hence s3fs and boto3) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
        }

    def storage_options(self, key: str | None = None, secret: str | None = None) -> dict[str, Any]:
        """fsspec/s3fs options for this server (moto accepts any key pair)."""
        return {
            "key": key or self.access_key,
            "secret": secret or self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
        }

    def boto3_client(self):
        """A boto3 S3 client with explicit endpoint and credentials (independent of the environment)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def create_bucket(self, name: str) -> str:
        """Create ``name`` (idempotent) and return it."""
        client = self.boto3_client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under ``prefix``, read with boto3 (bypasses s3fs and its listing cache)."""
        client = self.boto3_client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return sorted(keys)

    def get_object(self, bucket: str, key: str) -> bytes:
        return self.boto3_client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def object_sizes(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """key -> size of every object under ``prefix`` (boto3, no s3fs cache)."""
        client = self.boto3_client()
        sizes: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            sizes.update((item["Key"], int(item["Size"])) for item in page.get("Contents", []))
        return sizes


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def running_s3_server(**kwargs: Any) -> Iterator[S3Server]:
    """Start a server for the duration of the block."""
    server = S3Server(**kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def clear_s3fs_cache() -> None:
    """Drop cached ``S3FileSystem`` instances (and with them their clients and listing caches)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def aws_environment(server: S3Server) -> Iterator[dict[str, str]]:
    """Point the process environment at ``server`` for the block (previous values restored)."""
    values = server.environment()
    with _patched_environ(set_=values, remove=[name for name in AWS_VARIABLES if name not in values]):
        clear_s3fs_cache()
        try:
            yield values
        finally:
            clear_s3fs_cache()


@contextlib.contextmanager
def without_aws_environment(disable_imds: bool = True) -> Iterator[None]:
    """Remove every ``AWS_*`` variable (credentials, endpoint, region, CA bundle, ...) for the block.

    ``disable_imds`` sets ``AWS_EC2_METADATA_DISABLED=true`` (not a credential) so that a lookup that
    finds no credentials fails at once instead of probing the EC2 metadata address.
    """
    extra = {"AWS_EC2_METADATA_DISABLED": "true"} if disable_imds else {}
    remove = sorted(set(AWS_VARIABLES) | {name for name in os.environ if name.startswith("AWS_")})
    with _patched_environ(set_=extra, remove=remove):
        clear_s3fs_cache()
        try:
            yield
        finally:
            clear_s3fs_cache()


@contextlib.contextmanager
def fsspec_config(protocol: str, options: dict[str, Any] | None) -> Iterator[None]:
    """Set (or with None, remove) ``fsspec.config.conf[protocol]`` for the block, then restore it."""
    import copy

    import fsspec

    conf = fsspec.config.conf
    saved = copy.deepcopy(conf.get(protocol)) if protocol in conf else None
    had = protocol in conf
    if options is None:
        conf.pop(protocol, None)
    else:
        conf[protocol] = copy.deepcopy(options)
    try:
        yield
    finally:
        if had:
            conf[protocol] = saved
        else:
            conf.pop(protocol, None)


@contextlib.contextmanager
def _patched_environ(set_: dict[str, str], remove: list[str]) -> Iterator[None]:
    names = set(set_) | set(remove)
    saved = {name: os.environ.get(name) for name in names}
    try:
        for name in remove:
            os.environ.pop(name, None)
        os.environ.update(set_)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
