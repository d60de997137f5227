"""Task-run names are short: the stage and a digest prefix or a file name, never a 64-hex digest or an
absolute path (issue 19: the UI's task list and every log line carried both)."""

from __future__ import annotations

import pytest

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize("task_path, parameters, expected", [
    ("tasks.admit:fingerprint_inputs", {"corpus_uri": "/home/someone/data/deep/teacher-scored.jsonl"},
     "fingerprint-teacher-scored.jsonl"),
    ("tasks.admit:admit_task", {"dataset_sha256": DIGEST}, "admit-0123456789ab"),
    ("tasks.score:score_task", {"examples_uri": "s3://bucket/prefix/examples.jsonl"}, "score-examples.jsonl"),
    ("flows.validate_corpus:admission_verdict", {"corpus": "/abs/path/corpus.jsonl"}, "admit-only-corpus.jsonl"),
])
def test_task_run_names_are_short(task_path, parameters, expected):
    import importlib

    from prefect._internal.engine import resolve_custom_task_run_name

    module, name = task_path.split(":")
    task = getattr(importlib.import_module(module), name)
    resolved = resolve_custom_task_run_name(task, parameters)
    assert resolved == expected and "/" not in resolved and len(resolved) < 40


def test_the_materialize_name_takes_the_corpus_digest_prefix():
    from prefect._internal.engine import resolve_custom_task_run_name

    from kiln_core.contracts.stage_refs import CorpusRef
    from tasks.materialize import materialize_task

    corpus = CorpusRef(uri="/r/corpora/x", dataset_sha256=DIGEST, source_uri="/c.jsonl", examples=4, action_tokens=400,
                       env_tokens=0, effective_top_k=16, teacher_identity_revision=None)
    assert resolve_custom_task_run_name(materialize_task, {"corpus": corpus}) == "materialize-0123456789ab"
