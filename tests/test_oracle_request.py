"""Request loading for the HF next-token oracle: strict JSON, schema, cross-field, model and receipt rules.

Each rule gets a request that breaks exactly it (a valid request mutated, written to a temp file, run
through the loader) and an assertion on the stable rule name. The valid request is built once per
module from the tiny student with ``make_request``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from kiln_core.canonical import canonical_json_bytes, canonical_sha256, self_hash, sha256_prefixed
from kiln_core.oracle import OracleRejection, load_request, make_request, validate_inputs
from kiln_core.oracle.fingerprint import discover_weight_files, fingerprint_model, model_identity
from kiln_core.oracle.request import MAX_REQUEST_BYTES, load_schema
from kiln_core.strict_json import StrictJsonError, loads_strict

REPO = Path(__file__).resolve().parents[1]
MESSAGE = "What is two plus two?"


# ---------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def made(tiny_student, tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle-request")
    return make_request(
        tiny_student, message=MESSAGE, prefix_text="Two plus", kiln_id=17, vllm_id=42,
        request_id="tiny-request-1", out=root / "tiny-request-1.json", source_commit="ab" * 20,
    )


@pytest.fixture
def document(made) -> dict:
    return json.loads(Path(made.request_uri).read_text())


def refresh(doc: dict) -> dict:
    """Recompute every derived field so only the intended mutation is left to catch."""
    prompt = doc["prompt"]
    prompt["utf8_sha256"] = sha256_prefixed(prompt["messages"][0]["content"].encode("utf-8"))
    prompt["token_count"] = len(prompt["token_ids"])
    doc["input_token_ids"] = prompt["token_ids"] + [item["token_id"] for item in doc["continuation_prefix"]]
    doc["input_token_ids_sha256"] = canonical_sha256(doc["input_token_ids"])
    return doc


def write(tmp_path: Path, content, name: str = "request.json") -> str:
    path = tmp_path / name
    if isinstance(content, (bytes, bytearray)):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content, indent=2))
    return str(path)


def with_receipts(document: dict, root: Path, name: str = "request.json") -> str:
    """Write ``document`` under ``root`` with two synthetic receipts rebuilt to match it (as a serving
    run of exactly this request would have recorded them), so only the rule under test can fail."""
    from kiln_core.oracle.make_request import synthetic_receipt

    (root / "receipts").mkdir(parents=True, exist_ok=True)
    prefix = "".join(item["text"] for item in document["continuation_prefix"])
    for candidate in document["candidates"]:
        engine = candidate["engine"]
        receipt = synthetic_receipt(
            engine, identity_with_path={**document["model_identity"], "path": "/models/tiny"},
            source_commit=document["source"]["source_commit"], run_id=document["prompt"]["generator"]["run_id"],
            phase=document["prompt"]["generator"]["phase"], prompt_token_count=len(document["prompt"]["token_ids"]),
            exact_content=prefix + candidate["text"],
        )
        relative = f"receipts/{name}.{engine}.json"
        data = json.dumps(receipt).encode()
        (root / relative).write_bytes(data)
        document["source"][f"{engine}_receipt"] = {
            "path": relative, "file_sha256": sha256_prefixed(data), "content_sha256": receipt["receipt_sha256"]
        }
    return write(root, document, name)


def rejected(uri: str) -> OracleRejection:
    with pytest.raises(OracleRejection) as info:
        load_request(uri)
    return info.value


# ------------------------------------------------------------------------------------- golden vectors


def test_self_hash_drops_only_its_own_field():
    record = {"schema": "x", "b": [300.0, 1e-07], "result_sha256": "sha256:stale", "a": "é"}
    expected = "sha256:" + hashlib.sha256(b'{"a":"\\u00e9","b":[300.0,1e-07],"schema":"x"}').hexdigest()
    assert self_hash(record, "result_sha256") == expected


def test_python_repr_floats_survive_canonical_bytes():
    assert canonical_json_bytes({"y": 1e-07, "x": 300.0, "z": 24.199019849998876}) == b'{"x":300.0,"y":1e-07,"z":24.199019849998876}'


def test_input_ids_hash_is_compact_json_not_other_encodings():
    ids = [248045, 846, 198, 1206, 5517, 264]
    digest = canonical_sha256(ids)
    assert digest == "sha256:" + hashlib.sha256(b"[248045,846,198,1206,5517,264]").hexdigest()
    assert digest != "sha256:" + hashlib.sha256(json.dumps(ids).encode()).hexdigest()  # with spaces
    assert digest != "sha256:" + hashlib.sha256(struct.pack("<6I", *ids)).hexdigest()  # u32 LE
    # A fixed golden vector, independent of this codebase.
    assert canonical_sha256([1, 2, 3]) == "sha256:a615eeaee21de5179de080de8c3052c8da901138406ba71c38c032845f7d54f4"


# ------------------------------------------------------------------------------------- strict JSON


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ('{"a": 1, "a": 2}', "duplicate_key"),
        ('{"o": {"k": 1, "k": 1}}', "duplicate_key"),
        ('[NaN]', "non_finite_number"),
        ('[Infinity]', "non_finite_number"),
        ('[-Infinity]', "non_finite_number"),
        ('[1e400]', "non_finite_number"),
        ('[1e-400]', "invalid_json"),
        ('[0.10000000000000001]', "invalid_json"),
        ("[" + "9" * 4097 + "]", "invalid_json"),
        ('{"a": 1,}', "invalid_json"),
        ("", "invalid_json"),
    ],
)
def test_strict_json_rejections(text, rule):
    with pytest.raises(StrictJsonError) as info:
        loads_strict(text)
    assert info.value.rule == rule


def test_strict_json_rejects_bad_utf8_and_accepts_exact_numbers():
    with pytest.raises(StrictJsonError) as info:
        loads_strict(b'["\xff"]')
    assert info.value.rule == "invalid_json"
    assert loads_strict('[300.0, 1e-07, 1.50, -0.0, 0.1, ' + "9" * 4096 + "]")[:5] == [300.0, 1e-07, 1.5, -0.0, 0.1]


# ------------------------------------------------------------------------------------------ schema


def _walk(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


@pytest.mark.parametrize("name", ["hf-next-token-request-v1.schema.json", "hf-next-token-result-v1.schema.json"])
def test_shipped_schemas_are_valid_and_closed(name):
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    for node in _walk(schema):
        if node.get("type") == "object":
            assert node.get("additionalProperties") is False, node.get("description")


def test_request_schema_identity():
    schema = load_schema("hf-next-token-request-v1.schema.json")
    assert schema["$id"] == "https://ericflo.github.io/kiln/schemas/hf-next-token-request-v1.schema.json"
    assert schema["$defs"]["tokenId"]["maximum"] == 248319
    assert load_schema("hf-next-token-result-v1.schema.json")["properties"]["schema"]["const"] == "kiln-flows.hf-next-token-result.v1"


def test_valid_request_loads(made, document):
    loaded = load_request(made.request_uri)
    assert loaded.sha256 == canonical_sha256(document) == made.sha256
    assert [c.engine for c in loaded.request.candidates] == ["kiln", "vllm"]
    assert loaded.request.prompt.messages[0].content == MESSAGE


SCHEMA_MUTATIONS = {
    "extra_top_key": lambda d: d.update(extra=1),
    "missing_key": lambda d: d.pop("candidates"),
    "extra_nested_key": lambda d: d["source"]["kiln_receipt"].update(note="x"),
    "bool_token_id": lambda d: d["candidates"][0].update(token_id=True),
    "float_token_id": lambda d: d["continuation_prefix"][0].update(token_id=float(d["continuation_prefix"][0]["token_id"])),
    "bool_weight_bytes": lambda d: d["model_identity"]["weight_files"][0].update(bytes=True),
    "bool_token_count": lambda d: d["prompt"].update(token_count=True),
    "bool_request_index": lambda d: d["prompt"]["generator"].update(request_index=False),
    "token_id_above_seed_vocab": lambda d: d["candidates"][1].update(token_id=248320),
    "bad_id_pattern": lambda d: d.update(id="Bad_ID"),
    "uppercase_sha": lambda d: d.update(input_token_ids_sha256=d["input_token_ids_sha256"].upper()),
    "thinking_on": lambda d: d["prompt"]["template_kwargs"].update(enable_thinking=True),
    "two_messages": lambda d: d["prompt"]["messages"].append({"role": "user", "content": "x"}),
    "unknown_engine": lambda d: d["candidates"][1].update(engine="sglang"),
    "three_candidates": lambda d: d["candidates"].append(dict(d["candidates"][1])),
    "empty_prefix": lambda d: d.update(continuation_prefix=[]),
}


@pytest.mark.parametrize("mutation", sorted(SCHEMA_MUTATIONS))
def test_schema_violations(document, tmp_path, mutation):
    SCHEMA_MUTATIONS[mutation](document)
    error = rejected(write(tmp_path, document))
    assert error.rule == "schema_violation"
    assert error.message.startswith("$")


# ------------------------------------------------------------------------------------ file rules


def test_file_rules(document, tmp_path):
    assert rejected(str(tmp_path / "absent.json")).rule == "file_not_found"
    big = json.dumps(document) + " " * MAX_REQUEST_BYTES
    assert rejected(write(tmp_path, big, "big.json")).rule == "file_too_large"
    target = write(tmp_path, document, "real.json")
    os.symlink(target, tmp_path / "link.json")
    assert rejected(str(tmp_path / "link.json")).rule == "not_regular_file"
    (tmp_path / "dir.json").mkdir()
    assert rejected(str(tmp_path / "dir.json")).rule == "not_regular_file"


def test_fsspec_request_uri(document):
    import fsspec

    with fsspec.open("memory://oracle-requests/r.json", "w") as handle:
        json.dump(document, handle)
    assert load_request("memory://oracle-requests/r.json").request.id == document["id"]
    assert rejected("memory://oracle-requests/absent.json").rule == "file_not_found"


@pytest.mark.parametrize(
    ("payload", "rule"),
    [(b'{"schema": 1, "schema": 1}', "duplicate_key"), (b'{"x": NaN}', "non_finite_number"), (b"{not json", "invalid_json")],
)
def test_strict_json_rules_through_loader(tmp_path, payload, rule):
    assert rejected(write(tmp_path, payload)).rule == rule


# ------------------------------------------------------------------------------------ cross-field


def _swap(doc):
    doc["candidates"].reverse()


CROSS_FIELD = {
    "input_tokens_mismatch": lambda d: (refresh(d), d["input_token_ids"].append(5)),
    "input_hash_mismatch": lambda d: (refresh(d), d.update(input_token_ids_sha256=canonical_sha256(list(reversed(d["input_token_ids"]))))),
    "token_count_mismatch": lambda d: d["prompt"].update(token_count=d["prompt"]["token_count"] + 1),
    "utf8_hash_mismatch": lambda d: d["prompt"]["messages"][0].update(content=MESSAGE + " "),
    "candidate_order": _swap,
    "candidates_equal": lambda d: d["candidates"][1].update(token_id=d["candidates"][0]["token_id"]),
    "unsafe_path": lambda d: d["source"]["vllm_receipt"].update(path="../receipts/x.json"),
    "weight_paths_unsorted": lambda d: d["model_identity"]["weight_files"].append(dict(d["model_identity"]["weight_files"][0])),
}


@pytest.mark.parametrize("rule", sorted(CROSS_FIELD))
def test_cross_field_rules(document, tmp_path, rule):
    CROSS_FIELD[rule](document)
    error = rejected(write(tmp_path, document))
    assert error.rule == rule, error


@pytest.mark.parametrize("path", ["/abs/receipt.json", "./receipts/x.json", "receipts//x.json", "receipts/", "a/../b.json"])
def test_receipt_paths_must_be_normalized(document, tmp_path, path):
    document["source"]["kiln_receipt"]["path"] = path
    assert rejected(write(tmp_path, document)).rule == "unsafe_path"


def test_weight_paths_sorted_and_relative(document, tmp_path):
    first = document["model_identity"]["weight_files"][0]
    document["model_identity"]["weight_files"] = [dict(first, path="b.safetensors"), dict(first, path="a.safetensors")]
    assert rejected(write(tmp_path, document)).rule == "weight_paths_unsorted"
    document["model_identity"]["weight_files"] = [dict(first, path="../w.safetensors")]
    assert rejected(write(tmp_path, document, "r2.json")).rule == "unsafe_path"


# ---------------------------------------------------------------------------- model and tokenizer


def _validate(uri, model, receipts_root=None):
    from kiln_core.oracle.reference import check_model_inputs

    loaded, _ = validate_inputs(uri, model, receipts_root)
    check_model_inputs(model, loaded.request)
    return loaded


def _model_rejection(uri, model, receipts_root=None) -> OracleRejection:
    with pytest.raises(OracleRejection) as info:
        _validate(uri, model, receipts_root)
    return info.value


def test_valid_request_passes_model_tokenizer_and_receipt_checks(made, tiny_student):
    _validate(made.request_uri, tiny_student, made.receipts_root)


def test_model_identity_mismatch_lists_each_field(document, tmp_path, tiny_student, tiny_teacher):
    actual = document["model_identity"]["config_hash"]
    document["model_identity"]["config_hash"] = "sha256:" + "0" * 64
    error = _model_rejection(with_receipts(document, tmp_path), tiny_student, tmp_path)
    assert error.rule == "model_identity_mismatch"
    assert f"config_hash: expected sha256:{'0' * 64}, actual {actual}" in error.message
    assert "content_sha256" not in error.message
    error = _model_rejection(with_receipts(document, tmp_path, "other.json"), tiny_teacher, tmp_path)
    assert error.rule == "model_identity_mismatch"
    assert "weight_files[model.safetensors].sha256" in error.message and "content_sha256" in error.message


def test_prompt_render_mismatch(document, tmp_path, tiny_student):
    document["prompt"]["token_ids"][-2] += 1
    assert _model_rejection(with_receipts(refresh(document), tmp_path), tiny_student, tmp_path).rule == "prompt_render_mismatch"


def test_token_text_mismatch(document, tmp_path, tiny_student):
    document["candidates"][0]["text"] += "x"
    assert _model_rejection(with_receipts(document, tmp_path), tiny_student, tmp_path).rule == "token_text_mismatch"
    document["candidates"][0]["text"] = document["candidates"][0]["text"][:-1]
    document["continuation_prefix"][0]["text"] = ""
    assert _model_rejection(with_receipts(document, tmp_path, "p.json"), tiny_student, tmp_path).rule == "token_text_mismatch"


def test_token_id_out_of_range(document, tmp_path, tiny_student):
    document["candidates"][1]["token_id"] = 400  # tiny vocab is 400; the seed allows up to 248319
    assert _model_rejection(with_receipts(document, tmp_path), tiny_student, tmp_path).rule == "token_id_out_of_range"


# ------------------------------------------------------------------------------------------ receipts


def test_receipts_are_checked_against_the_current_directory_by_default(made, tiny_student, tmp_path, monkeypatch):
    """Kiln always checks the source receipts, from its repository root: no root given means cwd."""
    monkeypatch.chdir(made.receipts_root)
    loaded, warnings = validate_inputs(made.request_uri, tiny_student)
    assert loaded.request.id == "tiny-request-1" and warnings == []
    monkeypatch.chdir(tmp_path)  # the same request, run from a directory without its receipts
    error = _model_rejection(made.request_uri, tiny_student)
    assert error.rule == "receipt_missing"
    assert "kiln receipt receipts/tiny-request-1.kiln.json" in error.message and "--receipts-root" in error.message


def _clone_request_dir(made, tmp_path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(made.receipts_root, root)
    return root


def test_receipt_file_changed(made, tmp_path, tiny_student):
    root = _clone_request_dir(made, tmp_path)
    receipt = root / "receipts" / "tiny-request-1.vllm.json"
    receipt.write_bytes(receipt.read_bytes() + b" ")
    error = _model_rejection(str(root / "tiny-request-1.json"), tiny_student, root)
    assert error.rule == "receipt_mismatch" and "vllm" in error.message and "file bytes" in error.message


def test_receipt_missing(made, tmp_path, tiny_student):
    root = _clone_request_dir(made, tmp_path)
    (root / "receipts" / "tiny-request-1.kiln.json").unlink()
    error = _model_rejection(str(root / "tiny-request-1.json"), tiny_student, root)
    assert error.rule == "receipt_missing" and "kiln" in error.message
    (root / "receipts" / "tiny-request-1.vllm.json").unlink()
    (root / "receipts" / "tiny-request-1.kiln.json").mkdir()  # there, but not a file
    assert _model_rejection(str(root / "tiny-request-1.json"), tiny_student, root).rule == "receipt_unreadable"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda r: r.update(driver_version="8"), "driver_version"),
        (lambda r: r["driver_environment"]["repository"].update(dirty=True), "dirty"),
        (lambda r: r["workload"].update(run_id="other"), "run_id"),
        (lambda r: r["engine"]["model_identity"].update(config_hash="sha256:" + "1" * 64), "model_identity"),
        (lambda r: r["runs"][0].update(concurrency=True), "concurrency"),
        (lambda r: r["runs"][0]["output_evidence"][0]["exact_output"].update(content_base64="eHl6"), "does not start"),
    ],
)
def test_receipt_content_rules(made, tmp_path, tiny_student, edit, needle):
    root = _clone_request_dir(made, tmp_path)
    receipt_path = root / "receipts" / "tiny-request-1.kiln.json"
    receipt = json.loads(receipt_path.read_text())
    edit(receipt)
    receipt["receipt_sha256"] = self_hash(receipt, "receipt_sha256")
    receipt_path.write_text(json.dumps(receipt))
    request_path = root / "tiny-request-1.json"
    request = json.loads(request_path.read_text())
    request["source"]["kiln_receipt"].update(
        file_sha256=sha256_prefixed(receipt_path.read_bytes()), content_sha256=receipt["receipt_sha256"]
    )
    request_path.write_text(json.dumps(request))
    error = _model_rejection(str(request_path), tiny_student, root)
    assert error.rule == "receipt_mismatch" and needle in error.message, error


# --------------------------------------------------------------------------------------- fingerprint


def _fake_model(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"vocab_size": 8}\n')
    (root / "tokenizer.json").write_text("{}\n")
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return root


def test_fingerprint_discovery_and_aggregate(tmp_path):
    root = _fake_model(tmp_path / "m")
    (root / "b.safetensors").write_bytes(b"bbbb")
    (root / "a.safetensors").write_bytes(b"aa")
    assert discover_weight_files(root) == ["a.safetensors", "b.safetensors"]
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}))
    assert discover_weight_files(root) == ["b.safetensors", "a.safetensors"]
    identity = model_identity(fingerprint_model(root, "fake"))
    assert [item["path"] for item in identity["weight_files"]] == ["a.safetensors", "b.safetensors"]
    assert identity["weight_files"][0] == {"path": "a.safetensors", "bytes": 2, "sha256": sha256_prefixed(b"aa")}
    assert identity["chat_template_hash"] == sha256_prefixed(b"{{ messages }}")
    assert identity["config_hash"] == sha256_prefixed(b'{"vocab_size": 8}\n')
    content = {key: identity[key] for key in ("chat_template_hash", "config_hash", "id", "tokenizer_hash", "weight_files")}
    expected = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert identity["content_sha256"] == "sha256:" + hashlib.sha256(expected).hexdigest()
    (root / "chat_template.jinja").write_text("jinja")
    assert model_identity(fingerprint_model(root, "fake"))["chat_template_hash"] == sha256_prefixed(b"jinja")


@pytest.mark.parametrize("case", ["symlink", "shared_inode", "empty", "unsafe_index", "no_shards", "no_config"])
def test_fingerprint_refuses_bad_directories(tmp_path, case):
    root = _fake_model(tmp_path / "m")
    (root / "a.safetensors").write_bytes(b"aa")
    if case == "symlink":
        (tmp_path / "real.safetensors").write_bytes(b"cc")
        os.symlink(tmp_path / "real.safetensors", root / "c.safetensors")
    elif case == "shared_inode":
        os.link(root / "a.safetensors", root / "b.safetensors")
    elif case == "empty":
        (root / "b.safetensors").write_bytes(b"")
    elif case == "unsafe_index":
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../a.safetensors"}}))
    elif case == "no_shards":
        (root / "a.safetensors").unlink()
    elif case == "no_config":
        (root / "config.json").unlink()
    with pytest.raises(OracleRejection) as info:
        fingerprint_model(root, "fake")
    assert info.value.rule == "model_invalid"


# ------------------------------------------------------------------------------------------------ CLI


def _cli(capsys, *argv):
    from flows.cli import main

    code = main(["oracle", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


def test_request_nested_as_deep_as_serde_jsons_limit_is_refused(tmp_path):
    """Kiln's readers refuse the 128th nested container; 127 levels are only a schema problem."""
    assert rejected(write(tmp_path, ("[" * 127 + "]" * 127).encode(), "ok-depth.json")).rule == "schema_violation"
    assert rejected(write(tmp_path, ("[" * 128 + "]" * 128).encode(), "deep.json")).rule == "nesting_too_deep"
    assert rejected(write(tmp_path, ("[" * 5000 + "]" * 5000).encode(), "deeper.json")).rule == "nesting_too_deep"


def test_cli_json_rejections(capsys, tmp_path, document, tiny_student):
    code, record = _cli(capsys, str(tmp_path / "absent.json"), "--model", str(tiny_student), "--json")
    assert (code, record["status"], record["code"]) == (2, "rejected", "file_not_found")
    code, record = _cli(capsys, write(tmp_path, b'{"a":1,"a":2}'), "--model", str(tiny_student), "--json")
    assert (code, record["code"]) == (2, "duplicate_key")
    document["candidates"][1]["token_id"] = document["candidates"][0]["token_id"]
    code, record = _cli(capsys, write(tmp_path, document, "eq.json"), "--model", str(tiny_student), "--json")
    assert (code, record["code"]) == (2, "candidates_equal")
    assert "candidates[0].token_id" in record["message"]


def test_cli_subprocess_exit_code_and_last_line(tmp_path, tiny_student):
    request = write(tmp_path, b'{"x": Infinity}')
    env = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.run(
        [sys.executable, "-m", "flows.cli", "oracle", request, "--model", str(tiny_student), "--json"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60,
    )
    assert process.returncode == 2, process.stderr
    last = json.loads(process.stdout.strip().splitlines()[-1])
    assert last["status"] == "rejected" and last["code"] == "non_finite_number"
