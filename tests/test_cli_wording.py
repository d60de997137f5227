"""What a newcomer reads from ``kiln-flows`` (issue 32, docs and wording), in subprocesses:

* a pipeline spec file is ``PIPELINE.yaml`` or ``--spec PIPELINE.yaml`` in ``run`` and ``serve`` alike;
* ``--quiet`` has one meaning in every command that reports: nothing but warnings and errors, a
  success included; ``demo``, ``admit`` and ``eval`` take it too;
* ``kiln-flows eval-suites register`` stores the suite a ``post_eval`` gate needs, validated first;
* wording: a cancelled run says "cancelled: …", not "cancelled (cancelled): …"; one prompt is "1 prompt";
  the manifest stage names a teacher directory called ``teacher`` once, quoted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def cli(*argv: str, cwd: Path | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    # as a user's shell has it: without the test session's own switches (its progress bars off, its API)
    env = {key: value for key, value in os.environ.items()
           if key not in ("KILN_FLOWS_DEBUG", "PREFECT_API_URL", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "flows.cli", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def scored(tiny_student, tmp_path_factory) -> Path:
    """A 2-example teacher-scored corpus, its manifest file and an off-policy request for it."""
    from kiln_core.synthetic import synthesize_corpus

    directory = tmp_path_factory.mktemp("wording")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=2, top_k=16, seed=4)
    (directory / "teacher-manifest.jsonl").write_text((directory / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    config = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3, "epochs": 1}
    (directory / "request.json").write_text(json.dumps({"dataset_path": "corpus.jsonl",
                                                        "teacher": "teacher-manifest.jsonl", "config": config}))
    return directory


# ---------------------------------------------------------------------------------------------
# PIPELINE.yaml or --spec PIPELINE.yaml


@pytest.mark.parametrize("argv", [("run", "--spec", "{spec}"), ("run", "{spec}"), ("serve", "{spec}"),
                                  ("serve", "--spec", "{spec}")])
def test_run_and_serve_take_the_spec_file_either_way(argv, tmp_path):
    """Both spellings reach the spec (an invalid one here, so nothing runs): its rule is the answer, never
    argparse's "unrecognized arguments"."""
    spec = tmp_path / "pipeline.yaml"
    spec.write_text("teacher: {kind: local_dir, path: ./t}\ncorpus: ./c.jsonl\nadapter: a\n", encoding="utf-8")
    done = cli(*(part.format(spec=spec) for part in argv), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("rejected: [invalid_spec]") and "student" in done.stderr, done.stderr
    assert "unrecognized arguments" not in done.stderr and "usage:" not in done.stderr


def test_a_spec_file_given_twice_is_refused_in_one_line(tmp_path):
    done = cli("run", "a.yaml", "--spec", "b.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "rejected: [invalid_option] field --spec: give the spec file once: a.yaml or --spec b.yaml"]


# ---------------------------------------------------------------------------------------------
# --quiet


def _reporting_commands():
    """(name, parser) of every command and sub-action with --json: each reports something."""
    from flows.cli import build_parser

    def walk(parser, name):
        yield name, parser
        for action in parser._actions:
            choices = getattr(action, "choices", None)
            for choice, sub in (choices.items() if isinstance(choices, dict) else ()):
                yield from walk(sub, f"{name} {choice}".strip())

    return [(name, parser) for name, parser in walk(build_parser(), "")
            if any("--json" in action.option_strings for action in parser._actions)]


def test_every_command_that_reports_takes_quiet_with_one_meaning():
    from flows.commands._options import QUIET_HELP

    reporting = dict(_reporting_commands())
    for name in ("run", "train", "demo", "admit", "score", "eval", "distill self", "distill pump", "distill merge",
                 "recipe run", "eval-suites register"):
        quiet = [action for action in reporting[name]._actions if "--quiet" in action.option_strings]
        assert quiet and quiet[0].help == QUIET_HELP, name
    assert "print nothing but warnings and errors" in QUIET_HELP


@pytest.mark.slow
def test_quiet_prints_nothing_on_success_in_every_command(tiny_student, scored, tmp_path):
    """``train`` printed its summary under --quiet while ``run`` printed nothing; ``admit`` and ``eval`` had no
    --quiet. Now each prints nothing on a success, and a failure still says why."""
    corpus, manifest = scored / "corpus.jsonl", scored / "teacher-manifest.jsonl"
    outputs = {
        "admit": cli("admit", corpus, "--student", tiny_student, "--top-k", "16", "--quiet"),
        "train": cli("train", "--request", scored / "request.json", "--adapter", "quiet", "--student", tiny_student,
                     "--out", tmp_path / "out", "--quiet"),
        "eval": cli("eval", "--student", tiny_student, "--corpus", corpus, "--teacher-manifest", manifest, "--top-k",
                    "16", "--quiet"),
    }
    for name, done in outputs.items():
        assert done.returncode == 0, (name, done.stderr[-2000:])
        assert done.stdout == "", (name, done.stdout)
        assert "INFO" not in done.stderr and "%|" not in done.stderr, (name, done.stderr[-2000:])
    failed = cli("admit", tmp_path / "missing.jsonl", "--student", tiny_student, "--quiet")
    assert failed.returncode == 2 and failed.stderr.startswith("rejected: [file_not_found]"), failed.stderr


# ---------------------------------------------------------------------------------------------
# eval-suites register


SUITE = {"name": "math-smoke", "schema_version": 2,
         "default_scorer": {"kind": "numeric_tolerance", "atol": 0, "rtol": 0, "integer_only": True},
         "generation": {"temperature": 0, "max_tokens": 8, "n": 1}, "aggregation": {"kind": "single"},
         "examples": [{"id": "add", "messages": [{"role": "user", "content": "47 + 138?"}], "target": "185"}]}


def test_eval_suites_register_stores_the_suite_a_post_eval_gate_finds(tmp_path):
    from kiln_core.post_eval import SuiteRegistry, validate_post_eval_config
    from kiln_core.contracts.post_eval.config import parse_post_eval_config

    suite = tmp_path / "math-smoke.json"
    suite.write_text(json.dumps(SUITE), encoding="utf-8")
    root = tmp_path / "kiln-data"
    done = cli("eval-suites", "register", suite, "--out", root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("registered eval suite math-smoke (1 example) at "), done.stdout
    # what a run's post_eval block checks before it trains: the suite is installed under its storage root
    validate_post_eval_config(parse_post_eval_config({"suite": "math-smoke", "min_accuracy": 0.5}),
                              SuiteRegistry.for_storage_root(str(root)))
    listed = cli("eval-suites", "list", "--out", root, "--json")
    assert json.loads(listed.stdout) == ["math-smoke"]
    again = cli("eval-suites", "register", suite, "--out", root)
    assert again.returncode == 2 and again.stderr.startswith("rejected: [eval_suite_exists]"), again.stderr
    assert cli("eval-suites", "register", suite, "--out", root, "--force", "--quiet").stdout == ""


def test_eval_suites_register_refuses_a_broken_suite_before_storing_it(tmp_path, capsys):
    from flows.cli import main

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**SUITE, "default_scorer": {"kind": "no_such_scorer"}}), encoding="utf-8")
    assert main(["eval-suites", "register", str(broken), "--out", str(tmp_path / "kiln-data"), "--json"]) == 2
    record = json.loads(capsys.readouterr().out)
    assert record["status"] == "rejected" and record["code"].startswith("eval_")
    assert not (tmp_path / "kiln-data" / ".eval" / "suites").exists() or \
        not list((tmp_path / "kiln-data" / ".eval" / "suites").iterdir())


# ---------------------------------------------------------------------------------------------
# wording


def test_a_cancelled_run_says_cancelled_once(capsys):
    from types import SimpleNamespace

    from flows.commands.train import print_result

    result = SimpleNamespace(status="cancelled", failure_reason="cancelled", latest_checkpoint="c-step-4",
                             failure_message="training cancelled by user (stop requested at OPD step boundary)",
                             receipt="/r/train_receipt.json")
    print_result(result, "a", as_json=False)
    first = capsys.readouterr().err.splitlines()[0]
    assert first == "cancelled: training cancelled by user (stop requested at OPD step boundary)"
    print_result(SimpleNamespace(**{**vars(result), "status": "failed", "failure_reason": "nan_loss",
                                    "failure_message": "loss became non-finite"}), "a", as_json=False)
    assert capsys.readouterr().err.splitlines()[0] == "failed (nan_loss): loss became non-finite"


def test_counts_read_as_words():
    from kiln_core.wording import counted

    assert [counted(n, "prompt") for n in (0, 1, 2)] == ["0 prompts", "1 prompt", "2 prompts"]


@pytest.mark.integration
def test_the_manifest_stage_names_a_teacher_called_teacher_once(prefect_harness, tiny_student, tmp_path):
    """A teacher directory named ``teacher`` (the demo's) read "pinning teacher teacher (local_dir)"."""
    import logging
    import shutil

    from flows.opd_distill import opd_distill
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.synthetic import synthesize_corpus

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_student, teacher)
    line = build_manifest_line(local_teacher_identity(str(teacher), max_top_k=32))
    corpus = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=2, top_k=16, manifest_line=line)
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Keep()
    logging.getLogger("prefect.flow_runs").addHandler(handler)
    try:
        opd_distill(parse_spec({"teacher": {"kind": "local_dir", "path": str(teacher)}, "corpus": str(corpus),
                                "student": str(tiny_student), "storage_root": str(tmp_path / "out"), "adapter": "named",
                                "config": {"top_k": 16, "epochs": 1, "lora_rank": 4, "lora_alpha": 8.0, "seed": 1}}),
                    return_state=True)
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
    manifest = [message for message in messages if message.startswith("manifest:")]
    assert manifest and not [message for message in manifest if "teacher teacher" in message], manifest
    assert f"manifest: pinning the local_dir teacher {str(teacher)!r}" in manifest
