"""The Prefect tasks of the pipeline's stages, called as plain functions (``task.fn``) on tiny inputs.

What a user depends on: a rejected input is never retried (it would fail the same way again) while a
storage or network failure is; ``score`` writes a corpus that admission accepts and reuses it on a
re-run; ``prompts`` checks an on-policy prompt file before any training; the oracle task answers a
request with its verdict, or with the rule that rejected it; a training deployment that "completed"
without a successful receipt is not taken for a finished run.
"""

from __future__ import annotations

import json
import logging

import pytest
from prefect.states import Completed, Failed

from kiln_core.errors import EnvironmentFailure, Rejection
from tasks.retry import retry_unless_rejected

EXAMPLES = [
    {"id": "sum", "messages": [{"role": "user", "content": "What is two plus two?"}],
     "teacher_response": "Two plus two is four."},
    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}],
     "teacher_response": "Paris."},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ retry


def retried(error: BaseException | None) -> bool:
    """What Prefect asks ``retry_condition_fn`` after an attempt ended (real Prefect states)."""
    state = Completed(data="done") if error is None else Failed(data=error)
    return retry_unless_rejected(None, None, state)


def test_a_rejection_is_not_retried_but_an_environment_failure_or_a_bug_is():
    from kiln_core.scoring import ScoringError
    from kiln_core.training.checkpoint import CheckpointError

    assert not retried(Rejection("invalid_json", "line 3 is not JSON"))
    assert not retried(CheckpointError("checkpoint_file_sha256", "adapter_model.safetensors changed"))
    # the scoring errors pick their kind by code: a bad example is a rejection, a storage error is not
    assert not retried(ScoringError("invalid_example", "`messages` must not be empty", line=2))
    assert retried(ScoringError("storage_error", "the bucket did not answer"))
    assert retried(EnvironmentFailure("storage_unavailable", "the bucket did not answer"))
    assert retried(RuntimeError("a bug"))


def test_a_completed_attempt_is_not_retried():
    assert not retried(None)


# ------------------------------------------------------------------------------------------ dispatch


def test_a_run_without_a_successful_receipt_is_not_published(tmp_path):
    from tasks.dispatch import TrainingDeploymentFailed, published_run

    run = tmp_path / "runs" / "demo" / "key"
    run.mkdir(parents=True)
    with pytest.raises(TrainingDeploymentFailed) as empty:
        published_run(str(run), "demo")
    assert empty.value.code == "training_deployment_failed" and str(run) in empty.value.message
    assert isinstance(empty.value, EnvironmentFailure)  # the parent flow may retry: the child resumes

    # an adapter beside a failed receipt is what a crashed publication leaves: still not a finished run
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}", encoding="utf-8")
    (run / "train_receipt.json").write_text(json.dumps({"status": "failed"}), encoding="utf-8")
    with pytest.raises(TrainingDeploymentFailed, match="no successful receipt"):
        published_run(str(run), "demo")


# ------------------------------------------------------------------------------------------ score


def test_score_writes_an_admissible_corpus_and_reuses_it(tmp_path, tiny_teacher, tiny_student):
    from kiln_core.admission import admit_corpus
    from kiln_core.canonical import sha256_hex
    from tasks.score import score_task

    examples = write_jsonl(tmp_path / "examples.jsonl", EXAMPLES)
    out = tmp_path / "scored" / "corpus.jsonl"
    arguments = (str(examples), str(out), str(tiny_teacher), None, str(tmp_path / "registry"), str(tiny_student), 16)

    scored = score_task.fn(*arguments)
    assert (scored.examples, scored.reused) == (2, False) and out.is_file()
    admitted = admit_corpus(str(out), str(tiny_student), top_k=16)
    assert admitted.examples == 2 and admitted.dataset_sha256 == scored.sha256 == "sha256:" + sha256_hex(out.read_bytes())

    again = score_task.fn(*arguments)
    assert again.reused and (again.uri, again.sha256, again.examples) == (scored.uri, scored.sha256, 2)


def test_score_refuses_a_bad_example_line_and_writes_nothing(tmp_path, tiny_teacher, tiny_student):
    from kiln_core.scoring import ScoringError
    from tasks.score import score_task

    examples = write_jsonl(tmp_path / "examples.jsonl", [EXAMPLES[0], {"messages": [], "teacher_response": "x"}])
    out = tmp_path / "corpus.jsonl"
    with pytest.raises(ScoringError) as caught:
        score_task.fn(str(examples), str(out), str(tiny_teacher), None, str(tmp_path), str(tiny_student), 16)
    assert caught.value.code == "invalid_example" and caught.value.line == 2
    assert isinstance(caught.value, Rejection)  # so the task's one retry is not spent on it
    assert not out.exists()


# ------------------------------------------------------------------------------------------ prompts


@pytest.fixture(scope="module")
def local_teacher_manifest(tiny_teacher, tmp_path_factory):
    from kiln_core.contracts.pipeline import TeacherSource
    from kiln_core.engine.stages import resolve_manifest

    root = tmp_path_factory.mktemp("prompts-root")
    return resolve_manifest(TeacherSource(kind="local_dir", path=str(tiny_teacher)), str(root), max_top_k=32)


def on_policy_prompt(user: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": ""}]}


def test_prompts_task_checks_the_prompt_file_against_teacher_and_student(tmp_path, local_teacher_manifest, tiny_student):
    from kiln_core.contracts.opd_config import parse_opd_config
    from kiln_core.contracts.opd_prompt import prompts_content_sha256
    from kiln_core.contracts.settings import ResolvedSettings
    from kiln_core.on_policy.prompt_file import read_prompt_file
    from tasks.prompts import check_prompts_task

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [on_policy_prompt("What is two plus two?"),
                                                      on_policy_prompt("Name a colour.")])
    config = parse_opd_config({"training_mode": "on_policy", "max_tokens": 32, "top_k": 16})
    settings = ResolvedSettings.resolve(config, adapter="a", prompt_count=2)
    ref = check_prompts_task.fn(str(prompts), local_teacher_manifest, settings, str(tiny_student))

    assert (ref.kind, ref.examples, ref.effective_top_k) == ("prompts", 2, 16)
    assert ref.teacher_identity_revision == local_teacher_manifest.identity_revision
    assert ref.dataset_sha256 == "sha256:" + prompts_content_sha256(list(read_prompt_file(str(prompts)).prompts))


def test_prompts_task_refuses_a_bad_line_naming_it(tmp_path, local_teacher_manifest, tiny_student):
    from kiln_core.contracts.opd_config import parse_opd_config
    from kiln_core.contracts.settings import ResolvedSettings
    from tasks.prompts import check_prompts_task

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(on_policy_prompt("hi")) + "\n" + '{"messages": []}\n', encoding="utf-8")
    settings = ResolvedSettings.resolve(parse_opd_config({"training_mode": "on_policy", "max_tokens": 32}),
                                        adapter="a", prompt_count=2)
    with pytest.raises(Rejection) as caught:
        check_prompts_task.fn(str(prompts), local_teacher_manifest, settings, str(tiny_student))
    assert caught.value.code == "prompt_no_messages" and caught.value.line == 2


# ------------------------------------------------------------------------------------------ oracle


@pytest.fixture
def oracle_task(monkeypatch, caplog):
    """``run_oracle_request`` as a plain function: outside a Prefect run its logger is a plain one."""
    import tasks.oracle

    monkeypatch.setattr(tasks.oracle, "get_run_logger", lambda: logging.getLogger("tasks.oracle.test"))
    caplog.set_level(logging.INFO, logger="tasks.oracle.test")
    return tasks.oracle.run_oracle_request.fn


def test_oracle_task_answers_a_request_and_reuses_the_committed_result(tmp_path, tiny_student, oracle_task):
    from kiln_core.oracle import make_request

    made = make_request(tiny_student, message="What is the capital of France?", prefix_text="Paris", kiln_id=10,
                        vllm_id=20, request_id="fast-request", out=tmp_path / "req" / "fast-request.json")
    out = tmp_path / "out"
    ref = oracle_task(made.request_uri, str(tiny_student), out_root=str(out), dtype="fp32",
                      receipts_root=made.receipts_root)

    assert (ref.status, ref.request_id, ref.receipts_checked, ref.reused) == ("ok", "fast-request", True, False)
    record = json.loads((out / "oracle" / "fast-request" / "result.json").read_text(encoding="utf-8"))
    assert ref.result_sha256 == record["result_sha256"]
    assert (ref.verdict, ref.argmax_token_id) == (record["verdict"]["argmax_candidate"], record["verdict"]["argmax_token_id"])

    again = oracle_task(made.request_uri, str(tiny_student), out_root=str(out), dtype="fp32",
                        receipts_root=made.receipts_root)
    assert again.reused and again.result_sha256 == ref.result_sha256


def test_oracle_task_answers_a_rejected_request_with_its_rule(tmp_path, tiny_student, oracle_task, caplog):
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema": "kiln.hf-next-token-request.v1", "schema": "again"}', encoding="utf-8")

    ref = oracle_task(str(broken), str(tiny_student), out_root=str(tmp_path / "out"), dtype="fp32",
                      receipts_root=str(tmp_path))

    assert (ref.status, ref.rule, ref.request_uri) == ("rejected", "duplicate_key", str(broken))
    assert ref.message and ref.result_uri is None
    assert not (tmp_path / "out").exists()
    assert any("duplicate_key" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("flow_run_id, stops_on_sigterm", [(None, True), ("0b5e3c0e-6f7a-4d53-9d2c-1f1e5b2a9c11", False)])
def test_the_train_task_leaves_sigterm_to_the_worker_that_started_the_run(monkeypatch, flow_run_id, stops_on_sigterm):
    """A worker's cancel is acknowledged only by Prefect's own SIGTERM handler: in a run a worker (or
    ``serve``) started, training must not take SIGTERM over; anywhere else a SIGTERM is a stop at the
    next step boundary, like Ctrl-C."""
    import kiln_core.engine.training
    from kiln_core.contracts.stage_refs import TrainRef
    from tasks.train import train_task

    if flow_run_id is None:
        monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", flow_run_id)
    seen = {}

    def train(plan, corpus, manifest, student_dir, **options):
        seen.update(options)
        return TrainRef(run_uri="memory://run", status="cancelled", adapter_uri=None, receipt_uri="memory://run/r",
                        latest_checkpoint=None, final_loss=None, steps=0, total_steps=1)

    monkeypatch.setattr(kiln_core.engine.training, "train", train)

    class Plan:
        adapter = "demo"
        settings = type("Settings", (), {"config": type("Config", (), {"checkpoint_interval": 1, "sequences_per_step": 1})()})()

    class Corpus:
        kind, action_tokens, examples = "examples", 10, 1

    train_task.fn(Plan(), Corpus(), None, "./student")
    assert seen["stop_on_sigterm"] is stops_on_sigterm
