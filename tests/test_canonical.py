"""The two canonical JSON encodings (kiln_core.canonical) and the identity/manifest forms built on them.

* Kiln compact: insertion (declaration) order, raw UTF-8, ``null`` adapter — identities and manifests.
* Sorted-keys ASCII: ``\\uXXXX`` escapes, Python float ``repr`` kept, NaN refused — oracle digests.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct

import pytest

from kiln_core.canonical import (
    canonical_json_bytes,
    canonical_sha256,
    kiln_compact_json,
    self_hash,
    sha256_hex,
    sha256_prefixed,
    strip_sha256_prefix,
)
from kiln_core.contracts.identity import (
    IDENTITY_SCHEMA,
    KILN_VLLM_PROTOCOL,
    MANIFEST_SCHEMA,
    ManifestError,
    TeacherAdapter,
    TeacherIdentity,
    build_manifest_line,
    parse_identity_json,
    parse_manifest_line,
)

IDENTITY_FIELD_ORDER = [
    "schema", "protocol", "served_model_id", "base_model_sha256", "tokenizer_vocab_sha256", "tokenizer_config_sha256",
    "adapter", "vocab_size", "max_top_k", "max_model_len", "max_prompt_logprob_candidates", "logprobs_mode",
    "implementation", "inference_config_sha256",
]


def identity(**changes) -> TeacherIdentity:
    fields = dict(
        schema=IDENTITY_SCHEMA,
        protocol=KILN_VLLM_PROTOCOL,
        served_model_id="teacher-large",
        base_model_sha256="a" * 64,
        tokenizer_vocab_sha256="b" * 64,
        tokenizer_config_sha256="c" * 64,
        adapter=None,
        vocab_size=248320,
        max_top_k=32,
        max_model_len=32768,
        max_prompt_logprob_candidates=1_000_000,
        logprobs_mode="raw_logprobs",
        implementation="vllm:0.20.1",
        inference_config_sha256="d" * 64,
    )
    fields.update(changes)
    return TeacherIdentity(**fields)


# --- Kiln compact --------------------------------------------------------------------------------


def test_kiln_compact_keeps_insertion_order_and_has_no_whitespace():
    assert kiln_compact_json({"b": 1, "a": [1, 2], "c": {"z": None, "y": True}}) == '{"b":1,"a":[1,2],"c":{"z":null,"y":true}}'
    assert kiln_compact_json({"a": 1, "b": 1}) != kiln_compact_json({"b": 1, "a": 1})


def test_kiln_compact_writes_raw_utf8():
    text = kiln_compact_json({"name": "modèle-é", "emoji": "😀", "quote": 'a"b', "newline": "x\ny"})
    assert text == '{"name":"modèle-é","emoji":"😀","quote":"a\\"b","newline":"x\\ny"}'
    assert "\\u" not in text


def test_kiln_compact_null_adapter():
    text = identity().canonical_json()
    assert '"adapter":null,' in text
    assert '"adapter":{"name":"teacher-large","weights_sha256":"' + "e" * 64 + '","config_sha256":"' + "f" * 64 + '"}' in identity(
        adapter=TeacherAdapter(name="teacher-large", weights_sha256="e" * 64, config_sha256="f" * 64)
    ).canonical_json()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_kiln_compact_refuses_non_finite(value):
    with pytest.raises(ValueError):
        kiln_compact_json({"x": value})


# --- sorted-keys ASCII ---------------------------------------------------------------------------


def test_sorted_keys_ascii_sorts_and_escapes():
    assert canonical_json_bytes({"b": 1, "a": "é"}) == b'{"a":"\\u00e9","b":1}'
    assert canonical_json_bytes({"z": {"y": 1, "x": 2}, "a": []}) == b'{"a":[],"z":{"x":2,"y":1}}'
    # non-BMP characters become a surrogate pair
    assert canonical_json_bytes(["😀"]) == b'["\\ud83d\\ude00"]'
    assert canonical_json_bytes({"é": 1}) == b'{"\\u00e9":1}'
    encoded = canonical_json_bytes({"text": "naïve ☃ 日本"})
    encoded.decode("ascii")  # pure ASCII
    assert json.loads(encoded) == {"text": "naïve ☃ 日本"}


@pytest.mark.parametrize(
    "value, text",
    [(300.0, b"300.0"), (1e-07, b"1e-07"), (0.1, b"0.1"), (1e16, b"1e+16"), (-0.0, b"-0.0"), (300, b"300"),
     (2**53 + 1, b"9007199254740993"), (True, b"true"), (None, b"null")],
)
def test_sorted_keys_keeps_python_number_repr(value, text):
    assert canonical_json_bytes(value) == text
    assert canonical_json_bytes({"v": value}) == b'{"v":' + text + b"}"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_sorted_keys_refuses_non_finite(value):
    with pytest.raises(ValueError):
        canonical_json_bytes({"x": [1.0, value]})
    with pytest.raises(ValueError):
        canonical_sha256(value)


def test_the_two_encodings_differ_where_they_should():
    value = {"b": "é", "a": 1}
    assert kiln_compact_json(value).encode("utf-8") == '{"b":"é","a":1}'.encode("utf-8")
    assert canonical_json_bytes(value) == b'{"a":1,"b":"\\u00e9"}'


# --- digests -------------------------------------------------------------------------------------


def test_canonical_sha256_of_a_list_is_the_compact_array_text():
    ids = [1, 2, 3, 151643, 0]
    expected = hashlib.sha256(b"[1,2,3,151643,0]").hexdigest()
    assert canonical_sha256(ids) == "sha256:" + expected
    assert canonical_sha256([1, 2, 3]) == "sha256:a615eeaee21de5179de080de8c3052c8da901138406ba71c38c032845f7d54f4"
    spaced = "sha256:" + hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    u32_le = "sha256:" + hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()
    assert json.dumps(ids) != "[1,2,3,151643,0]"  # the spaced form really is different text
    assert canonical_sha256(ids) not in (spaced, u32_le)
    assert canonical_sha256(ids) != canonical_sha256(list(reversed(ids)))


def test_sha256_helpers():
    assert sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert sha256_prefixed(b"") == "sha256:" + sha256_hex(b"")
    assert strip_sha256_prefix(sha256_prefixed(b"x")) == sha256_hex(b"x")
    with pytest.raises(ValueError):
        strip_sha256_prefix(sha256_hex(b"x"))


def test_self_hash_drops_exactly_the_named_field():
    record = {"schema": "kiln.receipt.v1", "steps": 3, "loss": 0.25, "receipt_sha256": "sha256:" + "0" * 64}
    snapshot = dict(record)
    digest = self_hash(record, "receipt_sha256")
    assert record == snapshot  # the input is not modified
    assert digest == canonical_sha256({"schema": "kiln.receipt.v1", "steps": 3, "loss": 0.25})
    # the named field does not matter, every other field does
    assert self_hash({**record, "receipt_sha256": "anything"}, "receipt_sha256") == digest
    assert self_hash({**record, "steps": 4}, "receipt_sha256") != digest
    assert self_hash({k: v for k, v in record.items() if k != "loss"}, "receipt_sha256") != digest
    # dropping another field gives another digest; a missing field drops nothing
    assert self_hash(record, "loss") != digest
    assert self_hash(record, "absent") == canonical_sha256(record)


# --- identities and manifests --------------------------------------------------------------------


def test_identity_canonical_json_is_declaration_order():
    text = identity().canonical_json()
    assert list(json.loads(text)) == IDENTITY_FIELD_ORDER
    assert text == kiln_compact_json(json.loads(text))
    assert " " not in text and text.startswith('{"schema":"kiln.teacher-identity.v1","protocol":')


def test_identity_revisions():
    value = identity()
    canonical = value.canonical_json().encode("utf-8")
    assert value.content_revision() == hashlib.sha256(canonical).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", value.content_revision())
    assert value.identity_revision() == "sha256:" + value.content_revision()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", value.identity_revision())
    # the identity only, not the manifest wrapper
    assert value.content_revision() != hashlib.sha256(build_manifest_line(value).encode("utf-8")).hexdigest()
    assert identity(max_top_k=20).content_revision() != value.content_revision()


def test_identity_revision_of_non_ascii_identity_hashes_raw_utf8():
    value = identity(served_model_id="modèle-é")
    assert "modèle-é" in value.canonical_json()
    assert value.content_revision() == hashlib.sha256(value.canonical_json().encode("utf-8")).hexdigest()
    escaped = value.canonical_json().replace("è", "\\u00e8").replace("é", "\\u00e9")
    assert value.content_revision() != hashlib.sha256(escaped.encode("ascii")).hexdigest()


@pytest.mark.parametrize(
    "value",
    [
        identity(),
        identity(served_model_id="modèle-é", implementation="kiln/0.1/cuda/binary-sha256:" + "9" * 64),
        identity(adapter=TeacherAdapter(name="teacher-large", weights_sha256="e" * 64, config_sha256="f" * 64)),
    ],
    ids=["base", "non-ascii", "adapter"],
)
def test_manifest_line_round_trips_byte_for_byte(value):
    line = build_manifest_line(value)
    assert line.startswith('{"schema":"' + MANIFEST_SCHEMA + '","teacher_identity":{"schema":"' + IDENTITY_SCHEMA + '"')
    assert line == '{"schema":"' + MANIFEST_SCHEMA + '","teacher_identity":' + value.canonical_json() + "}"
    assert "\n" not in line
    parsed = parse_manifest_line(line)
    assert parsed.teacher_identity == value
    assert parsed.canonical_json() == line
    assert build_manifest_line(parsed.teacher_identity) == line
    assert parse_identity_json(value.canonical_json()) == value


@pytest.mark.parametrize(
    "transform",
    [
        lambda line: line + " ",
        lambda line: " " + line,
        lambda line: line + "\n",
        lambda line: json.dumps(json.loads(line), separators=(",", ":"), sort_keys=True),
        lambda line: json.dumps(json.loads(line), separators=(",", ":"), ensure_ascii=True),
        lambda line: json.dumps(json.loads(line)),
    ],
    ids=["trailing-space", "leading-space", "newline", "sorted-keys", "ascii-escaped", "spaced"],
)
def test_non_canonical_manifest_lines_are_refused(transform):
    line = build_manifest_line(identity(served_model_id="modèle-é"))
    changed = transform(line)
    assert changed != line
    with pytest.raises(ManifestError) as caught:
        parse_manifest_line(changed)
    assert caught.value.kind == "not_canonical"


def test_non_canonical_identity_json_is_refused():
    text = identity().canonical_json()
    with pytest.raises(ManifestError) as caught:
        parse_identity_json(json.dumps(json.loads(text), indent=1))
    assert caught.value.kind == "not_canonical"


def test_one_serde_json_writer():
    """Kiln's serde_json digests (prompt lists on- and off-policy, eval suites) come from one writer: three
    copies existed, and a fix to one would have silently split the digests."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    writers = sorted(path.relative_to(root).as_posix() for package in ("kiln_core", "tasks", "flows", "drills")
                     for path in (root / package).rglob("*.py")
                     if re.search(r"^def _ryu\(|ryu's|format64", path.read_text(encoding="utf-8"), re.M))
    assert writers == ["kiln_core/serde_json.py"]
