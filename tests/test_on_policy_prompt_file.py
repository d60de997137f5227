"""The pipeline's prompt JSONL: read from any fsspec URI, refused line by line with stable codes."""

from __future__ import annotations

import json

import fsspec
import pytest

from kiln_core.contracts.opd_prompt import prompts_content_sha256
from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.on_policy.prompt_file import parse_prompt_lines, read_prompt_file
from on_policy_support import chat, request

GOOD = [chat("What is two plus two?"), {**chat("List files."), "teacher_extra_messages": [
    {"role": "user", "content": "Answer with JSON only."}]}]


def _jsonl(records, *, blank_lines=(), crlf=False) -> bytes:
    lines = [json.dumps(r) for r in records]
    for index in blank_lines:
        lines.insert(index, "   ")
    return (("\r\n" if crlf else "\n").join(lines) + "\n").encode("utf-8")


@pytest.mark.parametrize("uri_kind", ["local", "memory"])
def test_reads_prompts_with_their_physical_lines_and_kilns_digest(tmp_path, uri_kind):
    data = _jsonl(GOOD, blank_lines=(0, 2), crlf=True)
    if uri_kind == "local":
        path = tmp_path / "prompts.jsonl"
        path.write_bytes(data)
        uri = str(path)
    else:
        uri = "memory://on-policy-tests/prompts.jsonl"
        fsspec.filesystem("memory").pipe("/on-policy-tests/prompts.jsonl", data)
    prompts = read_prompt_file(uri)
    assert prompts.lines == (2, 4)
    assert [p.model_dump(exclude_unset=True) for p in prompts.prompts] == GOOD
    # the same prompts inline or from a file are the same training data
    assert prompts_content_sha256(prompts.prompts) == prompts_content_sha256(request(GOOD).prompts)


@pytest.mark.parametrize("payload, code, line, fragment", [
    (b'{"messages": [{"role": "user", "content": "q"}]}\n\n{"messages": [\n', "invalid_json", 3, "not valid JSON"),
    (b'\n[1, 2]\n', "not_an_object", 2, "must be a JSON object, not list"),
    (b'{"messages": [{"role": "user", "content": "q"}], "teacher_extra_messages": null}\n', "invalid_prompt", 1,
     "valid list"),
    (b'{"prompt": "q"}\n', "invalid_prompt", 1, "Field required"),
    (b'{"messages": [{"role": "user", "content": "q"}]}\n{"messages": []}\n', "prompt_no_messages", 2,
     "OPD prompt 1 has no messages"),
    (b'{"messages": [], "messages": [{"role": "user", "content": "q"}]}\n', "invalid_json", 1, "duplicate object key"),
    (b'{"messages": [{"role": "user", "content": "q"}], "x": NaN}\n', "invalid_json", 1, "non-finite number NaN"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}\n', "invalid_json", 1, "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "q"}]}\n{"messages": "\xff"}\n', "invalid_utf8", 2, "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "invalid_json", 1, "nests too deeply"),
    (b"\n  \r\n\n", "no_prompts", None, "holds no prompt"),
])
def test_each_bad_line_is_refused_with_its_rule_and_line(payload, code, line, fragment):
    with pytest.raises(Rejection) as caught:
        parse_prompt_lines(payload, file="prompts.jsonl")
    assert (caught.value.code, caught.value.line, caught.value.file) == (code, line, "prompts.jsonl")
    assert fragment in caught.value.message


def test_missing_and_oversized_files(tmp_path, monkeypatch):
    import kiln_core.on_policy.prompt_file as prompt_file

    with pytest.raises(Rejection) as caught:
        read_prompt_file(str(tmp_path / "absent.jsonl"))
    assert caught.value.code == "file_not_found"
    with pytest.raises(Rejection) as caught:
        read_prompt_file(str(tmp_path))
    assert caught.value.code == "file_not_found"
    big = tmp_path / "big.jsonl"
    big.write_bytes(_jsonl(GOOD))
    monkeypatch.setattr(prompt_file, "MAX_PROMPT_FILE_BYTES", 32)
    with pytest.raises(Rejection) as caught:
        read_prompt_file(str(big))
    assert caught.value.code == "file_too_large"


def test_an_unreadable_store_is_an_environment_failure(monkeypatch):
    import kiln_core.on_policy.prompt_file as prompt_file

    class Broken:
        def open(self, path, mode):
            raise ConnectionError("connection reset by peer")

    real_resolve = prompt_file.resolve
    monkeypatch.setattr(prompt_file, "resolve", lambda uri, options=None: real_resolve(uri, options).__class__(
        Broken(), "/x", uri))
    with pytest.raises(EnvironmentFailure) as caught:
        read_prompt_file("memory://anywhere/prompts.jsonl")
    assert caught.value.code == "storage_unavailable" and caught.value.retryable
