"""Admission of a set of shards in a flow: one mapped ``admit-shard`` task per shard, a bounded number at once.

The same engine as ``kiln-flows admit DIRECTORY --workers N`` (``kiln_core.admission.shards``): each shard
is admitted exactly as a single file, then ``finish_shard_set`` applies the set's rules in set order, so
the verdict does not depend on which task finished first. A rejected shard is never retried; shards after
the first failing one are not started. The tasks run on the flow's task runner, or on one passed in
(``tasks.ray_fan_out``: prefect-ray's, on the run's Ray cluster).
"""

from __future__ import annotations

import dataclasses

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import TaskRunner

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
    """Admit one shard as the single file it is (materialized under its own digest when ``job.out_root``).

    The student directory may be an fsspec URI (a Ray worker on another node copies it once per node).
    """
    from kiln_core.admission.admit import load_admission_student
    from kiln_core.storage import localize_directory

    student_dir = localize_directory(job.student_dir, storage_options=job.storage_options)
    job = dataclasses.replace(job, student_dir=student_dir)
    return admit_shard(job, load_admission_student(student_dir))  # tasks share a process: no tokenizer cache


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
    task_runner: TaskRunner | None = None,
    worker_student: str | None = None,
) -> ShardSetResult:
    """Admit a set of shards from inside a flow, at most ``concurrency`` shard tasks at a time.

    Args:
        task_runner: A started task runner for the shard tasks (default: the flow run's own).
        worker_student: The student as the shard tasks should open it (an fsspec URI a remote worker can
            copy), when ``student_dir`` is this machine's local copy of it.

    Raises:
        AdmissionError: The first rule the set breaks, in set order.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    shards, jobs, student = plan_shard_set(uri, student_dir, top_k=top_k, pinned_manifest=pinned_manifest,
                                           kiln_strict=kiln_strict, out_root=out_root,
                                           storage_options=storage_options)
    if worker_student is not None:
        jobs = [dataclasses.replace(job, student_dir=worker_student) for job in jobs]
    outcomes: dict[int, ShardOutcome | BaseException] = {}
    waiting = list(jobs)
    running = {}
    first_failure = len(jobs)
    while waiting or running:
        while waiting and len(running) < concurrency and waiting[0].index < first_failure:
            job = waiting.pop(0)
            future = (admit_shard_task.submit(job) if task_runner is None
                      else task_runner.submit(admit_shard_task, {"job": job}))  # what Task.submit does in a flow
            running[future] = job.index
        if not running:
            break  # every shard left comes after a failing one
        future = next(as_completed(list(running)))
        index = running.pop(future)
        try:
            outcomes[index] = future.result()
        except Exception as error:  # noqa: BLE001 - reported in set order by finish_shard_set
            if task_runner is not None:  # a failure of the runner itself (Ray) is an environment failure
                from tasks.ray_fan_out import runner_failure

                error = runner_failure(error, jobs[index].name)
            outcomes[index] = error
            first_failure = min(first_failure, index)
    return finish_shard_set(shards, outcomes, student, out_root=out_root, storage_options=storage_options)
