"""Every admission code, produced by a minimal corpus that breaks exactly that rule.

The base corpus is built by ``kiln_core.synthetic`` for the tiny student: line 1 is the manifest,
lines 2.. are examples with 16 candidates per teacher token. Each case edits one thing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from student_variants import ASSISTANT_FIRST, LAST_MESSAGE_ONLY, student_variant

from kiln_core.admission import admit_corpus
from kiln_core.contracts.identity import TeacherIdentity, build_manifest_line
from kiln_core.errors import ADMISSION_CODES, AdmissionError
from kiln_core.synthetic import synthesize_corpus


@pytest.fixture(scope="module")
def base_lines(tiny_student, tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("base") / "corpus.jsonl"
    synthesize_corpus(tiny_student, path, n_examples=4, top_k=16, seed=3, trajectory_every=3)
    return path.read_text(encoding="utf-8").splitlines()


def write(tmp_path: Path, lines: list[str] | bytes, name: str = "corpus.jsonl") -> Path:
    path = tmp_path / name
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def edit_example(lines: list[str], line_number: int, change) -> list[str]:
    """Apply ``change(record)`` to the example on physical line ``line_number`` (1-based)."""
    lines = list(lines)
    record = json.loads(lines[line_number - 1])
    change(record)
    lines[line_number - 1] = compact(record)
    return lines


def rejection(tmp_path, lines, student, **kwargs) -> AdmissionError:
    path = write(tmp_path, lines) if not isinstance(lines, Path) else lines
    with pytest.raises(AdmissionError) as caught:
        admit_corpus(str(path), str(student), top_k=kwargs.pop("top_k", 16), **kwargs)
    return caught.value


def test_base_corpus_is_admitted(tmp_path, tiny_student, base_lines):
    result = admit_corpus(str(write(tmp_path, base_lines)), str(tiny_student), top_k=16)
    assert result.examples == 4
    assert result.effective_top_k == 16
    assert result.action_tokens > 0 and result.env_tokens > 0


# --- file-level rules ----------------------------------------------------------------------------


def test_file_not_found(tmp_path, tiny_student):
    error = rejection(tmp_path, tmp_path / "missing.jsonl", tiny_student)
    assert (error.code, error.line) == ("file_not_found", None)


def test_file_unreadable(tmp_path, tiny_student, base_lines, monkeypatch):
    import builtins

    import kiln_core.admission.source as source

    path = write(tmp_path, base_lines)
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):  # chmod does not stop root: the refusal is simulated
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(source, "open", refusing_open, raising=False)
    error = rejection(tmp_path, path, tiny_student)
    assert (error.code, error.line) == ("file_unreadable", None) and "Permission denied" in error.message


def test_symlink_is_not_a_regular_file(tmp_path, tiny_student, base_lines):
    target = write(tmp_path, base_lines)
    link = tmp_path / "link.jsonl"
    os.symlink(target, link)
    assert rejection(tmp_path, link, tiny_student).code == "not_regular_file"


def test_directory_is_not_a_regular_file(tmp_path, tiny_student):
    assert rejection(tmp_path, tmp_path, tiny_student).code == "not_regular_file"


def test_file_larger_than_64_mib(tmp_path, tiny_student, base_lines):
    path = write(tmp_path, base_lines)
    with path.open("ab") as handle:
        handle.truncate(64 * 1024 * 1024 + 1)
    error = rejection(tmp_path, path, tiny_student)
    assert (error.code, error.line) == ("file_too_large", None)


def test_invalid_utf8_names_the_line(tmp_path, tiny_student, base_lines):
    data = ("\n".join(base_lines[:2]) + "\n").encode() + b'{"bad": "\xff"}\n'
    error = rejection(tmp_path, write(tmp_path, data), tiny_student)
    assert (error.code, error.line) == ("invalid_utf8", 3)


# --- line parsing --------------------------------------------------------------------------------


def test_invalid_json(tmp_path, tiny_student, base_lines):
    lines = base_lines[:2] + ["{not json"] + base_lines[2:]
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("invalid_json", 3)


@pytest.mark.parametrize("literal", ["1e400", "1.8e308", "-" + "9" * 320])
def test_a_number_beyond_an_f64_is_invalid_json_even_in_an_ignored_field(tmp_path, tiny_student, base_lines, literal):
    """Kiln reads each line as a ``serde_json::Value`` first (opd.rs), and serde_json refuses such a number."""
    record = json.loads(base_lines[2])
    record["extra"] = {"n": "@@"}
    lines = base_lines[:2] + [json.dumps(record).replace('"@@"', literal)] + base_lines[3:]
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("invalid_json", 3) and "number out of range" in error.message


def test_not_an_object(tmp_path, tiny_student, base_lines):
    error = rejection(tmp_path, base_lines + ["[1, 2, 3]"], tiny_student)
    assert (error.code, error.line) == ("not_an_object", len(base_lines) + 1)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda r: r.__setitem__("messages", "hello"), "messages"),
        (lambda r: r.pop("messages"), "messages"),
        (lambda r: r.__setitem__("teacher_response", 5), "teacher_response"),
        (lambda r: r["teacher_tokens"].__setitem__(0, "x"), "teacher_tokens[0]"),
        (lambda r: r["teacher_tokens"][0]["top_logprobs"][0].__setitem__("token_id", -1), "token_id"),
        (lambda r: r["teacher_tokens"][0]["top_logprobs"][0].__setitem__("token_id", 1.5), "token_id"),
        (lambda r: r["teacher_tokens"][0]["top_logprobs"][0].__setitem__("logprob", "low"), "logprob"),
        (lambda r: r["teacher_tokens"][0].__setitem__("top_logprobs", None), "top_logprobs"),
        (lambda r: r["messages"][0].__setitem__("role", None), "role"),
        (lambda r: r.__setitem__("trajectory", [{"role": "assistant", "content": "x", "kind": "reward"}]), "kind"),
        (lambda r: r.__setitem__("id", 7), "id"),
    ],
)
def test_invalid_record_names_the_field(tmp_path, tiny_student, base_lines, change, field):
    error = rejection(tmp_path, edit_example(base_lines, 3, change), tiny_student)
    assert (error.code, error.line) == ("invalid_record", 3)
    assert field in error.message


@pytest.mark.parametrize("depth, verdict", [(127, "admitted"), (128, "nesting_too_deep")])
def test_nesting_limit_is_serde_jsons(tmp_path, tiny_student, base_lines, depth, verdict):
    """serde_json refuses the 128th nested container, even inside a field Kiln ignores (the line is
    decoded to a Value first); the record itself counts as one level."""
    lines = edit_example(base_lines, 3, lambda r: r.__setitem__("metadata", "@@"))
    lines[2] = lines[2].replace('"@@"', "[" * (depth - 1) + "]" * (depth - 1))
    path = write(tmp_path, lines)
    if verdict == "admitted":
        assert admit_corpus(str(path), str(tiny_student), top_k=16).examples == 4
    else:
        error = rejection(tmp_path, path, tiny_student)
        assert (error.code, error.line) == ("nesting_too_deep", 3)
        assert "128" in error.message


def test_unknown_example_fields_are_ignored(tmp_path, tiny_student, base_lines):
    lines = edit_example(base_lines, 2, lambda r: r.update({"extra": {"nested": [1, "x"]}, "schema": "other.v1"}))
    assert admit_corpus(str(write(tmp_path, lines)), str(tiny_student), top_k=16).examples == 4


def test_blank_lines_are_skipped_and_counted(tmp_path, tiny_student, base_lines):
    lines = ["", "   "] + base_lines[:1] + ["\t"] + base_lines[1:2] + [""] + ["{oops"]
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("invalid_json", 7)


# --- manifest rules ------------------------------------------------------------------------------


def test_manifest_not_first(tmp_path, tiny_student, base_lines):
    lines = base_lines[1:2] + base_lines[:1] + base_lines[2:]
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("manifest_not_first", 2)


def test_second_manifest_is_not_first(tmp_path, tiny_student, base_lines):
    error = rejection(tmp_path, base_lines[:1] + base_lines[:1] + base_lines[1:], tiny_student)
    assert (error.code, error.line) == ("manifest_not_first", 2)


@pytest.mark.parametrize(
    "transform",
    [
        lambda line: " " + line,
        lambda line: line + " ",
        lambda line: json.dumps(json.loads(line), indent=1).replace("\n", ""),
        lambda line: json.dumps(json.loads(line), separators=(",", ":"), sort_keys=True),
    ],
    ids=["leading-space", "trailing-space", "spaced", "sorted-keys"],
)
def test_manifest_not_canonical(tmp_path, tiny_student, base_lines, transform):
    error = rejection(tmp_path, [transform(base_lines[0])] + base_lines[1:], tiny_student)
    assert (error.code, error.line) == ("manifest_not_canonical", 1)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update({"extra": 1}),
        lambda m: m["teacher_identity"].update({"base_model_sha256": "sha256:" + "a" * 64}),
        lambda m: m["teacher_identity"].update({"base_model_sha256": "A" * 64}),
        lambda m: m["teacher_identity"].update({"logprobs_mode": "processed_logprobs"}),
        lambda m: m["teacher_identity"].update({"protocol": "other.v1"}),
        lambda m: m["teacher_identity"].update({"max_top_k": 0}),
        lambda m: m["teacher_identity"].update({"vocab_size": 400.0}),
        lambda m: m["teacher_identity"].pop("implementation"),
    ],
)
def test_manifest_invalid(tmp_path, tiny_student, base_lines, change):
    manifest = json.loads(base_lines[0])
    change(manifest)
    error = rejection(tmp_path, [compact(manifest)] + base_lines[1:], tiny_student)
    assert (error.code, error.line) == ("manifest_invalid", 1)


def test_kiln_strict_refuses_our_protocol(tmp_path, tiny_student, base_lines):
    manifest = json.loads(base_lines[0])
    manifest["teacher_identity"]["protocol"] = "kiln-flows.hf-eager.prompt-logprobs.numeric-token-ids.causal.v1"
    lines = [compact(manifest)] + base_lines[1:]
    assert admit_corpus(str(write(tmp_path, lines)), str(tiny_student), top_k=16).examples == 4
    assert rejection(tmp_path, lines, tiny_student, kiln_strict=True).code == "manifest_invalid"


def test_manifest_missing_when_logits_are_numeric(tmp_path, tiny_student, base_lines):
    error = rejection(tmp_path, base_lines[1:], tiny_student)
    assert (error.code, error.line) == ("manifest_missing", None)


def test_identity_mismatch_with_pinned_manifest(tmp_path, tiny_student, base_lines):
    pinned = TeacherIdentity.model_validate(json.loads(base_lines[0])["teacher_identity"])
    other = pinned.model_copy(update={"served_model_id": "another-teacher"})
    error = rejection(tmp_path, base_lines, tiny_student, pinned_manifest=build_manifest_line(other))
    assert (error.code, error.line) == ("identity_mismatch", 1)
    assert "served_model_id" in error.message
    # the exact pinned line (with a trailing newline, as a file holds it) is accepted
    ok = admit_corpus(str(write(tmp_path, base_lines)), str(tiny_student), top_k=16, pinned_manifest=base_lines[0] + "\n")
    assert ok.examples == 4


def test_vocab_size_mismatch(tmp_path, tiny_student, base_lines):
    manifest = json.loads(base_lines[0])
    manifest["teacher_identity"]["vocab_size"] = 512
    error = rejection(tmp_path, [compact(manifest)] + base_lines[1:], tiny_student)
    assert (error.code, error.line) == ("vocab_size_mismatch", 1)


def test_top_k_exceeds_identity(tmp_path, tiny_student, base_lines):
    manifest = json.loads(base_lines[0])
    manifest["teacher_identity"]["max_top_k"] = 20
    lines = [compact(manifest)] + base_lines[1:]
    error = rejection(tmp_path, lines, tiny_student, top_k=32)
    assert (error.code, error.line) == ("top_k_exceeds_identity", 1)
    assert admit_corpus(str(write(tmp_path, lines)), str(tiny_student), top_k=20).effective_top_k == 16


@pytest.mark.parametrize("requested", [0, 8, 15])
def test_top_k_unsupported(tmp_path, tiny_student, base_lines, requested):
    error = rejection(tmp_path, base_lines, tiny_student, top_k=requested)
    assert (error.code, error.line) == ("top_k_unsupported", None)


def test_no_examples(tmp_path, tiny_student, base_lines):
    error = rejection(tmp_path, base_lines[:1] + [""], tiny_student)
    assert (error.code, error.line) == ("no_examples", None)


# --- per-example rules ---------------------------------------------------------------------------


def test_empty_messages(tmp_path, tiny_student, base_lines):
    error = rejection(tmp_path, edit_example(base_lines, 3, lambda r: r.__setitem__("messages", [])), tiny_student)
    assert (error.code, error.line) == ("empty_messages", 3)
    assert "example 1" in error.message


def test_empty_response(tmp_path, tiny_student, base_lines):
    error = rejection(tmp_path, edit_example(base_lines, 4, lambda r: r.__setitem__("teacher_response", "")), tiny_student)
    assert (error.code, error.line) == ("empty_response", 4)


def test_no_action_tokens(tmp_path, tiny_student, base_lines):
    def only_context(record):
        record["trajectory"] = [{"role": "assistant", "content": "just context", "kind": "context"}]
        record["teacher_tokens"] = []

    error = rejection(tmp_path, edit_example(base_lines, 3, only_context), tiny_student)
    assert (error.code, error.line) == ("no_action_tokens", 3)


def test_token_count_mismatch(tmp_path, tiny_student, base_lines):
    error = rejection(tmp_path, edit_example(base_lines, 3, lambda r: r["teacher_tokens"].pop()), tiny_student)
    assert (error.code, error.line) == ("token_count_mismatch", 3)
    assert "teacher_tokens but" in error.message


def test_missing_teacher_tokens_is_a_count_mismatch(tmp_path, tiny_student, base_lines):
    error = rejection(tmp_path, edit_example(base_lines, 3, lambda r: r.pop("teacher_tokens")), tiny_student)
    assert (error.code, error.line) == ("token_count_mismatch", 3)


def test_token_id_mismatch(tmp_path, tiny_student, base_lines):
    def wrong_id(record):
        token = record["teacher_tokens"][2]
        token["token_id"] = (token["token_id"] + 1) % 300

    error = rejection(tmp_path, edit_example(base_lines, 3, wrong_id), tiny_student)
    assert (error.code, error.line) == ("token_id_mismatch", 3)
    assert "token 2" in error.message


def test_missing_top_logprobs_is_an_empty_row(tmp_path, tiny_student, base_lines):
    """serde's ``#[serde(default)]``: a token without ``top_logprobs`` has none, so too few for K."""
    error = rejection(tmp_path, edit_example(base_lines, 3, lambda r: r["teacher_tokens"][1].pop("top_logprobs")), tiny_student)
    assert (error.code, error.line) == ("too_few_candidates", 3)
    assert "token 1 " in error.message and "has 0 top_logprobs" in error.message


def test_absent_token_id_is_not_checked(tmp_path, tiny_student, base_lines):
    lines = edit_example(base_lines, 3, lambda r: [t.pop("token_id") for t in r["teacher_tokens"]])
    assert admit_corpus(str(write(tmp_path, lines)), str(tiny_student), top_k=16).examples == 4


def candidate_case(index: int, change):
    def apply(record):
        change(record["teacher_tokens"][index]["top_logprobs"])

    return apply


def test_too_few_candidates(tmp_path, tiny_student, base_lines):
    lines = edit_example(base_lines, 2, candidate_case(1, lambda c: c.pop()))
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("too_few_candidates", 2)
    assert "token 1" in error.message and "need at least 16" in error.message


def test_more_than_top_k_candidates_is_fine_and_only_first_k_count(tmp_path, tiny_student, base_lines):
    # an extra 17th candidate that would break every rule is never consumed
    lines = edit_example(base_lines, 2, candidate_case(0, lambda c: c.append({"token_id": 10**6, "logprob": 5.0})))
    assert admit_corpus(str(write(tmp_path, lines)), str(tiny_student), top_k=16).examples == 4


def test_token_id_out_of_range(tmp_path, tiny_student, base_lines):
    lines = edit_example(base_lines, 2, candidate_case(0, lambda c: c[3].__setitem__("token_id", 400)))
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("token_id_out_of_range", 2)
    assert "400" in error.message


@pytest.mark.parametrize("value", ["NaN", "-Infinity", "-1e39"])
def test_non_finite_logprob(tmp_path, tiny_student, base_lines, value):
    lines = edit_example(base_lines, 2, candidate_case(0, lambda c: c[-1].__setitem__("logprob", "@@")))
    lines = [line.replace('"@@"', value) for line in lines]
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("non_finite_logprob", 2)


def test_positive_logprob(tmp_path, tiny_student, base_lines):
    lines = edit_example(base_lines, 2, candidate_case(0, lambda c: c[0].__setitem__("logprob", 0.25)))
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("positive_logprob", 2)


def test_duplicate_candidate(tmp_path, tiny_student, base_lines):
    lines = edit_example(base_lines, 2, candidate_case(0, lambda c: c[5].__setitem__("token_id", c[4]["token_id"])))
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("duplicate_candidate", 2)


def test_not_non_increasing(tmp_path, tiny_student, base_lines):
    def swap(candidates):
        candidates[2]["logprob"], candidates[3]["logprob"] = candidates[3]["logprob"] - 0.0, candidates[2]["logprob"]
        if candidates[2]["logprob"] == candidates[3]["logprob"]:
            candidates[3]["logprob"] += 0.5

    error = rejection(tmp_path, edit_example(base_lines, 2, candidate_case(0, swap)), tiny_student)
    assert (error.code, error.line) == ("not_non_increasing", 2)


def test_ties_are_non_increasing(tmp_path, tiny_student, base_lines):
    def tie(candidates):
        candidates[1]["logprob"] = candidates[0]["logprob"]
        for c in candidates[2:]:
            c["logprob"] = min(c["logprob"], candidates[1]["logprob"])

    lines = edit_example(base_lines, 2, candidate_case(0, tie))
    assert admit_corpus(str(write(tmp_path, lines)), str(tiny_student), top_k=16).examples == 4


def test_mass_exceeds_one(tmp_path, tiny_student, base_lines):
    def heavy(candidates):
        for c in candidates:
            c["logprob"] = -0.05

    error = rejection(tmp_path, edit_example(base_lines, 2, candidate_case(0, heavy)), tiny_student)
    assert (error.code, error.line) == ("mass_exceeds_one", 2)


def test_mass_limit_is_one_plus_32_f32_epsilon(tmp_path, tiny_student, base_lines):
    import math

    import numpy as np

    eps = float(np.finfo(np.float32).eps)

    def at_mass(mass):
        def change(candidates):
            half = float(np.float32(math.log(mass / 2)))
            candidates[0]["logprob"] = candidates[1]["logprob"] = half
            for c in candidates[2:]:
                c["logprob"] = -120.0
        return candidate_case(0, change)

    ok = edit_example(base_lines, 2, at_mass(1.0 + 16 * eps))
    assert admit_corpus(str(write(tmp_path, ok)), str(tiny_student), top_k=16).examples == 4
    error = rejection(tmp_path, edit_example(base_lines, 2, at_mass(1.0 + 64 * eps)), tiny_student)
    assert error.code == "mass_exceeds_one"


def test_conflicting_duplicate_row(tmp_path, tiny_student, base_lines):
    duplicate = json.loads(base_lines[1])
    duplicate["teacher_tokens"][1]["top_logprobs"][-1]["logprob"] -= 0.5
    duplicate["id"] = "another-id"  # ids and metadata do not matter: the token sequence does
    error = rejection(tmp_path, base_lines + [compact(duplicate)], tiny_student)
    assert (error.code, error.line) == ("conflicting_duplicate_row", len(base_lines) + 1)
    assert "token 1" in error.message


def test_exact_duplicate_rows_are_harmless(tmp_path, tiny_student, base_lines):
    result = admit_corpus(str(write(tmp_path, base_lines + base_lines[1:2])), str(tiny_student), top_k=16)
    assert result.examples == 5


# --- mask rules and the student's vocabulary -----------------------------------------------------


def test_overlapping_masks(tmp_path, tiny_student):
    """Prefix renders that shrink make two supervised segments claim the same tokens: Kiln refuses it.

    The template renders only the last message, so the byte search finds no marker and the prefix
    fallback gives the action tokens [len(render(prompt)), len(render(+action))) and the observation
    tokens [len(render(+context)), len(render(all))) — the same positions.
    """
    student = student_variant(tiny_student, tmp_path / "last-only", template=LAST_MESSAGE_ONLY)
    record = {
        "messages": [{"role": "user", "content": "x"}],
        "teacher_response": "unused",
        "trajectory": [
            {"role": "assistant", "content": "the quick brown fox jumps", "kind": "action"},
            {"role": "user", "content": "y", "kind": "context"},
            {"role": "tool", "content": "over the lazy dog again", "kind": "observation"},
        ],
    }
    error = rejection(tmp_path, [compact(record)], student)
    assert (error.code, error.line) == ("overlapping_masks", 1)
    assert "overlap at token index 1" in error.message


def test_target_at_position_zero(tmp_path, tiny_student):
    """A template that starts the text with the assistant's content makes position 0 a target."""
    student = student_variant(tiny_student, tmp_path / "assistant-first", template=ASSISTANT_FIRST)
    record = {"messages": [{"role": "user", "content": "hi"}], "teacher_response": "hello world again"}
    error = rejection(tmp_path, [compact(record)], student)
    assert (error.code, error.line) == ("target_at_position_zero", 1)


def test_input_token_out_of_range(tmp_path, tiny_student, base_lines):
    """Kiln's fixture insert refuses input ids ≥ the model's vocab_size, after row 0 is validated."""
    from kiln_core.tokenization import encode_conversations, load_student_tokenizer
    from kiln_core.admission.records import parse_corpus

    student_dir = student_variant(tiny_student, tmp_path / "narrow", vocab_size=300)
    student = load_student_tokenizer(student_dir)
    manifest = json.loads(base_lines[0])
    manifest["teacher_identity"]["vocab_size"] = 300
    lines = [compact(manifest)] + base_lines[1:]
    (encoded,) = encode_conversations(student, parse_corpus((lines[2] + "\n").encode()).conversations)
    assert encoded.input_ids.max() >= 300  # the example does use an id the narrow model has no logit for

    def candidates_below_300(record):
        for token in record["teacher_tokens"]:
            for rank, candidate in enumerate(token["top_logprobs"]):
                candidate["token_id"] = 200 + rank  # a valid row: unique ids < 300, logprobs untouched

    lines = [lines[0]] + [edit_example(lines, n, candidates_below_300)[n - 1] for n in range(2, len(lines) + 1)]
    error = rejection(tmp_path, lines, student_dir)
    assert error.code == "input_token_out_of_range"
    assert "outside the student's vocab_size 300" in error.message
    # a bad row 0 is reported first: Kiln validates the row before it inserts the sequence
    first = edit_example(lines, error.line, candidate_case(0, lambda c: c.pop()))
    assert rejection(tmp_path, first, student_dir).code == "too_few_candidates"


# --- ordering: the first failure in file order wins ---------------------------------------------


def test_earliest_example_wins(tmp_path, tiny_student, base_lines):
    lines = edit_example(base_lines, 4, lambda r: r.__setitem__("messages", []))
    lines = edit_example(lines, 3, candidate_case(0, lambda c: c.pop()))
    error = rejection(tmp_path, lines, tiny_student)
    assert (error.code, error.line) == ("too_few_candidates", 3)


def test_every_code_is_covered():
    """Guard: each code of the contract has a test above that produces it."""
    source = Path(__file__).read_text(encoding="utf-8")
    missing = [code for code in ADMISSION_CODES if f'"{code}"' not in source.replace(f'"{code}" in', "")]
    assert not missing, missing
