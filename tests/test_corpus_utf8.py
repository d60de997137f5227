"""The corpus's UTF-8 rule is checked over the bytes in place (no decoded copy of the corpus), with
exactly the verdict of a strict UTF-8 decoder (Kiln reads the file as a Rust ``String``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln_core.admission import admit_corpus
from kiln_core.admission.source import is_utf8, read_corpus
from kiln_core.errors import AdmissionError
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
