"""The two corpus parsers and the robustness of admission as a whole.

* The fast (pyarrow) and exact (Python) parsers must produce identical tables for the same corpus;
  corpora that only the exact parser can read (content parts, ``tool_calls``, Unicode whitespace
  around a record, …) are admitted exactly like their plain equivalents.
* Whatever bytes a corpus holds, admission ends in an admission or in exactly one
  ``AdmissionError`` with a known code and a line inside the file, and a rejected corpus never
  leaves anything visible under ``<root>/corpora/``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import tempfile
import uuid
from pathlib import Path
from unittest import mock

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from student_variants import ASSISTANT_FIRST, LAST_MESSAGE_ONLY, student_variant

from kiln_core.admission import admit_corpus
from kiln_core.admission import columnar
from kiln_core.admission.records import parse_corpus
from kiln_core.contracts.identity import TeacherIdentity, build_manifest_line
from kiln_core.corpus import CorpusTables
from kiln_core.errors import ADMISSION_CODES, AdmissionError
from kiln_core.synthetic import synthesize_corpus
from kiln_core.tokenization import load_student_tokenizer

TABLE_FIELDS = [f.name for f in dataclasses.fields(CorpusTables)]


# --- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def student(tiny_student):
    return load_student_tokenizer(tiny_student)


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("paths")


@pytest.fixture(scope="module")
def base_lines(tiny_student, work_dir) -> list[str]:
    """Manifest + 4 examples (16 candidates per token); examples 0 and 3 use a trajectory."""
    path = synthesize_corpus(tiny_student, work_dir / "base.jsonl", n_examples=4, top_k=16, seed=21, trajectory_every=3)
    return path.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def small_lines(tiny_student, work_dir) -> list[str]:
    """A smaller corpus for the property tests: manifest + 3 short examples, one with a trajectory."""
    path = synthesize_corpus(
        tiny_student, work_dir / "small.jsonl", n_examples=3, top_k=16, seed=5, trajectory_every=2, words=3
    )
    return path.read_text(encoding="utf-8").splitlines()


def joined(lines: list[str], newline: str = "\n", final: bool = True) -> bytes:
    return (newline.join(lines) + (newline if final else "")).encode("utf-8")


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def edit(lines: list[str], index: int, change) -> list[str]:
    lines = list(lines)
    record = json.loads(lines[index])
    change(record)
    lines[index] = compact(record)
    return lines


_counter = iter(range(10**9))


def write_corpus(directory: Path, data: bytes) -> Path:
    path = directory / f"corpus-{next(_counter)}.jsonl"
    path.write_bytes(data)
    return path


def exact_only():
    """Force the exact parser (the fast one steps aside)."""
    return mock.patch.object(columnar, "parse_columnar", lambda data, lines: None)


def admit(path, student, tiny_student, *, exact=False, **kwargs):
    kwargs.setdefault("top_k", 16)
    if exact:
        with exact_only():
            return admit_corpus(str(path), str(tiny_student), student=student, **kwargs)
    return admit_corpus(str(path), str(tiny_student), student=student, **kwargs)


def outcome(path, student, tiny_student, *, exact=False, **kwargs):
    """``("admitted", result)`` or ``("rejected", code, line)``."""
    try:
        return ("admitted", admit(path, student, tiny_student, exact=exact, **kwargs))
    except AdmissionError as error:
        return ("rejected", error.code, error.line)


def assert_tables_equal(a: CorpusTables, b: CorpusTables, *, skip=()) -> None:
    for name in TABLE_FIELDS:
        if name in skip:
            continue
        x, y = getattr(a, name), getattr(b, name)
        if not isinstance(x, np.ndarray):  # kiln_prompts_sha256
            assert x == y, name
            continue
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def assert_same_admission(a, b, *, skip=()) -> None:
    assert (a.examples, a.action_tokens, a.env_tokens, a.effective_top_k) == (
        b.examples,
        b.action_tokens,
        b.env_tokens,
        b.effective_top_k,
    )
    assert a.manifest_line == b.manifest_line
    assert a.teacher_identity == b.teacher_identity
    assert_tables_equal(a.tables, b.tables, skip=skip)


def physical_lines(data: bytes) -> int:
    if not data:
        return 0
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


def visible_under(root: Path) -> list[str]:
    """Everything (hidden entries included) under ``<root>/corpora``."""
    corpora = root / "corpora"
    if not corpora.exists():
        return []
    return sorted(str(p.relative_to(corpora)) for p in corpora.rglob("*"))


# --- (a) fast and exact parsers ------------------------------------------------------------------


def test_parsers_produce_identical_parsed_corpora(base_lines):
    data = joined(base_lines)
    fast = parse_corpus(data)
    with exact_only():
        exact = parse_corpus(data)
    assert (fast.parser, exact.parser) == ("fast", "exact")
    for name in (
        "example_lines", "messages_count", "response_empty", "token_offsets", "declared_token_ids",
        "candidate_offsets", "candidate_ids", "candidate_logprobs",
    ):
        x, y = getattr(fast, name), getattr(exact, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    assert fast.conversations == exact.conversations
    assert fast.manifest_records == exact.manifest_records
    assert fast.first_example_line == exact.first_example_line == 2
    assert fast.numeric_logits is exact.numeric_logits is True
    assert fast.num_examples == exact.num_examples == 4
    assert any(c.trajectory for c in fast.conversations)


def test_fast_and_exact_admissions_are_identical(base_lines, student, tiny_student, tmp_path):
    path = write_corpus(tmp_path, joined(base_lines))
    fast = admit(path, student, tiny_student)
    exact = admit(path, student, tiny_student, exact=True)
    assert (fast.parser, exact.parser) == ("fast", "exact")
    assert fast.dataset_sha256 == exact.dataset_sha256
    assert fast.examples == 4 and fast.env_tokens > 0
    assert_same_admission(fast, exact)


def _content_parts(record):
    for message in record["messages"]:
        message["content"] = [{"type": "text", "text": message["content"]}]


def _split_content_parts(record):
    for message in record["messages"]:
        text = message["content"]
        message["content"] = [{"type": "text", "text": text[:3]}, {"type": "image"}, {"type": "text", "text": text[3:]}]


def _tool_calls(record):
    record["messages"][1]["tool_calls"] = [
        {"id": "call-1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"src\"}"}}
    ]


@pytest.mark.parametrize("change", [_content_parts, _split_content_parts, _tool_calls], ids=["parts", "split-parts", "tool-calls"])
def test_exact_only_records_admit_like_their_plain_equivalents(base_lines, student, tiny_student, tmp_path, change):
    changed = list(base_lines)
    for index in range(1, len(base_lines)):
        changed = edit(changed, index, change)
    plain = admit(write_corpus(tmp_path, joined(base_lines)), student, tiny_student)
    natural = admit(write_corpus(tmp_path, joined(changed)), student, tiny_student)
    assert natural.parser == "exact"
    assert natural.dataset_sha256 != plain.dataset_sha256
    if change is _tool_calls:  # Kiln's ChatMessage keeps tool_calls, so its prompt-list digest sees them
        assert natural.tables.kiln_prompts_sha256 != plain.tables.kiln_prompts_sha256
        assert_same_admission(natural, plain, skip=("kiln_prompts_sha256",))
    else:
        assert_same_admission(natural, plain)


def _with_whitespace_around_records(lines: list[str], before: str, after: str) -> list[str]:
    return [lines[0]] + [before + line + after for line in lines[1:]]


@pytest.mark.parametrize(
    "variant",
    ["form-feed", "ideographic-space", "nbsp-and-tab", "crlf", "no-final-newline", "crlf-no-final-newline", "blank-lines"],
)
def test_layout_variants_admit_like_the_plain_corpus(base_lines, student, tiny_student, tmp_path, variant):
    if variant == "form-feed":
        data = joined(_with_whitespace_around_records(base_lines, "\x0c", "\x0c"))
    elif variant == "ideographic-space":
        data = joined(_with_whitespace_around_records(base_lines, "\u3000", " \u3000"))
    elif variant == "nbsp-and-tab":
        data = joined(_with_whitespace_around_records(base_lines, "\t\u00a0", "\u2009\t"))
    elif variant == "crlf":
        data = joined(base_lines, "\r\n")
    elif variant == "no-final-newline":
        data = joined(base_lines, final=False)
    elif variant == "crlf-no-final-newline":
        data = joined(base_lines, "\r\n", final=False)
    else:
        data = joined([base_lines[0], "", "   ", base_lines[1], "\t", base_lines[2], " \r", *base_lines[3:]])
    plain = admit(write_corpus(tmp_path, joined(base_lines)), student, tiny_student)
    path = write_corpus(tmp_path, data)
    natural = admit(path, student, tiny_student)
    exact = admit(path, student, tiny_student, exact=True)
    if variant in ("form-feed", "ideographic-space", "nbsp-and-tab"):
        assert natural.parser == "exact"  # not JSON whitespace: only the exact parser reads it
    assert_same_admission(natural, exact)
    if variant == "blank-lines":
        assert_same_admission(natural, plain, skip=("lines",))
        np.testing.assert_array_equal(natural.tables.lines, [4, 6, 8, 9])
    else:
        assert_same_admission(natural, plain)
        np.testing.assert_array_equal(natural.tables.lines, [2, 3, 4, 5])


def test_whitespace_only_lines_of_any_kind_are_blank(base_lines, student, tiny_student, tmp_path):
    blanks = ["\x0c", "\u3000", "\u2028", " \t\r", "\x0b"]
    data = joined([blanks[0], base_lines[0], *blanks[1:], *base_lines[1:]])
    result = admit(write_corpus(tmp_path, data), student, tiny_student)
    assert result.examples == 4
    np.testing.assert_array_equal(result.tables.lines, np.arange(7, 11))


def test_crlf_manifest_is_canonical_but_trailing_unicode_whitespace_is_not(base_lines, student, tiny_student, tmp_path):
    crlf = joined(base_lines[:1], "\r\n") + joined(base_lines[1:])
    for exact in (False, True):
        assert admit(write_corpus(tmp_path, crlf), student, tiny_student, exact=exact).examples == 4
    for suffix in ("\u3000", "\x0c", " "):
        data = joined([base_lines[0] + suffix] + base_lines[1:])
        for exact in (False, True):
            verdict = outcome(write_corpus(tmp_path, data), student, tiny_student, exact=exact)
            assert verdict == ("rejected", "manifest_not_canonical", 1), (suffix, exact)


def test_declared_token_id_minus_one_is_rejected_on_both_paths(base_lines, student, tiny_student, tmp_path):
    """``teacher_tokens[].token_id`` is a u32 in Kiln: −1 is not "absent", it is an invalid record.

    The exact parser rejects it; the fast parser must not read −1 as its own "no token_id" marker.
    """
    lines = edit(base_lines, 2, lambda r: r["teacher_tokens"][0].__setitem__("token_id", -1))
    path = write_corpus(tmp_path, joined(lines))
    assert outcome(path, student, tiny_student, exact=True) == ("rejected", "invalid_record", 3)
    assert outcome(path, student, tiny_student) == ("rejected", "invalid_record", 3)


@pytest.mark.parametrize(
    "old, new, verdict",
    [
        ('{"id"', '{"metadata":{"a":1,"a":2},"id"', "admitted"),
        ('{"id"', '{"x":1,"x":2,"id"', "admitted"),
        ('{"role":"system"', '{"zz":1,"zz":2,"role":"system"', "admitted"),
        ('"top_logprobs":[{"token_id":', '"q":1,"q":2,"top_logprobs":[{"token_id":', "admitted"),
        ('"teacher_response":', '"teacher_response":"a","teacher_response":', "rejected"),
        ('{"role":"system"', '{"role":"user","role":"system"', "rejected"),
    ],
    ids=["metadata", "unknown-top-level", "unknown-in-message", "unknown-in-token", "known-top-level", "known-in-message"],
)
def test_duplicate_keys_get_the_same_verdict_on_both_paths(base_lines, student, tiny_student, tmp_path, old, new, verdict):
    """Like serde: a known field given twice is an invalid record; duplicates among ignored fields are ignored."""
    lines = list(base_lines)
    assert old in lines[2]
    lines[2] = lines[2].replace(old, new, 1)
    path = write_corpus(tmp_path, joined(lines))
    fast, exact = outcome(path, student, tiny_student), outcome(path, student, tiny_student, exact=True)
    assert exact[0] == verdict
    if verdict == "rejected":
        assert exact[1:] == ("invalid_record", 3)
        assert fast == exact
    else:
        assert fast[0] == "admitted"
        assert_tables_equal(fast[1].tables, exact[1].tables)


@pytest.mark.parametrize("token_id", [400, 2**31 - 1, 2**31, 2**32 - 1])
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_any_u32_candidate_id_beyond_the_vocab_is_out_of_range(base_lines, student, tiny_student, tmp_path, token_id, exact):
    """Every u32 is a well-formed candidate id; one ≥ vocab_size is ``token_id_out_of_range``, never a crash."""
    lines = edit(base_lines, 2, lambda r: r["teacher_tokens"][1]["top_logprobs"][4].__setitem__("token_id", token_id))
    path = write_corpus(tmp_path, joined(lines))
    with pytest.raises(AdmissionError) as caught:
        admit(path, student, tiny_student, exact=exact)
    assert (caught.value.code, caught.value.line) == ("token_id_out_of_range", 3)
    assert str(token_id) in caught.value.message


def test_fast_parser_steps_aside_for_what_it_cannot_carry(base_lines):
    assert parse_corpus(joined(base_lines)).parser == "fast"
    tool_calls = edit(base_lines, 1, _tool_calls)
    assert parse_corpus(joined(tool_calls)).parser == "exact"
    assert parse_corpus(joined(_with_whitespace_around_records(base_lines, "\u3000", ""))).parser == "exact"
    parts = edit(base_lines, 2, _content_parts)
    assert parse_corpus(joined(parts)).parser == "exact"


# --- (b) mutated corpora -------------------------------------------------------------------------

_INSERT_BYTES = [b"{", b"}", b"[", b"]", b'"', b",", b":", b"\n", b"\r", b"\r\n", b" ", b"\t", b"\x0c", b"\xff",
                 b"\xc3", b"\x00", b"0", b"-", b"9", b"e", b"NaN", b"null", "\u3000".encode()]
_SWAP_VALUES = [None, True, False, 0, -1, 1.5, "x", "", [], {}, [None], {"token_id": 1}, 2**32, 2**64, -0.0]
_NUMBER_SENTINELS = {"@@NAN@@": "NaN", "@@INF@@": "Infinity", "@@NINF@@": "-Infinity", "@@HUGE@@": "1e400",
                     "@@TINY@@": "-1e-400", "@@BIGNEG@@": "-1e39", "@@HUGEINT@@": "1" + "0" * 400}


def _nodes(value, path=()):
    """Every (container, key) address below ``value``."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield path + (key,)
            yield from _nodes(child, path + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield path + (index,)
            yield from _nodes(child, path + (index,))


def _get(value, path):
    for part in path:
        value = value[part]
    return value


def _mutate_record(rng: random.Random, lines: list[str], op: str) -> list[str]:
    candidates = [i for i, line in enumerate(lines) if line.strip().startswith("{")]
    if not candidates:
        return lines
    index = rng.choice(candidates)
    try:
        record = json.loads(lines[index])
    except ValueError:
        return lines
    if op == "number":
        paths = [p for p in _nodes(record) if isinstance(_get(record, p), (int, float)) and not isinstance(_get(record, p), bool)]
    else:
        paths = list(_nodes(record))
    if not paths:
        return lines
    path = rng.choice(paths)
    parent, key = _get(record, path[:-1]), path[-1]
    if op == "delete":
        del parent[key]
    elif op == "swap":
        parent[key] = rng.choice(_SWAP_VALUES)
    else:
        old = parent[key]
        choice = rng.randrange(14)
        if choice < 6:
            parent[key] = rng.choice(list(_NUMBER_SENTINELS))
        else:
            parent[key] = [old + 1, old - 1, -old, old * 1e30, float(old), 2**32 - 1, 0.5, -1][choice - 6]
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    for sentinel, literal in _NUMBER_SENTINELS.items():
        text = text.replace(f'"{sentinel}"', literal)
    lines = list(lines)
    lines[index] = text
    return lines


def mutate(base: list[str], ops: list[tuple[str, int]]) -> bytes:
    lines = list(base)
    data = None
    for op, seed in ops:
        rng = random.Random(seed)
        if op in ("delete", "swap", "number"):
            if data is not None:
                lines = data.decode("utf-8", "replace").split("\n")
                data = None
            lines = _mutate_record(rng, lines, op)
        elif op in ("shuffle", "duplicate", "drop", "blank"):
            if data is not None:
                lines = data.decode("utf-8", "replace").split("\n")
                data = None
            lines = list(lines)
            if op == "shuffle":
                rng.shuffle(lines)
            elif op == "duplicate":
                lines.insert(rng.randrange(len(lines) + 1), rng.choice(lines))
            elif op == "drop" and lines:
                lines.pop(rng.randrange(len(lines)))
            else:
                lines.insert(rng.randrange(len(lines) + 1), rng.choice(["", " ", "\t", "\u3000", "\r"]))
        else:
            buffer = bytearray(data if data is not None else joined(lines))
            if not buffer:
                continue
            position = rng.randrange(len(buffer))
            if op == "flip":
                buffer[position] ^= rng.randrange(1, 256)
            elif op == "insert":
                buffer[position:position] = rng.choice(_INSERT_BYTES)
            else:
                del buffer[position : position + rng.randrange(1, 9)]
            data = bytes(buffer)
    return data if data is not None else joined(lines)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "insert", "cut", "delete", "swap", "number", "number", "shuffle", "duplicate", "drop", "blank"]),
        st.integers(0, 2**32 - 1),
    ),
    min_size=1,
    max_size=3,
)


def check_outcome(data: bytes, student, tiny_student, root: Path):
    path = root / "corpus.jsonl"
    path.write_bytes(data)
    out = root / "out"
    try:
        result = admit_corpus(str(path), str(tiny_student), top_k=16, student=student, out_root=str(out))
    except AdmissionError as error:
        assert error.code in ADMISSION_CODES
        assert error.line is None or 1 <= error.line <= physical_lines(data), (error.line, physical_lines(data))
        assert isinstance(error.message, str) and error.message
        assert visible_under(out) == []
        return ("rejected", error.code, error.line)
    entries = visible_under(out)
    hex_digest = result.dataset_sha256.removeprefix("sha256:")
    assert not [e for e in entries if e.startswith(".") or "/." in e or "incomplete" in e], entries
    assert (out / "corpora" / hex_digest / "admission.json").is_file()
    assert result.examples >= 1 and result.action_tokens >= 1
    return ("admitted", result)


class Context:
    """Module-scoped inputs of the property tests (a short repr keeps Hypothesis reports readable)."""

    def __init__(self, lines, student, student_dir):
        self.lines, self.student, self.student_dir = lines, student, student_dir

    def __repr__(self) -> str:
        return "Context(small corpus, tiny student)"


@pytest.fixture(scope="module")
def ctx(small_lines, student, tiny_student) -> Context:
    return Context(small_lines, student, tiny_student)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS)
@example(ops=[("number", 119)])  # found by this test: a candidate token_id of 2**32 - 1
@example(ops=[("number", 34)])  # found by the fuzz drill: an integer logprob beyond float range (OverflowError)
def test_mutated_corpora_end_in_one_verdict(ctx, ops):
    data = mutate(ctx.lines, ops)
    root = Path(tempfile.mkdtemp(prefix="kiln-mutate-"))
    try:
        check_outcome(data, ctx.student, ctx.student_dir, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS)
@example(ops=[("number", 337)])  # found by this test: a declared teacher token_id of -1
@example(ops=[("number", 34)])  # found by the fuzz drill: an integer logprob beyond float range
def test_mutated_corpora_get_the_same_verdict_from_both_parsers(ctx, ops):
    data = mutate(ctx.lines, ops)
    root = Path(tempfile.mkdtemp(prefix="kiln-agree-"))
    try:
        path = root / "corpus.jsonl"
        path.write_bytes(data)
        default = outcome(path, ctx.student, ctx.student_dir)
        exact = outcome(path, ctx.student, ctx.student_dir, exact=True)
        if default[0] == "admitted" and exact[0] == "admitted":
            assert_same_admission(default[1], exact[1])
        else:
            assert default == exact
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_mutated_corpora_cover_admissions_and_many_codes(small_lines, student, tiny_student):
    rng = random.Random(1234)
    codes = set()
    admitted = 0
    kinds = ["flip", "insert", "cut", "delete", "swap", "number", "shuffle", "duplicate", "drop", "blank"]
    for _ in range(80):
        ops = [(rng.choice(kinds), rng.randrange(2**32)) for _ in range(rng.randrange(1, 3))]
        root = Path(tempfile.mkdtemp(prefix="kiln-cover-"))
        try:
            verdict = check_outcome(mutate(small_lines, ops), student, tiny_student, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if verdict[0] == "admitted":
            admitted += 1
        else:
            codes.add(verdict[1])
    assert admitted >= 1
    assert len(codes) >= 5, codes


# --- (c) nothing left behind on rejection --------------------------------------------------------


def _rejection_cases(lines: list[str]) -> dict[str, tuple[object, dict]]:
    manifest = json.loads(lines[0])

    def with_identity(**changes):
        changed = json.loads(lines[0])
        changed["teacher_identity"].update(changes)
        return [compact(changed)] + lines[1:]

    def candidates(change):
        return edit(lines, 1, lambda r: change(r["teacher_tokens"][0]["top_logprobs"]))

    def heavy(c):
        for candidate in c:
            candidate["logprob"] = -0.05

    pinned_other = TeacherIdentity.model_validate(manifest["teacher_identity"]).model_copy(
        update={"served_model_id": "another-teacher"}
    )
    conflicting = json.loads(lines[1])
    conflicting["teacher_tokens"][0]["top_logprobs"][-1]["logprob"] -= 0.5
    return {
        "invalid_utf8": (joined(lines[:2]) + b'{"x": "\xff"}\n', {}),
        "invalid_json": (lines[:2] + ["{nope"], {}),
        "not_an_object": (lines + ["[1]"], {}),
        "invalid_record": (edit(lines, 1, lambda r: r.__setitem__("messages", "hi")), {}),
        "manifest_not_first": (lines[1:2] + lines[:1] + lines[2:], {}),
        "manifest_not_canonical": ([" " + lines[0]] + lines[1:], {}),
        "manifest_invalid": (with_identity(max_top_k=0), {}),
        "manifest_missing": (lines[1:], {}),
        "identity_mismatch": (lines, {"pinned_manifest": build_manifest_line(pinned_other)}),
        "vocab_size_mismatch": (with_identity(vocab_size=512), {}),
        "top_k_exceeds_identity": (with_identity(max_top_k=20), {"top_k": 32}),
        "top_k_unsupported": (lines, {"top_k": 8}),
        "no_examples": (lines[:1], {}),
        "empty_messages": (edit(lines, 1, lambda r: r.__setitem__("messages", [])), {}),
        "empty_response": (edit(lines, 2, lambda r: r.__setitem__("teacher_response", "")), {}),
        "no_action_tokens": (
            edit(lines, 2, lambda r: r.update(trajectory=[{"role": "assistant", "content": "ctx", "kind": "context"}], teacher_tokens=[])),
            {},
        ),
        "token_count_mismatch": (edit(lines, 1, lambda r: r["teacher_tokens"].pop()), {}),
        "token_id_mismatch": (edit(lines, 1, lambda r: r["teacher_tokens"][1].__setitem__("token_id", (r["teacher_tokens"][1]["token_id"] + 1) % 300)), {}),
        "too_few_candidates": (candidates(lambda c: c.pop()), {}),
        "token_id_out_of_range": (candidates(lambda c: c[2].__setitem__("token_id", 400)), {}),
        "non_finite_logprob": ([line.replace('"@@"', "NaN") for line in candidates(lambda c: c[3].__setitem__("logprob", "@@"))], {}),
        "positive_logprob": (candidates(lambda c: c[0].__setitem__("logprob", 0.5)), {}),
        "duplicate_candidate": (candidates(lambda c: c[2].__setitem__("token_id", c[1]["token_id"])), {}),
        "not_non_increasing": (candidates(lambda c: c[5].__setitem__("logprob", c[4]["logprob"] + 0.25)), {}),
        "mass_exceeds_one": (candidates(heavy), {}),
        "conflicting_duplicate_row": (lines + [compact(conflicting)], {}),
        "nesting_too_deep": ([line.replace('"@@"', "[" * 200 + "]" * 200) for line in edit(lines, 2, lambda r: r.__setitem__("metadata", "@@"))], {}),
    }


def _custom_student_case(code: str, lines: list[str], directory: Path, tiny_student: Path) -> tuple[list[str], Path]:
    """A corpus and a student directory that together break ``code`` (see test_admission_rules.py)."""
    template, vocab_size = {
        "overlapping_masks": (LAST_MESSAGE_ONLY, None),
        "target_at_position_zero": (ASSISTANT_FIRST, None),
        "input_token_out_of_range": (None, 300),
    }[code]
    student_variant(tiny_student, directory, template=template, vocab_size=vocab_size)
    if code == "overlapping_masks":
        record = {"messages": [{"role": "user", "content": "x"}], "teacher_response": "unused", "trajectory": [
            {"role": "assistant", "content": "the quick brown fox jumps", "kind": "action"},
            {"role": "user", "content": "y", "kind": "context"},
            {"role": "tool", "content": "over the lazy dog again", "kind": "observation"}]}
        return [compact(record)], directory
    if code == "target_at_position_zero":
        return [compact({"messages": [{"role": "user", "content": "hi"}], "teacher_response": "hello world again"})], directory
    manifest = json.loads(lines[0])
    manifest["teacher_identity"]["vocab_size"] = vocab_size

    def narrow_candidates(record):
        for token in record["teacher_tokens"]:
            for rank, candidate in enumerate(token["top_logprobs"]):
                candidate["token_id"] = 200 + rank

    return [compact(manifest)] + [compact(json.loads(edit(lines, i, narrow_candidates)[i])) for i in range(1, len(lines))], directory


CUSTOM_STUDENT_CODES = ("overlapping_masks", "target_at_position_zero", "input_token_out_of_range")


REJECTION_KINDS = [
    "invalid_utf8", "invalid_json", "not_an_object", "invalid_record", "manifest_not_first", "manifest_not_canonical",
    "manifest_invalid", "manifest_missing", "identity_mismatch", "vocab_size_mismatch", "top_k_exceeds_identity",
    "top_k_unsupported", "no_examples", "empty_messages", "empty_response", "no_action_tokens", "token_count_mismatch",
    "token_id_mismatch", "too_few_candidates", "token_id_out_of_range", "non_finite_logprob", "positive_logprob",
    "duplicate_candidate", "not_non_increasing", "mass_exceeds_one", "conflicting_duplicate_row", "nesting_too_deep",
    *CUSTOM_STUDENT_CODES,
]


@pytest.mark.parametrize("code", REJECTION_KINDS)
def test_rejection_leaves_nothing_behind(base_lines, student, tiny_student, tmp_path, code):
    if code in CUSTOM_STUDENT_CODES:
        corpus, student_dir = _custom_student_case(code, base_lines, tmp_path / "student", tiny_student)
        failing_student, kwargs = load_student_tokenizer(student_dir), {}
    else:
        corpus, kwargs = _rejection_cases(base_lines)[code]
        failing_student, student_dir = student, tiny_student
    data = corpus if isinstance(corpus, bytes) else joined(corpus)
    path = write_corpus(tmp_path, data)
    root = tmp_path / "root"
    with pytest.raises(AdmissionError) as caught:
        admit(path, failing_student, student_dir, out_root=str(root), **kwargs)
    assert caught.value.code == code
    assert visible_under(root) == []
    # a root that already holds a committed corpus gains nothing either
    admit(write_corpus(tmp_path, joined(base_lines)), student, tiny_student, out_root=str(root))
    before = visible_under(root)
    assert len(before) == 4  # <hex>/, and its three files
    with pytest.raises(AdmissionError):
        admit(path, failing_student, student_dir, out_root=str(root), **kwargs)
    assert visible_under(root) == before


@pytest.mark.parametrize("code", ["file_not_found", "file_unreadable", "not_regular_file", "file_too_large"])
def test_file_rule_rejection_leaves_nothing_behind(base_lines, student, tiny_student, tmp_path, code, monkeypatch):
    if code == "file_not_found":
        path = tmp_path / "missing.jsonl"
    elif code == "file_unreadable":
        # chmod does not stop root (CI may run as root): the file system's refusal is simulated instead.
        import builtins

        import kiln_core.admission.source as source

        path = write_corpus(tmp_path, joined(base_lines))
        real_open = builtins.open

        def refusing_open(file, *args, **kwargs):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(source, "open", refusing_open, raising=False)
    elif code == "not_regular_file":
        path = tmp_path / "a-directory.jsonl"
        path.mkdir()
    else:
        path = write_corpus(tmp_path, joined(base_lines))
        with path.open("ab") as handle:
            handle.truncate(64 * 1024 * 1024 + 1)
    root = tmp_path / "root"
    with pytest.raises(AdmissionError) as caught:
        admit(path, student, tiny_student, out_root=str(root))
    assert (caught.value.code, caught.value.line) == (code, None)
    assert visible_under(root) == []


def test_rejection_on_a_reused_materialization_leaves_it_unchanged(base_lines, student, tiny_student, tmp_path):
    path = write_corpus(tmp_path, joined(base_lines))
    root = tmp_path / "root"
    first = admit(path, student, tiny_student, out_root=str(root))
    before = {p: p.read_bytes() for p in (root / "corpora").rglob("*") if p.is_file()}
    other = first.teacher_identity.model_copy(update={"served_model_id": "another-teacher"})
    with pytest.raises(AdmissionError) as caught:
        admit(path, student, tiny_student, out_root=str(root), pinned_manifest=build_manifest_line(other))
    assert (caught.value.code, caught.value.line) == ("identity_mismatch", 1)
    after = {p: p.read_bytes() for p in (root / "corpora").rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.parametrize("code", ["invalid_json", "token_count_mismatch", "conflicting_duplicate_row"])
def test_rejection_leaves_nothing_behind_on_memory_roots(base_lines, student, tiny_student, tmp_path, code):
    corpus, kwargs = _rejection_cases(base_lines)[code]
    path = write_corpus(tmp_path, joined(corpus))
    root = f"memory://paths-{uuid.uuid4().hex}"
    with pytest.raises(AdmissionError) as caught:
        admit(path, student, tiny_student, out_root=root, **kwargs)
    assert caught.value.code == code
    fs, corpora = fsspec.core.url_to_fs(root + "/corpora")
    assert not fs.exists(corpora) or fs.find(corpora) == []


def test_rejection_cases_cover_every_per_corpus_code():
    """Guard: together with the file rules above, every admission code is exercised here."""
    covered = set(REJECTION_KINDS) | {"file_not_found", "file_unreadable", "not_regular_file", "file_too_large"}
    assert covered == set(ADMISSION_CODES)


def test_staging_directory_is_removed_when_a_write_fails(base_lines, student, tiny_student, tmp_path, monkeypatch):
    """A failure while publishing leaves no staging directory and no committed corpus; a retry commits."""
    from kiln_core import storage

    original = storage.StagedDirectory.commit

    def broken(self, data):
        raise OSError("disk full")

    monkeypatch.setattr(storage.StagedDirectory, "commit", broken)
    root = tmp_path / "root"
    path = write_corpus(tmp_path, joined(base_lines))
    with pytest.raises(OSError, match="disk full"):
        admit(path, student, tiny_student, out_root=str(root))
    assert visible_under(root) == []
    monkeypatch.setattr(storage.StagedDirectory, "commit", original)
    result = admit(path, student, tiny_student, out_root=str(root))
    assert not result.reused
    assert (Path(result.materialized) / "admission.json").is_file()
