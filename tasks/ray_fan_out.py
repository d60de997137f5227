"""Shard admission on the run's Ray cluster, through prefect-ray's task runner.

When a spec trains on Ray (``distributed: {engine: ray, address: ...}``), the flow's mapped ``admit-shard``
tasks are submitted to ``prefect_ray.RayTaskRunner`` instead of the flow's thread pool: each shard is
admitted in a Ray worker process, on whichever node has a free CPU. The tasks are the same ones, with the
same engine call (``kiln_core.admission.shards.admit_shard``), so the verdict, the per-shard
materialization, the reuse of unchanged shards and a rejection naming shard and line are the thread path's.

Where the work may go is decided here, not in ``kiln_core`` (which never imports Prefect):

* ``address: local``: the run's own Ray instance on this machine. The flow joins it once, for the shard
  admission, and keeps it for the train stage (``ray_launcher.ray_session`` uses a session already open),
  so a run starts Ray once; ``PrefectStages`` stops it when the flow run ends.
* any other address: the cluster's workers write each shard's materialization under the storage root, so
  a local storage root is refused (``unshared_storage``, the rule training applies), and they read the
  shards, so shards given as local paths are admitted on this machine instead (logged), as before Ray.
  The student directory travels as the spec names it: an fsspec URI is copied by each worker
  (``localize_directory``); a local path must exist on every node (the image, as for training).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.contracts.spec_blocks import DistributedOptions, RayOptions
from kiln_core.storage import is_local_uri

__all__ = ["FanOut", "plan_fan_out", "ray_task_runner", "runner_failure", "prefect_worker_env"]



@dataclass(frozen=True)
class FanOut:
    """Where a set's shards are admitted: on the Ray cluster (``ray`` set) or on the flow's own threads.

    Attributes:
        ray: The cluster to admit on, or None for the flow's thread pool.
        reason: Why a Ray run's shards stay on this machine (for the run's log), else None.
        worker_student: The student as Ray workers open it: its fsspec URI (each node copies it), or None
            for this machine's local path (which every node must then have).
    """

    ray: RayOptions | None
    reason: str | None = None
    worker_student: str | None = None


def plan_fan_out(distributed: DistributedOptions | None, corpus_uri: str, storage_root: str,
                 student: str = "") -> FanOut:
    """Decide where a set of shards is admitted for a spec's ``distributed`` block.

    Args:
        distributed: The spec's block (None, torchrun or Ray).
        corpus_uri: The set (a directory or an index).
        storage_root: Where the shards are materialized.
        student: The student as the spec names it (a local path or an fsspec URI).

    Returns:
        ``FanOut(ray=...)`` for a Ray spec whose workers can read the shards and write the storage root.

    Raises:
        ConfigError: ``unshared_storage``: a cluster other than ``local`` with a local storage root
            (or ``memory://`` anywhere): its workers could not write the materialization, nor train from it.
    """
    options = distributed.ray_options() if distributed is not None else None
    if options is None:
        return FanOut(ray=None)
    from kiln_core.training.distributed.ray_launcher import check_cluster_storage

    check_cluster_storage(options, storage_root)  # what training refuses later, refused before any admission
    if not options.is_local and is_local_uri(corpus_uri):
        return FanOut(ray=None, reason=f"the shards are local paths on this machine; the Ray cluster at "
                                       f"{options.address} cannot read them")
    return FanOut(ray=options, worker_student=None if is_local_uri(student) else student)


def ray_task_runner(options: RayOptions):
    """prefect-ray's task runner for the cluster of ``options`` (enter it inside ``ray_session``: it then
    uses that session and leaves it open).

    Raises:
        ConfigError: ``ray_package_missing`` when prefect-ray is not installed.
    """
    from kiln_core.training.distributed.ray_launcher import RAY_INSTALL_HINT

    try:
        from prefect_ray import RayTaskRunner
    except ImportError as error:
        raise ConfigError(f"admitting or scoring shards on Ray needs prefect-ray ({error}); {RAY_INSTALL_HINT}",
                          "distributed.engine", code="ray_package_missing") from None
    return RayTaskRunner(address=options.address)


def prefect_worker_env(options: RayOptions) -> dict[str, str]:
    """The Prefect settings a flow's tasks in Ray workers need: the API this flow run reports to, and this
    process's own ``PREFECT_*`` settings (kiln-flows' offline ones among them). Without the API's address a
    worker started a temporary API server of its own, one per worker, each logging "Failed to send
    telemetry" at ERROR. A temporary API on this machine's loopback is reachable from a ``local`` Ray
    instance only; a cluster's workers keep their own settings then (give them ``PREFECT_API_URL``).
    """
    import os

    from prefect.client.orchestration import get_client

    env = {name: value for name, value in os.environ.items()
           if (name.startswith("PREFECT_") and not name.startswith("PREFECT__")) or name == "DO_NOT_TRACK"}
    with get_client(sync_client=True) as client:
        api_url = str(client.api_url)
    if options.is_local or not any(host in api_url for host in ("://127.0.0.1", "://localhost", "://[::1]")):
        env["PREFECT_API_URL"] = api_url.rstrip("/")
    return env


def runner_failure(error: BaseException, shard: str, doing: str = "admitting") -> BaseException:
    """What a shard task's failure means (``doing``: ``admitting``, or ``scoring`` for ``tasks.score_shards``):
    a rejection or a storage error raised by the task is returned as it is; a failure of Ray itself (the
    worker process died, a node could not unpickle the task because kiln-flows is not installed there) is
    the environment failure it is: ``ray_task_failed``, exit 3.
    """
    try:
        from ray.exceptions import RayError
    except ImportError:  # without Ray no Ray task ran
        return error
    if not isinstance(error, RayError):
        return error
    from kiln_core.training.distributed.ray_launcher import RayFailure

    summary = (str(error).strip().splitlines() or [""])[-1][:300]  # Ray's last line names the cause
    return RayFailure("ray_task_failed", f"shard {shard}: the Ray task {doing} it failed: {type(error).__name__}: "
                      f"{summary} (a worker that died, or a node without kiln-flows installed: docs/distributed.md)",
                      file=shard)
