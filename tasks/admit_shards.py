"""Admission of a set of shards in a flow: one mapped ``admit-shard`` task per shard, a bounded number at once.

The same engine as ``kiln-flows admit DIRECTORY --workers N`` (``kiln_core.admission.shards``): each shard
is admitted exactly as a single file, then ``finish_shard_set`` applies the set's rules in set order, so
the verdict does not depend on which task finished first. A rejected shard is never retried; shards after
the first failing one are not started.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from kiln_core.admission.shards import (
    ShardJob,
    ShardOutcome,
    ShardSetResult,
    admit_shard,
    finish_shard_set,
    plan_shard_set,
)
from tasks.names import run_name


# No Prefect cache: a shard's materialization is content-addressed already (an unchanged shard is reused),
# and a cache key would hash the job's storage options, credentials included.
@task(name="admit-shard", task_run_name=run_name("admit-shard", "job", "name"), cache_policy=NO_CACHE)
def admit_shard_task(job: ShardJob) -> ShardOutcome:
    """Admit one shard as the single file it is (materialized under its own digest when ``job.out_root``)."""
    from kiln_core.admission.admit import load_admission_student

    return admit_shard(job, load_admission_student(job.student_dir))  # tasks share a process: no tokenizer cache


def admit_set_with_tasks(
    uri: str,
    student_dir: str,
    *,
    top_k: int = 32,
    pinned_manifest: str | None = None,
    kiln_strict: bool = False,
    out_root: str | None = None,
    storage_options: dict | None = None,
    concurrency: int = 4,
) -> ShardSetResult:
    """Admit a set of shards from inside a flow, at most ``concurrency`` shard tasks at a time.

    Raises:
        AdmissionError: The first rule the set breaks, in set order.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    shards, jobs, student = plan_shard_set(uri, student_dir, top_k=top_k, pinned_manifest=pinned_manifest,
                                           kiln_strict=kiln_strict, out_root=out_root,
                                           storage_options=storage_options)
    outcomes: dict[int, ShardOutcome | BaseException] = {}
    waiting = list(jobs)
    running = {}
    first_failure = len(jobs)
    while waiting or running:
        while waiting and len(running) < concurrency and waiting[0].index < first_failure:
            job = waiting.pop(0)
            running[admit_shard_task.submit(job)] = job.index
        if not running:
            break  # every shard left comes after a failing one
        future = next(as_completed(list(running)))
        index = running.pop(future)
        try:
            outcomes[index] = future.result()
        except Exception as error:  # noqa: BLE001 - reported in set order by finish_shard_set
            outcomes[index] = error
            first_failure = min(first_failure, index)
    return finish_shard_set(shards, outcomes, student, out_root=out_root, storage_options=storage_options)
