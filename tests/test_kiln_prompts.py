"""Kiln's prompt-list digest (``data.content_sha256``) comes from admission's one parse of the corpus.

Both corpus parsers (the columnar fast path and the exact line-by-line path) feed the digest while they
read; the digest must be byte-for-byte what Kiln hashes whatever the corpus holds. It is checked here
against a naive reference written from Kiln's rules alone: decode every line with Python's ``json``,
build each example's prompt as Kiln's ``prepare_off_policy_distillation_dataset_with_identity`` does
(crates/kiln-train/src/opd.rs), and write the list as serde_json writes a ``serde_json::Value``
(keys sorted, compact, raw UTF-8, only ``"``, ``\\`` and control characters escaped, integers
outside i64/u64 as f64, floats in Ryū's layout).
"""

from __future__ import annotations

import hashlib
import json
import math
from decimal import Decimal
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln_core.admission import admit_corpus, columnar
from kiln_core.admission.records import parse_corpus
from kiln_core.kiln_prompts import KilnPromptDigest, kiln_prompts_sha256
from kiln_core.serde_json import serde_json_text
from kiln_core.synthetic import synthesize_corpus

MANIFEST_SCHEMA = "kiln.off-policy-distillation-manifest.v1"
RUST_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


# --- the naive reference ---------------------------------------------------------------------------


def reference_digest(corpus: bytes) -> str:
    prompts = []
    for line in corpus.decode("utf-8").split("\n"):
        line = line.strip(RUST_WHITESPACE)
        if not line:
            continue
        record = json.loads(line)
        if record.get("schema") == MANIFEST_SCHEMA:
            continue
        messages = []
        for message in record["messages"]:
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(part["text"] for part in content if isinstance(part.get("text"), str))
            kept = {"role": message["role"], "content": content or ""}
            kept.update({key: message[key] for key in ("name", "tool_call_id", "tool_calls") if message.get(key) is not None})
            messages.append(kept)
        if record.get("trajectory"):
            segments = []
            for segment in record["trajectory"]:
                kept = {"role": segment["role"], "content": segment["content"], "kind": segment.get("kind", "context")}
                kept.update({key: segment[key] for key in ("tool_call_id", "warning_prefix_len") if segment.get(key) is not None})
                segments.append(kept)
            prompts.append({"messages": messages, "trajectory": segments})
        else:
            prompts.append({"messages": messages + [{"role": "assistant", "content": record["teacher_response"]}]})
    return hashlib.sha256(serde_value_bytes(prompts)).hexdigest()


def serde_value_bytes(value) -> bytes:
    """``serde_json::to_vec(&serde_json::Value)``."""
    if value is None or isinstance(value, bool):
        return {None: b"null", True: b"true", False: b"false"}[value]
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return str(value).encode()
        value = float(value)  # serde_json (no arbitrary_precision) reads it as an f64
    if isinstance(value, float):
        return ryu_f64(value).encode()
    if isinstance(value, str):
        return serde_string(value)
    if isinstance(value, list):
        return b"[" + b",".join(serde_value_bytes(item) for item in value) + b"]"
    # A BTreeMap<String, Value>: keys in byte order of their UTF-8, which is code point order.
    return b"{" + b",".join(serde_string(key) + b":" + serde_value_bytes(value[key]) for key in sorted(value)) + b"}"


def serde_string(text: str) -> bytes:
    short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    escaped = "".join(short.get(c, "\\u%04x" % ord(c) if ord(c) < 0x20 else c) for c in text)
    return ('"' + escaped + '"').encode("utf-8")


def ryu_f64(value: float) -> str:
    """Ryū's ``format64`` (dtolnay/ryu src/pretty/mod.rs): positional from 1e-5 to below 1e16, else d.ddde±x."""
    if not math.isfinite(value):
        return "null"
    if value == 0:
        return "-0.0" if math.copysign(1, value) < 0 else "0.0"
    sign, digits, exponent = Decimal(repr(abs(value))).normalize().as_tuple()
    text = "".join(map(str, digits))
    point = len(text) + exponent  # the value is 0.<text> × 10^point
    if 0 < point <= 16:
        body = text + "0" * (point - len(text)) + ".0" if exponent >= 0 else text[:point] + "." + text[point:]
    elif -5 < point <= 0:
        body = "0." + "0" * -point + text
    else:
        body = text[0] + ("." + text[1:] if len(text) > 1 else "") + f"e{point - 1}"
    return ("-" if value < 0 else "") + body


@pytest.mark.parametrize(
    ("value", "written"),
    [(1e16, "1e16"), (1e15, "1000000000000000.0"), (1.5e-7, "1.5e-7"), (1e-5, "0.00001"), (0.1, "0.1"),
     (123.0, "123.0"), (2**64, "1.8446744073709552e19"), (-(2**63) - 1, "-9.223372036854776e18"), (1e300, "1e300"),
     (2**64 - 1, "18446744073709551615"), (-(2**63), "-9223372036854775808"), (-0.0, "-0.0")],
)
def test_reference_writes_numbers_as_serde_json(value, written):
    """The reference's own number layout, pinned to what serde_json writes for these values."""
    assert serde_value_bytes(value) == written.encode()


def test_the_writer_escapes_every_character_as_serde_json():
    """The one serde_json writer the digest goes through, against the reference, for every code point."""
    for start in range(0, 0x110000, 0x1000):
        text = "".join(chr(c) for c in range(start, start + 0x1000) if not 0xD800 <= c < 0xE000)
        assert serde_json_text(text).encode("utf-8") == serde_string(text), hex(start)
    assert serde_json_text({"k": "\x00\x1f\"\\\x7f"}) == '{"k":"\\u0000\\u001f\\"\\\\\x7f"}'


# --- corpora ---------------------------------------------------------------------------------------


def exact_only():
    """Force the exact parser (the fast one steps aside)."""
    return mock.patch.object(columnar, "parse_columnar", lambda data, lines: None)


def both_parsers(data: bytes):
    """``data`` parsed by the usual dispatch (fast path when it can) and by the exact parser alone."""
    fast = parse_corpus(data)
    with exact_only():
        exact = parse_corpus(data)
    assert exact.parser == "exact"
    return fast, exact


def record(messages, response="ok", trajectory=None, **extra) -> dict:
    value = {"messages": messages, "teacher_response": response, "teacher_tokens": [], **extra}
    if trajectory is not None:
        value["trajectory"] = trajectory
    return value


def corpus_of(*records, newline="\n", around="") -> bytes:
    return "".join(around + json.dumps(r, ensure_ascii=False, separators=(",", ":")) + around + newline
                   for r in records).encode("utf-8")


UNICODE_TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 😀🎉 and ZWJ 👩‍💻", "e\u0301 combining", "line\u2028sep\u2029para",
                 "nbsp\u00a0inside", "\u00ff\u0100\uffff", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]
ESCAPE_TEXTS = ['quote " and backslash \\', "tab\tnew\nline\rcr", "\x00\x01\x1f controls \x7f del", "\b\f",
                "\\u0041 looks escaped", "</script>", "\\\"\\\\"]


def test_unicode_and_escapes_digest_like_kiln_on_both_parsers():
    records = [record([{"role": "user", "content": text}], response=text) for text in UNICODE_TEXTS + ESCAPE_TEXTS]
    data = corpus_of(*records)
    fast, exact = both_parsers(data)
    assert fast.parser == "fast"
    assert fast.kiln_prompts_sha256 == exact.kiln_prompts_sha256 == reference_digest(data) == kiln_prompts_sha256(data)


def test_json_escapes_in_the_file_digest_as_the_characters_they_stand_for():
    """``\\u00e9``, a surrogate pair and ``\\/`` are written raw by serde_json, whatever the file spelled."""
    escaped = b'{"messages":[{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00 a\\/b"}],"teacher_response":"\\u0000","teacher_tokens":[]}\n'
    raw = '{"messages":[{"role":"user","content":"café 😀 a/b"}],"teacher_response":"\\u0000","teacher_tokens":[]}\n'.encode()
    for data in (escaped, raw):
        fast, exact = both_parsers(data)
        assert fast.kiln_prompts_sha256 == exact.kiln_prompts_sha256 == reference_digest(data)
    assert both_parsers(escaped)[0].kiln_prompts_sha256 == both_parsers(raw)[0].kiln_prompts_sha256


def test_optional_fields_missing_null_and_given_on_both_parsers():
    """Missing and null optional fields are left out alike; ``warning_prefix_len: 0`` is written, absent is not."""
    trajectory = [
        {"role": "user", "content": "ask", "kind": "context"},
        {"role": "assistant", "content": "act", "kind": "action", "tool_call_id": None, "warning_prefix_len": 0},
        {"role": "tool", "content": "seen", "kind": "observation", "tool_call_id": "t1", "warning_prefix_len": 2**40},
        {"role": "assistant", "content": "more", "kind": "action", "warning_prefix_len": None},
    ]
    messages = [{"role": "system", "content": None}, {"role": "user", "content": "q", "name": "ann", "tool_call_id": None}]
    data = corpus_of(record(messages, trajectory=trajectory), record(messages, trajectory=[]), record(messages))
    fast, exact = both_parsers(data)
    assert fast.parser == "fast"
    assert fast.kiln_prompts_sha256 == exact.kiln_prompts_sha256 == reference_digest(data)
    zero_dropped = data.replace(b',"warning_prefix_len":0', b"")
    assert parse_corpus(zero_dropped).kiln_prompts_sha256 != fast.kiln_prompts_sha256
    widest = data.replace(b'"warning_prefix_len":1099511627776', b'"warning_prefix_len":18446744073709551615')
    fast, exact = both_parsers(widest)  # a usize beyond i64: only the exact parser reads it
    assert fast.parser == "exact" and fast.kiln_prompts_sha256 == reference_digest(widest) != reference_digest(data)


def test_nested_tool_calls_and_big_numbers_digest_like_kiln():
    """``tool_calls`` is arbitrary JSON Kiln keeps: its keys are sorted, integers beyond u64/i64 become f64."""
    tool_calls = [{"type": "function", "id": "c1", "function": {"name": "f", "arguments": "{\"b\":1,\"a\":2}"},
                   "z": [1, -1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, 1.5e-7, 1e16, 0.1, 123.0, -0.0, 1e300],
                   "nested": {"y": [[{"k": None, "j": True, "i": False}]], "x": {"é": 1, "e": 2, "😀": 3, "Z": 4}}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "part "}, {"type": "image"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": None, "tool_calls": tool_calls},
                {"role": "tool", "content": "result", "tool_call_id": "c1", "name": "f"}]
    data = corpus_of(record(messages, response="done"))
    fast, exact = both_parsers(data)
    assert fast.parser == exact.parser == "exact"  # tool calls and content parts: only the exact parser reads them
    assert exact.kiln_prompts_sha256 == reference_digest(data) == kiln_prompts_sha256(data)


@pytest.mark.parametrize("number", ["9" * 310, "-" + "9" * 400, "1" + "0" * 5000, "1e400", "-1e400", "2e308"])
@pytest.mark.parametrize("where", ["tool_calls", "unknown_field", "candidate_logprob"])
def test_a_number_beyond_a_double_anywhere_in_a_line_is_invalid_json_on_both_parsers(number, where):
    """Kiln reads every line with ``serde_json::from_str::<Value>`` (opd.rs), built without
    ``arbitrary_precision``: a literal beyond an f64 is "number out of range", wherever it is."""
    from kiln_core.errors import AdmissionError

    if where == "tool_calls":
        line = record([{"role": "assistant", "content": None, "tool_calls": [{"n": 0}]}])
    elif where == "unknown_field":
        line = record([{"role": "user", "content": "hi"}], extra_field={"n": 0})
    else:
        line = record([{"role": "user", "content": "hi"}])
        line["teacher_tokens"] = [{"token_id": 5, "logprob": -0.5, "top_logprobs": [{"token_id": 5, "logprob": -0.5},
                                                                                     {"token_id": 6, "n": 0}]}]
    data = corpus_of(line).replace(b'"n":0', b'"logprob":' + number.encode() if where == "candidate_logprob"
                                   else b'"n":' + number.encode())
    for parse in (parse_corpus, lambda data: exact_parse(data)):
        with pytest.raises(AdmissionError) as refused:
            parse(data)
        assert refused.value.code == "invalid_json" and refused.value.line == 1
        assert "number out of range" in str(refused.value)


@pytest.mark.parametrize("number", ["9" * 300, "1e-400", "-1e308", "1.7976931348623157e308"])
def test_numbers_an_f64_holds_or_underflows_are_read(number):
    data = corpus_of(record([{"role": "user", "content": "hi"}], extra_field={"n": 0})).replace(
        b'"n":0', b'"n":' + number.encode())
    fast, exact = both_parsers(data)
    assert fast.kiln_prompts_sha256 == exact.kiln_prompts_sha256 == reference_digest(data)


def exact_parse(data: bytes):
    with exact_only():
        return parse_corpus(data)


@pytest.mark.parametrize(("newline", "around"), [("\r\n", ""), ("\n\n", " \t"), ("\n", "\u3000"), ("\n", "\x0c")])
def test_layout_does_not_change_the_digest(newline, around):
    records = [record([{"role": "user", "content": text}]) for text in ("a", "b", "c")]
    plain = reference_digest(corpus_of(*records))
    data = corpus_of(*records, newline=newline, around=around)
    fast, exact = both_parsers(data)
    assert fast.kiln_prompts_sha256 == exact.kiln_prompts_sha256 == reference_digest(data) == plain


def test_the_manifest_is_left_out(tiny_student, tmp_path):
    path = synthesize_corpus(tiny_student, tmp_path / "c.jsonl", n_examples=3, top_k=16, seed=5, trajectory_every=2)
    data = path.read_bytes()
    without_manifest = b"\n".join(line for line in data.split(b"\n") if MANIFEST_SCHEMA.encode() not in line)
    fast, exact = both_parsers(data)
    assert fast.parser == "fast" and fast.manifest is not None
    assert fast.kiln_prompts_sha256 == exact.kiln_prompts_sha256 == reference_digest(without_manifest)


def test_admission_records_the_digest_of_its_parse(tiny_student, tmp_path):
    """End to end, on both parsers: the admitted tables carry the digest Kiln computes for the file."""
    path = synthesize_corpus(tiny_student, tmp_path / "c.jsonl", n_examples=5, top_k=16, seed=9, trajectory_every=2)
    fast = admit_corpus(str(path), str(tiny_student), top_k=16)
    with exact_only():
        exact = admit_corpus(str(path), str(tiny_student), top_k=16)
    assert (fast.parser, exact.parser) == ("fast", "exact")
    expected = reference_digest(path.read_bytes())
    assert fast.tables.kiln_prompts_sha256 == exact.tables.kiln_prompts_sha256 == expected


def test_an_empty_prompt_list_is_the_digest_of_an_empty_array():
    assert KilnPromptDigest().hexdigest() == hashlib.sha256(b"[]").hexdigest()


def test_digest_can_be_read_before_the_last_example():
    digest = KilnPromptDigest()
    digest.add([{"role": "user", "content": "a"}], "x", None)
    first = digest.hexdigest()
    digest.add([{"role": "user", "content": "b"}], "y", None)
    assert first == reference_digest(corpus_of(record([{"role": "user", "content": "a"}], "x")))
    assert digest.hexdigest() == reference_digest(corpus_of(record([{"role": "user", "content": "a"}], "x"),
                                                            record([{"role": "user", "content": "b"}], "y")))


# Any text (no lone surrogates: neither serde_json nor UTF-8 can hold one).
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": st.none() | TEXT},
                                optional={"name": st.none() | TEXT, "tool_call_id": st.none() | TEXT})
SEGMENT = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": TEXT,
                                 "kind": st.sampled_from(["context", "action", "observation"])},
                                optional={"tool_call_id": st.none() | TEXT,
                                          "warning_prefix_len": st.none() | st.integers(0, 2**64 - 1)})
RECORD = st.builds(record, st.lists(MESSAGE, min_size=1, max_size=4), TEXT,
                   st.none() | st.lists(SEGMENT, max_size=4))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(RECORD, min_size=1, max_size=4))
def test_random_corpora_digest_like_kiln_on_both_parsers(records):
    data = corpus_of(*records)
    fast, exact = both_parsers(data)
    assert fast.kiln_prompts_sha256 == exact.kiln_prompts_sha256 == reference_digest(data)


def test_null_tool_calls_stay_on_the_fast_path_and_real_ones_leave_it():
    """The parse itself decides about ``tool_calls`` (no separate search of the bytes): null reads like
    missing on both parsers, any other value sends the corpus to the exact parser."""
    messages = [{"role": "user", "content": 'say "tool_calls"', "tool_calls": None}, {"role": "assistant", "content": "no"}]
    data = corpus_of(record(messages), record(messages[1:]))
    fast, exact = both_parsers(data)
    assert fast.parser == "fast"
    assert fast.conversations == exact.conversations
    assert fast.kiln_prompts_sha256 == exact.kiln_prompts_sha256 == reference_digest(data)
    # a record field outside the schema (here an unknown top-level `tool_calls`): the exact parser reads the
    # corpus, since pyarrow would skip the value unread; Kiln ignores the field, and so does the digest
    with_unknown = corpus_of(record(messages), record(messages[1:], tool_calls=[{"id": 1}]))
    fast, exact = both_parsers(with_unknown)
    assert fast.parser == "exact" and fast.kiln_prompts_sha256 == reference_digest(with_unknown) == reference_digest(data)
    calling = corpus_of(record([{"role": "assistant", "content": None, "tool_calls": []}]))
    assert parse_corpus(calling).parser == "exact"
    assert parse_corpus(calling).kiln_prompts_sha256 == reference_digest(calling)
