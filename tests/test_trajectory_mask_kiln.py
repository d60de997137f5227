"""Kiln's own trajectory-mask tests, translated (crates/kiln-train/src/trajectory_mask.rs ``mod tests``).

Kiln's fixture is a byte-level tokenizer (BPE over the 256 byte values, no merges: one token per
byte, so counts are byte lengths) and a Qwen-shaped chat template: every role renders as
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` except ``tool``, which renders inside a user block as
``<tool_response>\\n{content}\\n</tool_response>`` (consecutive tool turns share one block). Both are
rebuilt here the same way, and the assertions are Kiln's.

The last cases go beyond Kiln's suite: a ChatML template that renders tool turns as
``<|im_start|>tool\\n…`` (no ``<tool_response>``) sends the byte search to Kiln's prefix
re-tokenization fallback, whose counts are checked against an independent reference written here
(render every prefix with jinja2, count bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import numpy as np
import pytest

from kiln_core.tokenization import Conversation, Segment, encode_conversations, load_student_tokenizer
from kiln_core.trajectory_mask import supervised_count

# Kiln's template, with Rust's line continuations resolved (a trailing backslash drops the newline).
QWEN_SHAPED = (
    "{% for message in messages -%}"
    "{% if message.role == 'tool' %}"
    "{% if loop.previtem is undefined or loop.previtem.role != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
)

# ChatML that renders every role, tool included, as its own block, plus the generation prompt.
CHATML_TOOL = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_student(directory: Path, template: str):
    """Kiln's fixture tokenizer: token id b is byte b, no merges, no special tokens."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {chr(b): b for b in range(256)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])))
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps({"vocab_size": 256}), encoding="utf-8")
    return load_student_tokenizer(directory)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return byte_level_student(tmp_path_factory.mktemp("qwen-shaped"), QWEN_SHAPED)


@pytest.fixture(scope="module")
def chatml_tool(tmp_path_factory):
    return byte_level_student(tmp_path_factory.mktemp("chatml-tool"), CHATML_TOOL)


def ctx(role: str, content: str) -> Segment:
    return Segment(role, content, "context")


def act(content: str) -> Segment:
    return Segment("assistant", content, "action")


def obs(content: str, warning_prefix_len: int = 0) -> Segment:
    return Segment("tool", content, "observation", None, warning_prefix_len)


def build(student, trajectory, messages=()):
    (encoded,) = encode_conversations(student, [Conversation(list(messages), "unused", list(trajectory))])
    return encoded


def env_filtered(encoded) -> np.ndarray:
    """The env mask under Kiln's default config (warning filter on)."""
    return encoded.env_positions[~encoded.env_in_warning_prefix]


def text_of(student, encoded, positions) -> str:
    return bytes(encoded.input_ids[positions].tolist()).decode("utf-8")


# --- Kiln's #[test] cases --------------------------------------------------------------------------


def test_build_masks_assistant_only_marks_action_tokens(qwen):
    result = build(qwen, [ctx("system", "sys"), ctx("user", "ask"), act("REPLY")])
    assert result.action_positions.size == 5  # REPLY is 5 bytes/tokens
    assert result.env_positions.size == 0  # no observation segments
    assert result.observation_tokens == 0
    assert result.problem is None
    assert text_of(qwen, result, result.action_positions) == "REPLY"


def test_build_masks_four_turn_pi_session(qwen):
    trajectory = [ctx("system", "sys"), ctx("user", "ask"), act("RUN"), obs("OUTPUT"), act("FINAL")]
    rendered = jinja2.Template(QWEN_SHAPED).render(messages=[{"role": s.role, "content": s.content} for s in trajectory])
    assert "<tool_response>\nOUTPUT\n</tool_response>" in rendered  # the template does wrap tool results

    result = build(qwen, trajectory)
    assert result.action_positions.size == len("RUN") + len("FINAL")
    assert env_filtered(result).size == len("OUTPUT")
    assert np.intersect1d(result.action_positions, result.env_positions).size == 0
    assert result.observation_tokens == len("OUTPUT")  # |O| equals the env count with no warning trim
    # three supervised segments, in order: action, observation, action
    runs = np.split(result.action_positions, np.flatnonzero(np.diff(result.action_positions) != 1) + 1)
    assert [text_of(qwen, result, r) for r in runs] == ["RUN", "FINAL"]
    assert text_of(qwen, result, result.env_positions) == "OUTPUT"
    assert result.env_positions[0] > runs[0][-1] and result.env_positions[-1] < runs[1][0]


def test_build_masks_warning_filter_trims_env_span(qwen):
    raw = "WARNINGS:\n- bad\n<command_output>real</command_output>"
    warning_prefix_len = raw.index("<command_output>")
    assert warning_prefix_len == 16
    result = build(qwen, [ctx("system", "s"), ctx("user", "u"), act("A"), obs(raw, warning_prefix_len)])
    on, off = env_filtered(result), result.env_positions  # warning_filter on (Kiln's default) / off
    assert on.size == len(raw) - warning_prefix_len
    assert off.size - on.size == warning_prefix_len
    # |O| does not change with the filter and equals the unfiltered count
    assert result.observation_tokens == off.size == len(raw)
    assert text_of(qwen, result, on) == "<command_output>real</command_output>"


def test_build_masks_consecutive_tool_observations_share_user_block(qwen):
    trajectory = [ctx("system", "s"), ctx("user", "u"), act("call1"), obs("res1"), obs("res2"), act("done")]
    result = build(qwen, trajectory)
    assert result.env_positions.size == len("res1") + len("res2")
    assert result.action_positions.size == len("call1") + len("done")
    assert np.intersect1d(result.action_positions, result.env_positions).size == 0
    assert result.observation_tokens == 8


def test_masks_that_overlap_are_refused_not_repaired(tmp_path):
    """Kiln's ``assert_masks_disjoint``: a token in both masks is an error naming its index.

    A template that renders only the last message defeats the byte search; in the prefix fallback the
    action claims [len("p"), len("aaaa")) and the observation [len("c"), len("oooo")): tokens 1..3.
    """
    student = byte_level_student(tmp_path / "last-only", "{{ messages[-1]['content'] }}")
    result = build(student, [act("aaaa"), ctx("user", "c"), obs("oooo")], messages=[{"role": "user", "content": "p"}])
    assert result.problem is not None
    assert result.problem.code == "overlapping_masks"
    assert "overlap at token index 1" in result.problem.message


def test_supervised_segments_ignore_context():
    segments = [Segment("system", "x", "context"), Segment("assistant", "y", "action"), Segment("tool", "z", "observation")]
    assert supervised_count(segments) == 2


# --- the prefix re-tokenization fallback, against an independent reference -------------------------


def reference_fallback(template: str, messages: list[dict], trajectory: list[Segment]) -> tuple[list[int], list[int], int]:
    """Kiln's fallback by hand: segment i marks [bytes(render(prefix_i)), bytes(render(prefix_i+1))).

    With a byte-level tokenizer the token count of a text is its UTF-8 length; an empty message list
    renders to no tokens. Returns (action positions, env positions, |O|).
    """
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    chat += [{"role": s.role, "content": s.content} for s in trajectory]

    def size(prefix):
        if not prefix:
            return 0
        text = environment.from_string(template).render(messages=prefix, add_generation_prompt=True, bos_token="", eos_token="")
        return len(text.encode("utf-8"))

    total = size(chat)
    action, env, observed = set(), set(), 0
    for i, segment in enumerate(trajectory):
        start, end = size(chat[: len(messages) + i]), min(size(chat[: len(messages) + i + 1]), total)
        if segment.kind == "context" or end <= start:
            continue
        (action if segment.kind == "action" else env).update(range(start, end))
        if segment.kind == "observation":
            observed += end - start
    return sorted(action), sorted(env), observed


def test_chatml_tool_turns_fall_back_to_prefix_retokenization(chatml_tool):
    """No ``<tool_response>`` in the render: the byte search fails on the observation, and Kiln
    redoes every mask from token deltas, ``<|im_end|>`` and the next header included."""
    messages = [{"role": "user", "content": "list files"}]
    trajectory = [act("ls -la"), obs("a.txt b.txt"), act("two files")]
    result = build(chatml_tool, trajectory, messages)
    action, env, observed = reference_fallback(CHATML_TOOL, messages, trajectory)
    assert result.problem is None
    assert result.action_positions.tolist() == action
    assert result.env_positions.tolist() == env
    assert result.observation_tokens == observed == len(env)
    # the counts are not the content's: marking content bytes (the old rule) would give these
    assert result.action_positions.size != len("ls -la") + len("two files")
    assert text_of(chatml_tool, result, result.action_positions[: len("ls -la<|im_end|>\n")]) == "ls -la<|im_end|>\n"


def test_chatml_tool_fallback_ignores_the_warning_filter(chatml_tool):
    messages = [{"role": "user", "content": "run it"}]
    trajectory = [act("make"), obs("warning: old\nok", warning_prefix_len=13)]
    result = build(chatml_tool, trajectory, messages)
    _, env, _ = reference_fallback(CHATML_TOOL, messages, trajectory)
    assert result.env_positions.tolist() == env
    assert not result.env_in_warning_prefix.any()  # whole token deltas, no trimming


def test_empty_segment_is_not_skipped_it_forces_the_fallback(qwen):
    """An empty action finds its markers but marks no token, so the byte search records fewer spans
    than supervised segments and Kiln redoes the masks by prefix re-tokenization."""
    trajectory = [ctx("user", "u"), act(""), obs("OUT"), act("done")]
    result = build(qwen, trajectory)
    action, env, observed = reference_fallback(QWEN_SHAPED, [], trajectory)
    assert result.action_positions.tolist() == action
    assert result.env_positions.tolist() == env
    assert result.observation_tokens == observed
    assert result.action_positions.size > len("done")  # the empty turn's markers are marked too


def test_byte_search_starts_at_the_top_of_the_text(qwen):
    """Kiln searches from offset 0, not from the end of the prompt: an assistant turn inside
    ``messages`` is what the first action segment finds."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "EARLIER"}]
    result = build(qwen, [act("LATER")], messages)
    assert text_of(qwen, result, result.action_positions) == "EARLIER"


def test_warning_prefix_longer_than_the_content_is_clamped(qwen):
    result = build(qwen, [act("A"), obs("short", warning_prefix_len=10**9)])
    assert result.problem is None
    assert result.env_positions.size == len("short") and result.env_in_warning_prefix.all()
    assert result.observation_tokens == len("short")


def test_action_at_position_zero_is_refused(tmp_path):
    student = byte_level_student(tmp_path / "content-only", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    result = build(student, [act("go"), ctx("user", "x")], messages=[{"role": "user", "content": ""}])
    assert result.problem is not None and result.problem.code == "target_at_position_zero"
    assert result.action_positions[0] == 0
