"""``score_corpus``: score unscored examples with a local teacher into a Kiln-admissible corpus."""


import hashlib
from typing import Any

from prefect import flow

from tasks.cache import run_cached
from tasks.score import score_task


def _digest(uri: str) -> str:
    from kiln_core.storage import resolve

    return "sha256:" + hashlib.sha256(resolve(uri).read_bytes()).hexdigest()


def ray_options(ray_address: str, shard_size: int | None, examples: str, out: str):
    """The cluster a flow scores its shards on, refused before anything is read when it cannot be.

    Args:
        ray_address: ``local``, ``auto``, ``ray://host:port`` or ``host:port``.
        shard_size: The parsed shard size, or None.
        examples: The examples every worker reads.
        out: Where the workers write the shards (``out``, or the storage root it defaults under).

    Raises:
        ConfigError: ``invalid_ray_address`` (not one of the forms above), ``ray_needs_shard_size`` (one file
            is one task: there is nothing to fan out), ``unshared_storage`` (a cluster other than ``local``
            with the output or the examples on a local path, which its other nodes could not reach; or
            ``memory://`` anywhere: the rule shard admission and training apply).
    """
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.contracts.spec_blocks import RayOptions, check_ray_address
    from kiln_core.storage import is_local_uri

    try:
        check_ray_address(ray_address)
    except ValueError as error:
        raise ConfigError(str(error).replace("`distributed.address`", "ray_address"), "ray_address",
                          code="invalid_ray_address") from None
    if shard_size is None:
        raise ConfigError("scoring on Ray fans the shards out, one task per shard: give shard_size (--shard-size) "
                          "with ray_address (--ray)", "shard_size", code="ray_needs_shard_size")
    from kiln_core.training.distributed.ray_launcher import check_cluster_storage

    options = RayOptions(address=ray_address)
    check_cluster_storage(options, out)  # the workers write the shards there
    if not options.is_local and is_local_uri(examples):
        raise ConfigError(f"{examples} is a local path, but the Ray cluster at {ray_address} may run workers on "
                          "other machines: the examples must be on storage every node reads (s3://, gs://, ...)",
                          "examples", code="unshared_storage")
    return options


def _remote(uri: str | None) -> str | None:
    """An fsspec URI a Ray worker copies itself, or None for a local path (the same on every node)."""
    from kiln_core.storage import is_local_uri

    return uri if uri and not is_local_uri(uri) else None


def _score_on_ray(ray, examples, out_uri, student, student_dir, teacher_dir, teacher_alias, storage_root, top_k,
                  shard_size) -> dict[str, Any]:
    """One ``score-shard`` task per unfinished shard on the Ray cluster (``tasks.score_shards``)."""
    from prefect import get_run_logger

    from kiln_core.contracts.stage_refs import ScoredRef
    from kiln_core.storage import localize_directory
    from kiln_core.training.distributed.ray_launcher import ray_session
    from tasks.ray_fan_out import prefect_worker_env, ray_task_runner
    from tasks.score_shards import score_set_with_tasks

    runner = ray_task_runner(ray)  # prefect-ray missing: refused before Ray starts
    with ray_session(ray, 1, worker_env=prefect_worker_env(ray)), runner:
        result, workers = score_set_with_tasks(
            examples, task_runner=runner, student_dir=student_dir,
            teacher_dir=teacher_dir and localize_directory(teacher_dir),
            teacher_alias=teacher_alias, registry_root=storage_root, top_k=top_k, out_uri=out_uri,
            shard_size=shard_size, worker_student=_remote(student), worker_teacher=_remote(teacher_dir))
    get_run_logger().info("score: %d shards (%d finished by an earlier run) scored on Ray at %s by %d worker "
                          "process(es): %s; index %s", len(result.shards), result.resumed_shards, ray.address,
                          len(set(workers)), ", ".join(sorted(set(workers))), result.index_uri)
    return ScoredRef(uri=result.index_uri, sha256=result.set_sha256, examples=result.examples,
                     reused=result.resumed_shards == len(result.shards)).model_dump()


@flow(name="score-corpus", flow_run_name="score-{examples}")
def score_corpus(
    examples: str,
    student: str,
    teacher_dir: str | None = None,
    teacher_alias: str | None = None,
    storage_root: str = "./kiln-data",
    top_k: int = 32,
    out: str | None = None,
    shard_size: int | str | None = None,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Score examples with a local teacher (directory or registry alias).

    With ``shard_size`` the scored corpus is a set of shards of at most that size (``64MiB``, ``500KiB`` or
    bytes; at most 64 MiB) plus ``index.json`` in a directory; a rerun resumes it shard by shard, and the
    result's ``uri`` names the index (what ``kiln-flows admit`` and ``validate_corpus`` take).

    Args:
        examples: Unscored examples JSONL (messages, teacher_response, optional trajectory).
        student: Student model directory (its tokenizer and masks pick the targets).
        teacher_dir: Local Hugging Face teacher directory.
        teacher_alias: Or a teacher registered in ``<storage_root>/teachers.json``.
        storage_root: Root for the registry and, without ``out``, for the scored corpus.
        top_k: Candidates per target.
        out: Where to write the corpus (default: content-addressed under ``<root>/scored/``); with
            ``shard_size``, a directory.
        shard_size: Shard the output (see above); None writes one file.
        ray_address: Score the shards on a Ray cluster, one ``score-shard`` task per shard (prefect-ray):
            ``local`` (a Ray instance on this machine for the run), ``auto``, ``ray://host:10001`` or
            ``host:port``. Needs ``shard_size``; a cluster other than ``local`` needs ``out`` (or the
            storage root) and the examples on shared storage (``s3://``, ...). Every node needs kiln-flows,
            and the student and teacher at the same local paths, or as fsspec URIs each worker copies.
    """
    from kiln_core.contracts.pipeline import SpecError, TeacherSource
    from kiln_core.engine.stages import resolve_manifest, scored_location
    from kiln_core.scoring.shards import parse_shard_size
    from kiln_core.storage import localize_directory

    if (teacher_dir is None) == (teacher_alias is None):
        raise SpecError("give exactly one of teacher_dir or teacher_alias", "teacher_dir")
    if shard_size is not None:
        shard_size = parse_shard_size(shard_size)  # a bad size is refused before anything is read
    ray = ray_options(ray_address, shard_size, examples, out or storage_root) if ray_address is not None else None

    student_dir = localize_directory(student)
    source = TeacherSource(kind="local_registry", alias=teacher_alias) if teacher_alias else TeacherSource(kind="local_dir", path=teacher_dir)
    manifest = resolve_manifest(source, storage_root, max_top_k=max(32, top_k))
    out_uri = out or scored_location(storage_root, _digest(examples), manifest.identity_revision, student_dir, top_k,
                                     shard_size)
    if ray is not None:
        return _score_on_ray(ray, examples, out_uri, student, student_dir, teacher_dir, teacher_alias, storage_root,
                             top_k, shard_size)
    arguments = dict(examples_uri=examples, out_uri=out_uri, teacher_dir=teacher_dir, teacher_alias=teacher_alias,
                     registry_root=storage_root, student_dir=student_dir, top_k=top_k, shard_size=shard_size)
    scored, _ = run_cached(score_task, arguments, storage_root=storage_root, recompute={"replace": True})
    return scored.model_dump()
