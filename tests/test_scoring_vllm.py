"""Scoring through vLLM's prompt-logprobs contract, end to end against a loopback fake server process."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kiln_core.admission import admit_corpus
from kiln_core.contracts.identity import KILN_VLLM_PROTOCOL, TeacherIdentity, build_manifest_line
from kiln_core.scoring import ScoringError, score_examples
from test_scoring import EXAMPLES, TOP_K, read_rows, write_jsonl  # tests/ is on sys.path under pytest

SERVED_MODEL = "tiny-teacher-vllm"
SERVER = Path(__file__).with_name("fake_vllm_server.py")


@pytest.fixture(scope="module")
def vllm_identity(tiny_teacher) -> TeacherIdentity:
    """The tiny teacher as a Kiln vLLM teacher would describe it (Kiln's own protocol string)."""
    from kiln_core.identity.local_teacher import local_teacher_identity

    fields = local_teacher_identity(tiny_teacher, device_kind="cpu").as_ordered_dict()
    fields.update(protocol=KILN_VLLM_PROTOCOL, served_model_id=SERVED_MODEL, implementation="vllm:0.20.1")
    return TeacherIdentity.model_validate(fields)


@pytest.fixture(scope="module")
def manifest_file(tmp_path_factory, vllm_identity) -> Path:
    path = tmp_path_factory.mktemp("vllm") / "manifest.jsonl"
    path.write_text(build_manifest_line(vllm_identity) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server_url(tiny_teacher, manifest_file):
    """Start the fake server as a real subprocess; yields its base URL (append a scenario)."""
    log = manifest_file.with_name("server.log")
    with open(log, "w") as stderr:  # a file, not a pipe: an unread pipe could block the server
        process = subprocess.Popen(
            [sys.executable, str(SERVER), "--port", "0", "--teacher", str(tiny_teacher), "--manifest", str(manifest_file)],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    port: list[str] = []
    reader = threading.Thread(target=lambda: port.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=120)
    try:
        if not port or not port[0].strip():
            process.kill()
            raise RuntimeError(f"fake vLLM server did not start: {log.read_text()[-2000:]}")
        yield f"http://127.0.0.1:{int(port[0])}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def score_vllm(examples, out, url, manifest_file, **overrides):
    options = dict(vllm_url=url, served_model=SERVED_MODEL, pinned_manifest=manifest_file.read_text(encoding="utf-8"),
                   student_dir=overrides.pop("student_dir"), top_k=TOP_K, out_uri=str(out), batch_size=3)
    options.update(overrides)
    return score_examples(str(examples), **options)


def test_fingerprint_is_the_kiln_form(vllm_identity):
    from kiln_core.scoring.vllm import teacher_fingerprint

    fingerprint = teacher_fingerprint(vllm_identity)
    prefix, encoded, digest = fingerprint.split(".")
    canonical = vllm_identity.canonical_json().encode("utf-8")
    assert prefix == "kiln-teacher-v1" and "=" not in encoded
    assert base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)) == canonical
    assert digest == hashlib.sha256(canonical).hexdigest() == vllm_identity.content_revision()


def test_vllm_scoring_is_admitted_and_matches_local(tmp_path, server_url, manifest_file, tiny_teacher, tiny_student):
    examples = write_jsonl(tmp_path / "examples.jsonl", EXAMPLES)
    out = tmp_path / "corpus.jsonl"
    result = score_vllm(examples, out, f"{server_url}/ok", manifest_file, student_dir=str(tiny_student))
    manifest = manifest_file.read_text(encoding="utf-8").rstrip("\n")
    assert result.manifest_line == manifest and result.examples == len(EXAMPLES)
    admitted = admit_corpus(str(out), str(tiny_student), top_k=TOP_K, pinned_manifest=manifest, kiln_strict=True)
    assert admitted.examples == len(EXAMPLES) and admitted.action_tokens == result.action_tokens

    local_out = tmp_path / "local.jsonl"
    score_examples(str(examples), teacher_dir=str(tiny_teacher), student_dir=str(tiny_student), top_k=TOP_K,
                   out_uri=str(local_out), device="cpu")
    for remote_row, local_row in zip(read_rows(out)[1], read_rows(local_out)[1]):
        for remote, local in zip(remote_row["teacher_tokens"], local_row["teacher_tokens"]):
            assert remote["token_id"] == local["token_id"] and remote["token"] == local["token"]
            assert remote["top_logprobs"][0]["token_id"] == local["top_logprobs"][0]["token_id"]
            assert remote["logprob"] == pytest.approx(local["logprob"], abs=1e-4)
            np.testing.assert_allclose([c["logprob"] for c in remote["top_logprobs"]],
                                       [c["logprob"] for c in local["top_logprobs"]], atol=1e-4)


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("bad-fingerprint", "system_fingerprint"),
        ("bad-model", "does not match the requested model 'tiny-teacher-vllm'"),
        ("missing-rank", "].rank is missing"),
        ("high-mass", "probability mass"),
    ],
)
def test_contract_violations_are_refused(tmp_path, server_url, manifest_file, tiny_student, scenario, expected):
    examples = write_jsonl(tmp_path / "examples.jsonl", EXAMPLES[:2])
    out = tmp_path / "corpus.jsonl"
    with pytest.raises(ScoringError) as caught:
        score_vllm(examples, out, f"{server_url}/{scenario}", manifest_file, student_dir=str(tiny_student))
    assert caught.value.code == "vllm_response"
    assert expected in caught.value.message and caught.value.line == 1
    assert not out.exists()


def test_request_limits_from_the_identity_are_checked_before_sending(tmp_path, vllm_identity, tiny_student):
    fields = vllm_identity.as_ordered_dict()
    fields.update(max_prompt_logprob_candidates=40)
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(build_manifest_line(TeacherIdentity.model_validate(fields)))
    examples = write_jsonl(tmp_path / "examples.jsonl", EXAMPLES[:1])
    # Nothing listens on this port: a request would fail as unreachable, not as vllm_request.
    with pytest.raises(ScoringError) as caught:
        score_vllm(examples, tmp_path / "out.jsonl", "http://127.0.0.1:9", manifest, student_dir=str(tiny_student))
    assert caught.value.code == "vllm_request" and "max_prompt_logprob_candidates is 40" in caught.value.message


def test_served_model_and_url_are_checked(tmp_path, manifest_file, tiny_student):
    examples = write_jsonl(tmp_path / "examples.jsonl", EXAMPLES[:1])
    with pytest.raises(ScoringError) as caught:
        score_vllm(examples, tmp_path / "out.jsonl", "http://127.0.0.1:9", manifest_file,
                   student_dir=str(tiny_student), served_model="other")
    assert caught.value.code == "teacher_mismatch" and "served_model_id" in caught.value.message
    with pytest.raises(ScoringError, match="use https unless the host is loopback"):
        score_vllm(examples, tmp_path / "out.jsonl", "http://example.com", manifest_file, student_dir=str(tiny_student))
    with pytest.raises(ScoringError) as caught:
        score_vllm(examples, tmp_path / "out.jsonl", "http://127.0.0.1:9", manifest_file, student_dir=str(tiny_student))
    assert caught.value.code == "vllm_unreachable" and caught.value.transient


def test_cli_vllm_exit_codes(tmp_path, capsys, server_url, manifest_file, tiny_student):
    from flows.cli import main

    examples = write_jsonl(tmp_path / "examples.jsonl", EXAMPLES[:2])
    common = ["score", str(examples), "--student", str(tiny_student), "--top-k", str(TOP_K),
              "--served-model", SERVED_MODEL, "--teacher-manifest", str(manifest_file), "--quiet"]
    assert main([*common, "--vllm", f"{server_url}/ok", "--out", str(tmp_path / "ok.jsonl")]) == 0
    assert capsys.readouterr().out == ""  # --quiet: nothing but warnings and errors
    assert main([*common, "--vllm", f"{server_url}/bad-fingerprint", "--out", str(tmp_path / "bad.jsonl")]) == 2
    assert "system_fingerprint" in capsys.readouterr().err
    assert main([*common, "--vllm", "http://127.0.0.1:9", "--out", str(tmp_path / "down.jsonl")]) == 3
    assert not (tmp_path / "bad.jsonl").exists() and not (tmp_path / "down.jsonl").exists()
    assert json.loads((tmp_path / "ok.jsonl").read_text().splitlines()[1])["id"] == "single"
