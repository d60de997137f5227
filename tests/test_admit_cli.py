"""``kiln-flows admit``: exit codes, the one-object JSON output, pinning, materialization, top-K,
the installed console script, and a ``--help`` that never imports Prefect or torch."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from kiln_core.contracts.identity import TeacherIdentity, build_manifest_line
from kiln_core.synthetic import synthesize_corpus

REPO = Path(__file__).resolve().parents[1]
# The console script installed next to the interpreter running the tests (any venv, any checkout).
KILN_FLOWS = Path(sys.executable).with_name("kiln-flows")
ADMITTED_KEYS = {"status", "dataset_sha256", "examples", "action_tokens", "env_tokens", "observation_tokens",
                 "effective_top_k", "materialized"}


@pytest.fixture(scope="module")
def corpus(tiny_student, tmp_path_factory) -> Path:
    return synthesize_corpus(
        tiny_student, tmp_path_factory.mktemp("cli") / "teacher-data.jsonl", n_examples=3, top_k=32, seed=8, trajectory_every=2
    )


@pytest.fixture(scope="module")
def manifest_line(corpus) -> str:
    return corpus.read_text(encoding="utf-8").split("\n", 1)[0]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["admit", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_json_object(stdout: str) -> dict:
    assert stdout.endswith("\n") and stdout.count("\n") == 1, stdout
    value = json.loads(stdout)
    assert isinstance(value, dict)
    return value


def test_admit_json_prints_one_object(capsys, corpus, tiny_student):
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student, "--json")
    assert code == 0
    value = one_json_object(out)
    assert set(value) == ADMITTED_KEYS
    assert value["status"] == "admitted"
    assert value["dataset_sha256"] == "sha256:" + hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert value["examples"] == 3
    assert value["action_tokens"] > 0 and value["env_tokens"] > 0
    assert value["effective_top_k"] == 32
    assert value["materialized"] is None


def test_admit_without_json_is_human_readable(capsys, corpus, tiny_student):
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student)
    assert code == 0
    assert out.startswith("admitted sha256:")
    assert "3 examples" in out and "--out" in out


def test_rejection_exits_2_with_the_rejection_object(capsys, corpus, tiny_student, tmp_path):
    lines = corpus.read_text(encoding="utf-8").splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n", encoding="utf-8")
    code, out, _ = run_cli(capsys, bad, "--student", tiny_student, "--json")
    assert code == 2
    value = one_json_object(out)
    assert set(value) == {"status", "code", "line", "field", "message"}
    assert (value["status"], value["code"], value["line"]) == ("rejected", "invalid_json", 3)
    assert isinstance(value["message"], str) and value["message"]


def test_file_level_rejection_has_null_line(capsys, tiny_student, tmp_path):
    code, out, _ = run_cli(capsys, tmp_path / "missing.jsonl", "--student", tiny_student, "--json")
    assert code == 2
    assert one_json_object(out)["line"] is None
    assert one_json_object(out)["code"] == "file_not_found"


def test_rejection_without_json_goes_to_stderr(capsys, tiny_student, tmp_path):
    code, out, err = run_cli(capsys, tmp_path / "missing.jsonl", "--student", tiny_student)
    assert code == 2
    assert out == ""
    assert "file_not_found" in err


def test_teacher_manifest_pinning(capsys, corpus, tiny_student, manifest_line, tmp_path):
    pinned = tmp_path / "pinned.jsonl"
    pinned.write_text(manifest_line + "\n", encoding="utf-8")
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student, "--teacher-manifest", pinned, "--json")
    assert code == 0 and one_json_object(out)["status"] == "admitted"

    identity = TeacherIdentity.model_validate(json.loads(manifest_line)["teacher_identity"])
    other = tmp_path / "other.jsonl"
    other.write_text(build_manifest_line(identity.model_copy(update={"max_model_len": 4096})) + "\n", encoding="utf-8")
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student, "--teacher-manifest", other, "--json")
    assert code == 2
    value = one_json_object(out)
    assert (value["code"], value["line"]) == ("identity_mismatch", 1)
    assert "max_model_len" in value["message"]


def test_missing_teacher_manifest_file_is_a_rejection(capsys, corpus, tiny_student, tmp_path):
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student, "--teacher-manifest", tmp_path / "nope", "--json")
    assert code == 2
    assert one_json_object(out)["status"] == "rejected"


def test_out_materializes_and_prints_the_uri(capsys, corpus, tiny_student, tmp_path):
    root = tmp_path / "store"
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student, "--out", root, "--json")
    assert code == 0
    value = one_json_object(out)
    expected = root / "corpora" / hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert Path(value["materialized"]) == expected
    assert (expected / "admission.json").is_file()
    # the second run reuses it and says so in the human-readable form
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student, "--out", root)
    assert code == 0
    assert "already materialized" in out and str(expected) in out


@pytest.mark.parametrize("requested, effective", [("20", 16), ("16", 16), ("31", 16), ("32", 32), ("100", 32)])
def test_top_k_resolution(capsys, corpus, tiny_student, requested, effective):
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student, "--top-k", requested, "--json")
    assert code == 0
    assert one_json_object(out)["effective_top_k"] == effective


def test_top_k_below_16_is_rejected(capsys, corpus, tiny_student):
    code, out, _ = run_cli(capsys, corpus, "--student", tiny_student, "--top-k", "15", "--json")
    assert code == 2
    value = one_json_object(out)
    assert (value["code"], value["line"]) == ("top_k_unsupported", None)


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def test_installed_console_script(corpus, tiny_student, tmp_path):
    script = KILN_FLOWS
    assert script.exists(), f"no kiln-flows console script beside {sys.executable}: pip install -e ."
    done = subprocess.run(
        [str(script), "admit", str(corpus), "--student", str(tiny_student), "--json", "--top-k", "20"],
        capture_output=True, text=True, timeout=120, env=_subprocess_env(), cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    value = one_json_object(done.stdout)
    assert value["status"] == "admitted" and value["effective_top_k"] == 16
    bad = subprocess.run(
        [str(script), "admit", str(tmp_path / "missing.jsonl"), "--student", str(tiny_student), "--json"],
        capture_output=True, text=True, timeout=120, env=_subprocess_env(), cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert one_json_object(bad.stdout)["code"] == "file_not_found"


def test_admit_help_imports_neither_prefect_nor_torch(tmp_path):
    probe = (
        "import sys, contextlib, io\n"
        "from flows.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        main(['admit', '--help'])\n"
        "    except SystemExit as exit:\n"
        "        code = exit.code\n"
        "assert code == 0, code\n"
        "assert '--student' in out.getvalue() and '--teacher-manifest' in out.getvalue()\n"
        "print(sorted(m for m in ('prefect', 'torch') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=_subprocess_env(), cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_version_names_the_installed_distribution(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kiln-flows {version('kiln-flows')}"
