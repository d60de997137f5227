"""The ``kiln-flows`` command line as a newcomer meets it (issue 19, "CLI polish"), in subprocesses:

* ``--debug`` works before or after the command (and after a sub-action), so "run with --debug" works
  as written;
* ``kiln-flows --help`` lists the exit codes, from the one definition in ``kiln_core.errors``;
* ``--json`` and ``--quiet`` say the same thing in every command's help;
* libraries' own deprecation notices (transformers' ``FutureWarning`` on every train) are not shown,
  while a warning from anywhere else still is;
* a log line or warning written while a progress bar is drawn gets a line of its own;
* an on-policy run says how many candidates it will train on and a first ETA;
* ``demo --json`` prints exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "KILN_FLOWS_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **extra}


def cli(*argv: str, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], capture_output=True, text=True,
                          env=environment(), timeout=timeout, cwd=cwd)


def cli_with_command(body: str, *argv: str) -> subprocess.CompletedProcess:
    """``kiln-flows ARGV`` in a subprocess whose ``admit`` command is replaced by ``body`` (a function
    ``run(args)``): the real ``main`` around a command that does what the test needs."""
    script = ("import sys\nimport flows.commands.admit as command\n" + body +
              "\ncommand.run = run\nfrom flows.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                          env=environment(), timeout=300)


def rendered_lines(stderr: str) -> list[str]:
    """What a terminal shows: each line as the last carriage-return overwrite leaves it."""
    lines = []
    for raw in stderr.split("\n"):
        screen = ""
        for segment in raw.split("\r"):
            screen = segment + screen[len(segment):]
        lines.append(screen.rstrip())
    return [line for line in lines if line]


# ---------------------------------------------------------------------------------------------
# --debug


BUG = "def run(args):\n    raise ZeroDivisionError('a bug')\n"


@pytest.mark.parametrize("argv", [
    ("--debug", "admit", "c.jsonl", "--student", "s"),
    ("admit", "c.jsonl", "--student", "s", "--debug"),
    ("admit", "--debug", "c.jsonl", "--student", "s"),
])
def test_debug_before_or_after_the_command_prints_the_traceback(argv):
    done = cli_with_command(BUG, *argv)
    assert done.returncode == 3, done.stderr
    assert "Traceback" in done.stderr and "ZeroDivisionError: a bug" in done.stderr


def test_the_debug_hint_works_as_written():
    done = cli_with_command(BUG, "admit", "c.jsonl", "--student", "s")
    assert done.returncode == 3 and "Traceback" not in done.stderr
    assert "(run with --debug" in done.stderr
    again = cli_with_command(BUG, "admit", "c.jsonl", "--student", "s", "--debug")  # appended, as a user would
    assert again.returncode == 3 and "Traceback" in again.stderr


def test_debug_after_a_sub_action_and_after_train_is_not_a_usage_error(tmp_path):
    listing = cli("teachers", "list", "--out", str(tmp_path), "--debug")
    assert listing.returncode == 0, listing.stderr
    train = cli("train", "--request", str(tmp_path / "missing.json"), "--adapter", "a", "--student", str(tmp_path),
                "--out", str(tmp_path), "--debug")
    assert "unrecognized arguments" not in train.stderr
    assert train.returncode == 2 and "[" in train.stderr  # the request's own rejection, with its code


# ---------------------------------------------------------------------------------------------
# Help texts


def test_help_lists_every_exit_code_from_the_one_definition():
    import inspect

    import flows.cli
    from kiln_core.errors import EXIT_CODES

    done = cli("--help")
    assert done.returncode == 0
    epilog = done.stdout[done.stdout.index("exit codes:"):]
    for code, meaning in EXIT_CODES:
        assert f"  {code}  {meaning.split()[0]}" in epilog
    assert "run_in_progress" in epilog
    source = inspect.getsource(flows.cli)
    assert "EXIT_FAILED = " not in source and "EXIT_REJECTED = " not in source  # defined in kiln_core.errors only


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_json_and_quiet_have_one_wording_in_every_help():
    from flows.cli import build_parser
    from flows.commands._options import JSON_HELP, QUIET_HELP

    seen: dict[str, set[str]] = {"--json": set(), "--quiet": set()}
    count = 0
    for parser in _all_parsers(build_parser()):
        for action in parser._actions:
            for flag in seen:
                if flag in action.option_strings:
                    seen[flag].add(action.help)
                    count += 1
    assert seen == {"--json": {JSON_HELP}, "--quiet": {QUIET_HELP}} and count >= 10
    # and the user sees that wording
    assert " ".join(JSON_HELP.split()[:4]) in " ".join(cli("train", "--help").stdout.split())


# ---------------------------------------------------------------------------------------------
# Warnings and progress bars


def test_library_deprecations_are_silenced_but_not_other_warnings():
    body = ("import warnings\n"
            "def run(args):\n"
            "    warnings.warn_explicit('library internals', FutureWarning, 'x.py', 1, module='transformers.modeling_utils')\n"
            "    warnings.warn_explicit('torch internals', DeprecationWarning, 'y.py', 1, module='torch.nn')\n"
            "    warnings.warn_explicit('a user-facing library warning', UserWarning, 'z.py', 1, module='transformers.x')\n"
            "    warnings.warn('ours', FutureWarning)\n"
            "    return 0\n")
    done = cli_with_command(body, "admit", "c.jsonl", "--student", "s")
    assert done.returncode == 0, done.stderr
    assert "library internals" not in done.stderr and "torch internals" not in done.stderr
    assert "a user-facing library warning" in done.stderr and "ours" in done.stderr
    debug = cli_with_command(body, "admit", "c.jsonl", "--student", "s", "--debug")
    assert "library internals" in debug.stderr  # --debug hides nothing


def test_log_lines_and_warnings_do_not_share_a_progress_bar_line():
    body = ("import logging, sys, warnings\n"
            "from tqdm import tqdm\n"
            "def run(args):\n"
            "    logging.basicConfig(stream=sys.stderr, format='LOG %(message)s')\n"
            "    bar = tqdm(total=4, desc='train', unit='step', file=sys.stderr)\n"
            "    bar.update(1)\n"
            "    logging.getLogger('x').warning('a log line')\n"
            "    bar.update(1)\n"
            "    warnings.warn('a warning line')\n"
            "    bar.update(1)\n"
            "    print('a printed line', file=sys.stderr)\n"
            "    bar.update(1)\n"
            "    bar.close()\n"
            "    return 0\n")
    done = cli_with_command(body, "admit", "c.jsonl", "--student", "s")
    assert done.returncode == 0, done.stderr
    lines = rendered_lines(done.stderr)
    for message in ("LOG a log line", "a warning line", "a printed line"):
        holding = [line for line in lines if message in line]
        assert holding, (message, lines)
        assert all("train:" not in line and "%|" not in line for line in holding), holding
    assert any("train: 100%" in line for line in lines)  # the bar is still drawn, below the lines


@pytest.mark.usefixtures("one_torch_thread")
def test_train_shows_no_library_future_warning(tiny_student, tmp_path):
    from kiln_core.synthetic import synthesize_corpus

    synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=2, top_k=16, seed=0)
    (tmp_path / "teacher-manifest.jsonl").write_text((tmp_path / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    config = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3, "epochs": 1}
    (tmp_path / "request.json").write_text(json.dumps({"dataset_path": "corpus.jsonl",
                                                       "teacher": "teacher-manifest.jsonl", "config": config}))
    done = cli("train", "--request", str(tmp_path / "request.json"), "--adapter", "quiet", "--student",
               str(tiny_student), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "FutureWarning" not in done.stderr and "DeprecationWarning" not in done.stderr
    assert "warnings.warn(" not in done.stderr


# ---------------------------------------------------------------------------------------------
# On-policy: the candidate count and an ETA at the start


def test_on_policy_start_line_names_the_effective_candidate_count_and_an_eta():
    from types import SimpleNamespace

    from flows.commands._progress import on_policy_start_line
    from kiln_core.contracts.opd_config import OpdConfig

    first = SimpleNamespace(rollouts_sampled=64, rollouts_reused=0, elapsed_s=160.0)
    line = on_policy_start_line(1, 128, first, OpdConfig(training_mode="on_policy", epochs=1))
    # the README's two prompts: Kiln's rule turns the default 4 samples into 64 below 50 prompts
    assert line.startswith("on-policy: 128 candidates (2 prompts × 64 samples_per_prompt × 1 epoch;")
    assert "scaled the default samples_per_prompt" in line and "ETA ~5m18s" in line
    line = on_policy_start_line(1, 30, SimpleNamespace(rollouts_sampled=3, rollouts_reused=0, elapsed_s=3.0),
                                OpdConfig(training_mode="on_policy", epochs=2, samples_per_prompt=3))
    assert line == "on-policy: 30 candidates (5 prompts × 3 samples_per_prompt × 2 epochs); ETA ~0m29s"


@pytest.mark.usefixtures("one_torch_thread")
def test_on_policy_train_prints_its_candidate_count_and_eta_at_the_start(tiny_student, tiny_teacher, tmp_path):
    register = cli("teachers", "register", "tiny-teacher", str(tiny_teacher), "--out", str(tmp_path), "--device", "cpu")
    assert register.returncode == 0, register.stderr
    from on_policy_support import chat

    prompts = [chat("What is two plus two?"), chat("Translate to French: good morning")]
    config = {"samples_per_prompt": 2, "max_tokens": 3, "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 5,
              "checkpoint_interval": 100, "epochs": 1}
    (tmp_path / "request.json").write_text(json.dumps({"teacher": "tiny-teacher", "prompts": prompts, "config": config}))
    done = cli("train", "--request", str(tmp_path / "request.json"), "--adapter", "eta", "--student", str(tiny_student),
               "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = rendered_lines(done.stderr)
    start = [line for line in lines if line.startswith("on-policy: 4 candidates")]
    assert start, lines
    assert "(2 prompts × 2 samples_per_prompt × 1 epoch); ETA ~" in start[0]
    # printed before the bar's first line
    assert lines.index(start[0]) < min(i for i, line in enumerate(lines) if line.startswith("train:"))


# ---------------------------------------------------------------------------------------------
# demo --json


@pytest.mark.slow
@pytest.mark.integration
def test_demo_json_prints_exactly_one_json_object_on_stdout(tmp_path):
    done = cli("demo", "--json", "--examples", "4", "--epochs", "1", "--out", str(tmp_path / "data"), cwd=tmp_path,
               timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)  # the whole of stdout: one object, nothing before or after
    assert isinstance(summary, dict) and summary["status"] == "success"
    assert "kiln-flows demo finished" in done.stderr  # the report is still there, on stderr


@pytest.mark.integration
def test_run_prefect_log_lines_do_not_share_the_training_progress_bar_line(tiny_student, tiny_teacher, tmp_path):
    """``kiln-flows run`` draws a training bar on stderr while Prefect logs each step: every log line
    is a line of its own on the terminal."""
    import yaml

    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.synthetic import synthesize_corpus

    line = build_manifest_line(local_teacher_identity(str(tiny_teacher), max_top_k=32))
    corpus = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=4, top_k=16, manifest_line=line)
    spec = {"teacher": {"kind": "local_dir", "path": str(tiny_teacher)}, "corpus": str(corpus),
            "student": str(tiny_student), "storage_root": str(tmp_path / "out"), "adapter": "bar",
            "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 2, "seed": 5, "lora_rank": 4,
                       "lora_alpha": 8.0, "checkpoint_interval": 2}}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(spec))
    env = {key: value for key, value in environment().items() if key != "PREFECT_API_URL"}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"})
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(tmp_path / "pipeline.yaml")],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = rendered_lines(done.stderr)
    step_logs = [line for line in lines if "train step" in line]
    assert step_logs and any("%|" in line for line in lines), lines  # both were drawn
    glued = [line for line in lines if "%|" in line and ("| INFO" in line or "| WARNING" in line)]
    assert not glued, glued


def test_nested_bars_draw_through_the_line_keeper_without_recursion():
    """tqdm moves between nested bars' lines with bare newlines and cursor-up codes (a GGUF import's bar
    inside a stage's bar in ``demo --real``); those pass straight through, and a line written meanwhile
    still lands whole, above the bars."""
    import io

    from tqdm import tqdm

    from flows.console import _LinesAboveBars

    sink = io.StringIO()
    stream = _LinesAboveBars(sink)
    with tqdm(total=3, file=stream, position=0) as outer, tqdm(total=4, file=stream, position=1, leave=False) as inner:
        for _ in range(4):
            inner.update()
            stream.write("a log line\n")
        outer.update(3)
    stream.write("tail")
    stream.write("\n")
    text = sink.getvalue()
    assert text.count("a log line\n") == 4 and "tail\n" in text  # whole lines, none lost
