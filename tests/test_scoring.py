"""Scoring with a local teacher: what ``score`` writes, ``admit`` admits, and the rows are the teacher's."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from student_variants import ASSISTANT_FIRST, student_variant

from kiln_core.admission import admit_corpus
from kiln_core.scoring import ScoringError, score_examples

TOP_K = 16

EXAMPLES = [
    {"id": "single", "messages": [{"role": "user", "content": "What is two plus two?"}],
     "teacher_response": "Two plus two is four."},
    {"id": "multi-turn", "metadata": {"source": "test", "tags": [1, 2.5]},
     "messages": [
         {"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "Paris."},
         {"role": "user", "content": [{"type": "text", "text": "And two plus two?"}]},
     ],
     "teacher_response": "four"},
    {"id": "trajectory", "messages": [{"role": "user", "content": "List files under src/."}],
     "teacher_response": "done",
     "trajectory": [
         {"role": "assistant", "content": 'Tool call: read_file(path="src/main.rs")', "kind": "action"},
         {"role": "tool", "content": "warning: deprecated API. fn main() {}", "kind": "observation",
          "warning_prefix_len": 9},
         {"role": "assistant", "content": "done: src/main.rs", "kind": "action"},
     ]},
    {"id": "json", "messages": [{"role": "user", "content": "List files under src/ as JSON."}],
     "teacher_response": '{"directory":"src","recursive":true}'},
    {"messages": [{"role": "user", "content": "Translate to French: good morning"}], "teacher_response": "bonjour"},
    # An exact duplicate of the first example in a later batch: its rows must be reused bit for bit.
    {"id": "single", "messages": [{"role": "user", "content": "What is two plus two?"}],
     "teacher_response": "Two plus two is four."},
]


def write_jsonl(path, records, *, blank_lines: bool = False):
    lines = [json.dumps(record) for record in records]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n", encoding="utf-8")
    return path


def read_rows(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[0], [json.loads(line) for line in lines[1:]]


@pytest.fixture(scope="module")
def examples_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("examples") / "examples.jsonl", EXAMPLES, blank_lines=True)


@pytest.fixture(scope="module")
def scored(tmp_path_factory, examples_file, tiny_teacher, tiny_student):
    out = tmp_path_factory.mktemp("scored") / "corpus.jsonl"
    progress = []
    result = score_examples(
        str(examples_file), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student), top_k=TOP_K,
        out_uri=str(out), batch_size=4, device="cpu", on_progress=lambda done, total: progress.append((done, total)),
    )
    return result, out, progress


@pytest.fixture(scope="module")
def teacher_model(tiny_teacher):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_teacher), dtype=torch.float32, attn_implementation="eager").eval()


def test_scored_corpus_is_admitted(scored, tiny_student, tiny_teacher):
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity

    result, out, progress = scored
    manifest, rows = read_rows(out)
    assert manifest == result.manifest_line
    assert manifest == build_manifest_line(local_teacher_identity(tiny_teacher, max_top_k=32, device_kind="cpu"))
    assert result.examples == len(EXAMPLES) and result.reused_rows == 1
    assert progress == [(4, 6), (6, 6)]
    assert result.sha256 == "sha256:" + __import__("hashlib").sha256(out.read_bytes()).hexdigest()

    admitted = admit_corpus(str(out), str(tiny_student), top_k=TOP_K, pinned_manifest=manifest)
    assert admitted.examples == len(EXAMPLES)
    assert admitted.action_tokens == result.action_tokens == sum(len(row["teacher_tokens"]) for row in rows)
    assert admitted.env_tokens > 0  # the trajectory's observation segment
    assert admitted.dataset_sha256 == result.sha256
    # Input fields are copied as given, in order, then teacher_tokens.
    assert list(rows[1]) == ["id", "messages", "teacher_response", "metadata", "teacher_tokens"]
    assert rows[1]["messages"] == EXAMPLES[1]["messages"] and rows[1]["metadata"] == EXAMPLES[1]["metadata"]
    assert "id" not in rows[4]
    assert rows[5]["teacher_tokens"] == rows[0]["teacher_tokens"]


def test_rows_are_the_teachers_full_vocab_log_softmax(scored, tiny_student, teacher_model):
    import torch

    from kiln_core.scoring.examples import iter_examples
    from kiln_core.tokenization import encode_conversations, load_student_tokenizer

    _, out, _ = scored
    _, rows = read_rows(out)
    student = load_student_tokenizer(tiny_student)
    examples = list(iter_examples(str(out)))
    encoded = encode_conversations(student, [example.conversation for example in examples])
    for row, enc in zip(rows[:3], encoded[:3]):
        ids = torch.tensor(enc.input_ids[None].astype(np.int64))
        with torch.no_grad():
            logits = teacher_model(ids).logits[0]
        positions = enc.action_positions.tolist()
        assert len(row["teacher_tokens"]) == len(positions)
        for token, q in list(zip(row["teacher_tokens"], positions))[:: max(1, len(positions) // 4)]:
            assert token["token_id"] == int(enc.input_ids[q])
            assert token["top_logprobs"][0]["token_id"] == int(logits[q - 1].argmax())
            expected = torch.log_softmax(logits[q - 1].float(), dim=-1)
            assert token["logprob"] == pytest.approx(float(expected[token["token_id"]]), abs=1e-5)
            assert token["token"] == student.tokenizer.decode([token["token_id"]])
            top = token["top_logprobs"]
            assert len(top) == TOP_K and len({c["token_id"] for c in top}) == TOP_K
            values = [c["logprob"] for c in top]
            assert values == sorted(values, reverse=True)
            assert all(float(np.float32(v)) == v for v in values + [token["logprob"]])  # exact f32 in JSON
            assert np.exp(np.asarray(values, np.float64)).sum() <= 1 + 32 * np.finfo(np.float32).eps


def test_batched_equals_unbatched(tiny_teacher, tiny_student):
    from kiln_core.scoring import _encode
    from kiln_core.scoring.examples import ScoringExample, _example
    from kiln_core.scoring.local import LocalTeacher
    from kiln_core.tokenization import load_student_tokenizer

    student = load_student_tokenizer(tiny_student)
    batch = [_example(record, i + 1) for i, record in enumerate(EXAMPLES[:5])]
    assert all(isinstance(example, ScoringExample) for example in batch)
    requests = _encode(student, batch, 2048)
    assert len({int(r.input_ids.shape[0]) for r in requests}) > 1  # padding really happens
    for attn in ("eager", "sdpa"):
        teacher = LocalTeacher.load(str(tiny_teacher), vocab_size=400, attn_implementation=attn, device="cpu")
        together = teacher.score(requests, TOP_K)
        for request, batched_rows in zip(requests, together):
            alone = teacher.score([request], TOP_K)[0]
            np.testing.assert_array_equal(alone.target_ids, batched_rows.target_ids)
            np.testing.assert_allclose(alone.target_logprobs, batched_rows.target_logprobs, atol=1e-5)
            np.testing.assert_array_equal(alone.top_ids, batched_rows.top_ids)
            np.testing.assert_allclose(alone.top_logprobs, batched_rows.top_logprobs, atol=1e-5)


def test_top_k_ties_rank_lower_ids_first():
    import torch

    from kiln_core.scoring.local import top_k_sorted

    row = torch.tensor([[-2.0, -1.0, -3.0, -1.0, -1.0, -0.5]])
    ids, values = top_k_sorted(row, 3)
    assert ids.tolist() == [[5, 1, 3]] and values.tolist() == [[-0.5, -1.0, -1.0]]
    ids, _ = top_k_sorted(torch.zeros((2, 8)), 4)
    assert ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Any attempt to load teacher weights fails the test."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("teacher weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_teacher_with_another_vocabulary_is_refused_before_loading(tmp_path, examples_file, tiny_student, no_weight_loading):
    from kiln_core.tiny_models import build_tiny_model

    other = build_tiny_model(tmp_path / "other-teacher", seed=3, hidden_size=32, num_layers=1, tokenizer_vocab_size=320)
    out = tmp_path / "corpus.jsonl"
    with pytest.raises(ScoringError) as caught:
        score_examples(str(examples_file), teacher_dir=str(other), student_dir=str(tiny_student), top_k=TOP_K,
                       out_uri=str(out), device="cpu")
    assert caught.value.code == "teacher_mismatch"
    assert "tokenizer_vocab_sha256" in caught.value.message
    assert not out.exists()


def test_teacher_with_another_logit_width_is_refused_before_loading(tmp_path, examples_file, tiny_teacher, tiny_student, no_weight_loading):
    wide = tmp_path / "wide-teacher"
    shutil.copytree(tiny_teacher, wide)
    config = json.loads((wide / "config.json").read_text())
    config["vocab_size"] = 512
    (wide / "config.json").write_text(json.dumps(config))
    with pytest.raises(ScoringError) as caught:
        score_examples(str(examples_file), teacher_dir=str(wide), student_dir=str(tiny_student), top_k=TOP_K,
                       out_uri=str(tmp_path / "corpus.jsonl"), device="cpu")
    assert caught.value.code == "teacher_mismatch" and "vocab_size" in caught.value.message


def test_bad_example_line_is_named_before_loading(tmp_path, tiny_teacher, tiny_student, no_weight_loading):
    path = tmp_path / "examples.jsonl"
    path.write_text(json.dumps(EXAMPLES[0]) + "\n\n" + json.dumps({"messages": [], "teacher_response": "x"}) + "\n")
    with pytest.raises(ScoringError) as caught:
        score_examples(str(path), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student), top_k=TOP_K,
                       out_uri=str(tmp_path / "corpus.jsonl"), device="cpu")
    assert caught.value.code == "invalid_example" and caught.value.line == 3
    assert "`messages` must not be empty" in str(caught.value)
    path.write_text('{"messages": [{"role": "user", "content": "hi"}], "teacher_response": 3}\n')
    with pytest.raises(ScoringError, match=r"line 1: `teacher_response` must be a string"):
        score_examples(str(path), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student), top_k=TOP_K,
                       out_uri=str(tmp_path / "corpus.jsonl"), device="cpu")


def test_failure_midway_leaves_nothing_at_out(tmp_path, monkeypatch, examples_file, tiny_teacher, tiny_student):
    from kiln_core.scoring.local import LocalTeacher

    original = LocalTeacher.score
    calls = []

    def fail_on_second_batch(self, requests, top_k):
        calls.append(len(requests))
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return original(self, requests, top_k)

    monkeypatch.setattr(LocalTeacher, "score", fail_on_second_batch)
    out = tmp_path / "out" / "corpus.jsonl"
    with pytest.raises(RuntimeError, match="simulated crash"):
        score_examples(str(examples_file), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student),
                       top_k=TOP_K, out_uri=str(out), batch_size=2, device="cpu")
    assert calls == [2, 2]
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # no temp file left behind either


def test_alias_uses_the_registered_manifest(tmp_path, examples_file, tiny_teacher, tiny_student):
    from kiln_core.teachers.local_registry import register_local_teacher

    root = tmp_path / "root"
    entry = register_local_teacher(root, "tiny-teacher", tiny_teacher, device_kind="cpu")
    small = write_jsonl(tmp_path / "two.jsonl", EXAMPLES[:2])
    out = tmp_path / "corpus.jsonl"
    result = score_examples(str(small), teacher_alias="tiny-teacher", registry_root=str(root),
                            student_dir=str(tiny_student), top_k=TOP_K, out_uri=str(out), device="cpu")
    assert result.manifest_line == entry.off_policy_manifest == read_rows(out)[0]
    assert result.identity_revision == entry.identity_revision
    # Scoring options that differ from the registration's would not be the pinned identity.
    with pytest.raises(ScoringError) as caught:
        score_examples(str(small), teacher_alias="tiny-teacher", registry_root=str(root), student_dir=str(tiny_student),
                       top_k=TOP_K, out_uri=str(tmp_path / "other.jsonl"), device="cpu", dtype="bfloat16")
    assert caught.value.code == "teacher_changed" and "inference_config_sha256" in caught.value.message
    with pytest.raises(ScoringError) as caught:
        score_examples(str(small), teacher_alias="nope", registry_root=str(root), student_dir=str(tiny_student),
                       top_k=TOP_K, out_uri=str(tmp_path / "other.jsonl"))
    assert caught.value.code == "teacher_invalid" and "tiny-teacher" in caught.value.message


def test_remote_output_uri(tmp_path, tiny_teacher, tiny_student):
    import fsspec

    small = write_jsonl(tmp_path / "one.jsonl", EXAMPLES[:1])
    result = score_examples(str(small), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student), top_k=TOP_K,
                            out_uri="memory://scoring-test/corpus.jsonl", device="cpu")
    with fsspec.open("memory://scoring-test/corpus.jsonl", "rb") as handle:
        data = handle.read()
    assert result.out_uri == "memory://scoring-test/corpus.jsonl"
    assert data.decode().splitlines()[0] == result.manifest_line
    assert result.size_bytes == len(data)
    # A pinned manifest the local teacher does not match is refused before its weights load.
    other = result.manifest_line.replace('"max_model_len":2048', '"max_model_len":1024')
    assert other != result.manifest_line
    with pytest.raises(ScoringError) as caught:
        score_examples(str(small), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student), top_k=TOP_K,
                       out_uri="memory://scoring-test/other.jsonl", device="cpu", pinned_manifest=other)
    assert caught.value.code == "teacher_mismatch"


def test_cli_end_to_end(tmp_path, capsys, examples_file, tiny_teacher, tiny_student):
    from flows.cli import main

    out = tmp_path / "corpus.jsonl"
    code = main(["score", str(examples_file), "--teacher", str(tiny_teacher), "--student", str(tiny_student),
                 "--top-k", str(TOP_K), "--out", str(out), "--batch-size", "3", "--device", "cpu", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert result["examples"] == len(EXAMPLES) and result["out_uri"] == str(out)
    assert "scoring" in captured.err  # the progress bar
    assert main(["admit", str(out), "--student", str(tiny_student), "--top-k", str(TOP_K), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "admitted"

    code = main(["score", str(examples_file), "--teacher", "no-such-alias", "--registry", str(tmp_path / "root"),
                 "--student", str(tiny_student), "--top-k", str(TOP_K), "--out", str(tmp_path / "x.jsonl"), "--quiet"])
    captured = capsys.readouterr()
    assert code == 2 and "no-such-alias" in captured.err and captured.err.count("\n") == 1


CHATML_TOOL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_score_sizes_trajectories_by_kilns_builder(tmp_path, tiny_teacher, tiny_student):
    """A template without ``<tool_response>`` sends Kiln to its prefix re-tokenization fallback; the
    scorer picks the same targets, so the corpus admits with exactly those counts."""
    from kiln_core.tokenization import Conversation, Segment, encode_conversations, load_student_tokenizer

    student_dir = student_variant(tiny_student, tmp_path / "chatml-tool", template=CHATML_TOOL)
    student = load_student_tokenizer(student_dir)
    record = EXAMPLES[2]
    examples = write_jsonl(tmp_path / "examples.jsonl", [record])
    out = tmp_path / "corpus.jsonl"
    result = score_examples(str(examples), teacher_dir=str(tiny_teacher), student_dir=str(student_dir), top_k=TOP_K,
                            out_uri=str(out), device="cpu")
    segments = [Segment(s["role"], s["content"], s["kind"], None, s.get("warning_prefix_len", 0)) for s in record["trajectory"]]
    (expected,) = encode_conversations(student, [Conversation(record["messages"], record["teacher_response"], segments)])
    admitted = admit_corpus(str(out), str(student_dir), top_k=TOP_K, pinned_manifest=result.manifest_line)
    assert result.action_tokens == admitted.action_tokens == expected.action_positions.size
    np.testing.assert_array_equal(admitted.tables.example(0).action_positions, expected.action_positions)
    # whole token deltas, not the segments' content: the first action takes its <|im_end|> and more
    content_tokens = sum(len(student.tokenizer(s.content, add_special_tokens=False)["input_ids"])
                         for s in segments if s.kind == "action")
    assert expected.action_positions.size != content_tokens


def test_score_refuses_what_admission_would_refuse_at_its_line(tmp_path, tiny_teacher, tiny_student):
    student_dir = student_variant(tiny_student, tmp_path / "assistant-first", template=ASSISTANT_FIRST)
    examples = write_jsonl(tmp_path / "examples.jsonl", [EXAMPLES[0]], blank_lines=True)
    out = tmp_path / "corpus.jsonl"
    with pytest.raises(ScoringError) as caught:
        score_examples(str(examples), teacher_dir=str(tiny_teacher), student_dir=str(student_dir), top_k=TOP_K,
                       out_uri=str(out), device="cpu")
    assert (caught.value.code, caught.value.line) == ("target_at_position_zero", 1)
    assert not out.exists()


def test_deeply_nested_example_line_is_refused_before_loading(tmp_path, tiny_teacher, tiny_student, no_weight_loading):
    deep = dict(EXAMPLES[0], metadata="@@")
    path = tmp_path / "examples.jsonl"
    path.write_text(json.dumps(EXAMPLES[0]) + "\n" + json.dumps(deep).replace('"@@"', "[" * 200 + "]" * 200) + "\n")
    with pytest.raises(ScoringError) as caught:
        score_examples(str(path), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student), top_k=TOP_K,
                       out_uri=str(tmp_path / "corpus.jsonl"), device="cpu")
    assert (caught.value.code, caught.value.line) == ("nesting_too_deep", 2)
