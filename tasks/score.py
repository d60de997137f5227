"""Scoring as a pipeline stage: unscored examples + a local teacher → a teacher-scored corpus.

The output location is derived from what decides its bytes (the examples' digest, the teacher's
identity revision, the student's tokenizer and top-K), so re-running on unchanged inputs reuses the
scored corpus instead of running the teacher again.
"""

from __future__ import annotations

import hashlib

from prefect import task
from pydantic import BaseModel, ConfigDict

from tasks.cache import DigestCachePolicy


class ScoredRef(BaseModel):
    """A scored corpus and the digest of its bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    uri: str
    sha256: str
    examples: int
    reused: bool


def scored_location(storage_root: str, examples_sha256: str, identity_revision: str, student_dir: str, top_k: int) -> str:
    """``<root>/scored/<key>.jsonl`` for these inputs."""
    from kiln_core.storage import resolve
    from kiln_core.tokenization import load_student_tokenizer

    identity = load_student_tokenizer(student_dir).identity()
    key_text = "|".join([examples_sha256, identity_revision, identity["tokenizer_vocab_sha256"],
                         identity["chat_template_sha256"], str(top_k)])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:24]
    return resolve(storage_root).child("scored", f"{key}.jsonl").uri


def score(examples_uri: str, out_uri: str, *, teacher_dir: str | None, teacher_alias: str | None,
          registry_root: str, student_dir: str, top_k: int) -> ScoredRef:
    """Score unless ``out_uri`` already holds the scored corpus (plain function)."""
    from kiln_core.scoring import score_examples
    from kiln_core.storage import resolve

    out = resolve(out_uri)
    if out.exists():
        data = out.read_bytes()
        return ScoredRef(uri=out.uri, sha256="sha256:" + hashlib.sha256(data).hexdigest(),
                         examples=max(data.count(b"\n") - 1, 0), reused=True)
    result = score_examples(
        examples_uri,
        teacher_dir=teacher_dir if teacher_alias is None else None,
        teacher_alias=teacher_alias,
        registry_root=registry_root,
        student_dir=student_dir,
        top_k=top_k,
        out_uri=out.uri,
    )
    return ScoredRef(uri=result.out_uri, sha256=result.sha256, examples=result.examples, reused=False)


@task(name="score", task_run_name="score-{examples_uri}",
      cache_policy=DigestCachePolicy(version="kiln-flows-score-v1", inputs=("out_uri",)),
      persist_result=True, result_serializer="json", retries=1, retry_delay_seconds=5)
def score_task(examples_uri: str, out_uri: str, teacher_dir: str | None, teacher_alias: str | None,
               registry_root: str, student_dir: str, top_k: int) -> ScoredRef:
    """Score examples with a local teacher into a corpus that ``admit`` accepts by construction.

    Example:
        ```python
        scored = score_task("examples.jsonl", out_uri, "./teacher", None, "./kiln-data", "./student", 32)
        ```
    """
    return score(examples_uri, out_uri, teacher_dir=teacher_dir, teacher_alias=teacher_alias,
                 registry_root=registry_root, student_dir=student_dir, top_k=top_k)
