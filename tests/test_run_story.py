"""What a person reads about a run in the Prefect UI, built without a server: the artifacts' content
(loss chart, receipt table, outputs list), the training log lines, the quieted stage completions, and
the spec check's one-line rejections."""

from __future__ import annotations

import base64
import logging
import re
from types import SimpleNamespace

import pytest

from tasks.artifacts import loss_curve_markdown, loss_curve_svg, outputs_markdown, receipt_rows, svg_image_markdown


# ---------------------------------------------------------------------------------------------
# the loss curve


def _points(svg: str) -> list[tuple[float, float]]:
    [points] = re.findall(r'<polyline points="([^"]+)"', svg)
    return [tuple(map(float, pair.split(","))) for pair in points.split()]


def test_loss_curve_plots_every_step_left_to_right_and_lower_loss_lower_on_the_chart():
    losses = [3.0, 2.0, 2.5, 1.0]
    points = _points(loss_curve_svg({"train loss": losses}))
    assert len(points) == len(losses)
    xs, ys = [x for x, _ in points], [y for _, y in points]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    # SVG's y grows downwards: the highest loss is the topmost point, the lowest the bottom one
    assert ys.index(min(ys)) == losses.index(max(losses))
    assert ys.index(max(ys)) == losses.index(min(losses))
    # equal loss steps are equal pixel steps (a linear axis)
    assert (ys[1] - ys[0]) == pytest.approx(2 * (ys[2] - ys[1]) * -1)


def test_loss_curve_skips_non_finite_points_and_draws_a_flat_curve():
    assert len(_points(loss_curve_svg({"loss": [1.0, float("nan"), 0.5, float("inf")]}))) == 2
    flat = _points(loss_curve_svg({"loss": [0.7, 0.7, 0.7]}))
    assert len({y for _, y in flat}) == 1


def test_loss_curve_markdown_embeds_the_svg_as_an_image_the_ui_keeps():
    text = loss_curve_markdown("demo", [2.0, 1.0, 1.5])
    [uri] = re.findall(r"!\[loss curve\]\((data:image/svg\+xml;base64,[A-Za-z0-9+/=]+)\)", text)
    svg = base64.b64decode(uri.split(",", 1)[1]).decode()
    assert svg.startswith("<svg") and "<script" not in svg
    assert "first 2.0000 · lowest 1.0000 (step 2) · last 1.5000 · 3 steps" in text
    assert "No step was trained" in loss_curve_markdown("demo", [])
    assert svg_image_markdown("<svg/>", "x") == "![x](data:image/svg+xml;base64,PHN2Zy8+)"


# ---------------------------------------------------------------------------------------------
# the receipt table and the outputs list


def _receipt(**overrides):
    receipt = SimpleNamespace(
        status="success", failure_reason=None,
        hyperparameters=SimpleNamespace(learning_rate=0.02, epochs=3, optimizer="adam_w", rank=8, alpha=16.0),
        token_counts=SimpleNamespace(action_tokens=1234),
        opd=SimpleNamespace(final_opd_loss=0.5258346199989319, action_tokens=1234,
                            teacher_identity_revision="sha256:" + "ab" * 32, teacher_content_revision="x"),
        data=SimpleNamespace(examples_trained=12, total_steps=12),
        training_data=SimpleNamespace(sha256="sha256:" + "cd" * 32),
    )
    for key, value in overrides.items():
        setattr(receipt, key, value)
    return receipt


def test_receipt_table_is_compact_with_the_numbers_checked_first():
    rows = {row["field"]: row["value"] for row in receipt_rows(_receipt())}
    assert list(rows) == ["status", "steps", "final loss", "learning rate", "epochs", "optimizer",
                          "LoRA rank / alpha", "action tokens", "corpus sha256", "teacher revision"]
    assert rows["final loss"] == "0.5258"
    assert rows["learning rate"] == "0.02" and rows["epochs"] == "3" and rows["optimizer"] == "adam_w"
    assert rows["LoRA rank / alpha"] == "8 / 16" and rows["steps"] == "12 of 12"
    assert rows["corpus sha256"] == "sha256:" + "cd" * 8 + "…"
    assert all(isinstance(value, str) for value in rows.values())


def test_receipt_table_of_a_failed_run_says_why_and_has_no_loss():
    failed = _receipt(status="failed", failure_reason="nan_loss")
    failed.opd.final_opd_loss = None
    rows = {row["field"]: row["value"] for row in receipt_rows(failed)}
    assert rows["status"] == "failed (nan_loss)" and rows["final loss"] == ""


def test_outputs_start_with_adapter_receipt_latest_and_collapse_checkpoints():
    checkpoints = [f"/root/runs/a/k/a-checkpoint-step-{s:08d}.kiln-checkpoint" for s in (2, 4, 6)]
    text = outputs_markdown("a", "success", adapter_uri="/root/runs/a/k/adapter", receipt_uri="/root/runs/a/k/r.json",
                            latest_uri="/root/runs/a/latest.json", checkpoints=checkpoints, run_uri="/root/runs/a/k")
    items = [line for line in text.splitlines() if line.startswith("- ")]
    assert [item.split("**")[1] for item in items[:3]] == ["adapter", "receipt", "latest.json"]
    assert len(items) == 5
    assert checkpoints[-1] in items[3] and "+2 older" in items[3]
    assert not any(c in text for c in checkpoints[:-1])
    unpublished = outputs_markdown("a", "failed", adapter_uri=None, receipt_uri="/r.json", latest_uri=None,
                                   checkpoints=[], run_uri="/run")
    assert [line.split("**")[1] for line in unpublished.splitlines() if line.startswith("- ")] == ["receipt", "run directory"]


# ---------------------------------------------------------------------------------------------
# the training log


class _Lines:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, message, *args):
        self.lines.append(message % args)


def _training_log(interval=2, total_every=None):
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.contracts.stage_refs import CorpusRef, TrainPlan
    from tasks.train import TrainingLog

    config = OpdConfig(training_mode="off_policy", top_k=16, checkpoint_interval=interval, sequences_per_step=1)
    plan = TrainPlan.for_config(config, "/r/runs/demo/k", "demo")
    corpus = CorpusRef(uri="/c", dataset_sha256="sha256:x", source_uri="/c.jsonl", examples=4, action_tokens=400,
                       env_tokens=0, effective_top_k=16, teacher_identity_revision=None)
    lines = _Lines()
    return TrainingLog(plan, corpus, lines, every=total_every), lines


def test_training_log_reports_step_loss_rate_eta_and_checkpoints():
    log, out = _training_log(interval=2)
    for step in range(1, 21):
        log.progress(step, 20, 1.0 / step)
        log.step_committed(step)
    steps = [line for line in out.lines if line.startswith("train step")]
    # the first step, every 20 // 10 = 2 steps, and the last
    assert [int(re.search(r"step (\d+)/", line).group(1)) for line in steps] == [1] + list(range(2, 21, 2))
    assert steps[0] == "train step 1/20: loss 1.0000"  # no rate before a step has been timed
    assert re.fullmatch(r"train step 20/20: loss 0\.0500, ~\d+ action tok/s, ETA 0m00s", steps[-1])
    published = [line for line in out.lines if line.startswith("checkpoint published")]
    # periodic checkpoints before the last step only (the last step's state is the adapter), one per step line
    assert published[0] == "checkpoint published: demo-checkpoint-step-00000002.kiln-checkpoint"
    assert len(published) == 9


def test_checkpoint_lines_are_throttled_like_step_lines():
    """Issue 19: a 400-step run with checkpoint_interval 4 logged 100 checkpoint lines against 10 step lines."""
    log, out = _training_log(interval=4)
    for step in range(1, 401):
        log.progress(step, 400, 1.0)
        log.step_committed(step)
    steps = [line for line in out.lines if line.startswith("train step")]
    published = [line for line in out.lines if line.startswith("checkpoint published")]
    assert len(steps) == 11 and len(published) <= len(steps), (len(steps), len(published))
    assert published[0] == "checkpoint published: demo-checkpoint-step-00000004.kiln-checkpoint"
    # each later line names the newest checkpoint and how many were committed since the previous line
    assert published[1] == "checkpoint published: demo-checkpoint-step-00000044.kiln-checkpoint (10 since step 4)"
    assert published[-1].startswith("checkpoint published: demo-checkpoint-step-00000364.kiln-checkpoint")


def test_training_log_counts_rate_from_the_resumed_step():
    log, out = _training_log(interval=None, total_every=5)
    for step in range(11, 21):  # resumed at step 10
        log.progress(step, 20, 0.5)
        log.step_committed(step)
    assert out.lines[0].startswith("train step 11/20")
    assert not any(line.startswith("checkpoint") for line in out.lines)


# ---------------------------------------------------------------------------------------------
# stage completions are quiet, failures are not


def _record(message, level=logging.INFO, task_name="admit"):
    record = logging.LogRecord("prefect.task_runs", level, __file__, 1, message, None, None)
    record.task_name = task_name
    return record


def test_stage_completion_lines_are_dropped_and_everything_else_kept():
    from flows.run_log import _StageCompletionFilter

    quiet = _StageCompletionFilter()
    assert not quiet.filter(_record("Finished in state Completed()"))
    assert not quiet.filter(_record("Finished in state Cached(type=COMPLETED)"))
    assert quiet.filter(_record("Finished in state Failed('boom')", level=logging.ERROR))
    assert quiet.filter(_record("Finished in state Completed()", task_name="someone-elses-task"))
    assert quiet.filter(_record("admit: 4 examples"))


# ---------------------------------------------------------------------------------------------
# the spec check


@pytest.fixture
def local_inputs(tmp_path):
    (tmp_path / "student").mkdir()
    (tmp_path / "teacher").mkdir()
    (tmp_path / "corpus.jsonl").write_text("{}\n")
    return {"teacher": {"kind": "local_dir", "path": str(tmp_path / "teacher")}, "corpus": str(tmp_path / "corpus.jsonl"),
            "student": str(tmp_path / "student"), "storage_root": str(tmp_path / "root"), "adapter": "fine",
            "config": {"training_mode": "off_policy", "top_k": 16}}


def test_validate_spec_accepts_a_good_spec_as_dict_or_model(local_inputs):
    from kiln_core.contracts.pipeline import PipelineSpec
    from tasks.validate import validate_spec

    spec = validate_spec.fn(local_inputs)
    assert isinstance(spec, PipelineSpec) and spec.adapter == "fine"
    assert validate_spec.fn(spec) == spec


@pytest.mark.parametrize("change, expected", [
    ({"adapter": "my adapter/v2!"}, r"^spec\.adapter: 'my adapter/v2!' must be 1-128 characters of letters"),
    ({"examples": "x.jsonl"}, r"^spec: give exactly one of `corpus`"),
    ({"config": {"training_mode": "off_policy", "top_k": 8}}, r"^spec\.config\.top_k: OPD top_k 8 is not executable"),
    ({"config": {"training_mode": "off_policy", "lora_rnak": 8}}, r"^spec\.config\.lora_rnak: unknown key"),
    ({"student": "/nowhere/student"}, r"^spec\.student: /nowhere/student is not a directory$"),
    ({"corpus": "file:///nowhere/c.jsonl"}, r"^spec\.corpus: file:///nowhere/c\.jsonl does not exist$"),
])
def test_validate_spec_rejects_in_one_line_naming_the_field(local_inputs, change, expected):
    from kiln_core.contracts.pipeline import SpecError
    from kiln_core.errors import Rejection
    from tasks.validate import validate_spec

    with pytest.raises(SpecError) as caught:
        validate_spec.fn({**local_inputs, **change})
    assert isinstance(caught.value, Rejection)
    assert "\n" not in str(caught.value)
    told = f"{caught.value.field}: {caught.value}"  # the field once, then the rule (never the field twice)
    assert re.search(expected, told), told
    assert caught.value.field.startswith("spec") and not str(caught.value).startswith(caught.value.field)


def test_remote_inputs_are_left_to_the_stages(local_inputs):
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.contracts.spec_file import check_local_inputs

    check_local_inputs(parse_spec({**local_inputs, "student": "s3://bucket/student", "corpus": "memory://c.jsonl"}))


# ---------------------------------------------------------------------------------------------
# the deployment page and the demo's closing hint


def test_serve_puts_its_limit_and_the_schedules_time_zone_on_the_deployment(monkeypatch, capsys):
    import argparse

    import prefect

    import flows.local_api
    from flows.commands import serve as serve_command

    served = {}
    monkeypatch.setattr(flows.local_api, "start_local_api", lambda: None)
    monkeypatch.setattr(prefect, "serve", lambda *deployments, **options: served.update(deployments=deployments, **options))
    args = argparse.Namespace(name="local", cron="0 2 * * *", timezone=None, spec=None, spec_path=None, _spec_required=False, limit=3)
    assert serve_command.run(args) == 0
    [deployment] = served["deployments"]
    assert served["limit"] == 3
    assert deployment.concurrency_limit == 3  # what the deployment page shows instead of "∞"
    [schedule] = deployment.schedules
    assert schedule.schedule.timezone == "UTC" and schedule.schedule.cron == "0 2 * * *"
    # the deployment page says when, with the time zone (both UIs show the schedule as "At 02:00 AM" only):
    # in the description and as a tag, which both show on the deployment page itself
    assert "cron `0 2 * * *` in time zone UTC" in deployment.description and "tz:UTC" in deployment.tags
    args = argparse.Namespace(name="local", cron="30 1 * * 1", timezone="Europe/Berlin", spec=None, spec_path=None,
                              _spec_required=False, limit=1)
    assert serve_command.run(args) == 0
    assert "cron `30 1 * * 1` in time zone Europe/Berlin" in served["deployments"][0].description
    assert "tz:Europe/Berlin" in served["deployments"][0].tags
    args = argparse.Namespace(name="local", cron=None, timezone=None, spec=None, spec_path=None, _spec_required=False,
                              limit=1)
    assert serve_command.run(args) == 0
    assert not [tag for tag in served["deployments"][0].tags if tag.startswith("tz:")]  # no schedule, no zone


def test_every_scheduled_deployment_shows_its_time_zone_on_its_page():
    """deployments/prefect.yaml: both UIs show a cron schedule as "At 02:00 AM" (the zone only in its edit
    dialog, or a tooltip); each scheduled deployment carries ``tz:<zone>``, a tag both show on its page."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    deployments = yaml.safe_load((root / "deployments" / "prefect.yaml").read_text(encoding="utf-8"))["deployments"]
    scheduled = [deployment for deployment in deployments if deployment.get("schedules")]
    assert len(scheduled) >= 2
    for deployment in scheduled:
        zones = {schedule.get("timezone", "UTC") for schedule in deployment["schedules"]}
        assert {f"tz:{zone}" for zone in zones} <= set(deployment["tags"]), deployment["name"]


def test_the_demos_hint_links_the_run_when_it_went_to_a_server():
    from flows.commands.demo import _run_url

    assert _run_url("1234", None, "http://ui.example:4200/v2") == "http://ui.example:4200/v2/runs/flow-run/1234"
    assert _run_url("1234", 3.2, "http://ui.example:4200/v2") is None  # the temporary API is gone when the demo exits


@pytest.mark.parametrize("default_ui, expected", [("v2", "/v2"), ("v1", "")])
def test_printed_links_open_the_ui_the_servers_root_opens(default_ui, expected, monkeypatch):
    """Prefect 3.9's root opens its new UI (``/v2``) while the links it prints (``PREFECT_UI_URL``, derived from
    the API's address) open the old one: within ``links_to_the_default_ui`` they follow what the server says
    its root opens (``/ui-settings``), and the address printed is the UI's, never ``…/api``."""
    import json
    import os
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings
    from prefect.utilities.urls import url_for

    from flows.local_api import links_to_the_default_ui

    class UiSettings(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"default_ui": default_ui, "v1_base_url": "/", "v2_base_url": "/v2"}).encode()
            self.send_response(200 if self.path == "/ui-settings" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), UiSettings)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    try:
        with temporary_settings(updates={PREFECT_API_URL: f"{root}/api", PREFECT_UI_URL: None}):
            with links_to_the_default_ui() as ui:
                assert ui == root + expected
                assert url_for("flow-run", obj_id="1234") == f"{root}{expected}/runs/flow-run/1234"
                assert os.environ["PREFECT_UI_URL"] == root + expected  # the runs it starts print the same
            # Once the block ends the process keeps no link to that server: a later command in the same
            # process (a notebook, a test session) against another server printed links to this one.
            assert "PREFECT_UI_URL" not in os.environ
            monkeypatch.setenv("PREFECT_UI_URL", "http://proxy.example/ui")  # the user's own value comes back
            with links_to_the_default_ui():
                pass
            assert os.environ["PREFECT_UI_URL"] == "http://proxy.example/ui"
    finally:
        server.shutdown()


def test_the_demos_closing_hint_depends_on_where_the_run_went(capsys):
    from flows.commands.demo import _report

    summary = {"adapter": "/a", "receipt": "/r", "latest": "/l", "loss_history": [2.0, 1.0]}
    _report(summary, 1.0, None, None, "http://ui/runs/flow-run/1")
    linked = capsys.readouterr().out
    assert "See the run in the Prefect UI: http://ui/runs/flow-run/1" in linked and "prefect server start" not in linked
    _report(summary, 1.0, None, 2.5, None)
    assert "start `prefect server start`" in capsys.readouterr().out


def test_training_log_works_outside_a_flow_run():
    """``train_task.fn(...)`` (tests, drills) has no run logger: the training log falls back to a plain one."""
    from tasks.train import _run_logger

    assert _run_logger().name == "kiln_flows.train"


def test_a_rejection_is_told_once_in_the_run_log():
    """The failing task's "Task run failed with exception: SpecError(...)" and its "Finished in state
    Failed(...)" are dropped (the flow run's final state tells it, ``reject_run``); other failures stay."""
    import logging

    from flows.run_log import quiet_run_logs
    from kiln_core.contracts.pipeline import SpecError

    quiet_run_logs()
    logger = logging.getLogger("prefect.task_runs")
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        error = SpecError("/c.jsonl does not exist", "spec.source.corpus", code="file_not_found")
        logger.error("Task run failed with exception: %r - Retries are exhausted", error, exc_info=(SpecError, error, None),
                     extra={"task_run_id": "run-1", "task_name": "validate"})
        logger.error("Finished in state Failed('Task run encountered an exception SpecError: ...')",
                     extra={"task_run_id": "run-1", "task_name": "validate"})
        boom = RuntimeError("disk on fire")
        logger.error("Task run failed with exception: %r", boom, exc_info=(RuntimeError, boom, None),
                     extra={"task_run_id": "run-2", "task_name": "train"})
        logger.error("Finished in state Failed('disk on fire')", extra={"task_run_id": "run-2", "task_name": "train"})
    finally:
        logger.removeHandler(handler)
    assert kept == ["Task run failed with exception: RuntimeError('disk on fire')", "Finished in state Failed('disk on fire')"]


def test_a_rejection_line_names_the_code_the_place_and_the_rule():
    from flows.run_log import end_line
    from kiln_core.errors import Rejection

    assert end_line(Rejection("token_count_mismatch", "3 tokens, 4 logprobs", line=3, file="c.jsonl")) == \
        "rejected (token_count_mismatch) c.jsonl line 3: 3 tokens, 4 logprobs"


def test_a_run_ended_by_kiln_flows_is_told_at_error_without_the_engines_traceback(monkeypatch):
    """Prefect logs a flow run's "Finished in state Failed(...)" at INFO whatever the state: a rejected or
    failed run's one line is raised to ERROR (the UI's "Error and above" shows it); the engine's
    "exited with unexpected exception" after the flow returned its Failed or Cancelled state is dropped."""
    import logging

    from prefect.exceptions import CancelledRun

    import flows.run_log as run_log
    from flows.run_log import quiet_run_logs

    quiet_run_logs()
    monkeypatch.setattr(run_log, "_ENDED_RUNS", {"flow-1"})
    kept: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append((record.levelname, record.getMessage()))

    handler = Keep()
    flow_logger = logging.getLogger("prefect.flow_runs")
    flow_logger.addHandler(handler)
    try:
        line = "Finished in state Failed('rejected (file_not_found) spec.source.corpus: /c does not exist')"
        flow_logger.info(line, extra={"flow_run_id": "flow-1"})
        flow_logger.info("Finished in state Failed('boom')", extra={"flow_run_id": "flow-2"})  # not ended by us
        cancelled = CancelledRun("training cancelled at step 2; checkpoint c kept (a retry resumes from it)")
        flow_logger.error("Engine execution exited with unexpected exception", exc_info=(CancelledRun, cancelled, None),
                          extra={"flow_run_id": "flow-1"})
    finally:
        flow_logger.removeHandler(handler)
    assert kept == [("ERROR", line), ("INFO", "Finished in state Failed('boom')")]
