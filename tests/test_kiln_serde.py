"""Kiln's record parser is serde: the shapes it refuses are refused here, on both parsers, at Kiln's line.

Each case is one edit of a valid corpus; the verdict (admitted, or code and line) must be the same
from the fast (pyarrow) parser and the exact one. The serde derives decide (opd.rs, trajectory.rs,
kiln-core's ChatMessage): a required field may not be missing or null, an ``Option`` may be null, a
``#[serde(default)] Vec`` may be missing but not null, an enum is never null, integers have Kiln's
widths. Kiln reads line by line, so the first bad line is reported, manifest rules included.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest

from kiln_core.admission import admit_corpus, columnar
from kiln_core.errors import AdmissionError
from kiln_core.synthetic import synthesize_corpus
from kiln_core.tokenization import load_student_tokenizer


@pytest.fixture(scope="module")
def student(tiny_student):
    return load_student_tokenizer(tiny_student)


@pytest.fixture(scope="module")
def base_lines(tiny_student, tmp_path_factory) -> list[str]:
    """Manifest + 4 examples; the examples on lines 2 and 5 use a trajectory."""
    path = synthesize_corpus(tiny_student, tmp_path_factory.mktemp("serde") / "c.jsonl", n_examples=4, top_k=16, seed=8,
                             trajectory_every=3)
    return path.read_text(encoding="utf-8").splitlines()


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def edited(lines: list[str], number: int, change) -> list[str]:
    lines = list(lines)
    record = json.loads(lines[number - 1])
    change(record)
    lines[number - 1] = compact(record)
    return lines


def verdicts(tmp_path: Path, lines: list[str], student, student_dir) -> tuple:
    """The verdict of the default parser and of the exact one; they must agree."""
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    results = []
    for exact in (False, True):
        patch = mock.patch.object(columnar, "parse_columnar", lambda data, index: None) if exact else nullcontext()
        with patch:
            try:
                result = admit_corpus(str(path), str(student_dir), top_k=16, student=student)
                results.append(("admitted", result.examples, result.action_tokens, result.env_tokens))
            except AdmissionError as error:
                results.append(("rejected", error.code, error.line, error.message))
    assert results[0][:3] == results[1][:3], results
    return results[1]


def segment(record, index: int = 0) -> dict:
    return record["trajectory"][index]


REFUSED = {
    "trajectory-null": (2, lambda r: r.__setitem__("trajectory", None), "trajectory"),
    "kind-null": (2, lambda r: segment(r).__setitem__("kind", None), "kind"),
    "segment-role-null": (2, lambda r: segment(r).__setitem__("role", None), "role"),
    "segment-content-null": (2, lambda r: segment(r).__setitem__("content", None), "content"),
    "segment-tool-call-id-number": (2, lambda r: segment(r).__setitem__("tool_call_id", 5), "tool_call_id"),
    "warning-prefix-negative": (2, lambda r: segment(r, 1).__setitem__("warning_prefix_len", -1), "warning_prefix_len"),
    "warning-prefix-float": (2, lambda r: segment(r, 1).__setitem__("warning_prefix_len", 9.0), "warning_prefix_len"),
    "warning-prefix-bool": (2, lambda r: segment(r, 1).__setitem__("warning_prefix_len", True), "warning_prefix_len"),
    "warning-prefix-beyond-u64": (2, lambda r: segment(r, 1).__setitem__("warning_prefix_len", 2**64), "warning_prefix_len"),
    "teacher-tokens-null": (3, lambda r: r.__setitem__("teacher_tokens", None), "teacher_tokens"),
    "top-logprobs-null": (3, lambda r: r["teacher_tokens"][0].__setitem__("top_logprobs", None), "top_logprobs"),
    "candidate-id-null": (3, lambda r: r["teacher_tokens"][0]["top_logprobs"][0].__setitem__("token_id", None), "token_id"),
    "candidate-logprob-null": (3, lambda r: r["teacher_tokens"][0]["top_logprobs"][0].__setitem__("logprob", None), "logprob"),
    "candidate-id-beyond-u32": (3, lambda r: r["teacher_tokens"][0]["top_logprobs"][0].__setitem__("token_id", 2**32), "token_id"),
    "token-text-number": (3, lambda r: r["teacher_tokens"][0].__setitem__("token", 5), "token"),
    "messages-null": (3, lambda r: r.__setitem__("messages", None), "messages"),
    "response-null": (3, lambda r: r.__setitem__("teacher_response", None), "teacher_response"),
    "message-name-number": (3, lambda r: r["messages"][0].__setitem__("name", 5), "name"),
    "message-tool-call-id-list": (3, lambda r: r["messages"][0].__setitem__("tool_call_id", []), "tool_call_id"),
    "message-tool-calls-string": (3, lambda r: r["messages"][0].__setitem__("tool_calls", "read"), "tool_calls"),
    "id-number": (3, lambda r: r.__setitem__("id", 7), "id"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_shapes_serde_refuses_are_invalid_records(tmp_path, base_lines, student, tiny_student, case):
    number, change, field = REFUSED[case]
    verdict = verdicts(tmp_path, edited(base_lines, number, change), student, tiny_student)
    assert verdict[:3] == ("rejected", "invalid_record", number)
    assert field in verdict[3]


ACCEPTED = {
    "id-null": (3, lambda r: r.__setitem__("id", None)),
    "metadata-anything": (3, lambda r: r.__setitem__("metadata", [None, {"deep": [1]}])),
    "declared-token-id-null": (3, lambda r: r["teacher_tokens"][0].__setitem__("token_id", None)),
    "token-logprob-null": (3, lambda r: r["teacher_tokens"][0].__setitem__("logprob", None)),
    "kind-missing-is-context": (2, lambda r: r["trajectory"].append({"role": "user", "content": "thanks"})),
    "segment-tool-call-id-null": (2, lambda r: segment(r).__setitem__("tool_call_id", None)),
    "warning-prefix-null": (2, lambda r: segment(r, 1).__setitem__("warning_prefix_len", None)),
    "message-optional-fields-null": (3, lambda r: r["messages"][0].update(name=None, tool_call_id=None, tool_calls=None)),
    "content-null": (3, lambda r: r["messages"][0].__setitem__("content", None)),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_shapes_serde_accepts_are_admitted(tmp_path, base_lines, student, tiny_student, case):
    number, change = ACCEPTED[case]
    assert verdicts(tmp_path, edited(base_lines, number, change), student, tiny_student)[0] == "admitted"


@pytest.mark.parametrize("prefix", [16, 10_000, 2**64 - 1])
def test_warning_prefix_beyond_the_content_is_clamped_not_refused(tmp_path, base_lines, student, tiny_student, prefix):
    """Kiln trims ``min(content_start + warning_prefix_len, content_end)``: the whole observation is
    warning, so no env target is left, and |O| is unchanged."""
    def long_prefix(record):
        observation = segment(record, 1)
        assert observation["kind"] == "observation"
        observation["content"] = "warning: x"  # 10 bytes, shorter than every prefix here
        observation["warning_prefix_len"] = prefix

    def exact_prefix(record):
        long_prefix(record)
        segment(record, 1)["warning_prefix_len"] = 10

    clamped = verdicts(tmp_path, edited(base_lines, 2, long_prefix), student, tiny_student)
    whole = verdicts(tmp_path, edited(base_lines, 2, exact_prefix), student, tiny_student)
    assert clamped[0] == "admitted" and clamped == whole


# --- nesting ---------------------------------------------------------------------------------------


def nested(lines: list[str], number: int, depth: int, *, tail: str = "") -> list[str]:
    """Line ``number`` with ``metadata`` nesting so the line is ``depth`` containers deep."""
    lines = edited(lines, number, lambda r: r.__setitem__("metadata", "@@"))
    lines[number - 1] = lines[number - 1].replace('"@@"', "[" * (depth - 1) + "]" * (depth - 1) + tail)
    return lines


@pytest.mark.parametrize("depth, expected", [(126, "admitted"), (127, "admitted"), (128, "rejected"), (129, "rejected"),
                                             (50_000, "rejected")])
def test_nesting_boundary_on_both_parsers(tmp_path, base_lines, student, tiny_student, depth, expected):
    verdict = verdicts(tmp_path, nested(base_lines, 4, depth), student, tiny_student)
    assert verdict[0] == expected
    if expected == "rejected":
        assert verdict[1:3] == ("nesting_too_deep", 4)


def test_too_deep_container_before_a_syntax_error_is_reported_as_nesting(tmp_path, base_lines, student, tiny_student):
    """serde_json reads left to right: the 128th container is refused before it sees the broken tail."""
    deep_then_broken = base_lines[:3] + ['{"metadata":' + "[" * 130 + "nope"]
    assert verdicts(tmp_path, deep_then_broken, student, tiny_student)[1:3] == ("nesting_too_deep", 4)
    broken_then_deep = base_lines[:3] + ['{"x": nope, "metadata":' + "[" * 130 + "]" * 130 + "}"]
    assert verdicts(tmp_path, broken_then_deep, student, tiny_student)[1:3] == ("invalid_json", 4)


def test_brackets_inside_strings_do_not_nest(tmp_path, base_lines, student, tiny_student):
    text = "[" * 300 + '\\"' + "{" * 300
    lines = edited(base_lines, 3, lambda r: r.__setitem__("metadata", {"note": text}))
    assert verdicts(tmp_path, lines, student, tiny_student)[0] == "admitted"


def test_too_deep_manifest_line(tmp_path, base_lines, student, tiny_student):
    manifest = json.loads(base_lines[0])
    manifest["teacher_identity"]["adapter"] = "@@"
    line = compact(manifest).replace('"@@"', "[" * 140 + "]" * 140)
    assert verdicts(tmp_path, [line] + base_lines[1:], student, tiny_student)[1:3] == ("nesting_too_deep", 1)


# --- which line is reported ------------------------------------------------------------------------


def test_bad_example_before_a_misplaced_manifest_is_reported_first(tmp_path, base_lines, student, tiny_student):
    bad = edited(base_lines, 3, lambda r: r.__setitem__("messages", None))[2]
    lines = [base_lines[1], bad, base_lines[0]] + base_lines[2:]
    assert verdicts(tmp_path, lines, student, tiny_student)[1:3] == ("invalid_record", 2)


def test_misplaced_manifest_before_a_bad_example_is_reported_first(tmp_path, base_lines, student, tiny_student):
    bad = edited(base_lines, 3, lambda r: r.__setitem__("messages", None))[2]
    lines = [base_lines[1], base_lines[0], bad] + base_lines[3:]
    assert verdicts(tmp_path, lines, student, tiny_student)[1:3] == ("manifest_not_first", 2)


def test_bad_manifest_is_reported_before_a_later_bad_line(tmp_path, base_lines, student, tiny_student):
    manifest = json.loads(base_lines[0])
    manifest["teacher_identity"]["max_top_k"] = 0
    lines = [compact(manifest)] + base_lines[1:] + ["{not json"]
    assert verdicts(tmp_path, lines, student, tiny_student)[1:3] == ("manifest_invalid", 1)
    assert verdicts(tmp_path, [" " + base_lines[0]] + base_lines[1:] + ["[1]"], student, tiny_student)[1:3] == (
        "manifest_not_canonical", 1)


def test_the_documented_record_model_agrees(base_lines):
    """``kiln_core.contracts.example.OpdExample`` documents the record: it refuses and accepts the same shapes."""
    import pydantic

    from kiln_core.contracts.example import OpdExample

    for case, (number, change, _) in REFUSED.items():
        with pytest.raises(pydantic.ValidationError):
            OpdExample.model_validate_json(edited(base_lines, number, change)[number - 1])
    for case, (number, change) in ACCEPTED.items():
        OpdExample.model_validate_json(edited(base_lines, number, change)[number - 1])
