"""The ``hf_next_token_oracle`` flow: a batch with a rejected request still answers the rest and tables verdicts."""

from __future__ import annotations

import json

import pytest

from kiln_core.oracle import make_request


def test_artifact_key_slug():
    from flows.oracle import artifact_key

    key = artifact_key("hf-next-token-oracle", "Batch #1 / Tiny_Student")
    assert key == "hf-next-token-oracle-batch-1-tiny-student"


@pytest.mark.integration
def test_flow_tables_verdicts_and_survives_rejections(prefect_harness, tiny_student, tmp_path):
    from prefect.artifacts import Artifact

    from flows.oracle import ARTIFACT_KEY_PREFIX, artifact_key, hf_next_token_oracle

    made = [
        make_request(tiny_student, message="What is the capital of France?", prefix_text="Paris", kiln_id=10 + i,
                     vllm_id=20 + i, request_id=f"flow-request-{i}", out=tmp_path / "req" / f"flow-request-{i}.json")
        for i in range(2)
    ]
    broken = tmp_path / "req" / "broken.json"
    broken.write_text('{"schema": "kiln.hf-next-token-request.v1", "schema": "again"}')
    elsewhere = make_request(tiny_student, message="What is the capital of France?", prefix_text="Paris", kiln_id=30,
                             vllm_id=31, request_id="flow-request-elsewhere", out=tmp_path / "other" / "elsewhere.json")
    uris = [made[0].request_uri, str(broken), made[1].request_uri, elsewhere.request_uri]

    refs = hf_next_token_oracle(uris, str(tiny_student), out_root=str(tmp_path / "out"), dtype="fp32",
                                receipts_root=made[0].receipts_root)

    assert [ref.status for ref in refs] == ["ok", "rejected", "ok", "rejected"]
    assert refs[1].rule == "duplicate_key"
    assert refs[3].rule == "receipt_missing"  # its receipts are not under this batch's receipts root
    for ref in (refs[0], refs[2]):
        assert ref.verdict in {"kiln", "vllm", "neither"} and ref.receipts_checked is True
        record = json.loads((tmp_path / "out" / "oracle" / ref.request_id / "result.json").read_text())
        assert record["result_sha256"] == ref.result_sha256

    artifact = Artifact.get(artifact_key(ARTIFACT_KEY_PREFIX, "verdicts"))
    assert artifact is not None and artifact.type == "table"
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    assert [row["status"] for row in rows] == ["ok", "rejected", "ok", "rejected"]
    assert rows[1]["rule"] == "duplicate_key" and rows[0]["request"] == "flow-request-0"


@pytest.mark.integration
def test_flow_records_failed_forward_and_fails(prefect_harness, tiny_student, tmp_path):
    import shutil

    from flows.oracle import hf_next_token_oracle

    broken = tmp_path / "broken"
    shutil.copytree(tiny_student, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    made = make_request(broken, message="hi there", prefix_ids=[70], kiln_id=3, vllm_id=4, request_id="broken-model",
                        out=tmp_path / "req" / "broken-model.json")
    state = hf_next_token_oracle([made.request_uri], str(broken), out_root=str(tmp_path / "out"), dtype="fp32",
                                 receipts_root=made.receipts_root, return_state=True)
    assert state.is_failed()
    assert not (tmp_path / "out" / "oracle" / "broken-model" / "result.json").exists()
