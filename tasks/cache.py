"""Prefect caching as a hint: keys from our own content digests, records kept under the storage root, and a
cached result reused only after its artifact is checked on storage.

Prefect's default policy includes the flow run id, so a new run never hits the cache; input hashing
pickles objects, which is slow and not stable for tensors. ``DigestCachePolicy`` hashes only the named task
inputs — ``sha256:`` digests and small settings computed upstream — plus a version tag, so the same corpus
bytes for the same student and top-K hit the cache across runs, deployments and machines. Like
prefect-dbt's node policy, it holds no references to files or objects and pickles safely.

A cache record says what a task returned, not what is on storage now: a user may delete the storage root
(``rm -rf kiln-data``) or a file in it may change, while the record lives on. So every cached task runs
through ``run_cached``:

* its records and results live under the storage root (``cache_options``: ``<root>/prefect/cache-keys``
  and ``<root>/prefect/results``), so deleting the root deletes them with the artifacts. A root that is
  not a local directory gets no Prefect cache: Prefect keeps results elsewhere only through a saved block,
  and the stages reuse their content-addressed artifacts by themselves;
* a ``Cached`` result is checked against storage (``kiln_core.engine.stages.stale_reason``: the artifact
  exists and its digest is the recorded one); a missing or changed artifact is logged and the task runs
  again, its record overwritten, with the arguments that make it redo the artifact instead of reusing it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from prefect.cache_policies import NO_CACHE, CachePolicy


@dataclass
class DigestCachePolicy(CachePolicy):
    """Cache key = sha256 of ``version`` and the named inputs (JSON-encoded, sorted).

    Example:
        >>> policy = DigestCachePolicy(version="admit-v1", inputs=("dataset_sha256", "student_digest"))
    """

    version: str = "v1"
    inputs: tuple[str, ...] = field(default_factory=tuple)

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str | None:
        missing = [name for name in self.inputs if name not in inputs]
        if missing:
            raise KeyError(f"cache key inputs missing: {missing}")
        payload = {"version": self.version, **{name: _plain(inputs[name]) for name in self.inputs}}
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        return f"{self.version}-{digest}"


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def cache_options(policy: DigestCachePolicy, storage_root: str, refresh: bool = False) -> dict[str, Any]:
    """Task options that keep a cached task's records and their results together under a local storage root
    (no Prefect cache for any other root).

    A cache record names its result by absolute path. Kept under the storage root, both outlive a change of
    ``PREFECT_HOME`` (another user, a fresh container, a test harness), and both go when the root goes.

    Example:
        >>> cache_options(DigestCachePolicy(version="v1"), "./kiln-data")["result_storage"]  # doctest: +SKIP
        PosixPath('/abs/kiln-data/prefect/results')
    """
    from pathlib import Path

    from kiln_core.storage import resolve

    location = resolve(storage_root)
    if not location.is_local:
        return {"cache_policy": NO_CACHE, "persist_result": False}
    return {"refresh_cache": refresh,
            "cache_policy": policy.configure(key_storage=f"{location.path}/prefect/cache-keys"),
            "result_storage": Path(location.path) / "prefect" / "results"}  # a local file system there


def run_cached(task, arguments: dict[str, Any], *, storage_root: str, refresh: bool = False,
               recompute: dict[str, Any] | None = None):
    """Run a ``DigestCachePolicy`` task with ``cache_options``; a ``Cached`` result is reused only when its
    artifact is still on storage with the recorded digest (``stale_reason``), else the task runs again
    with ``recompute`` added to its arguments and its record overwritten.

    Returns:
        ``(result, state)``: the task's result and the final state (``Cached`` when the record was reused).

    Raises:
        Whatever the task raises (a rejection, a storage failure).
    """
    from prefect import get_run_logger

    from kiln_core.engine.stages import stale_reason

    configured = task.with_options(**cache_options(task.cache_policy, storage_root, refresh))
    state = configured(**arguments, return_state=True)
    result = state.result()  # re-raises the task's rejection or failure
    if state.name != "Cached":
        return result, state
    problem = stale_reason(result)
    if problem is None:
        return result, state
    get_run_logger().warning("%s: the cached result is stale (%s); running it again", task.name, problem)
    state = configured.with_options(refresh_cache=True)(**arguments, **(recompute or {}), return_state=True)
    return state.result(), state
