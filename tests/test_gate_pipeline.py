"""The gate stage in the one engine path, through ``kiln-flows train``: Kiln's ``post_eval`` and our
quality gate decide whether ``runs/<adapter>/latest.json`` moves.

What a user depends on: a promoted adapter becomes ``latest``; a losing one is renamed
``<adapter>.failed`` with the evidence in its receipt and ``latest.json`` still names what served
before (exit 4: trained, held back — not a failure); a held-out suite overlapping the training corpus,
and every bad ``post_eval`` value, are refused before training (exit 2, field named).

The Kiln gate's outcomes are known in advance because its suites are built from what the models
answer: the same request trained under another storage root gives the same adapter bytes (the run
key and seed do not depend on the root), so a suite whose targets are that adapter's greedy answers
makes it a significant improvement over the base student; unreachable targets demote it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from kiln_core.post_eval import SuiteRegistry
from gate_support import training_and_held_out

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

CONFIG = {"training_mode": "off_policy", "objective": "reverse_kl", "loss": "teacher_top_k", "top_k": 16, "lora_rank": 4,
          "lora_alpha": 8.0, "seed": 3, "learning_rate": 0.05, "checkpoint_interval": 4, "epochs": 2}
PROMPTS = [f"What is {i} plus {i + 3}?" for i in range(24)]
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def corpus_dir(tiny_student, tmp_path_factory):
    """A 4-example training corpus, a disjoint 3-example held-out corpus, the manifest file."""
    return training_and_held_out(tiny_student, tmp_path_factory.mktemp("gate-corpus"))


def write_request(directory: Path, name: str, post_eval=None, **config) -> str:
    body = {"dataset_path": "corpus.jsonl", "teacher": "manifest.jsonl", "config": {**CONFIG, **config},
            "post_eval": post_eval}
    (directory / name).write_text(json.dumps(body))
    return str(directory / name)


def train(capsys, request: str, out: Path, student, adapter: str = "gated", *extra: str):
    code = main(["train", "--request", request, "--adapter", adapter, "--student", str(student), "--out", str(out),
                 "--json", *extra])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1])


def greedy_answers(student, adapter=None) -> list[str]:
    from kiln_core.post_eval.runner import generate, load_arm, render_prompt
    from kiln_core.contracts.post_eval.suite import EvalChatMessage, EvalGenerationParams

    arm = load_arm(str(student), adapter)
    params = EvalGenerationParams(max_tokens=MAX_TOKENS)
    return [generate(arm, render_prompt(arm, [EvalChatMessage(role="user", content=p)], None, None, params), params, 0)[0]
            for p in PROMPTS]


def register_suite(root: Path, name: str, targets: list[str]) -> None:
    doc = {"name": name, "default_scorer": {"kind": "exact_match", "strip_whitespace": False},
           "generation": {"max_tokens": MAX_TOKENS},
           "examples": [{"id": f"q{i}", "messages": [{"role": "user", "content": p}], "target": t}
                        for i, (p, t) in enumerate(zip(PROMPTS, targets))]}
    path = root / f"{name}.json"
    path.write_text(json.dumps(doc))
    SuiteRegistry.for_storage_root(str(root)).register(str(path))


@pytest.fixture(scope="module")
def trained_once(tiny_student, corpus_dir, tmp_path_factory):
    """The request's adapter, trained once without a gate, and the greedy answers it and the base give."""
    out = tmp_path_factory.mktemp("gate-reference")
    request = write_request(corpus_dir, "plain.json")
    assert main(["train", "--request", request, "--adapter", "gated", "--student", str(tiny_student), "--out", str(out),
                 "--quiet"]) == 0
    adapter = json.loads((out / "runs" / "gated" / "latest.json").read_text())["adapter"]
    base, tuned = greedy_answers(tiny_student), greedy_answers(tiny_student, adapter)
    assert sum(a != b for a, b in zip(base, tuned)) >= 8, "training must change enough answers to prove a gain"
    return {"base": base, "tuned": tuned}


def serve_an_earlier_run(capsys, corpus_dir, out, student) -> dict:
    """Publish another run of the adapter (other config) first, so there is a latest.json to keep or move."""
    code, earlier = train(capsys, write_request(corpus_dir, "earlier.json", epochs=1), out, student)
    assert code == 0 and earlier["gate"] is None
    return json.loads((out / "runs" / "gated" / "latest.json").read_text())


def test_promoted_adapter_moves_latest(tiny_student, corpus_dir, trained_once, tmp_path, capsys):
    before = serve_an_earlier_run(capsys, corpus_dir, tmp_path, tiny_student)
    register_suite(tmp_path, "tuned", trained_once["tuned"])
    request = write_request(corpus_dir, "promote.json", post_eval={"suite": "tuned", "min_accuracy": 0.5})
    code, result = train(capsys, request, tmp_path, tiny_student)
    assert code == 0, result
    gate = result["gate"]
    assert gate["outcome"] == "promoted" and gate["promoted"] is True
    evidence = gate["post_eval"]["post_eval_gate_evidence"][0]
    changed = sum(a != b for a, b in zip(trained_once["base"], trained_once["tuned"]))
    assert (evidence["improved"], evidence["regressed"], evidence["paired_examples"]) == (changed, 0, len(PROMPTS))
    assert evidence["candidate_accuracy"] == 1.0 and evidence["outcome"] == "promoted"
    latest = json.loads((tmp_path / "runs" / "gated" / "latest.json").read_text())
    assert latest["run"] == result["run"] != before["run"]  # latest moved to the promoted run
    receipt_bytes = Path(result["receipt"]).read_bytes()
    receipt = json.loads(receipt_bytes)
    assert receipt["gate_outcome"] == "promoted" and receipt["post_eval"]["gate_outcome"] == "promoted"
    from kiln_core.canonical import sha256_hex

    assert latest["receipt_sha256"] == "sha256:" + sha256_hex(receipt_bytes)  # the pointer covers the evidence


def test_demoted_adapter_is_renamed_with_evidence_and_latest_untouched(tiny_student, corpus_dir, tmp_path, capsys):
    before = serve_an_earlier_run(capsys, corpus_dir, tmp_path, tiny_student)
    latest_bytes = (tmp_path / "runs" / "gated" / "latest.json").read_bytes()
    register_suite(tmp_path, "unreachable", ["no model answers this"] * len(PROMPTS))
    request = write_request(corpus_dir, "demote.json", post_eval={"suite": "unreachable", "min_accuracy": 0.5})
    code, result = train(capsys, request, tmp_path, tiny_student)
    assert code == 4, result  # trained, held back by the gate: not exit 3, the run did not fail
    assert result["status"] == "success" and result["latest"] is None
    assert result["gate"]["outcome"] == "demoted" and result["gate"]["promoted"] is False
    failed = tmp_path / "runs" / "gated" / "gated.failed"
    assert result["run"] == str(failed) and result["receipt"] == str(failed / "train_receipt.json")
    assert (failed / "adapter" / "adapter_model.safetensors").exists()
    receipt = json.loads((failed / "train_receipt.json").read_text())
    assert receipt["status"] == "success" and receipt["gate_outcome"] == "demoted"
    evidence = receipt["post_eval"]["post_eval_gate_evidence"][0]
    assert evidence["candidate_accuracy"] == 0.0 and evidence["candidate_accuracy_upper_bound"] < 0.5
    assert evidence["outcome"] == "demoted" and "renamed to `gated.failed`" in receipt["post_eval"]["post_eval_verdict"]
    assert (tmp_path / "runs" / "gated" / "latest.json").read_bytes() == latest_bytes
    assert Path(before["run"]).exists()


def test_the_cli_prints_outcome_and_evidence(tiny_student, corpus_dir, tmp_path, capsys):
    register_suite(tmp_path, "unreachable", ["no model answers this"] * len(PROMPTS))
    request = write_request(corpus_dir, "demote.json", post_eval={"suite": "unreachable", "min_accuracy": 0.5})
    code = main(["train", "--request", request, "--adapter", "gated", "--student", str(tiny_student), "--out",
                 str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 4
    assert "gate: demoted" in out and "latest.json: not moved" in out
    assert "improved 0, regressed 0, tied 24; exact sign test p = 1" in out
    assert "accuracy: base 0.000 [0.000, 0.138], adapter 0.000 [0.000, 0.138] (95% Wilson), floor 0.5" in out


def test_quality_gate_decides_on_held_out_metrics(tiny_student, corpus_dir, tmp_path):
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine import run_pipeline

    def spec(root, **gate):
        return parse_spec({"teacher": {"kind": "manifest_file", "path": str(corpus_dir / "manifest.jsonl")},
                           "corpus": str(corpus_dir / "corpus.jsonl"), "student": str(tiny_student),
                           "storage_root": str(root), "adapter": "quality", "config": CONFIG,
                           "quality_gate": {"corpus": str(corpus_dir / "heldout.jsonl"), **gate}})

    passed = run_pipeline(spec(tmp_path / "a", max_reverse_kl=1e6, min_top1_agreement=0.0))
    quality = passed.gate["quality_gate"]
    assert passed.gate["outcome"] == "promoted" and passed.latest is not None
    assert quality["failures"] == [] and quality["distilled"]["tokens"] == quality["base"]["tokens"] > 0
    assert quality["base"]["reverse_kl"] != quality["distilled"]["reverse_kl"]  # the adapter was applied

    failed = run_pipeline(spec(tmp_path / "b", max_reverse_kl=0.0))
    assert failed.gate["outcome"] == "demoted" and failed.latest is None and failed.held_back
    assert failed.run.endswith("/quality.failed") and not (tmp_path / "b" / "runs" / "quality" / "latest.json").exists()
    receipt = json.loads(Path(failed.receipt).read_text())
    assert receipt["gate_outcome"] == "demoted" and receipt["quality_gate"]["failures"][0].startswith("reverse_kl ")
    assert "post_eval" not in receipt


def test_the_quality_gate_corpus_is_admitted_once_before_training_and_read_back_by_the_gate(
        tiny_student, corpus_dir, tmp_path, monkeypatch):
    import hashlib

    import kiln_core.evaluation as evaluation
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine import run_pipeline
    from kiln_core.evaluation import corpus as eval_corpus

    real, admitted = eval_corpus.admit_eval_corpus, []

    def counting(corpus_uri, *args, **kwargs):
        admitted.append(corpus_uri)
        return real(corpus_uri, *args, **kwargs)

    monkeypatch.setattr(eval_corpus, "admit_eval_corpus", counting)
    monkeypatch.setattr(evaluation, "admit_eval_corpus", counting)  # the gate's own import, were it to admit again
    heldout = corpus_dir / "heldout.jsonl"
    result = run_pipeline(parse_spec({
        "teacher": {"kind": "manifest_file", "path": str(corpus_dir / "manifest.jsonl")},
        "corpus": str(corpus_dir / "corpus.jsonl"), "student": str(tiny_student), "storage_root": str(tmp_path),
        "adapter": "quality-once", "config": CONFIG, "quality_gate": {"corpus": str(heldout), "max_reverse_kl": 1e6}}))
    assert result.gate["outcome"] == "promoted" and admitted == [str(heldout)]
    digest = hashlib.sha256(heldout.read_bytes()).hexdigest()
    assert result.gate["quality_gate"]["corpus_sha256"] == "sha256:" + digest
    assert (tmp_path / "corpora" / digest / "admission.json").exists()


def test_a_retried_gate_reads_its_decision_back(tiny_student, corpus_dir, tmp_path, monkeypatch):
    """A second pass over a decided run (a flow retry) neither evaluates again nor changes the receipt."""
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine import run_pipeline

    spec = parse_spec({"teacher": {"kind": "manifest_file", "path": str(corpus_dir / "manifest.jsonl")},
                       "corpus": str(corpus_dir / "corpus.jsonl"), "student": str(tiny_student),
                       "storage_root": str(tmp_path), "adapter": "again", "config": CONFIG,
                       "quality_gate": {"corpus": str(corpus_dir / "heldout.jsonl"), "max_reverse_kl": 1e6}})
    first = run_pipeline(spec)
    receipt = Path(first.receipt).read_bytes()

    def refuse(*args, **kwargs):
        raise AssertionError("the gate evaluated a run it had already decided")

    monkeypatch.setattr("kiln_core.engine.gate._quality_gate", refuse)
    second = run_pipeline(spec)
    assert second.reused and second.gate["outcome"] == "promoted" and second.latest == first.latest
    assert Path(second.receipt).read_bytes() == receipt


def test_held_out_suite_overlapping_the_corpus_is_refused_before_training(tiny_student, corpus_dir, tmp_path, capsys):
    row = json.loads((corpus_dir / "corpus.jsonl").read_text().splitlines()[2])
    doc = {"name": "leaky", "default_scorer": {"kind": "exact_match"},
           "examples": [{"messages": row["messages"], "target": row["teacher_response"]}]}
    (tmp_path / "leaky.json").write_text(json.dumps(doc))
    SuiteRegistry.for_storage_root(str(tmp_path)).register(str(tmp_path / "leaky.json"))
    request = write_request(corpus_dir, "leaky.json", post_eval={"suite": "leaky", "min_accuracy": 0.5})
    code, result = train(capsys, request, tmp_path, tiny_student)
    assert code == 2 and result["code"] == "post_eval_overlap" and result["field"] == "post_eval.data_scope"
    assert "declared held-out but overlaps admitted training data via exact prompt/target" in result["message"]
    assert not (tmp_path / "runs").exists()  # nothing trained
    # the same suite as a diagnostic is allowed (and cannot gate)
    request = write_request(corpus_dir, "diag.json", post_eval={"suite": "leaky", "data_scope": "train-set-eval"})
    code, result = train(capsys, request, tmp_path, tiny_student)
    assert code == 0 and result["gate"]["outcome"] is None and result["latest"] is not None
    assert result["gate"]["post_eval"]["gated"] is False and result["gate"]["post_eval"]["metrics"]["candidate"]


@pytest.mark.parametrize("post_eval, code_name, field", [
    ({"suite": "tuned", "min_accuracy": 1.5}, "post_eval_min_accuracy_out_of_range", "post_eval.min_accuracy"),
    ({"suite": "tuned", "min_accuracy": "high"}, "post_eval_invalid_config", "post_eval.min_accuracy"),
    ({"suite": "tuned", "data_scope": "train-set-eval", "min_accuracy": 0.5}, "post_eval_train_set_eval_gated",
     "post_eval.data_scope"),
    ({"suite": "tuned", "data_scope": "heldout"}, "post_eval_invalid_config", "post_eval.data_scope"),
    ({"suite": "missing", "min_accuracy": 0.5}, "post_eval_suite_not_installed", "post_eval.suite"),
    ({"min_accuracy": 0.5}, "post_eval_invalid_config", "post_eval.suite"),
])
def test_bad_post_eval_is_refused_naming_the_field(tiny_student, corpus_dir, tmp_path, capsys, post_eval, code_name,
                                                   field):
    register_suite(tmp_path, "tuned", ["x"] * len(PROMPTS))
    code, result = train(capsys, write_request(corpus_dir, "bad.json", post_eval=post_eval), tmp_path, tiny_student)
    assert code == 2 and result["code"] == code_name and result["field"] == field, result
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("block, field", [
    ({"suite": "s", "min_accuracy": 2.0}, "post_eval.min_accuracy"),
    ({"suite": "s", "data_scope": "train-set-eval", "min_accuracy": 0.1}, "post_eval.data_scope"),
    ({"suite": "s", "include_baseline": "yes"}, "post_eval.include_baseline"),
])
def test_bad_post_eval_in_a_spec_names_the_field(tiny_student, block, field):
    from kiln_core.contracts.pipeline import SpecError, parse_spec

    with pytest.raises(SpecError) as caught:
        parse_spec({"corpus": "c.jsonl", "student": str(tiny_student), "adapter": "a", "post_eval": block})
    assert caught.value.field == field and caught.value.code == "invalid_spec"


@pytest.mark.parametrize("block, field", [
    ({"corpus": "h.jsonl"}, "quality_gate"),
    ({"corpus": "h.jsonl", "min_top1_agreement": 1.5}, "quality_gate.min_top1_agreement"),
    ({"corpus": "h.jsonl", "max_reverse_kl": -1}, "quality_gate.max_reverse_kl"),
    ({"corpus": "h.jsonl", "max_kl": 1}, "quality_gate.max_kl"),
])
def test_bad_quality_gate_names_the_field(tiny_student, block, field):
    from kiln_core.contracts.pipeline import SpecError, parse_spec

    with pytest.raises(SpecError) as caught:
        parse_spec({"corpus": "c.jsonl", "student": str(tiny_student), "adapter": "a", "quality_gate": block})
    assert caught.value.field == field


def test_an_eval_that_does_not_complete_is_outcome_error(tiny_student, corpus_dir, tmp_path, capsys, monkeypatch):
    """Kiln: an eval job that fails is outcome ``error`` — the adapter stays where it is, not promoted."""
    register_suite(tmp_path, "tuned", ["x"] * len(PROMPTS))

    def broken_model(*args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr("kiln_core.post_eval.runner.load_arm", broken_model)
    request = write_request(corpus_dir, "error.json", post_eval={"suite": "tuned", "min_accuracy": 0.5})
    code, result = train(capsys, request, tmp_path, tiny_student)
    assert code == 4 and result["status"] == "success" and result["latest"] is None
    assert result["gate"]["outcome"] == "error" and "NOT promoted" in result["gate"]["verdict"]
    assert Path(result["run"]).parent == tmp_path / "runs" / "gated" and Path(result["run"]).name != "gated.failed"
    receipt = json.loads(Path(result["receipt"]).read_text())
    assert receipt["gate_outcome"] == "error" and "device-side assert" in receipt["post_eval"]["error"]
    assert receipt["post_eval"]["post_eval_gate_evidence"] == []


def test_a_pass_without_auto_load_is_kept_not_published(tiny_student, corpus_dir, tmp_path):
    """Kiln: a passing gate without ``auto_load`` is ``kept`` — in place, not active; not a held-back run (exit 0)."""
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine import run_pipeline

    spec = parse_spec({"teacher": {"kind": "manifest_file", "path": str(corpus_dir / "manifest.jsonl")},
                       "corpus": str(corpus_dir / "corpus.jsonl"), "student": str(tiny_student),
                       "storage_root": str(tmp_path), "adapter": "kept", "config": {**CONFIG, "auto_load": False},
                       "quality_gate": {"corpus": str(corpus_dir / "heldout.jsonl"), "max_reverse_kl": 1e6}})
    result = run_pipeline(spec)
    assert result.gate["outcome"] == "kept" and "kept (auto_load not requested)" in result.gate["verdict"]
    assert result.latest is None and not result.held_back and Path(result.run).parent.name == "kept"
    assert not (tmp_path / "runs" / "kept" / "latest.json").exists()


@pytest.mark.parametrize("outcome, event", [
    ("promoted", "kiln-flows.adapter.promoted"), ("kept", "kiln-flows.adapter.kept"),
    ("demoted", "kiln-flows.adapter.rejected"), ("regression", "kiln-flows.adapter.rejected"),
    ("inconclusive", "kiln-flows.adapter.rejected"), ("error", "kiln-flows.adapter.rejected"), (None, None),
])
def test_every_outcome_has_its_event(outcome, event):
    from tasks.gate import gate_event_name

    assert gate_event_name(outcome) == event
