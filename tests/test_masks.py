"""The mask builders (kiln_core.tokenization, docs/architecture.md decision 3) on the tiny student.

What a user depends on: which tokens become reverse-KL action targets and ECHO env targets, for
plain conversations (``{% generation %}`` blocks or the ChatML fallback) and for trajectories
(``kind`` decides, ``role`` never does), and that what Kiln refuses — a target at position 0,
overlapping masks, a template that does not mark its assistant turns — is refused, not repaired.
Kiln's own trajectory tests, translated, are in ``test_trajectory_mask_kiln.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln_core.admission import admit_corpus
from kiln_core.admission.records import parse_corpus
from kiln_core.errors import AdmissionError
from kiln_core.synthetic import synthesize_corpus
from kiln_core.tokenization import (
    Conversation,
    Segment,
    TokenizationError,
    encode_conversations,
    load_student_tokenizer,
    normalize_content,
)

IM_END = "<|im_end|>"


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gen(tiny_student):
    student = load_student_tokenizer(tiny_student)
    assert student.has_generation_blocks
    return student


@pytest.fixture(scope="module")
def plain(tiny_student_plain):
    student = load_student_tokenizer(tiny_student_plain)
    assert not student.has_generation_blocks
    return student


def _student_copy(source: Path, destination: Path, template: str | None) -> Path:
    """The student's tokenizer files (no weights) with another chat template (or none)."""
    destination.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, destination / name)
    config = json.loads((destination / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    (destination / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if template is not None:
        (destination / "chat_template.jinja").write_text(template, encoding="utf-8")
    return destination


@pytest.fixture(scope="module")
def custom_dirs(tiny_student, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mask-students")
    chatml = (Path(tiny_student) / "chat_template.jinja").read_text(encoding="utf-8")
    hidden_tool = chatml.replace("message['content'] + '\\n</tool_response>", "'[hidden]' + '\\n</tool_response>")
    assert hidden_tool != chatml
    return {
        # every message's content in a generation block, nothing else: position 0 is content
        "gen_content_only": _student_copy(
            tiny_student, root / "gen-content-only",
            "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}",
        ),
        # contents back to back, no markup: position 0 is content, segments can share a token
        "content_only": _student_copy(
            tiny_student, root / "content-only", "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ),
        # ChatML that never shows a tool message's content
        "hidden_tool": _student_copy(tiny_student, root / "hidden-tool", hidden_tool),
        # a template that refuses tool turns
        "raising": _student_copy(
            tiny_student, root / "raising",
            chatml.replace("{%- elif message['role'] == 'tool' -%}", "{%- elif message['role'] == 'tool' -%}"
                           "{{- raise_exception('no tools here') -}}"),
        ),
        # only the assistant turn is rendered, in a generation block: position 0 is its content
        "assistant_first": _student_copy(
            tiny_student, root / "assistant-first",
            "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
            "{% endgeneration %}{% endif %}{% endfor %}",
        ),
        "no_template": _student_copy(tiny_student, root / "no-template", None),
        # ChatML whose assistant turns never close
        "unterminated": _student_copy(
            tiny_student, root / "unterminated",
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% if m['role'] != 'assistant' %}<|im_end|>\n{% endif %}{% endfor %}",
        ),
    }


def encode_one(student, conversation: Conversation):
    (encoded,) = encode_conversations(student, [conversation])
    return encoded


def runs(positions: np.ndarray) -> list[np.ndarray]:
    """Split sorted positions into maximal runs of consecutive integers."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return np.split(positions, breaks)


def decoded_runs(student, ids: np.ndarray, positions: np.ndarray) -> list[str]:
    return [student.tokenizer.decode(ids[run].tolist()) for run in runs(positions)]


def decoded(student, ids: np.ndarray, positions: np.ndarray) -> str:
    return student.tokenizer.decode(ids[positions].tolist())


SYSTEM = {"role": "system", "content": "Answer briefly."}

CONVERSATIONS = [
    Conversation([SYSTEM, {"role": "user", "content": "What is two plus two?"}], "Two plus two is four."),
    Conversation(
        [
            SYSTEM,
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hello world"},
            {"role": "user", "content": "List files under src/"},
            {"role": "assistant", "content": '{"directory":"src","recursive":true}'},
            {"role": "user", "content": "and tests?"},
        ],
        "tests/ docs/ README.md",
    ),
    Conversation([{"role": "user", "content": "Translate to French: good morning"}], "bonjour"),
    Conversation(
        [
            {"role": "user", "content": "read it"},
            {"role": "assistant", "content": 'read_file(path="src/main.rs")'},
            {"role": "tool", "content": 'fn main() { println!("hi"); }'},
        ],
        "It prints hi.\nDone.",
    ),
    Conversation([{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}], "ok"),
]


# --- (a) generation blocks -----------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_generation_blocks_mark_each_assistant_turn_plus_im_end_newline(gen, index):
    conversation = CONVERSATIONS[index]
    encoded = encode_one(gen, conversation)
    assistant_turns = [m["content"] for m in conversation.messages if m["role"] == "assistant"]
    assistant_turns.append(conversation.teacher_response)
    expected = [content + IM_END + "\n" for content in assistant_turns]
    assert decoded_runs(gen, encoded.input_ids, encoded.action_positions) == expected
    assert encoded.env_positions.size == 0 and encoded.env_in_warning_prefix.size == 0


def test_assistant_turns_inside_messages_are_supervised(gen):
    with_history = CONVERSATIONS[1]
    without_history = Conversation(
        [m for m in with_history.messages if m["role"] != "assistant"], with_history.teacher_response
    )
    full = encode_one(gen, with_history)
    bare = encode_one(gen, without_history)
    assert decoded(gen, full.input_ids, full.action_positions).startswith("hello world" + IM_END + "\n")
    assert len(runs(full.action_positions)) == 3
    assert len(runs(bare.action_positions)) == 1
    assert full.action_positions.size > bare.action_positions.size


def test_targets_are_the_tokens_of_the_rendered_text(gen):
    """The ids are the tokenization of the rendered ChatML text: nothing is added or dropped."""
    conversation = CONVERSATIONS[0]
    encoded = encode_one(gen, conversation)
    text = gen.tokenizer.decode(encoded.input_ids.tolist())
    assert text == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nTwo plus two is four.<|im_end|>\n"
    )
    # the assistant header is not a target
    header_end = len(gen.tokenizer("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
                                   "What is two plus two?<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)["input_ids"])
    assert encoded.action_positions[0] == header_end
    assert encoded.action_positions[-1] == len(encoded.input_ids) - 1


# --- (b) ChatML fallback -------------------------------------------------------------------------


def test_fallback_marks_the_same_positions_as_generation_blocks(gen, plain):
    with_blocks = encode_conversations(gen, CONVERSATIONS)
    fallback = encode_conversations(plain, CONVERSATIONS)
    for a, b in zip(with_blocks, fallback, strict=True):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.action_positions, b.action_positions)
        assert a.action_positions.size > 0


def test_fallback_one_at_a_time_matches_batch(plain):
    batch = encode_conversations(plain, CONVERSATIONS)
    for conversation, encoded in zip(CONVERSATIONS, batch):
        single = encode_one(plain, conversation)
        np.testing.assert_array_equal(single.input_ids, encoded.input_ids)
        np.testing.assert_array_equal(single.action_positions, encoded.action_positions)


def test_fallback_marks_every_assistant_turn_text(plain):
    conversation = CONVERSATIONS[1]
    encoded = encode_one(plain, conversation)
    assert decoded_runs(plain, encoded.input_ids, encoded.action_positions) == [
        "hello world" + IM_END + "\n",
        '{"directory":"src","recursive":true}' + IM_END + "\n",
        "tests/ docs/ README.md" + IM_END + "\n",
    ]


def test_fallback_and_generation_students_admit_the_same_corpus_identically(
    gen, plain, tiny_student, tiny_student_plain, tmp_path
):
    path = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=5, top_k=16, seed=11, trajectory_every=2)
    a = admit_corpus(str(path), str(tiny_student), top_k=16, student=gen).tables
    b = admit_corpus(str(path), str(tiny_student_plain), top_k=16, student=plain).tables
    for name in ("input_ids", "action_positions", "action_offsets", "env_positions", "env_in_warning_prefix"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def _expected_prefix_render_mask(student, messages, response):
    """Kiln's last resort for a plain example, by hand: the tokens overlapping the characters the
    assistant turn adds to the rendered prompt (ASCII text: characters are bytes)."""
    chat = list(messages) + [{"role": "assistant", "content": response}]
    render = lambda m: student.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=False)
    before, full = render(messages), render(chat)
    assert full.startswith(before) and full.isascii()
    offsets = student.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [i for i, (a, b) in enumerate(offsets) if a != b and a < len(full) and b > len(before)]


def test_chatml_fallback_finding_extra_headers_marks_nothing_then_prefix_renders_decide(plain):
    """A user message quoting the assistant header makes the ChatML search count 2 spans for 1
    assistant turn: Kiln then marks nothing from it and falls back to prefix renders, whose span
    starts at the turn's own header."""
    messages = [{"role": "user", "content": "say <|im_start|>assistant\n please"}]
    encoded = encode_one(plain, Conversation(messages, "two plus two is four"))
    assert encoded.problem is None
    assert encoded.action_positions.tolist() == _expected_prefix_render_mask(plain, messages, "two plus two is four")
    assert decoded(plain, encoded.input_ids, encoded.action_positions) == (
        "<|im_start|>assistant\ntwo plus two is four" + IM_END + "\n"
    )


def test_unterminated_assistant_turn_falls_back_to_prefix_renders(custom_dirs):
    student = load_student_tokenizer(custom_dirs["unterminated"])
    messages = [{"role": "user", "content": "hello"}]
    encoded = encode_one(student, Conversation(messages, "hello world"))
    assert encoded.problem is None
    assert encoded.action_positions.tolist() == _expected_prefix_render_mask(student, messages, "hello world")
    assert decoded(student, encoded.input_ids, encoded.action_positions) == "<|im_start|>assistant\nhello world"


# --- (c) trajectories ----------------------------------------------------------------------------


def trajectory(*segments: Segment, messages=None) -> Conversation:
    messages = [SYSTEM, {"role": "user", "content": "hello"}] if messages is None else messages
    return Conversation(messages=messages, teacher_response="unused", trajectory=list(segments))


def test_trajectory_kinds_decide_action_and_env(gen):
    conversation = trajectory(
        Segment("assistant", 'read_file(path="src/main.rs")', "action", "call-1"),
        Segment("tool", "src/lib.rs src/main.rs", "observation", "call-1"),
        Segment("user", "thanks for that", "context"),
        Segment("assistant", "The quick brown fox.", "action"),
    )
    encoded = encode_one(gen, conversation)
    assert decoded_runs(gen, encoded.input_ids, encoded.action_positions) == [
        'read_file(path="src/main.rs")',
        "The quick brown fox.",
    ]
    assert decoded_runs(gen, encoded.input_ids, encoded.env_positions) == ["src/lib.rs src/main.rs"]
    assert not encoded.env_in_warning_prefix.any()
    # <|im_end|> is not part of an action segment (unlike the no-trajectory mask)
    im_end = gen.tokenizer.convert_tokens_to_ids(IM_END)
    assert im_end not in encoded.input_ids[encoded.action_positions].tolist()


def test_context_segment_tokens_are_not_targets(gen):
    context = "thanks for that"
    conversation = trajectory(Segment("assistant", "ok done", "action"), Segment("user", context, "context"))
    encoded = encode_one(gen, conversation)
    targets = set(encoded.action_positions.tolist()) | set(encoded.env_positions.tolist())
    assert decoded(gen, encoded.input_ids, encoded.action_positions) == "ok done"
    # find the context tokens and check none is a target
    text_ids = encoded.input_ids.tolist()
    context_ids = gen.tokenizer(context, add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(text_ids)) if text_ids[i : i + len(context_ids)] == context_ids)
    assert not targets & set(range(start, start + len(context_ids)))


def test_missing_kind_is_context_but_null_kind_is_refused(gen):
    record = {
        "messages": [{"role": "user", "content": "hello"}],
        "teacher_response": "x",
        "trajectory": [
            {"role": "assistant", "content": "no kind here"},
            {"role": "assistant", "content": "the action", "kind": "action"},
        ],
    }
    parsed = parse_corpus((json.dumps(record) + "\n").encode())
    (conversation,) = parsed.conversations
    assert [s.kind for s in conversation.trajectory] == ["context", "action"]
    encoded = encode_one(gen, conversation)
    assert decoded(gen, encoded.input_ids, encoded.action_positions) == "the action"
    assert encoded.env_positions.size == 0
    record["trajectory"][0]["kind"] = None  # serde: an enum is never null
    with pytest.raises(AdmissionError) as caught:
        parse_corpus((json.dumps(record) + "\n").encode())
    assert (caught.value.code, caught.value.line) == ("invalid_record", 1)


def test_role_never_implies_kind(gen):
    """A context segment with role assistant or tool marks nothing; only ``kind`` supervises."""
    conversation = trajectory(
        Segment("assistant", "read_file", "action"),
        Segment("tool", "src/lib.rs src/main.rs", "context", "call-1"),
        Segment("assistant", "ok done", "context"),
        Segment("tool", "warning: deprecated API", "observation", "call-2"),
        Segment("assistant", "The quick brown fox.", "action"),
    )
    encoded = encode_one(gen, conversation)
    assert encoded.problem is None
    assert decoded_runs(gen, encoded.input_ids, encoded.action_positions) == ["read_file", "The quick brown fox."]
    assert decoded(gen, encoded.input_ids, encoded.env_positions) == "warning: deprecated API"


def test_segment_matching_starts_after_the_prompt_and_advances(gen):
    """A segment whose text also appears in the prompt, or repeats, is matched at its own turn."""
    conversation = trajectory(
        Segment("assistant", "hello world", "context"),
        Segment("assistant", "hello world", "action"),
        messages=[{"role": "user", "content": "hello world"}],
    )
    encoded = encode_one(gen, conversation)
    ids = encoded.input_ids
    first_action = int(encoded.action_positions[0])
    prefix_text = gen.tokenizer.decode(ids[:first_action].tolist())
    assert prefix_text.count("hello world") == 2  # the prompt's and the context segment's
    assert decoded(gen, ids, encoded.action_positions) == "hello world"


def test_warning_prefix_flags_leading_bytes(gen):
    content = "error: file not found. ok"
    for prefix, flagged_text in [(0, ""), (6, "error:"), (len(content), content)]:
        encoded = encode_one(
            gen,
            trajectory(Segment("assistant", "a b", "action"), Segment("tool", content, "observation", None, prefix)),
        )
        env = encoded.env_positions
        assert decoded(gen, encoded.input_ids, env) == content  # |O| is the whole observation
        assert encoded.env_in_warning_prefix.shape == env.shape
        flagged = env[encoded.env_in_warning_prefix]
        assert decoded(gen, encoded.input_ids, flagged) == flagged_text
        # the flagged tokens are a leading run of the observation
        assert np.array_equal(encoded.env_in_warning_prefix, np.arange(env.size) < flagged.size)


def test_warning_prefix_splitting_a_multibyte_character(gen):
    """``é`` is bytes 3-4 of "ok é done" and the byte-level tokenizer gives each byte its own token.

    Kiln trims bytes: a prefix of 4 ends inside ``é``, so the token of its first byte (which ends at
    byte 4) is trimmed and the token of its second byte is kept. A prefix of 5 trims both.
    """
    content = "ok é done"
    assert content.encode("utf-8")[3:5] == "é".encode("utf-8")
    results = {}
    for prefix in (3, 4, 5):
        encoded = encode_one(
            gen,
            trajectory(Segment("assistant", "a b", "action"), Segment("tool", content, "observation", None, prefix)),
        )
        assert decoded(gen, encoded.input_ids, encoded.env_positions) == content
        results[prefix] = encoded
    flagged = {p: e.env_positions[e.env_in_warning_prefix] for p, e in results.items()}
    first_byte, second_byte = gen.tokenizer.convert_tokens_to_ids(["Ã", "©"])  # é as byte-level tokens
    ids = results[4].input_ids
    assert ids[flagged[4]].tolist() == ids[flagged[3]].tolist() + [first_byte]
    assert ids[flagged[5]].tolist() == ids[flagged[3]].tolist() + [first_byte, second_byte]
    assert decoded(gen, ids, flagged[3]) == "ok " and decoded(gen, ids, flagged[5]) == "ok é"
    np.testing.assert_array_equal(results[3].env_positions, results[5].env_positions)


def test_warning_prefix_applies_to_observations_only(gen):
    encoded = encode_one(
        gen,
        trajectory(
            Segment("assistant", "warning: x", "action", None, 9),
            Segment("tool", "warning: y", "observation", None, 0),
        ),
    )
    assert not encoded.env_in_warning_prefix.any()
    assert decoded(gen, encoded.input_ids, encoded.action_positions) == "warning: x"


def test_observation_marks_whatever_the_tool_response_wrapper_holds(custom_dirs):
    """Kiln finds observations by their ``<tool_response>`` wrapper, not by their content: a template
    that shows something else there gets that something else marked."""
    hidden = load_student_tokenizer(custom_dirs["hidden_tool"])
    conversation = trajectory(Segment("assistant", "ok", "action"), Segment("tool", "secret output", "observation"))
    encoded = encode_one(hidden, conversation)
    assert encoded.problem is None
    assert decoded(hidden, encoded.input_ids, encoded.env_positions) == "[hidden]"


def test_template_that_raises_rejects_its_line(custom_dirs, tmp_path):
    raising = load_student_tokenizer(custom_dirs["raising"])
    with pytest.raises(TokenizationError, match="no tools here"):
        encode_one(raising, trajectory(Segment("assistant", "ok", "action"), Segment("tool", "x", "observation")))
    record = {
        "messages": [{"role": "user", "content": "hello"}],
        "teacher_response": "ok",
        "trajectory": [
            {"role": "assistant", "content": "ok", "kind": "action"},
            {"role": "tool", "content": "secret output", "kind": "observation"},
        ],
    }
    plain = {"messages": [{"role": "user", "content": "hello"}], "teacher_response": "ok"}
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n" + json.dumps(record) + "\n" + json.dumps(plain) + "\n", encoding="utf-8")
    with pytest.raises(AdmissionError) as caught:
        admit_corpus(str(path), str(custom_dirs["raising"]), top_k=16)
    assert (caught.value.code, caught.value.line) == ("invalid_record", 2)
    assert "no tools here" in caught.value.message


# --- (d) position 0 ------------------------------------------------------------------------------


def test_generation_blocks_must_match_the_assistant_turns(custom_dirs):
    """Kiln's training template must return one span per assistant message, or it refuses the example."""
    student = load_student_tokenizer(custom_dirs["gen_content_only"])
    assert student.has_generation_blocks
    encoded = encode_one(student, Conversation([{"role": "user", "content": "hello"}], "world"))
    assert encoded.problem is not None and encoded.problem.code == "invalid_record"
    assert "2 assistant spans for 1 assistant messages" in encoded.problem.message


def test_action_target_at_position_zero_is_refused(custom_dirs):
    student = load_student_tokenizer(custom_dirs["assistant_first"])
    encoded = encode_one(student, Conversation([{"role": "user", "content": "hello"}], "hello world again"))
    assert encoded.action_positions[0] == 0
    assert encoded.problem is not None and encoded.problem.code == "target_at_position_zero"


@pytest.mark.parametrize("kind", ["action", "observation"])
def test_trajectory_target_at_position_zero(custom_dirs, kind):
    """Back-to-back contents: no marker, so Kiln's prefix fallback marks from token 0. An action there
    is refused; an observation token at 0 is no ECHO target (no causal row) and leaves no action."""
    student = load_student_tokenizer(custom_dirs["content_only"])
    encoded = encode_one(student, Conversation([], "x", [Segment("assistant", "hello world", kind)]))
    n = len(encoded.input_ids)
    if kind == "action":
        np.testing.assert_array_equal(encoded.action_positions, np.arange(0, n))
        assert encoded.problem.code == "target_at_position_zero"
    else:
        np.testing.assert_array_equal(encoded.env_positions, np.arange(1, n))
        assert encoded.observation_tokens == n
        assert encoded.problem.code == "no_action_tokens"


def test_admitted_positions_are_at_least_one_and_increasing(tiny_student, gen, tmp_path):
    path = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=6, top_k=16, seed=5, trajectory_every=2)
    tables = admit_corpus(str(path), str(tiny_student), top_k=16, student=gen).tables
    assert tables.env_positions.size > 0
    for example in tables:
        for positions in (example.action_positions, example.env_positions):
            assert positions.size == 0 or positions.min() >= 1
            assert np.all(np.diff(positions) > 0)


# --- (e) content normalization -------------------------------------------------------------------


def test_normalize_content():
    assert normalize_content(None) == ""
    assert normalize_content("text") == "text"
    parts = [{"type": "text", "text": "Hello "}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "world"}]
    assert normalize_content(parts) == "Hello world"
    assert normalize_content([]) == ""
    with pytest.raises(TokenizationError):
        normalize_content(["not a part"])
    with pytest.raises(TokenizationError):
        normalize_content(5)


def test_null_content_and_parts_render_like_plain_text(gen):
    records = [
        {
            "messages": [
                {"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "List files "}, {"type": "text", "text": "under src/"}]},
            ],
            "teacher_response": "src/lib.rs",
        },
        {
            "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "List files under src/"}],
            "teacher_response": "src/lib.rs",
        },
    ]
    parsed = parse_corpus(("\n".join(json.dumps(r) for r in records) + "\n").encode())
    assert parsed.conversations[0].messages[0]["content"] == ""
    assert parsed.conversations[0].messages[1]["content"] == "List files under src/"
    a, b = encode_conversations(gen, parsed.conversations)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.action_positions, b.action_positions)
    assert decoded(gen, a.input_ids, a.action_positions) == "src/lib.rs" + IM_END + "\n"


# --- (f) refused students ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_student_dir(tmp_path_factory) -> Path:
    """A directory whose tokenizer is a Python (non-fast) one: CTRL has no fast implementation."""
    directory = tmp_path_factory.mktemp("slow-student")
    (directory / "config.json").write_text(json.dumps({"model_type": "ctrl", "vocab_size": 16}))
    (directory / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<unk>": 3}))
    (directory / "merges.txt").write_text("#version: 0.2\na b\n")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "CTRLTokenizer",
                "unk_token": "<unk>",
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            }
        )
    )
    return directory


def test_slow_tokenizer_is_refused(slow_student_dir):
    with pytest.raises(TokenizationError, match="fast"):
        load_student_tokenizer(slow_student_dir)


def test_missing_chat_template_is_refused(custom_dirs):
    with pytest.raises(TokenizationError, match="chat template"):
        load_student_tokenizer(custom_dirs["no_template"])


def test_refused_student_is_an_admission_error_not_a_crash(slow_student_dir, custom_dirs, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "teacher_response": "ok"}) + "\n")
    for directory, needle in ((slow_student_dir, "fast"), (custom_dirs["no_template"], "chat template")):
        with pytest.raises(AdmissionError) as caught:
            admit_corpus(str(path), str(directory), top_k=16)
        assert caught.value.line is None
        assert needle in caught.value.message


def test_missing_student_directory_is_refused(tmp_path):
    with pytest.raises(TokenizationError, match="does not exist"):
        load_student_tokenizer(tmp_path / "nope")


# --- (g) disjoint masks --------------------------------------------------------------------------


def test_segments_sharing_a_token_claim_it_in_both_masks(custom_dirs):
    """Back-to-back contents make Kiln fall back to token deltas; a span that the render of the next
    prefix re-tokenizes is claimed by both segments only if deltas overlap — here they abut."""
    student = load_student_tokenizer(custom_dirs["content_only"])
    conversation = Conversation(
        [{"role": "user", "content": "x "}], "x", [Segment("assistant", "hel", "action"), Segment("tool", "lo world", "observation")]
    )
    encoded = encode_one(student, conversation)
    assert np.intersect1d(encoded.action_positions, encoded.env_positions).size == 0
    prompt = len(student.tokenizer("x ", add_special_tokens=False)["input_ids"])
    with_action = len(student.tokenizer("x hel", add_special_tokens=False)["input_ids"])
    np.testing.assert_array_equal(encoded.action_positions, np.arange(prompt, with_action))
    np.testing.assert_array_equal(encoded.env_positions, np.arange(with_action, len(encoded.input_ids)))


def test_masks_are_disjoint_over_a_trajectory_corpus(tiny_student, gen, tmp_path):
    path = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=6, top_k=16, seed=9, trajectory_every=1)
    tables = admit_corpus(str(path), str(tiny_student), top_k=16, student=gen).tables
    assert tables.env_positions.size > 0 and tables.action_positions.size > 0
    for example in tables:
        assert np.intersect1d(example.action_positions, example.env_positions).size == 0


def test_tool_call_arguments_given_as_json_text_reach_the_template_parsed(tiny_student, tmp_path):
    """Kiln's renderer parses ``arguments`` strings (both tool-call envelopes) before the template runs,
    so a template that walks ``arguments|items`` renders; text that is not JSON stays text."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% for call in m.get('tool_calls', []) %}{% set args = call.function.arguments if call.function is defined "
        "else call.arguments %}{% if args is mapping %}{% for k, v in args|items %}[{{ k }}={{ v }}]{% endfor %}"
        "{% else %}[raw {{ args }}]{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    )
    student = load_student_tokenizer(_student_copy(tiny_student, tmp_path / "tool-args", template))
    calls = [
        {"id": "1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "src"}'}},
        {"name": "list", "arguments": '{"recursive": true}'},
        {"name": "broken", "arguments": "not json"},
        {"name": "nan", "arguments": "NaN"},
    ]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok", "tool_calls": calls},
                {"role": "user", "content": "and?"}]
    encoded = encode_one(student, Conversation(messages, "done"))
    text = student.tokenizer.decode(encoded.input_ids.tolist())
    assert "[path=src][recursive=True][raw not json][raw NaN]" in text
