"""Scoring as a pipeline stage: unscored examples + a local teacher → a teacher-scored corpus.

The output location is derived from what decides its bytes (``kiln_core.engine.stages.scored_location``),
so re-running on unchanged inputs reuses the scored corpus instead of running the teacher again. The
task's cache is a hint (``tasks.cache.run_cached``): a cached ``ScoredRef`` is reused only while its file
(or set of shards) is there with the recorded digest; otherwise the teacher scores again (``replace``).
"""

from __future__ import annotations

from prefect import task

from kiln_core.contracts.stage_refs import ScoredRef
from tasks.cache import DigestCachePolicy
from tasks.names import run_name
from tasks.retry import retry_unless_rejected


# v3: results are kiln_core.contracts.stage_refs.ScoredRef (it was kiln_core.engine.refs)
SCORE_CACHE = DigestCachePolicy(version="kiln-flows-score-v3", inputs=("out_uri", "shard_size"))


@task(name="score", task_run_name=run_name("score", "examples_uri"), cache_policy=SCORE_CACHE, persist_result=True, result_serializer="json", retries=1, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_rejected)
def score_task(examples_uri: str, out_uri: str, teacher_dir: str | None, teacher_alias: str | None,
               registry_root: str, student_dir: str, top_k: int, shard_size: int | str | None = None,
               replace: bool = False) -> ScoredRef:
    """Score examples with a local teacher into a corpus that ``admit`` accepts by construction.

    With ``shard_size`` the corpus is a set of shards in the directory ``out_uri``; the ref names its index.
    ``replace``: score again over a file already at ``out_uri`` (its bytes are not the ones recorded).

    Example:
        ```python
        scored = score_task("examples.jsonl", out_uri, "./teacher", None, "./kiln-data", "./student", 32)
        ```
    """
    from kiln_core.engine.stages import score

    return score(examples_uri, out_uri, teacher_dir=teacher_dir, teacher_alias=teacher_alias,
                 registry_root=registry_root, student_dir=student_dir, top_k=top_k, shard_size=shard_size,
                 replace=replace)
