"""Scoring a set of shards on a Ray cluster: one ``score-shard`` task per unfinished shard, on prefect-ray.

``score_corpus(..., shard_size=S, ray_address=A)`` plans the set here (``kiln_core.scoring.shard_jobs``),
submits a task for each shard an earlier run did not finish to ``prefect_ray.RayTaskRunner``, and writes
``index.json`` here once all are done. Each task loads the student and the local teacher in its Ray worker
and scores its shard with the same engine call as the one-task path (``score_planned_shard``), so the
shards, their records and the index are the bytes that path writes, and a rerun resumes the same way.

A shard that repeats rows of an earlier shard is submitted once that shard is committed (it copies those
rows' bytes from it). A shard's rejection keeps its code and place; a failure of Ray itself is
``ray_task_failed`` (exit 3). After the first failure no further shard is started; the ones running finish
(their shards stay committed for the rerun) and the first failure in shard order is raised.
"""

from __future__ import annotations

import os
import socket

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import TaskRunner

from kiln_core.contracts.scored_set import ScoreSetResult
from kiln_core.scoring.shard_jobs import ScoringShardJob, open_scoring_set, score_shard_job
from tasks.names import run_name


# No Prefect cache: a finished shard is found by its completion record (resume), and a cache key would
# hash the job's storage options, credentials included.
@task(name="score-shard", task_run_name=run_name("score-shard", "job", "name"), cache_policy=NO_CACHE)
def score_shard_task(job: ScoringShardJob):
    """Score one shard in this (worker) process; returns the finished shard and ``host:pid`` of the worker."""
    return score_shard_job(job), f"{socket.gethostname()}:{os.getpid()}"


def score_set_with_tasks(examples_uri: str, *, task_runner: TaskRunner, **scoring) -> tuple[ScoreSetResult, list[str]]:
    """Score a set of shards with one ``score-shard`` task per unfinished shard on ``task_runner``.

    Args:
        examples_uri: The unscored examples (a path or URI every worker reads).
        task_runner: A started task runner (prefect-ray's, inside ``ray_session``).
        **scoring: ``open_scoring_set``'s options (student, teacher, ``top_k``, ``out_uri``, ``shard_size``, ...).

    Returns:
        The set as ``score_examples`` returns it, and the ``host:pid`` of each worker that scored a shard.

    Raises:
        ScoringError: The first shard's rejection in shard order, or a refused input before any task.
        RayFailure: ``ray_task_failed`` when Ray lost a shard's task.
    """
    from kiln_core.scoring.shards import finish_shard_set
    from tasks.ray_fan_out import runner_failure

    run, jobs = open_scoring_set(examples_uri, **scoring)
    waiting = list(jobs)
    running = {}
    failures: dict[int, BaseException] = {}
    workers = []
    while waiting or running:
        if not failures:
            ready = [job for job in waiting if job.after.issubset(run.done)]
            for job in ready:
                waiting.remove(job)
                running[task_runner.submit(score_shard_task, {"job": job})] = job  # what Task.submit does in a flow
        if not running:
            break  # a failure stopped the rest
        future = next(as_completed(list(running)))
        job = running.pop(future)
        try:
            done, worker = future.result()
        except Exception as error:  # noqa: BLE001 - the first one in shard order is raised below
            failures[job.shard.number] = runner_failure(error, job.name, doing="scoring")
            continue
        run.finish(done)
        workers.append(worker)
    if failures:
        raise failures[min(failures)]
    return finish_shard_set(run), workers
