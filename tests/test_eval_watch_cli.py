"""The held-out watch from the command line: ``kiln-flows train --eval-corpus FILE --eval-every N
[--stop-on-divergence]`` reaches the trainer through the engine; off by default; bad flags exit 2."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from gate_support import training_and_held_out

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)

CONFIG = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
          "learning_rate": 0.02, "checkpoint_interval": 2, "epochs": 2}


@pytest.fixture(scope="module")
def request_file(tiny_student, tmp_path_factory):
    directory = training_and_held_out(tiny_student, tmp_path_factory.mktemp("watch-cli"))
    (directory / "request.json").write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "manifest.jsonl",
                                                        "config": CONFIG}))
    return directory / "request.json"


def train(capsys, request_file, student, out, *flags):
    code = main(["train", "--request", str(request_file), "--adapter", "watched", "--student", str(student),
                 "--out", str(out), "--json", *flags])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_flags_watch_the_run(tiny_student, request_file, tmp_path, capsys):
    heldout = str(request_file.parent / "heldout.jsonl")
    code, result = train(capsys, request_file, tiny_student, tmp_path, "--eval-corpus", heldout, "--eval-every", "3")
    assert code == 0, result
    receipt = json.loads(open(result["receipt"]).read())
    curve = receipt["eval_curve"]
    assert [p["step"] for p in curve["points"]] == [0, 3, 6, 8]  # before the first step, every 3, after the last
    assert curve["watch"]["corpus"] == heldout and curve["watch"]["stop_on_divergence"] is False
    assert curve["held_out"]["tokens"] > 0 and receipt["phase_timings_ms"]["eval"] > 0


def test_the_held_out_corpus_is_admitted_once_per_run_and_training_reads_its_materialization(
        tiny_student, request_file, tmp_path, capsys, monkeypatch):
    """Admitted when the run is prepared (refused there), materialized under the storage root, and read back
    by training — never admitted a second time, also not by a run of the same inputs that finds it committed."""
    import hashlib

    from kiln_core.evaluation import corpus as eval_corpus

    real, admitted = eval_corpus.admit_eval_corpus, []

    def counting(corpus_uri, *args, **kwargs):
        result = real(corpus_uri, *args, **kwargs)
        admitted.append((corpus_uri, result.reused))
        return result

    monkeypatch.setattr(eval_corpus, "admit_eval_corpus", counting)
    heldout = request_file.parent / "heldout.jsonl"
    code, result = train(capsys, request_file, tiny_student, tmp_path, "--eval-corpus", str(heldout),
                         "--eval-every", "4")
    assert code == 0, result
    assert admitted == [(str(heldout), False)]
    digest = hashlib.sha256(heldout.read_bytes()).hexdigest()
    assert (tmp_path / "corpora" / digest / "admission.json").exists()
    curve = json.loads(open(result["receipt"]).read())["eval_curve"]
    assert curve["held_out"]["corpus_sha256"] == "sha256:" + digest and len(curve["points"]) > 1

    # the same command under another adapter name: prepared again, the committed held-out tables reused
    code, again = train(capsys, request_file, tiny_student, tmp_path, "--eval-corpus", str(heldout), "--eval-every",
                        "4", "--adapter", "watched-again")
    assert code == 0, again
    assert admitted == [(str(heldout), False), (str(heldout), True)]
    assert json.loads(open(again["receipt"]).read())["eval_curve"] == curve


def test_a_held_out_materialization_that_is_not_the_admitted_corpus_is_not_trained_on(tiny_student, request_file,
                                                                                      tmp_path):
    from kiln_core.contracts.eval_watch import EvalWatch
    from kiln_core.contracts.stage_refs import HeldOutRef
    from kiln_core.errors import EnvironmentFailure
    from kiln_core.training.watch import HeldOutSlice

    watch = EvalWatch(corpus=str(request_file.parent / "heldout.jsonl"), every_steps=2)
    admitted = HeldOutSlice.admit(watch, str(tiny_student), top_k=16, out_root=str(tmp_path))
    ref = admitted.ref()
    assert (ref.examples, ref.uri) == (3, admitted.materialized) and ref.uri.startswith(str(tmp_path / "corpora"))
    loaded = HeldOutSlice.load(watch, ref)
    assert loaded.record() == admitted.record()  # the same slice, from the committed tables
    with pytest.raises(EnvironmentFailure) as caught:
        HeldOutSlice.load(watch, ref.model_copy(update={"corpus_sha256": "sha256:" + "0" * 64}))
    assert caught.value.code == "corpus_changed" and caught.value.file == ref.uri
    with pytest.raises(FileNotFoundError):
        HeldOutSlice.load(watch, ref.model_copy(update={"uri": str(tmp_path / "corpora" / "nothing-here")}))


def test_no_flags_no_watch(tiny_student, request_file, tmp_path, capsys):
    code, result = train(capsys, request_file, tiny_student, tmp_path)
    assert code == 0
    receipt = json.loads(open(result["receipt"]).read())
    assert "eval_curve" not in receipt and "stop_reason" not in receipt


def test_stop_on_divergence_stops_with_the_rule_named(tiny_student, request_file, tmp_path, capsys):
    # the default rules (patience 3) at a learning rate far too high: the held-out KL stops improving
    body = json.loads(request_file.read_text())
    body["config"] = {**CONFIG, "learning_rate": 3.0, "epochs": 6}
    hot = tmp_path / "hot.json"
    hot.write_text(json.dumps(body).replace('"corpus.jsonl"', json.dumps(str(request_file.parent / "corpus.jsonl")))
                   .replace('"manifest.jsonl"', json.dumps(str(request_file.parent / "manifest.jsonl"))))
    code, result = train(capsys, hot, tiny_student, tmp_path / "out", "--eval-corpus",
                         str(request_file.parent / "heldout.jsonl"), "--eval-every", "1", "--stop-on-divergence")
    assert code == 3 and result["status"] == "failed", result
    receipt = json.loads(open(result["receipt"]).read())
    assert (receipt["stop_reason"], receipt["failure_reason"]) == ("stalled", "training_error")
    assert "rule stalled, eval.stop_on_divergence" in receipt["failure_message"]
    # where it stalls depends on the floating-point path of the installed libraries; what a user relies on
    # is that it stopped before the end, at the step the rule fired, with that step's state checkpointed
    steps = result["steps"]
    assert patience_evaluations_without_improvement(receipt, steps) and 3 < steps < 24
    assert result["latest_checkpoint"].endswith(f"-step-{steps:08d}.kiln-checkpoint")


@pytest.mark.parametrize("flags, field", [
    (["--eval-every", "2"], "eval.corpus"),
    (["--stop-on-divergence"], "eval.corpus"),
    (["--eval-corpus", "heldout.jsonl"], "eval.every_steps"),
    (["--eval-corpus", "heldout.jsonl", "--eval-every", "0"], "eval.every_steps"),
])
def test_bad_eval_flags_exit_2_naming_the_field(tiny_student, request_file, tmp_path, capsys, flags, field):
    code, result = train(capsys, request_file, tiny_student, tmp_path, *flags)
    assert code == 2 and result["field"] == field, result
    assert not (tmp_path / "runs").exists()


def test_eval_corpus_of_another_teacher_is_refused_before_training(tiny_student, request_file, tmp_path, capsys):
    from kiln_core.contracts.identity import build_manifest_line, parse_manifest_line

    other = tmp_path / "other.jsonl"
    lines = (request_file.parent / "heldout.jsonl").read_text().splitlines()
    identity = parse_manifest_line(lines[0]).teacher_identity
    manifest = build_manifest_line(identity.model_copy(update={"served_model_id": "another-teacher"}))
    other.write_text("\n".join([manifest, *lines[1:]]) + "\n")
    code, result = train(capsys, request_file, tiny_student, tmp_path, "--eval-corpus", str(other), "--eval-every", "2")
    assert code == 2 and result["code"] == "identity_mismatch", result
    assert not (tmp_path / "runs").exists()


def test_eval_with_several_processes_is_refused(tiny_student, request_file, tmp_path, capsys):
    code, result = train(capsys, request_file, tiny_student, tmp_path, "--eval-corpus", "h.jsonl", "--eval-every", "2",
                         "--nproc", "2")
    assert code == 2 and result["field"] == "eval", result


def patience_evaluations_without_improvement(receipt, stopped_at, patience=3, min_improvement=0.01):
    """The stall rule, recomputed naively from the receipt's curve: the held-out KL of the last ``patience``
    evaluations up to the stop is never ``min_improvement`` (relative) below the best before them."""
    points = [p for p in receipt["eval_curve"]["points"] if p["step"] <= stopped_at]
    kls = [p["reverse_kl"] for p in points]
    best_before = min(kls[:-patience])
    return all(kl > best_before * (1 - min_improvement) for kl in kls[-patience:])
