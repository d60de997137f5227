"""Reading an admitted set of shards the way training does (``kiln_core.corpus_set``), and the pipeline
stages around it: the set's fingerprint, the verification of its materializations, the held-out overlap
rule over every shard. Nothing here trains; training on sets is in test_shard_training.py.

One synthesized 7-example corpus for the tiny student is cut into shards of 3, 1 and 3 examples.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import numpy as np
import pytest

from kiln_core.admission import admit_corpus
from kiln_core.admission.shards import admit_shard_set, build_index
from kiln_core.contracts.corpus_shards import set_sha256
from kiln_core.corpus_set import ShardedCorpus, ShardLayout, combined_revision
from kiln_core.synthetic import synthesize_corpus
from shard_support import write_file, write_set

CUTS = (3, 1, 3)


@pytest.fixture(scope="module")
def corpus_lines(tiny_student, tmp_path_factory) -> list[str]:
    path = synthesize_corpus(tiny_student, tmp_path_factory.mktemp("whole") / "whole.jsonl", n_examples=sum(CUTS),
                             top_k=16, seed=21)
    return path.read_text(encoding="utf-8").splitlines()


@pytest.fixture
def admitted(tiny_student, corpus_lines, tmp_path):
    """(the set on disk, its admission result, the single file's tables)."""
    directory = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    result = admit_shard_set(str(directory), str(tiny_student), top_k=16, out_root=str(tmp_path / "root"))
    whole = admit_corpus(str(write_file(tmp_path / "whole.jsonl", corpus_lines)), str(tiny_student), top_k=16)
    return directory, result, whole.tables


# --- the layout: set index -> shard and row, candidates -> cursor ------------------------------------------


def test_layout_locates_every_example_and_cursor_follows_the_flat_candidate_order():
    layout = ShardLayout("sha256:set", ("sha256:a", "sha256:b", "sha256:c"), (0, 3, 4, 7))
    # naive reference: the flat list of (shard, row) in set order
    flat = [(shard, row) for shard, count in enumerate(CUTS) for row in range(count)]
    assert [layout.locate(i) for i in range(7)] == flat
    for samples in (1, 2, 3):
        order = [(epoch, *flat[i], sample) for epoch in range(2) for i in range(7) for sample in range(samples)]
        for candidate, (epoch, shard, row, sample) in enumerate(order):
            cursor = layout.cursor(candidate, samples_per_prompt=samples)
            assert (cursor.epoch, cursor.shard, cursor.row, cursor.sample) == (epoch, shard, row, sample)
            assert cursor.shard_sha256 == layout.shard_sha256[shard] and cursor.set_sha256 == "sha256:set"
        end = layout.cursor(len(order), samples_per_prompt=samples)  # one past the last: the next epoch's start
        assert (end.epoch, end.shard, end.row, end.sample) == (2, 0, 0, 0)
    with pytest.raises(IndexError):
        layout.locate(7)


def test_combined_revision_is_a_single_shards_own_and_order_sensitive_for_several():
    assert combined_revision(["sha256:aa"]) == "sha256:aa"
    forward, backward = combined_revision(["sha256:aa", "sha256:bb"]), combined_revision(["sha256:bb", "sha256:aa"])
    expected = hashlib.sha256(b"kiln-flows.corpus-set-revision.v1\nsha256:aa\nsha256:bb\n").hexdigest()
    assert forward == "sha256:" + expected and backward != forward


# --- the corpus: examples as the single file's, one shard in memory ------------------------------------------


def test_a_sharded_corpus_gives_the_single_files_examples_in_order(admitted):
    _, result, whole = admitted
    corpus = ShardedCorpus.open(result.record_uri)
    assert (corpus.num_examples, corpus.top_k, corpus.shard_count) == (7, 16, 3)
    assert corpus.kiln_prompts_sha256 is None
    for i, (ours, reference) in enumerate(itertools.zip_longest(corpus, whole)):
        assert ours.index == i
        for field in ("input_ids", "action_positions", "env_positions", "env_in_warning_prefix", "teacher_ids",
                      "teacher_logprobs"):
            assert np.array_equal(getattr(ours, field), getattr(reference, field)), (i, field)
        assert ours.observation_tokens == reference.observation_tokens
    # the line is the example's line in its own shard: shard 1's only example is its line 2
    assert corpus.example(3).line == 2 and corpus.example(4).line == 2


def test_reading_the_set_in_order_reads_each_shard_once_and_holds_one(admitted, monkeypatch):
    import kiln_core.materialize as materialize

    _, result, _ = admitted
    reads: list[str] = []
    real = materialize._read_tables
    monkeypatch.setattr(materialize, "_read_tables", lambda location, record: reads.append(record.dataset_sha256)
                        or real(location, record))
    corpus = ShardedCorpus.open(result.record_uri)
    held = []
    for i in range(corpus.num_examples):
        corpus.example(i)
        held.append(corpus._loaded[0])
    assert reads == [shard.dataset_sha256 for shard in result.shards]
    assert held == [0, 0, 0, 1, 2, 2, 2]


def test_a_damaged_shard_materialization_is_refused_when_read_and_at_verify(admitted):
    from kiln_core.engine.stages import MaterializationMismatch, set_ref, verify
    from kiln_core.contracts.stage_refs import InputsRef

    _, result, _ = admitted
    inputs = InputsRef(corpus_uri="corpus", dataset_sha256=result.set_sha256, student_dir="s", student_digest="d",
                       effective_top_k=16)
    ref = set_ref(result, inputs)
    assert verify(ref).examples == 7 and ref.kind == "shard_set"
    damaged = Path(result.shards[2].materialized) / "targets.parquet"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match admission.json"):
        ShardedCorpus.open(result.record_uri).shard(2)
    with pytest.raises(MaterializationMismatch) as refused:
        verify(ref)
    assert refused.value.code == "materialization_mismatch" and refused.value.file == result.record_uri


def test_a_set_that_changed_since_it_was_fingerprinted_is_corpus_changed(admitted, tiny_student):
    from kiln_core.contracts.stage_refs import InputsRef
    from kiln_core.engine.stages import set_ref
    from kiln_core.errors import EnvironmentFailure

    _, result, _ = admitted
    inputs = InputsRef(corpus_uri="corpus", dataset_sha256="sha256:" + "0" * 64, student_dir="s", student_digest="d",
                       effective_top_k=16)
    with pytest.raises(EnvironmentFailure) as failed:
        set_ref(result, inputs)
    assert failed.value.code == "corpus_changed"


# --- the stages before training --------------------------------------------------------------------------------


def test_fingerprint_of_a_set_is_its_set_digest_for_a_directory_and_an_index(tiny_student, corpus_lines, tmp_path):
    from kiln_core.engine.stages import fingerprint

    directory = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    index = directory / "corpus.index.json"
    build_index(str(index), [f"part-{n:02d}.jsonl" for n in range(3)])
    expected = set_sha256(["sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.jsonl"))])
    assert fingerprint(str(directory), str(tiny_student), 16).dataset_sha256 == expected
    assert fingerprint(str(index), str(tiny_student), 16).dataset_sha256 == expected


def test_fingerprint_refuses_an_index_whose_shard_is_missing_or_changed(tiny_student, corpus_lines, tmp_path):
    from kiln_core.engine.stages import fingerprint
    from kiln_core.errors import AdmissionError

    directory = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    index = directory / "corpus.index.json"
    build_index(str(index), [f"part-{n:02d}.jsonl" for n in range(3)])
    (directory / "part-02.jsonl").write_text((directory / "part-02.jsonl").read_text() + "\n")
    with pytest.raises(AdmissionError) as changed:
        fingerprint(str(index), str(tiny_student), 16)
    assert changed.value.code == "shard_digest_mismatch" and changed.value.file == "part-02.jsonl"
    (directory / "part-01.jsonl").unlink()
    with pytest.raises(AdmissionError) as missing:
        fingerprint(str(index), str(tiny_student), 16)
    assert missing.value.code == "shard_missing" and missing.value.file == "part-01.jsonl"


def test_a_held_out_corpus_sharing_a_prompt_with_any_shard_is_refused_naming_the_shard(tiny_student, corpus_lines,
                                                                                         tmp_path):
    from kiln_core.evaluation.corpus import check_no_overlap
    from kiln_core.evaluation.models import EvalInputError

    directory = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    held_out = write_file(tmp_path / "held-out.jsonl", [corpus_lines[0], corpus_lines[6]])  # shard 2's 2nd example
    with pytest.raises(EvalInputError) as refused:
        check_no_overlap(str(held_out), str(directory))
    assert refused.value.code == "eval_train_overlap"
    assert "line 3 of shard part-02.jsonl of the training set" in str(refused.value)
    fresh = synthesize_corpus(tiny_student, tmp_path / "fresh.jsonl", n_examples=2, top_k=16, seed=99)
    check_no_overlap(str(fresh), str(directory))  # no shared prompt: accepted
