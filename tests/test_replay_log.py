"""``replay.jsonl`` beside every adapter a run trains, and Kiln's reader of it (what ``distill merge`` reads).

What a user depends on: every successful run (off-policy corpus, set of shards, on-policy prompts) leaves
``<run>/adapter/replay.jsonl`` with one ``{"prompts":[{"messages":[...]}]}`` line per training example, in
training-file order (a corpus row: its messages plus its ``teacher_response`` as the assistant's turn), and
``read_replay_prompts`` reads it, or a Kiln adapter's own log, under Kiln's rules and messages.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kiln_core.contracts.stage_refs import CorpusRef, TrainRef
from kiln_core.engine.replay_log import corpus_row_messages, replay_line, write_replay_log
from kiln_core.errors import EnvironmentFailure
from kiln_core.teachers.replay import ReplayLogError, read_replay_prompts
from test_on_policy_cli import root  # noqa: F401  (the storage root with the tiny teacher registered)
from test_shard_training import corpus_lines  # noqa: F401  (a synthesized corpus for the tiny student)

MANIFEST = json.dumps({"schema": "kiln.off-policy-distillation-manifest.v1", "teacher_identity": {}})
ROWS = [
    {"messages": [{"role": "user", "content": "What is two plus two?"}], "teacher_response": "Four.",
     "teacher_tokens": [], "metadata": {"x": 1}},
    {"id": "parts", "messages": [{"role": "system", "content": None},
                                 {"role": "user", "content": [{"type": "text", "text": "Bonjour "},
                                                              {"type": "text", "text": "à tous"}]}],
     "teacher_response": "Salut.", "teacher_tokens": []},
    {"messages": [{"role": "user", "content": "ls"},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "ls"}}]},
                  {"role": "tool", "content": "a.txt", "tool_call_id": "c1"}],
     "teacher_response": "done", "trajectory": [{"role": "assistant", "content": "done", "kind": "action"}]},
]
EXPECTED = [
    [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "Bonjour à tous"},
     {"role": "assistant", "content": "Salut."}],
    [{"role": "user", "content": "ls"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "ls"}}]},
     {"role": "tool", "content": "a.txt", "tool_call_id": "c1"}, {"role": "assistant", "content": "done"}],
]


def sha(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def trained_into(adapter: Path, *, reused: bool = False) -> TrainRef:
    adapter.mkdir(parents=True, exist_ok=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    return TrainRef(run_uri=str(adapter.parent), status="success", adapter_uri=str(adapter),
                    receipt_uri=str(adapter.parent / "train_receipt.json"), latest_checkpoint=None, final_loss=0.1,
                    steps=1, reused=reused)


def corpus_ref(path: Path, **changes) -> CorpusRef:
    fields = dict(uri="unused", dataset_sha256=sha(path), source_uri=str(path), examples=len(ROWS), action_tokens=0,
                  env_tokens=0, effective_top_k=16, teacher_identity_revision=None)
    return CorpusRef(**{**fields, **changes})


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A corpus as admission reads it: manifest first, a blank and a whitespace line, CRLF on one row."""
    path = tmp_path / "corpus.jsonl"
    lines = [MANIFEST, json.dumps(ROWS[0]), "", json.dumps(ROWS[1], ensure_ascii=False) + "\r", " \t",
             json.dumps(ROWS[2])]
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    return path


def test_a_corpus_run_writes_one_line_per_example_in_file_order(tmp_path, corpus):
    adapter = tmp_path / "run" / "adapter"
    uri = write_replay_log(trained_into(adapter), corpus_ref(corpus))
    assert uri == str(adapter / "replay.jsonl")
    data = (adapter / "replay.jsonl").read_bytes()
    assert data == b"".join(replay_line(messages) for messages in EXPECTED)
    lines = data.decode("utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == len(ROWS) + 1  # a newline after every line, none extra
    assert json.loads(lines[0]) == {"prompts": [{"messages": EXPECTED[0]}]}
    assert lines[0] == json.dumps({"prompts": [{"messages": EXPECTED[0]}]}, separators=(",", ":"), sort_keys=True)
    assert "à tous" in lines[1]  # UTF-8, not \u escapes
    assert read_replay_prompts(str(adapter), source="demo") == EXPECTED
    assert [p.name for p in adapter.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_a_corpus_changed_since_training_is_refused_and_nothing_is_written(tmp_path, corpus):
    adapter = tmp_path / "run" / "adapter"
    ref = corpus_ref(corpus)
    corpus.write_bytes(corpus.read_bytes() + json.dumps(ROWS[0]).encode() + b"\n")
    with pytest.raises(EnvironmentFailure) as caught:
        write_replay_log(trained_into(adapter), ref)
    assert caught.value.code == "corpus_changed" and caught.value.exit_code == 3
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_model.safetensors"]


def test_only_a_successful_run_gets_a_log_and_a_finished_one_keeps_its_own(tmp_path, corpus):
    adapter = tmp_path / "run" / "adapter"
    failed = trained_into(adapter).model_copy(update={"status": "failed"})
    assert write_replay_log(failed, corpus_ref(corpus)) is None and not (adapter / "replay.jsonl").exists()
    reused = trained_into(adapter, reused=True)
    assert write_replay_log(reused, corpus_ref(corpus)) is not None  # a finished run that lacks one gets it
    (adapter / "replay.jsonl").write_bytes(b"kept\n")
    assert write_replay_log(reused, corpus_ref(corpus)) is None
    assert (adapter / "replay.jsonl").read_bytes() == b"kept\n"


def test_an_on_policy_prompt_file_is_written_as_its_prompts_messages(tmp_path):
    from kiln_core.contracts.opd_prompt import OpdPrompt, prompts_content_sha256
    from kiln_core.engine.prompts import write_inline_prompts

    prompts = [OpdPrompt.model_validate(p) for p in (
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
         "teacher_extra_messages": [{"role": "user", "content": "teacher only"}]},
        {"messages": [{"role": "user", "content": "Again"}],
         "trajectory": [{"role": "assistant", "content": "x", "kind": "action"}]},
    )]
    uri = write_inline_prompts(prompts, str(tmp_path / "root"))
    ref = CorpusRef(uri=uri, dataset_sha256="sha256:" + prompts_content_sha256(prompts), source_uri=uri, examples=2,
                    action_tokens=0, env_tokens=0, effective_top_k=16, teacher_identity_revision=None, kind="prompts")
    adapter = tmp_path / "run" / "adapter"
    write_replay_log(trained_into(adapter), ref)
    assert (adapter / "replay.jsonl").read_text(encoding="utf-8").splitlines() == [
        '{"prompts":[{"messages":[{"content":"Hi","role":"user"},{"content":"","role":"assistant"}]}]}',
        '{"prompts":[{"messages":[{"content":"Again","role":"user"}]}]}',
    ]
    with pytest.raises(EnvironmentFailure) as caught:
        write_replay_log(trained_into(tmp_path / "other" / "adapter"),
                         ref.model_copy(update={"dataset_sha256": "sha256:" + "0" * 64}))
    assert caught.value.code == "corpus_changed"


# ---------------------------------------------------------------------------------------------------- the reader


def write_log(tmp_path: Path, text: str | bytes) -> Path:
    adapter = tmp_path / "adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "replay.jsonl").write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return adapter


def test_the_reader_takes_kilns_shapes_and_keeps_only_chat_messages(tmp_path):
    user = {"role": "user", "content": "hi"}
    lines = [
        json.dumps({"kind": "request", "request_body": {"examples": [{"messages": [user]}],
                                                        "prompts": [{"messages": [user, {"role": "assistant",
                                                                                         "content": "yo"}]}]}}),
        json.dumps({"prompts": [{"messages": [user], "teacher_extra_messages": [{"role": "user", "content": "x"}],
                                 "trajectory": [{"role": "assistant", "content": "a", "kind": "action"}]}]}),
        json.dumps({"prompts": [{"messages": [{"content": "no role"}, 7, user, {"role": "user", "content": 5}]}]}),
        json.dumps({"prompts": [{"messages": [{"content": "no role"}]}, {"other": 1}, "text"]}),
        json.dumps({"request_body": None, "prompts": [{"messages": [user]}]}),  # request_body wins, even null
        json.dumps([{"messages": [user]}]),
        json.dumps({"prompts": {"messages": [user]}}),
        "   ",
    ]
    adapter = write_log(tmp_path, "\r\n".join(lines))
    assert read_replay_prompts(str(adapter), source="a") == [
        [user], [user, {"role": "assistant", "content": "yo"}],  # examples first, then prompts
        [user],  # teacher_extra_messages and trajectory dropped
        [user],  # the entries that are not chat messages dropped
    ]


@pytest.mark.parametrize("case", ["absent", "directory", "too large", "not utf-8"])
def test_an_unreadable_log_is_missing_with_kilns_message(tmp_path, monkeypatch, case):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    if case == "directory":
        (adapter / "replay.jsonl").mkdir()
    elif case == "too large":
        import kiln_core.teachers.replay as replay

        monkeypatch.setattr(replay, "MAX_REPLAY_BYTES", 16)
        write_log(tmp_path, '{"prompts": []}\n{"prompts": []}\n')
    elif case == "not utf-8":
        write_log(tmp_path, b'{"prompts": []}\n\xff\n')
    with pytest.raises(ReplayLogError) as caught:
        read_replay_prompts(str(adapter), source="rust-helper")
    assert caught.value.code == "replay_log_missing" and caught.value.exit_code == 2
    assert caught.value.message.startswith(f'distill_merge: source adapter "rust-helper" has no readable replay log '
                                           f"at {adapter / 'replay.jsonl'}")


def test_an_invalid_line_is_named_by_its_physical_line(tmp_path):
    adapter = write_log(tmp_path, '{"prompts": []}\n\n{"prompts": [}\n')
    with pytest.raises(ReplayLogError) as caught:
        read_replay_prompts(str(adapter), source="rust-helper")
    assert caught.value.code == "replay_log_invalid" and caught.value.line == 3
    assert caught.value.message.startswith('distill_merge: source adapter "rust-helper" replay line 3 is invalid JSON: ')


def test_a_log_nested_deeper_than_serde_json_reads_is_invalid(tmp_path):
    adapter = write_log(tmp_path, "[" * 200 + "]" * 200 + "\n")
    with pytest.raises(ReplayLogError) as caught:
        read_replay_prompts(str(adapter), source="deep")
    assert caught.value.code == "replay_log_invalid" and caught.value.line == 1


def test_an_object_store_log_reads_the_same(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        fs.pipe("/replay-test/adapter/replay.jsonl", replay_line([{"role": "user", "content": "hi"}]))
        assert read_replay_prompts("memory://replay-test/adapter", source="m") == [[{"role": "user", "content": "hi"}]]
        with pytest.raises(ReplayLogError) as caught:
            read_replay_prompts("memory://replay-test/none", source="m")
        assert caught.value.code == "replay_log_missing"
    finally:
        fs.rm("/replay-test", recursive=True)


def test_corpus_row_messages_appends_the_teacher_response():
    assert corpus_row_messages(ROWS[0]) == EXPECTED[0]


# ---------------------------------------------------------------------------------------------------- end to end


@pytest.mark.usefixtures("one_torch_thread")
def test_every_run_leaves_the_log_of_its_training_file_beside_the_adapter(tiny_student, corpus_lines, tmp_path):
    from shard_support import write_file, write_set
    from test_shard_training import CUTS, run, spec_for

    whole = write_file(tmp_path / "whole.jsonl", corpus_lines)
    expected = [corpus_row_messages(json.loads(line)) for line in corpus_lines[1:]]
    from_file = run(spec_for(whole, tmp_path / "file-root", tiny_student, epochs=1))
    assert from_file.status == "success"
    assert read_replay_prompts(from_file.adapter, source="set-run") == expected
    log = Path(from_file.adapter) / "replay.jsonl"
    assert log.read_bytes() == b"".join(replay_line(messages) for messages in expected)
    # A set of shards: every shard in set order, the same log as the file it was cut from.
    from_set = run(spec_for(write_set(tmp_path / "corpus", corpus_lines, CUTS), tmp_path / "set-root", tiny_student,
                            epochs=1))
    assert (Path(from_set.adapter) / "replay.jsonl").read_bytes() == log.read_bytes()
    # The same spec again finds the run finished and leaves the log as it was; a log lost since is written again.
    log.unlink()
    again = run(spec_for(whole, tmp_path / "file-root", tiny_student, epochs=1))
    assert again.reused and log.read_bytes() == b"".join(replay_line(messages) for messages in expected)


@pytest.mark.usefixtures("one_torch_thread")
def test_an_on_policy_run_leaves_its_prompts(tiny_student, root, tmp_path, capsys):
    from kiln_core.contracts.opd_prompt import OpdPrompt, kiln_prompt_value
    from test_on_policy_cli import PROMPTS, train, write_request

    code, result = train(capsys, "--request", write_request(tmp_path), "--adapter", "onpol-replay", "--student",
                         str(tiny_student), "--out", str(root), "--json")
    assert code == 0 and result["status"] == "success"
    expected = [kiln_prompt_value(OpdPrompt.model_validate(prompt))["messages"] for prompt in PROMPTS]
    assert read_replay_prompts(result["adapter"], source="onpol-replay") == expected
