"""A set of shards scored one task per shard, each task in its own process (a flow's Ray workers).

``score_examples(..., shard_size=...)`` scores every shard in one process. A flow that fans the shards out
(``tasks.score_shards``) runs the same steps of ``kiln_core.scoring.shards`` split across processes:

1. here: ``open_scoring_set`` checks the inputs, binds the teacher (no weights load), plans the split,
   writes ``plan.json`` and finds the shards an earlier run finished; it returns one ``ScoringShardJob``
   per shard left;
2. on a worker: ``score_shard_job`` loads the student and the teacher there, checks the teacher is the
   one the plan was made for (its manifest line), and scores that one shard (``score_planned_shard``):
   the shard file and its completion record, the very bytes the one-process run writes;
3. here: ``run.finish`` for each shard scored, then ``finish_shard_set`` writes ``index.json``.

A shard that copies rows of an earlier shard (a repeated token sequence) reads them from that shard's
committed file, so it may start only once that shard is finished (``ScoringShardJob.after``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln_core.scoring.shard_plan import SetPlan, ShardPlan

__all__ = ["ScoringShardJob", "open_scoring_set", "score_shard_job"]


@dataclass(frozen=True)
class ScoringShardJob:
    """Everything a worker needs to score one shard of a planned set (sent to it by value).

    Attributes:
        shard: The shard to score.
        after: Numbers of the earlier shards it copies rows from (to be committed before it starts).
        plan: The whole split (the worker reads the sequence keys and where each was first scored).
        student_dir, teacher_dir: As the worker opens them: local paths every node has, or fsspec URIs
            each worker copies (``localize_directory``); or the teacher's alias in the registry under
            ``registry_root`` (which every node must then reach).
        manifest_line: The teacher's manifest the plan was made with; the worker's teacher must match it.
    """

    examples_uri: str
    out_uri: str
    shard: ShardPlan
    after: frozenset[int]
    plan: SetPlan
    student_dir: str
    teacher_dir: str | None
    teacher_alias: str | None
    registry_root: str | None
    manifest_line: str
    top_k: int
    shard_size: int
    batch_size: int
    storage_options: dict | None = None

    @property
    def name(self) -> str:
        return self.shard.name


def open_scoring_set(examples_uri: str, *, student_dir: str, teacher_dir: str | None = None,
                     teacher_alias: str | None = None, registry_root: str | None = None, top_k: int, out_uri: str,
                     shard_size: int | str, batch_size: int = 8, storage_options: dict | None = None,
                     worker_student: str | None = None, worker_teacher: str | None = None):
    """Check, plan and resume a sharded scoring run whose shards are scored elsewhere.

    Args:
        student_dir: The student on this machine (a local directory).
        teacher_dir, teacher_alias, registry_root: The local teacher, as ``score_examples`` takes it.
        worker_student, worker_teacher: The student and teacher directories as the workers open them
            (fsspec URIs they copy), when the local paths above are this machine's copies.

    Returns:
        ``(run, jobs)``: the run (``kiln_core.scoring.shards``; ``run.finish`` each scored shard, then
        ``finish_shard_set(run)``), and one job per shard left to score, in set order.

    Raises:
        ScoringError: what ``score_examples`` refuses before scoring (options, examples, teacher, the
            directory), with the same codes.
    """
    from kiln_core.scoring import _check_options, _open_inputs
    from kiln_core.scoring.shards import open_shard_set, shard_dependencies

    _check_options(top_k, batch_size, None, "eager", None, teacher_dir, teacher_alias, None)
    shard_size, _, student, binding, _ = _open_inputs(
        examples_uri, student_dir, top_k, out_uri=out_uri, shard_size=shard_size, storage_options=storage_options,
        **_teacher_options(teacher_dir, teacher_alias, registry_root, None, batch_size))
    run = open_shard_set(examples_uri, student=student, binding=binding, top_k=top_k, out_uri=out_uri,
                         shard_size=shard_size, batch_size=batch_size, storage_options=storage_options)
    job = ScoringShardJob(examples_uri=examples_uri, out_uri=run.out.uri, shard=run.plan.shards[0], after=frozenset(),
                          plan=run.plan, student_dir=worker_student or student_dir,
                          teacher_dir=worker_teacher or teacher_dir, teacher_alias=teacher_alias,
                          registry_root=registry_root, manifest_line=binding.manifest_line, top_k=top_k,
                          shard_size=shard_size, batch_size=batch_size, storage_options=storage_options)
    jobs = [replace(job, shard=shard, after=frozenset(shard_dependencies(run.plan, shard))) for shard in run.todo()]
    return run, jobs


def score_shard_job(job: ScoringShardJob):
    """Score ``job``'s shard in this process: the worker's side of ``open_scoring_set``.

    Returns:
        The finished shard, for ``run.finish`` of the run that planned it.

    Raises:
        ScoringError: ``teacher_mismatch`` when this node's teacher is not the one the set was planned with,
            ``scored_set_mismatch`` when a shard it copies rows from is not committed, or any scoring code.
    """
    from kiln_core.scoring import _load_student
    from kiln_core.scoring.shards import score_planned_shard
    from kiln_core.storage import localize_directory

    student = _load_student(localize_directory(job.student_dir, storage_options=job.storage_options))
    teacher_dir = job.teacher_dir and localize_directory(job.teacher_dir, storage_options=job.storage_options)
    from kiln_core.scoring import _bind_teacher

    binding, load_scorer = _bind_teacher(student, job.top_k, **_teacher_options(
        teacher_dir, job.teacher_alias, job.registry_root, job.manifest_line, job.batch_size))
    scorer = load_scorer()
    try:
        return score_planned_shard(job.examples_uri, job.shard, plan=job.plan, student=student, binding=binding,
                                   scorer=scorer, top_k=job.top_k, out_uri=job.out_uri, shard_size=job.shard_size,
                                   batch_size=job.batch_size, storage_options=job.storage_options)
    finally:
        if hasattr(scorer, "close"):
            scorer.close()


def _teacher_options(teacher_dir, teacher_alias, registry_root, pinned_manifest, batch_size) -> dict:
    """``_bind_teacher``'s keywords for the local teacher as ``score_examples`` binds it by default (default
    dtype and device, eager attention), on the planning side and on every worker alike."""
    return dict(teacher_dir=teacher_dir, teacher_alias=teacher_alias, registry_root=registry_root, dtype=None,
                attn_implementation="eager", vllm_url=None, served_model=None, pinned_manifest=pinned_manifest,
                device=None, batch_size=batch_size)
