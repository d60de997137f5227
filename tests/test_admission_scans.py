"""The byte scans admission makes besides its one parse, each with exactly the verdict of its slow,
obvious form:

* the corpus's UTF-8 rule is checked over the bytes in place (no decoded copy of the corpus), as a
  strict UTF-8 decoder decides (Kiln reads the file as a Rust ``String``);
* serde_json's nesting limit is measured on the raw text, strings and escaped quotes skipped, as a
  character-by-character scanner measures it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln_core.admission import admit_corpus
from kiln_core.admission.source import is_utf8, read_corpus
from kiln_core.errors import AdmissionError
from kiln_core.strict_json import text_nesting_depth
from kiln_core.synthetic import synthesize_corpus


def decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize(
    "data",
    [b"", b"plain", "é日本😀".encode(), b"\x7f", b"\xc2\x80", b"\xdf\xbf", b"\xef\xbf\xbf", b"\xf4\x8f\xbf\xbf",
     b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xf0\x80\x80\x80",  # overlong
     b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80",  # surrogates, alone or paired (CESU-8)
     b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\xfe",  # beyond U+10FFFF, never-valid bytes
     b"\xc3", b"\xe6\x97", b"\xf0\x9f\x98", b"ok\xc3", b"\xc3(", b"\xe6\x97(", b"\xf0\x9f\x98("],  # truncated
)
def test_is_utf8_agrees_with_a_strict_decoder(data):
    assert is_utf8(data) is decodes(data)
    assert is_utf8(b"x" * 100 + data + b"y" * 100) is decodes(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=24) | st.text(max_size=12).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_is_utf8_agrees_with_a_strict_decoder_on_any_bytes(data):
    assert is_utf8(data) is decodes(data)


def test_a_non_ascii_corpus_is_admitted_and_a_bad_byte_is_named_by_line(tiny_student, tmp_path):
    path = synthesize_corpus(tiny_student, tmp_path / "c.jsonl", n_examples=3, top_k=16, seed=3)
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"content":"', '"content":"é日本😀 '.encode(), 1)
    path.write_bytes(b"\n".join(lines))
    assert read_corpus(str(path)).data == b"\n".join(lines)
    assert admit_corpus(str(path), str(tiny_student), top_k=16).examples == 3

    lines[3] = lines[3].replace(b'"content":"', b'"content":"\xed\xa0\x80', 1)  # a UTF-8-encoded surrogate
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(AdmissionError) as caught:
        read_corpus(str(path))
    assert (caught.value.code, caught.value.line) == ("invalid_utf8", 4)


def scanned_depth(text: str) -> int:
    """Character by character: a backslash escapes a following backslash or quote; an unescaped quote
    opens or closes a string; brackets outside strings nest. The deepest level after any bracket (text
    that closes more than it opened goes below zero), or 0 without brackets."""
    depth, levels = 0, [0]
    inside = False
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text) and text[i + 1] in '\\"':
            i += 2
            continue
        if char == '"':
            inside = not inside
        elif not inside and char in "[{]}":
            depth += 1 if char in "[{" else -1
            levels.append(depth)
        i += 1
    return max(levels[1:] or levels)


@pytest.mark.parametrize(
    "text",
    ['["\\\\"]', '["\\""]', '["a\\\\\\"[[", [[]]]', '{"k\\"[":["\\\\",["\\\\\\\\"]]]}', "\\", '"\\', '["\\\\\\',
     '[\\[', '\\"[', '\\\\"[', '\\\\\\"[', '["\\n", ["\\t\\"\\\\"]]'],
)
def test_nesting_depth_skips_escaped_quotes_like_a_scanner(text):
    assert text_nesting_depth(text) == scanned_depth(text)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet='\\"[]{}a', max_size=40))
def test_nesting_depth_of_any_text_matches_a_scanner(text):
    """Also text that is not JSON: the exact parser measures the prefix before a syntax error."""
    assert text_nesting_depth(text) == scanned_depth(text)
