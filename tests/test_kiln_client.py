"""The Kiln registry client against a real HTTP server process on loopback (tests/kiln_fake_server.py).

No HTTP client is patched: every test goes through sockets, so timeouts, refused connections and
retries behave as they would against Kiln.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kiln_core.contracts.identity import IDENTITY_SCHEMA, KILN_VLLM_PROTOCOL, TeacherIdentity, build_manifest_line
from kiln_core.teachers.kiln_client import TeacherRegistryError, fetch_off_policy_manifest, fetch_teachers

SERVER_SCRIPT = Path(__file__).with_name("kiln_fake_server.py")
ALIAS = "teacher-large@vllm"
TOKEN = "s3cret-token-value"


def _identity(served_model_id: str) -> TeacherIdentity:
    return TeacherIdentity.model_validate(
        {
            "schema": IDENTITY_SCHEMA,
            "protocol": KILN_VLLM_PROTOCOL,
            "served_model_id": served_model_id,
            "base_model_sha256": "a" * 64,
            "tokenizer_vocab_sha256": "b" * 64,
            "tokenizer_config_sha256": "c" * 64,
            "adapter": None,
            "vocab_size": 151936,
            "max_top_k": 32,
            "max_model_len": 32768,
            "max_prompt_logprob_candidates": 1_000_000,
            "logprobs_mode": "raw_logprobs",
            "implementation": "vllm:0.20.1",
            "inference_config_sha256": "d" * 64,
        }
    )


# Non-ASCII on purpose: the server escapes it as \uXXXX, the client must hand back the raw UTF-8 line.
IDENTITY = _identity("qwen-tëacher/ä")
MANIFEST = build_manifest_line(IDENTITY)


def _entry(alias: str, *, usable: bool = True, status: str = "verified", manifest: str | None = MANIFEST, message=None):
    entry = {
        "spec": {"alias": alias, "kind": "remote", "provider": "vllm", "model_id": "qwen", "max_top_k": 32,
                 "vocab_size": 151936, "supports_full_vocab": False, "tokenizer_hash": "b" * 64,
                 "url": "http://gpu:8000", "notes": None, "adapter": None, "future_field": 1},
        "capabilities": None,
        "status": status,
        "usable": usable,
        "identity_revision": IDENTITY.identity_revision(),
    }
    if manifest is not None:
        entry["off_policy_manifest"] = manifest
    if message is not None:
        entry["status_message"] = message
    return entry


OK_BODY = {
    "teachers": [
        _entry("fixture-teacher", status="configured"),
        _entry(ALIAS),
        _entry("broken@vllm", usable=False, status="unavailable", manifest=None,
               message="identity probe failed: connection refused; restart the vLLM launcher"),
        _entry("legacy@vllm", status="legacy_unverified", manifest=None),
        _entry("noncanonical@vllm", manifest=MANIFEST.replace('"adapter":null', '"adapter": null')),
    ]
}

SCENARIOS = {
    "ok": [{"status": 200, "json": OK_BODY}],
    "flaky": [{"status": 500, "text": "boom"}, {"status": 200, "json": OK_BODY}],
    "down": [{"status": 503, "text": "teacher registry overloaded"}],
    "notfound": [{"status": 404, "json": {"error": {"code": "not_found", "message": "no route"}}}],
    "slow": [{"status": 200, "json": OK_BODY, "delay_s": 3}],
    "garbage": [{"status": 200, "text": "<html>not json</html>"}],
    "wrongshape": [{"status": 200, "json": {"items": []}}],
    "auth": [{"status": 200, "json": OK_BODY, "require_bearer": TOKEN}],
}


@pytest.fixture(scope="module")
def kiln_server(tmp_path_factory):
    """Base URL of a fake Kiln process; scenario ``name`` is at ``f"{base}/{name}"``."""
    fixture = tmp_path_factory.mktemp("kiln") / "scenarios.json"
    fixture.write_text(json.dumps(SCENARIOS), encoding="utf-8")
    process = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT), "--port", "0", "--fixture", str(fixture)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def _hits(base: str, scenario: str) -> int:
    with urllib.request.urlopen(f"{base}/{scenario}/__hits", timeout=5) as response:
        return json.loads(response.read())["hits"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_api_key(monkeypatch):
    monkeypatch.delenv("KILN_API_KEY", raising=False)


def test_manifest_returned_byte_for_byte(kiln_server):
    line = fetch_off_policy_manifest(ALIAS, f"{kiln_server}/ok")
    assert line == MANIFEST
    assert line.encode("utf-8") == MANIFEST.encode("utf-8")
    assert "tëacher" in line  # raw UTF-8, not the server's \u escapes


def test_unknown_alias_lists_known(kiln_server):
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest("nope", f"{kiln_server}/ok")
    assert caught.value.code == "unknown_alias"
    for alias in ("fixture-teacher", ALIAS, "broken@vllm", "legacy@vllm"):
        assert alias in caught.value.message
    assert not caught.value.transient


def test_unusable_teacher_reports_status(kiln_server):
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest("broken@vllm", f"{kiln_server}/ok")
    assert caught.value.code == "teacher_unusable"
    assert "unavailable" in caught.value.message
    assert "restart the vLLM launcher" in caught.value.message


def test_missing_manifest(kiln_server):
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest("legacy@vllm", f"{kiln_server}/ok")
    assert caught.value.code == "no_manifest"
    assert "legacy_unverified" in caught.value.message


def test_non_canonical_manifest_refused(kiln_server):
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest("noncanonical@vllm", f"{kiln_server}/ok")
    assert caught.value.code == "invalid_manifest"


def test_500_then_success_retries(kiln_server):
    line = fetch_off_policy_manifest(ALIAS, f"{kiln_server}/flaky", retries=2, backoff=0.01)
    assert line == MANIFEST
    assert _hits(kiln_server, "flaky") == 2


def test_persistent_503_is_bounded(kiln_server):
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest(ALIAS, f"{kiln_server}/down", retries=2, backoff=0.01)
    assert caught.value.code == "server_error"
    assert caught.value.status == 503
    assert "teacher registry overloaded" in caught.value.message
    assert caught.value.transient
    assert _hits(kiln_server, "down") == 3  # first try + 2 retries


def test_404_is_not_retried(kiln_server):
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest(ALIAS, f"{kiln_server}/notfound", retries=3, backoff=0.01)
    assert caught.value.code == "http_error"
    assert caught.value.status == 404
    assert "no route" in caught.value.message
    assert _hits(kiln_server, "notfound") == 1


def test_slow_response_times_out(kiln_server):
    started = time.monotonic()
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest(ALIAS, f"{kiln_server}/slow", timeout=0.3, retries=1, backoff=0.01)
    assert caught.value.code == "timeout"
    assert caught.value.transient
    assert time.monotonic() - started < 2.5
    assert _hits(kiln_server, "slow") == 2


def test_connection_refused():
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest(ALIAS, f"http://127.0.0.1:{_free_port()}", retries=1, backoff=0.01)
    assert caught.value.code == "unreachable"
    assert caught.value.transient


@pytest.mark.parametrize("scenario", ["garbage", "wrongshape"])
def test_malformed_response(kiln_server, scenario):
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_teachers(f"{kiln_server}/{scenario}", retries=0)
    assert caught.value.code == "malformed_response"


def test_bad_url():
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_teachers("ftp://example/", retries=0)
    assert caught.value.code == "bad_url"


def test_bearer_token_from_environment(kiln_server, monkeypatch):
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest(ALIAS, f"{kiln_server}/auth", retries=0)
    assert caught.value.status == 401
    monkeypatch.setenv("KILN_API_KEY", TOKEN)
    assert fetch_off_policy_manifest(ALIAS, f"{kiln_server}/auth", retries=0) == MANIFEST
    monkeypatch.setenv("KILN_API_KEY", "wrong-token")
    with pytest.raises(TeacherRegistryError) as caught:
        fetch_off_policy_manifest(ALIAS, f"{kiln_server}/auth", retries=0)
    assert "wrong-token" not in str(caught.value)


def test_cli_manifest_from_kiln(kiln_server, capsys):
    from flows.cli import main

    assert main(["manifest", "--kiln", f"{kiln_server}/ok", "--alias", ALIAS]) == 0
    captured = capsys.readouterr()
    assert captured.out == MANIFEST + "\n"

    assert main(["manifest", "--kiln", f"{kiln_server}/ok", "--alias", "nope"]) == 2
    assert "fixture-teacher" in capsys.readouterr().err

    refused = f"http://127.0.0.1:{_free_port()}"
    assert main(["manifest", "--kiln", refused, "--alias", ALIAS, "--retries", "0"]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "unreachable" in captured.err

    assert main(["manifest", "--alias", ALIAS]) == 2
