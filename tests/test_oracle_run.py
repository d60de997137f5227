"""Running the HF next-token oracle on the tiny student: verdicts, evidence, artifacts, idempotence, CLI.

The reference argmax is recomputed in the test itself with a plain ``model(...).logits`` so the
oracle's verdict is checked against an independent computation. Runs are fp32 on CPU, plus one bf16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln_core.canonical import canonical_sha256, self_hash, sha256_prefixed
from kiln_core.oracle import OracleRejection, load_request, make_request, read_result, run_oracle, validate_result
from kiln_core.strict_json import loads_strict

MESSAGE = "Summarize the text in one sentence."


@pytest.fixture(scope="module")
def independent(tiny_student, tmp_path_factory):
    """Input ids of the probe request and the float32 logits of a plain, separately loaded model."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("oracle-probe")
    probe = make_request(tiny_student, message=MESSAGE, prefix_text="The text", kiln_id=3, vllm_id=4,
                         request_id="probe", out=root / "probe.json")
    ids = load_request(probe.request_uri).request.input_token_ids
    model = AutoModelForCausalLM.from_pretrained(str(tiny_student), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return {"ids": ids, "logits": logits, "argmax": int(torch.argmax(logits))}


@pytest.fixture(scope="module")
def requests_dir(tiny_student, independent, tmp_path_factory):
    """Three requests at the probe state: the argmax is Kiln's, vLLM's, or neither candidate."""
    root = tmp_path_factory.mktemp("oracle-requests")
    top = independent["argmax"]
    other = [i for i in (5, 6, 7) if i != top]
    pairs = {"kiln-wins": (top, other[0]), "vllm-wins": (other[0], top), "neither-wins": (other[0], other[1])}
    for request_id, (kiln_id, vllm_id) in pairs.items():
        make_request(tiny_student, message=MESSAGE, prefix_text="The text", kiln_id=kiln_id, vllm_id=vllm_id,
                     request_id=request_id, out=root / f"{request_id}.json")
    return root


@pytest.fixture(scope="module")
def kiln_outcome(tiny_student, requests_dir, tmp_path_factory):
    out_root = str(tmp_path_factory.mktemp("oracle-out"))
    outcome = run_oracle(str(requests_dir / "kiln-wins.json"), tiny_student, out_root=out_root, dtype="fp32",
                         receipts_root=requests_dir)
    return outcome, out_root


def test_verdict_matches_independent_argmax(kiln_outcome, independent):
    import torch

    outcome, _ = kiln_outcome
    record = outcome.record
    assert record["verdict"] == {"argmax_candidate": "kiln", "argmax_token_id": independent["argmax"], "candidate_attribution_complete": True}
    assert record["oracle"]["argmax"] == independent["argmax"]
    assert record["receipts_checked"] is True and outcome.reused is False
    kiln, vllm = record["oracle"]["candidate_tokens"]
    assert kiln["rank"] == 1 and vllm["rank"] > 1
    logprobs = torch.log_softmax(independent["logits"], dim=-1)
    assert kiln["logit"] == pytest.approx(float(independent["logits"][kiln["token_id"]]), abs=1e-4)
    assert vllm["logprob"] == pytest.approx(float(logprobs[vllm["token_id"]]), abs=1e-4)
    assert record["oracle"]["top_logit_margin"] > 0


def test_result_record_is_self_consistent(kiln_outcome, independent, requests_dir):
    outcome, _ = kiln_outcome
    record = loads_strict(Path(outcome.result_uri).read_bytes())
    assert record == outcome.record
    validate_result(record)
    assert record["result_sha256"] == self_hash(record, "result_sha256")
    assert record["schema"] == "kiln-flows.hf-next-token-result.v1"
    loaded = load_request(str(requests_dir / "kiln-wins.json"))
    assert record["request"]["sha256"] == loaded.sha256 == canonical_sha256(loaded.document)
    assert record["request"]["input_token_ids_sha256"] == canonical_sha256(independent["ids"])
    assert record["model_identity"] == loaded.document["model_identity"]
    assert record["runtime"]["dtype"] == "fp32" and record["runtime"]["device"] == "cpu"
    top = record["oracle"]["top_tokens"]
    assert len(top) == 10 and top[0]["token_id"] == record["oracle"]["argmax"]
    assert all((a["logit"], -a["token_id"]) >= (b["logit"], -b["token_id"]) for a, b in zip(top, top[1:]))


def test_logits_artifact(kiln_outcome, independent):
    import torch
    from safetensors import safe_open

    outcome, _ = kiln_outcome
    path = Path(outcome.result_uri).parent / "logits.safetensors"
    artifact = outcome.record["reference_artifact"]
    assert artifact["sha256"] == sha256_prefixed(path.read_bytes()) and artifact["bytes"] == path.stat().st_size
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(handle.keys()) == ["input_ids", "logits"]
        metadata = handle.metadata()
        input_ids, logits = handle.get_tensor("input_ids"), handle.get_tensor("logits")
    assert input_ids.dtype == torch.int64 and input_ids.tolist() == [independent["ids"]]
    assert logits.dtype == torch.float32 and logits.shape == (400,)
    assert torch.allclose(logits, independent["logits"], atol=1e-4)
    assert outcome.record["oracle"]["logits_sha256"] == sha256_prefixed(logits.numpy().astype("<f4").tobytes())
    assert metadata["attention_implementation"] == "eager" and metadata["dtype"] == "float32"
    assert json.loads(metadata["input_token_ids"]) == independent["ids"]
    assert {"schema", "torch_version", "transformers_version"} <= set(metadata)


def test_rerun_is_idempotent_and_never_overwrites(kiln_outcome, tiny_student, requests_dir):
    outcome, out_root = kiln_outcome
    again = run_oracle(str(requests_dir / "kiln-wins.json"), tiny_student, out_root=out_root, dtype="fp32", receipts_root=requests_dir)
    assert again.reused is True and again.record == outcome.record
    with pytest.raises(OracleRejection) as info:
        run_oracle(str(requests_dir / "kiln-wins.json"), tiny_student, out_root=out_root, dtype="bf16",
                   receipts_root=requests_dir)
    assert info.value.rule == "result_exists" and "dtype" in info.value.message
    # A contract failure is reported by its own rule even when a result is committed for that id.
    document = json.loads((requests_dir / "kiln-wins.json").read_text())
    document["candidates"][1]["text"] += "x"
    tampered = Path(out_root).parent / "kiln-wins-tampered.json"
    tampered.write_text(json.dumps(document))
    with pytest.raises(OracleRejection) as info:
        run_oracle(str(tampered), tiny_student, out_root=out_root, dtype="fp32", receipts_root=requests_dir)
    assert info.value.rule == "receipt_mismatch"  # the receipts recorded the untampered candidate text


def test_corrupt_committed_result_is_refused(kiln_outcome, tiny_student, requests_dir, tmp_path):
    outcome, out_root = kiln_outcome
    shutil.copytree(Path(out_root) / "oracle", tmp_path / "oracle")
    result = tmp_path / "oracle" / "kiln-wins" / "result.json"
    record = json.loads(result.read_text())
    record["verdict"]["argmax_candidate"] = "vllm"
    result.write_text(json.dumps(record))
    with pytest.raises(OracleRejection) as info:
        read_result(str(tmp_path), "kiln-wins")
    assert info.value.rule == "result_exists"


@pytest.mark.parametrize(("request_id", "verdict"), [("vllm-wins", "vllm"), ("neither-wins", "neither")])
def test_other_verdicts_with_receipts_under_the_current_directory(tiny_student, requests_dir, independent, tmp_path,
                                                                   monkeypatch, request_id, verdict):
    monkeypatch.chdir(requests_dir)  # no receipts root given: Kiln's, the current directory
    outcome = run_oracle(str(requests_dir / f"{request_id}.json"), tiny_student, out_root=str(tmp_path), dtype="fp32")
    assert outcome.record["verdict"]["argmax_candidate"] == verdict
    assert outcome.record["verdict"]["candidate_attribution_complete"] is (verdict != "neither")
    assert outcome.record["oracle"]["argmax"] == independent["argmax"]
    assert outcome.record["receipts_checked"] is True and outcome.warnings == ()


def test_missing_receipts_reject_the_request_and_write_nothing(tiny_student, requests_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OracleRejection) as info:
        run_oracle(str(requests_dir / "vllm-wins.json"), tiny_student, out_root=str(tmp_path / "out"), dtype="fp32")
    assert info.value.rule == "receipt_missing"
    assert not (tmp_path / "out").exists()


def test_bf16_run_to_object_store(tiny_student, requests_dir, independent):
    import fsspec

    root = "memory://oracle-bf16"
    outcome = run_oracle(str(requests_dir / "kiln-wins.json"), tiny_student, out_root=root, dtype="bf16",
                         receipts_root=requests_dir)
    assert outcome.result_uri == f"{root}/oracle/kiln-wins/result.json"
    assert outcome.record["runtime"]["dtype"] == "bf16"
    fs = fsspec.filesystem("memory")
    assert fs.exists("/oracle-bf16/oracle/kiln-wins/logits.safetensors")
    assert read_result(root, "kiln-wins") == outcome.record
    # bf16 logits stay close to the fp32 reference on this tiny model.
    top = outcome.record["oracle"]["top_tokens"][0]
    assert abs(top["logit"] - float(independent["logits"][top["token_id"]])) < 0.25


def test_forward_failure_exits_3(tiny_student, tmp_path, capsys):
    from flows.cli import main

    broken = tmp_path / "broken"
    shutil.copytree(tiny_student, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    made = make_request(broken, message=MESSAGE, prefix_ids=[70], kiln_id=3, vllm_id=4, request_id="broken", out=tmp_path / "broken.json")
    code = main(["oracle", made.request_uri, "--model", str(broken), "--dtype", "fp32", "--out", str(tmp_path / "out"),
                 "--receipts-root", made.receipts_root, "--json"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 3 and last["status"] == "failed"
    assert not (tmp_path / "out" / "oracle" / "broken" / "result.json").exists()


def test_cli_end_to_end(tiny_student, tmp_path, capsys, independent):
    from flows.cli import main

    request = tmp_path / "req" / "cli-request.json"
    code = main(["oracle", "make-request", "--model", str(tiny_student), "--message", MESSAGE, "--prefix", "The text",
                 "--kiln-id", str(independent["argmax"]), "--vllm-id", "9" if independent["argmax"] != 9 else "8",
                 "--id", "cli-request", "--out", str(request), "--run-id", "run-7", "--json"])
    made = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and made["status"] == "ok" and request.exists()
    argv = ["oracle", str(request), "--model", str(tiny_student), "--dtype", "fp32", "--out", str(tmp_path / "out"),
            "--receipts-root", made["receipts_root"], "--json"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["verdict"]["argmax_candidate"] == "kiln" and record["receipts_checked"] is True
    validate_result(record)
    assert main(argv[:-1]) == 0  # human summary; reuses the committed result
    assert "reused committed" in capsys.readouterr().out


def test_cli_tokenizer_rejection(tiny_student, requests_dir, tmp_path, capsys):
    from flows.cli import main

    document = json.loads((requests_dir / "vllm-wins.json").read_text())
    document["prompt"]["token_ids"][0] = 2
    document["input_token_ids"][0] = 2
    document["input_token_ids_sha256"] = canonical_sha256(document["input_token_ids"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    code = main(["oracle", str(path), "--model", str(tiny_student), "--dtype", "fp32", "--out", str(tmp_path),
                 "--receipts-root", str(requests_dir), "--json"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (code, last["code"]) == (2, "prompt_render_mismatch")
    code = main(["oracle", str(path), "--model", str(tiny_student), "--dtype", "fp32", "--out", str(tmp_path), "--json"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (code, last["code"]) == (2, "receipt_missing")  # run from a directory without the receipts
