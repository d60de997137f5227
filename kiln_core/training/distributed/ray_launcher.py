"""Launching a data-parallel run on a Ray cluster: a ``ray.train.torch.TorchTrainer`` whose workers run
the same job as the torchrun ranks (``kiln_core.training.distributed.worker.run_job``), no second trainer.

How a Ray run relates to a torchrun run (docs/distributed.md, "Ray"):

* **Same ranks, same math.** Ray's torch backend starts ``workers`` processes and initializes
  ``torch.distributed`` (gloo on CPU, nccl with GPUs); each worker turns that process group into this
  project's ``World`` and calls ``run_job`` with the plan the driver sends as JSON. The sharding, the
  hand-made gradient all-reduce and rank 0's publishing are the torchrun path's, so a Ray run of W
  workers trains the bytes a ``--nproc W`` run trains (and one worker, the one-process run's bytes).
* **Who retries what.** A worker process that dies makes Ray restart the whole worker group, up to
  ``max_failures`` times, inside the one train call (``FailureConfig``); every restarted group resumes
  from the newest committed checkpoint of the run directory (rank 0 looks, the others take its answer).
  A crash of the driver (the process calling ``launch_on_ray``: the CLI or the Prefect train task) is
  not Ray's business: the Prefect task retry (``options.train_retries``) starts the stage again, which
  resumes from the newest checkpoint as on every engine. Rejections (bad input) are never retried:
  rank 0 reports them and every worker returns normally.
* **The driver's side** is this module; each worker runs ``ray_worker.train_loop_per_worker``. Results,
  progress lines and the cancel flag travel through one small actor (``_Mailbox``, no CPU), never
  through files, so the workers may sit on other machines; the run's storage (corpus materialization
  and run directory) must then be shared by every node.

Every ``ray`` import is inside the functions of both modules: importing them (or the engine) needs no Ray.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.contracts.spec_blocks import RayOptions
from kiln_core.errors import EnvironmentFailure
from kiln_core.storage import is_local_uri
from kiln_core.training.distributed.launcher import DistributedJob, _rebuild_rejection
from kiln_core.training.distributed.ray_worker import quiet_worker, train_loop_per_worker
from kiln_core.training.distributed.world import ClusterFacts, check_shared_storage
from kiln_core.training.trainer import TrainResult

__all__ = ["RayFailure", "RAY_INSTALL_HINT", "CONNECT_TIMEOUT_SECONDS", "WORKER_QUIET_ENV", "import_ray",
           "check_cluster_storage", "check_capacity", "ray_session", "launch_on_ray"]

RAY_INSTALL_HINT = "pip install 'kiln-flows[ray]'"
CONNECT_TIMEOUT_SECONDS = 20.0
STOP_GRACE_SECONDS = 20.0  # how long a driver being stopped waits for its ranks' cooperative stop
"""How long connecting to a cluster may take before the run fails as an environment failure (exit 3)."""
DEFAULT_PORTS = {"ray": 10001, "gcs": 6379}


class RayFailure(EnvironmentFailure):
    """The cluster could not be reached, or the worker group failed more often than ``max_failures``:
    exit 3, retried by Prefect (a retry resumes from the newest checkpoint)."""


# ---------------------------------------------------------------------------------------------
# Checks that come before any training


def import_ray():
    """``ray`` with its Train and torch parts, or a rejection that says how to install them.

    Raises:
        ConfigError: ``ray_package_missing``.
    """
    try:
        import ray
        import ray.train.torch  # noqa: F401 - the TorchTrainer comes with the `train` extra
    except ImportError as error:
        raise ConfigError(f"training on Ray needs the ray package with Ray Train ({error}); {RAY_INSTALL_HINT}",
                          "distributed.engine", code="ray_package_missing") from None
    return ray


def check_cluster_storage(options: RayOptions, *uris: str) -> None:
    """Every worker must reach the run's storage: ``memory://`` is refused on any cluster, and a local path
    on a cluster this run does not start itself (its workers may sit on other machines).

    Raises:
        ConfigError: ``unshared_storage``.
    """
    check_shared_storage(*uris)
    if options.is_local:
        return
    for uri in uris:
        if is_local_uri(uri):
            raise ConfigError(f"{uri} is a local path, but the Ray cluster at {options.address} may run workers on "
                              "other machines: the storage root of a cluster run must be shared by every node "
                              "(s3://, gs://, ...), or train with `address: local`", "storage_root",
                              code="unshared_storage")


def check_capacity(resources: dict[str, float], workers: int, gpus_per_worker: float) -> None:
    """Refuse a run the cluster cannot place before any worker starts (Ray would otherwise wait forever).

    Each worker takes one CPU and ``gpus_per_worker`` GPUs.

    Raises:
        ConfigError: ``ray_cluster_too_small``, naming what the run needs and what the cluster has.
    """
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if workers > cpus:
        raise ConfigError(f"{workers} Ray workers need {workers} CPUs, but the cluster has {cpus:g}; lower `workers` "
                          "or grow the cluster", "distributed.workers", code="ray_cluster_too_small")
    if workers * gpus_per_worker > gpus:
        raise ConfigError(f"{workers} Ray workers × {gpus_per_worker:g} GPUs need {workers * gpus_per_worker:g} GPUs, "
                          f"but the cluster has {gpus:g}", "distributed.gpus_per_worker", code="ray_cluster_too_small")


def _probe(address: str, timeout: float) -> None:
    """Fail fast, in bounded time, when an explicit ``host:port`` does not accept connections."""
    if address in ("local", "auto"):
        return
    kind = "ray" if address.startswith("ray://") else "gcs"
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    try:
        with socket.create_connection((host.strip("[]"), int(port or DEFAULT_PORTS[kind])), timeout=timeout):
            return
    except (OSError, ValueError) as error:
        raise RayFailure("ray_cluster_unreachable", f"no Ray cluster answers at {address}: {error}",
                         field="distributed.address") from None


def _explicit_address(address: str) -> str:
    """``auto`` is ``RAY_ADDRESS`` when that is set (then probed like any other address)."""
    if address == "auto" and os.environ.get("RAY_ADDRESS") not in (None, "", "auto", "local"):
        return os.environ["RAY_ADDRESS"]
    return address


# What the run's Ray workers print besides the run's own lines, switched off in their environment: each
# rank's own "Loading weights" bar (one per rank, each prefixed by Ray: the driver draws the run's bar).
WORKER_QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
# On a Ray instance this run starts on its own machine: Ray Train's node-preemption watcher (nothing to watch
# on one machine; it logged an error when the instance stopped under it).
LOCAL_INSTANCE_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


class _DefaultTokenAuthNotice(logging.Filter):
    """Drops Ray's notice that a local instance it starts has token authentication on (its default, which the
    run keeps): a warning in every run that asks nothing of the user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


@contextmanager
def ray_session(options: RayOptions, workers: int, *, timeout: float = CONNECT_TIMEOUT_SECONDS,
                worker_env: dict[str, str] | None = None) -> Iterator[ClusterFacts]:
    """Connected to the run's cluster: a local instance started for the run (and stopped after it), or the
    cluster at ``options.address``; yields what the receipt records about it.

    A session already connected in this process (``ray.init`` by the caller) is used as it is and left open.

    Args:
        options: The run's Ray block.
        workers: The ranks the run asks for.
        timeout: Seconds connecting may take.
        worker_env: Environment variables every task and actor of the run gets (``runtime_env``), on top of
            ``WORKER_QUIET_ENV`` (e.g. the Prefect API a flow's Ray tasks report to).

    Raises:
        RayFailure: ``ray_cluster_unreachable`` within about ``timeout`` seconds.
    """
    ray = import_ray()
    facts = ClusterFacts(engine="ray", version=ray.__version__, address=options.address)
    if ray.is_initialized():
        yield facts
        return
    _probe(_explicit_address(options.address), timeout)
    env = {**WORKER_QUIET_ENV, **(worker_env or {})}
    if options.is_local:
        # One CPU per worker; the machine's cores, so a run asking for more is refused by check_capacity.
        init = dict(num_cpus=max(1, os.cpu_count() or 1), include_dashboard=False)
        env.update(LOCAL_INSTANCE_ENV)
        notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
        if not any(isinstance(f, _DefaultTokenAuthNotice) for f in notice.filters):
            notice.addFilter(_DefaultTokenAuthNotice())
    else:
        init = dict(address=options.address)
    runtime_env = {"env_vars": env, "worker_process_setup_hook": f"{quiet_worker.__module__}.{quiet_worker.__name__}"}
    _init(ray, {**init, "runtime_env": runtime_env}, options.address)
    try:
        yield facts
    finally:
        ray.shutdown()


def _init(ray, init: dict[str, Any], address: str) -> None:
    """``ray.init(**init)`` in this thread (Ray installs its handlers there); a refusal to connect is an
    environment failure. The bound on time comes from ``_probe`` before it."""
    try:
        ray.init(logging_level="WARNING", **init)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as error:
        raise RayFailure("ray_cluster_unreachable", f"cannot connect to the Ray cluster at {address}: "
                         f"{type(error).__name__}: {error}", field="distributed.address") from None


# ---------------------------------------------------------------------------------------------
# The driver


class _Mailbox:
    """A Ray actor between the driver and rank 0: attempts, progress lines, the cancel flag, the outcome."""

    def __init__(self) -> None:
        self.attempts = 0
        self.lines: list[tuple[int, int, float]] = []
        self.cancel = False
        self.result: str | None = None

    def start_attempt(self) -> int:
        """0 for the first worker group, then 1, 2, … for each group Ray restarts."""
        self.attempts += 1
        return self.attempts - 1

    def progress(self, step: int, total: int, loss: float) -> None:
        self.lines.append((step, total, loss))

    def take_progress(self) -> list[tuple[int, int, float]]:
        lines, self.lines = self.lines, []
        return lines

    def request_cancel(self) -> None:
        self.cancel = True

    def cancelled(self) -> bool:
        return self.cancel

    def put_outcome(self, outcome: str) -> None:
        self.result = outcome

    def outcome(self) -> str | None:
        return self.result


def launch_on_ray(job: DistributedJob, options: RayOptions, *,
                  on_progress: Callable[[int, int, float], None] | None = None,
                  should_cancel: Callable[[], bool] | None = None, poll_seconds: float = 0.5) -> TrainResult:
    """Run ``job`` on ``job.plan.settings.world_size`` Ray workers and return rank 0's ``TrainResult``.

    Args:
        job: The plan, committed corpus and teacher every worker trains (``plan.resume`` a basename or None).
        options: The cluster address, GPUs per worker and how many worker-group restarts Ray makes.
        on_progress: Called here, as ``(step, total, loss)``, for each step rank 0 committed.
        should_cancel: Polled here; once True every rank stops at the next step boundary after a checkpoint
            and the result says ``cancelled``.
        poll_seconds: How often progress and ``should_cancel`` are looked at.

    Raises:
        ConfigError: ``ray_package_missing``, ``unshared_storage``, ``ray_cluster_too_small``, or the
            rejection rank 0 raised before training (with its code and place, as on one process).
        CheckpointError/ResumeError/AdmissionError: rank 0 rejected the job before training.
        RayFailure: the cluster is unreachable, or the worker group failed more than ``max_failures`` times.
    """
    import_ray()
    workers = job.plan.settings.world_size
    check_cluster_storage(options, job.corpus.uri, job.plan.run_uri)
    with ray_session(options, workers) as facts:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        check_capacity(ray.cluster_resources(), workers, options.gpus_per_worker)
        mailbox = ray.remote(num_cpus=0)(_Mailbox).remote()
        use_gpu = options.gpus_per_worker > 0
        backend = job.plan.backend if job.plan.backend != "auto" else ("nccl" if use_gpu else "gloo")
        if not use_gpu and job.plan.device is None:  # a CPU worker on a GPU node still trains on its CPU
            job = job.model_copy(update={"plan": job.plan.model_copy(update={"device": "cpu"})})
        config = {"job": job.model_dump_json(), "mailbox": mailbox, "cluster": dataclasses.asdict(facts)}
        with tempfile.TemporaryDirectory(prefix="kiln-ray-") as scratch:
            trainer = TorchTrainer(
                train_loop_per_worker, train_loop_config=config, torch_config=TorchConfig(backend=backend),
                scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu,
                                             resources_per_worker={"CPU": 1, **({"GPU": options.gpus_per_worker} if use_gpu else {})}),
                run_config=RunConfig(name=f"kiln-{job.plan.adapter}-{job.plan.run_key[:12]}",
                                     storage_path=scratch if options.is_local else None,
                                     failure_config=FailureConfig(max_failures=options.max_failures)))
            error = _fit_relaying(ray, trainer, mailbox, on_progress, should_cancel, poll_seconds)
            outcome = ray.get(mailbox.outcome.remote())
    if outcome is None:
        raise RayFailure("ray_run_failed", f"the Ray worker group failed ({options.max_failures} restarts allowed) "
                         f"and no rank reported a result: {error}")
    return _outcome_result(json.loads(outcome))


def _fit_relaying(ray, trainer, mailbox, on_progress, should_cancel, poll_seconds: float) -> BaseException | None:
    """``trainer.fit()`` in a thread while this one relays progress and the cancel flag; returns fit's error."""
    failure: dict[str, BaseException | None] = {"error": None}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as error:  # noqa: BLE001 - the outcome (or its absence) decides below
            failure["error"] = error

    thread = threading.Thread(target=fit, name="kiln-ray-fit", daemon=True)
    thread.start()
    cancelled = False
    try:
        while True:
            thread.join(poll_seconds)
            finished = not thread.is_alive()  # looked at before draining: every line sent before the end is relayed
            for step, total, loss in ray.get(mailbox.take_progress.remote()):
                if on_progress is not None:
                    on_progress(step, total, loss)
            if finished:
                return failure["error"]
            if not cancelled and should_cancel is not None and should_cancel():
                cancelled = True
                mailbox.request_cancel.remote()
    except BaseException:
        # The driver is being stopped (a second Ctrl-C, Prefect's termination signal in a worker's run):
        # the ranks still stop at a step boundary after a checkpoint and a cancelled receipt, if they can
        # within STOP_GRACE_SECONDS (inside Prefect's 30 s before SIGKILL); then the driver goes on stopping.
        mailbox.request_cancel.remote()
        thread.join(STOP_GRACE_SECONDS)
        raise


def _outcome_result(outcome: dict[str, Any]) -> TrainResult:
    if outcome["kind"] == "result":
        return TrainResult.model_validate(outcome["result"])
    if outcome["kind"] == "rejected":
        raise _rebuild_rejection(outcome["error"], outcome["payload"])
    raise RayFailure("ray_run_failed", f"rank 0 failed: {outcome['message']}")
