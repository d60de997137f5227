"""The error model end to end: every bad input of issue 10 → its exit code and one clear line.

Rejection → exit 2 (``status: rejected``, a stable ``code``); environment failure (storage, network)
→ exit 3; anything unexpected → exit 3 with one line, the traceback only with ``--debug``. Never exit 1
with a traceback. The CLI runs in this process (``flows.cli.main``) unless the case needs a fresh one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from kiln_core.synthetic import synthesize_corpus

DEEP = 100_000


@pytest.fixture(scope="module")
def corpus_dir(tiny_student, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("errors")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=2, top_k=16, seed=4)
    (directory / "teacher-manifest.jsonl").write_text((directory / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    return directory


def cli(capsys, *argv: str) -> tuple[int, dict | None, str]:
    """Exit code, the JSON object of the last stdout line (if any), and stderr."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines else None), captured.err


def subprocess_cli(*argv: str, env: dict | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport sys\nfrom flows.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def assert_one_line_no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert len([line for line in stderr.splitlines() if line.strip()]) == 1, stderr


def read_only_directory(tmp_path: Path) -> Path:
    """A directory nothing can be created in: chmod for a normal user; sysfs when running as root
    (root ignores permission bits, and CI containers may run as root)."""
    if os.geteuid() == 0:
        return Path("/sys/kiln-flows-read-only-test")
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    return directory


# ---------------------------------------------------------------------------------------------
# Storage: read-only --out, unknown protocol, no s3fs, no credentials, a frozen endpoint


def test_out_on_a_read_only_directory_exits_3_with_one_line(capsys, corpus_dir, tiny_student, tmp_path):
    out = read_only_directory(tmp_path)
    code, record, err = cli(capsys, "admit", corpus_dir / "corpus.jsonl", "--student", tiny_student, "--top-k", 16,
                            "--out", out / "kiln")
    assert code == 3 and record is None
    assert_one_line_no_traceback(err)
    assert err.startswith("failed: [storage_error]") and str(out) in err
    code, record, _ = cli(capsys, "admit", corpus_dir / "corpus.jsonl", "--student", tiny_student, "--top-k", 16,
                          "--out", out / "kiln", "--json")
    assert code == 3 and (record["status"], record["code"]) == ("failed", "storage_error")


def test_an_unknown_fsspec_protocol_is_a_rejection(capsys, tiny_student):
    code, record, _ = cli(capsys, "admit", "nosuchproto://bucket/corpus.jsonl", "--student", tiny_student, "--json")
    assert code == 2 and (record["status"], record["code"]) == ("rejected", "unknown_protocol")
    assert "nosuchproto" in record["message"] and record["file"] == "nosuchproto://bucket/corpus.jsonl"


def test_s3_without_s3fs_is_a_rejection_naming_the_package(tiny_student):
    done = subprocess_cli("admit", "s3://bucket/corpus.jsonl", "--student", tiny_student, "--json",
                          prelude="import sys; sys.modules['s3fs'] = None  # as if s3fs were not installed")
    assert done.returncode == 2, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["code"] == "storage_package_missing" and "s3fs" in record["message"]
    assert "Traceback" not in done.stderr


def test_s3_without_credentials_is_an_environment_failure(tiny_student):
    from drills.s3_server import AWS_VARIABLES

    env = {name: "" for name in AWS_VARIABLES} | {"AWS_EC2_METADATA_DISABLED": "true",
                                                  "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                                                  "AWS_CONFIG_FILE": "/nonexistent"}
    done = subprocess_cli("admit", "s3://kiln-no-credentials/corpus.jsonl", "--student", tiny_student, env=env,
                          prelude="import os\nfor k in [k for k, v in os.environ.items() if k.startswith('AWS_') and not v]: "
                                  "del os.environ[k]")
    assert done.returncode == 3, done.stderr
    assert_one_line_no_traceback(done.stderr)
    assert "storage_error" in done.stderr and "NoCredentialsError" in done.stderr


def test_a_frozen_s3_endpoint_fails_a_write_in_bounded_time(monkeypatch):
    """The product's own settings (no patching): a PUT to a server that stopped answering fails."""
    from drills.s3_server import aws_environment, clear_s3fs_cache, running_s3_server

    from kiln_core.storage import StorageFailure, as_environment_failure, resolve, write_bytes_atomic

    monkeypatch.setenv("KILN_FLOWS_STORAGE_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("KILN_FLOWS_STORAGE_READ_TIMEOUT", "2")
    monkeypatch.setenv("KILN_FLOWS_STORAGE_MAX_ATTEMPTS", "2")
    with running_s3_server() as server, aws_environment(server):
        server.create_bucket("kiln-frozen")
        clear_s3fs_cache()
        target = resolve("s3://kiln-frozen/runs/x/train_receipt.json")
        write_bytes_atomic(target, b"{}")  # answers while it runs
        server.pause()
        started = time.monotonic()
        try:
            with pytest.raises(Exception) as caught:
                write_bytes_atomic(resolve("s3://kiln-frozen/runs/x/latest.json"), b"{}")
        finally:
            server.resume()
        elapsed = time.monotonic() - started
    assert elapsed < 60, f"a frozen endpoint held a write for {elapsed:.0f} s"
    assert isinstance(as_environment_failure(caught.value), StorageFailure), repr(caught.value)


def test_two_runs_in_one_process_keep_their_own_credentials():
    """Credentials are scoped to a run (a context variable), not written to fsspec's global config."""
    import threading

    import fsspec

    from kiln_core.storage import resolve, storage_options_scope

    seen: dict[str, list[str]] = {"a": [], "b": []}
    barrier = threading.Barrier(2)

    def run(name: str) -> None:
        with storage_options_scope({"s3": {"key": f"key-{name}", "secret": f"secret-{name}"}}):
            for _ in range(20):
                barrier.wait(timeout=30)  # both runs are inside their scope at the same moment
                seen[name].append(resolve(f"s3://bucket-{name}/x").fs.key)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {"a": ["key-a"] * 20, "b": ["key-b"] * 20}
    assert "s3" not in fsspec.config.conf or "key" not in fsspec.config.conf["s3"]
    with storage_options_scope({"s3": {"key": "outer"}}):
        with storage_options_scope({"s3": {"secret": "inner"}}):
            inner = resolve("s3://bucket/x").fs
        assert (inner.key, inner.secret) == ("outer", "inner")
        assert resolve("s3://bucket/x").fs.secret is None


def test_storage_settings_reach_s3_and_bad_values_are_rejected(monkeypatch):
    from kiln_core.storage import StorageRejection, resolve

    monkeypatch.setenv("KILN_FLOWS_STORAGE_READ_TIMEOUT", "7")
    fs = resolve("s3://bucket/settings").fs
    assert fs.config_kwargs["read_timeout"] == 7.0 and fs.config_kwargs["connect_timeout"] == 10.0
    assert fs.config_kwargs["retries"] == {"max_attempts": 3, "mode": "standard"} and fs.retries == 1
    assert resolve("s3://bucket/x", {"config_kwargs": {"read_timeout": 1}}).fs.config_kwargs["read_timeout"] == 1
    monkeypatch.setenv("KILN_FLOWS_STORAGE_READ_TIMEOUT", "soon")
    with pytest.raises(StorageRejection) as caught:
        resolve("s3://bucket/bad")
    assert caught.value.code == "invalid_storage_setting"


# ---------------------------------------------------------------------------------------------
# Nesting 100,000 deep: pipeline YAML and OPD request file


def test_a_pipeline_yaml_nested_100000_deep_is_nesting_too_deep(capsys, tmp_path):
    spec = tmp_path / "deep.yaml"
    spec.write_text("teacher: " + "[" * DEEP + "]" * DEEP + "\n")
    code, record, _ = cli(capsys, "run", spec, "--json")
    assert code == 2 and (record["code"], record["line"]) == ("nesting_too_deep", 1)


@pytest.mark.parametrize(("levels", "code"), [(127, "invalid_spec"), (128, "nesting_too_deep")])
def test_the_yaml_nesting_limit_is_kilns(capsys, tmp_path, levels, code):
    spec = tmp_path / "nested.yaml"  # 127 levels parse (then fail as a spec), 128 do not parse
    spec.write_text("[" * (levels - 1) + "{a: 1}" + "]" * (levels - 1) + "\n")
    exit_code, record, _ = cli(capsys, "run", spec, "--json")
    assert exit_code == 2 and record["code"] == code


def test_an_opd_request_nested_100000_deep_is_nesting_too_deep(capsys, corpus_dir, tiny_student, tmp_path):
    request = tmp_path / "deep.json"
    request.write_text('{"teacher": "x", "config": ' + "[" * DEEP + "]" * DEEP + "}")
    code, record, _ = cli(capsys, "train", "--request", request, "--adapter", "deep", "--student", tiny_student,
                          "--out", tmp_path / "out", "--json")
    assert code == 2 and record["code"] == "nesting_too_deep"
    request.write_text('{"teacher": "x", "dataset_path": "c.jsonl", "config": {"x": ' + "[" * 130 + "]" * 130 + "}}")
    code, record, _ = cli(capsys, "train", "--request", request, "--adapter", "deep", "--student", tiny_student,
                          "--out", tmp_path / "out", "--json")
    assert code == 2 and record["code"] == "nesting_too_deep"  # too deep even where Kiln ignores the key


# ---------------------------------------------------------------------------------------------
# A hand-written spec's config: unknown keys are refused naming the key


def test_a_typo_in_a_spec_config_is_refused_naming_the_key(capsys, corpus_dir, tiny_student, tiny_teacher, tmp_path):
    spec = {"teacher": {"kind": "local_dir", "path": str(tiny_teacher)}, "corpus": str(corpus_dir / "corpus.jsonl"),
            "student": str(tiny_student), "storage_root": str(tmp_path / "out"), "adapter": "typo",
            "config": {"training_mode": "off_policy", "top_k": 16, "lora_rnak": 8}}
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(spec))
    code, record, _ = cli(capsys, "run", path, "--json")
    assert code == 2 and (record["code"], record["field"]) == ("invalid_spec", "config.lora_rnak")
    assert record["message"].endswith("did you mean `lora_rank`?")  # the request's wording (test_request_typos.py)
    spec["config"] = {"training_mode": "off_policy", "top_k": 16, "echo": {"lamda": 0.1}}
    path.write_text(yaml.safe_dump(spec))
    code, record, _ = cli(capsys, "run", path, "--json")
    assert code == 2 and record["field"] == "config.echo.lamda"
    assert not (tmp_path / "out").exists()


def test_a_kiln_request_ignores_unknown_config_keys_only_when_lenient(capsys, corpus_dir, tiny_student):
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.engine import spec_from_request

    request = corpus_dir / "lenient.json"
    request.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "teacher-manifest.jsonl",
                                   "config": {"training_mode": "off_policy", "top_k": 16, "lora_rnak": 8}}))
    with pytest.raises(ConfigError) as caught:
        spec_from_request(str(request), adapter="lenient", student_dir=str(tiny_student))
    assert (caught.value.code, caught.value.field) == ("invalid_request", "config.lora_rnak")
    prepared = spec_from_request(str(request), adapter="lenient", student_dir=str(tiny_student), kiln_lenient=True)
    assert prepared.spec.config.lora_rank == 16  # Kiln's default; the unknown key is ignored, as Kiln does
    assert prepared.ignored_keys == ("config.lora_rnak",)
    assert any("`config.lora_rnak`" in warning and "`lora_rank`" in warning for warning in prepared.warnings)


# ---------------------------------------------------------------------------------------------
# kiln-flows run: missing or unreadable inputs are rejections (exit 2), as for admit and train


def _spec_file(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


UNREADABLE_HOOK = """
# Test hook (only on this subprocess's PYTHONPATH): the file system refuses to open one corpus, as it
# would for a file without read permission (chmod does not stop root, and CI may run as root).
import builtins
import os

if os.environ.get("KILN_TEST_UNREADABLE"):
    import kiln_core.admission.source as _source

    _real_open = builtins.open

    def _refusing_open(file, *args, **kwargs):
        if str(file) == os.environ["KILN_TEST_UNREADABLE"]:
            raise PermissionError(13, "Permission denied", str(file))
        return _real_open(file, *args, **kwargs)

    _source.open = _refusing_open
"""


@pytest.mark.integration
@pytest.mark.parametrize("broken", ["corpus", "unreadable-corpus", "student", "teacher-dir", "teacher-alias"])
def test_run_rejects_missing_inputs_with_exit_2(prefect_harness, corpus_dir, tiny_student, tiny_teacher, tmp_path, broken):
    import prefect.settings

    corpus = str(corpus_dir / "corpus.jsonl")
    spec = {"teacher": {"kind": "local_dir", "path": str(tiny_teacher)}, "corpus": corpus, "student": str(tiny_student),
            "storage_root": str(tmp_path / "out"), "adapter": f"broken-{broken}",
            "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 1}}
    expected = {"corpus": "file_not_found", "unreadable-corpus": "file_unreadable", "student": "invalid_student",
                "teacher-dir": None, "teacher-alias": "unknown_alias"}[broken]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(UNREADABLE_HOOK)
    # the hook first, then the tree under test (a worktree run from another checkout's environment)
    env = {"PREFECT_API_URL": prefect.settings.PREFECT_API_URL.value(),
           "PYTHONPATH": os.pathsep.join([str(hook), str(Path(__file__).resolve().parents[1]),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    if broken == "corpus":
        spec["corpus"] = str(tmp_path / "missing.jsonl")
    elif broken == "unreadable-corpus":
        env["KILN_TEST_UNREADABLE"] = corpus
    elif broken == "student":
        spec["student"] = str(tmp_path / "no-student")
    elif broken == "teacher-dir":
        spec["teacher"]["path"] = str(tmp_path / "no-teacher")
    else:
        spec["teacher"] = {"kind": "local_registry", "alias": "nobody"}
    done = subprocess_cli("run", _spec_file(tmp_path, **spec), "--json", env=env)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 2, (record, done.stderr[-3000:])
    assert record["status"] == "rejected" and (expected is None or record["code"] == expected), record
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.integration
def test_a_rejection_in_a_retrying_task_is_not_retried(prefect_harness, tiny_student, corpus_dir, tmp_path):
    """The manifest task has retries; an unknown local alias fails it on the first attempt."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.opd_distill import opd_distill
    from flows.spec import parse_spec

    spec = parse_spec({"teacher": {"kind": "local_registry", "alias": "nobody"}, "corpus": str(corpus_dir / "corpus.jsonl"),
                       "student": str(tiny_student), "storage_root": str(tmp_path / "out"), "adapter": "no-retry",
                       "config": {"training_mode": "off_policy", "top_k": 16}})
    state = opd_distill(spec, return_state=True)
    assert state.is_failed() and "unknown_alias" in state.message
    deadline = time.monotonic() + 60
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
        manifest = [run for run in runs if run.name.startswith("manifest")]
        if manifest and manifest[0].state is not None and manifest[0].state.is_final():
            break
        assert time.monotonic() < deadline, "the manifest task run was not recorded"
        time.sleep(0.5)
    assert manifest[0].run_count == 1 and manifest[0].state.is_failed()


# ---------------------------------------------------------------------------------------------
# The guard: a bug is exit 3 with one line; --debug (or KILN_FLOWS_DEBUG=1) shows the traceback


def test_an_unexpected_error_is_one_line_exit_3_and_debug_shows_the_traceback(capsys, monkeypatch, tmp_path):
    import flows.commands.admit as admit_command

    def broken(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(admit_command, "run", broken)
    code, _, err = cli(capsys, "admit", tmp_path / "c.jsonl", "--student", tmp_path)
    assert code == 3
    assert_one_line_no_traceback(err)
    assert "failed [unexpected_error]: ZeroDivisionError: a bug" in err and "--debug" in err
    code, record, _ = cli(capsys, "admit", tmp_path / "c.jsonl", "--student", tmp_path, "--json")
    assert code == 3 and (record["status"], record["code"]) == ("failed", "unexpected_error")
    code, _, err = cli(capsys, "--debug", "admit", tmp_path / "c.jsonl", "--student", tmp_path)
    assert code == 3 and "Traceback" in err and "ZeroDivisionError" in err
    monkeypatch.setenv("KILN_FLOWS_DEBUG", "1")
    code, _, err = cli(capsys, "admit", tmp_path / "c.jsonl", "--student", tmp_path)
    assert code == 3 and "Traceback" in err


def test_every_error_class_is_one_of_the_two_kinds():
    from kiln_core.admission.records import RecordError
    from kiln_core.contracts.identity import ManifestError
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.contracts.pipeline import SpecError
    from kiln_core.errors import AdmissionError, EnvironmentFailure, Rejection
    from kiln_core.identity.hashing import IdentityHashError
    from kiln_core.strict_json import NestingTooDeep
    from kiln_core.oracle import OracleRejection, OracleRunError
    from kiln_core.scoring import ScoringError
    from kiln_core.storage import StorageFailure, StorageRejection
    from kiln_core.strict_json import StrictJsonError
    from kiln_core.teachers.kiln_client import TeacherRegistryError
    from kiln_core.teachers.local_registry import LocalRegistryError
    from kiln_core.tokenization import TokenizationError
    from kiln_core.training.checkpoint import CheckpointError

    rejections = [AdmissionError("invalid_json", 2, "m"), ConfigError("m", "config.top_k"), ManifestError("invalid", "m"),
                  IdentityHashError("no_weights", "m"), LocalRegistryError("unknown_alias", "m"),
                  TokenizationError("m"), SpecError("m", "adapter"), OracleRejection("candidates_equal", "m"),
                  StrictJsonError("duplicate_key", "m"), RecordError("messages", "m"), CheckpointError("c", "m"),
                  NestingTooDeep("m"), StorageRejection("unknown_protocol", "m"),
                  ScoringError("no_examples", "m"), TeacherRegistryError("unknown_alias", "m")]
    failures = [ScoringError("vllm_unreachable", "m"), TeacherRegistryError("timeout", "m"), OracleRunError("m"),
                StorageFailure("m")]
    for error in rejections:
        assert isinstance(error, Rejection) and error.exit_code == 2 and error.to_json()["status"] == "rejected", error
    for error in failures:
        assert isinstance(error, EnvironmentFailure) and error.exit_code == 3, error
    for error in rejections + failures:  # one JSON shape, the same key everywhere
        assert {"status", "code", "line", "field", "message"} <= set(error.to_json()), error
    # mixed classes keep working as their own type too
    assert isinstance(ScoringError("vllm_unreachable", "m"), ScoringError) and ScoringError("vllm_unreachable", "m").transient


def test_errors_survive_pickling():
    import pickle

    from kiln_core.errors import AdmissionError
    from kiln_core.scoring import ScoringError

    for error in (AdmissionError("invalid_json", 3, "bad"), ScoringError("vllm_unreachable", "down", line=4)):
        clone = pickle.loads(pickle.dumps(error))
        assert type(clone) is type(error) and clone.to_json() == error.to_json() and str(clone) == str(error)


@pytest.mark.parametrize("adapter", ["my adapter/v2!", "demo\n", "../escape", "x.kiln-checkpoint"])
def test_a_spec_breaking_the_adapter_name_rule_is_refused_with_the_requests_code(capsys, corpus_dir, tiny_student,
                                                                                  tiny_teacher, tmp_path, adapter):
    """`kiln-flows run` and `kiln-flows train` refuse a bad adapter name with one code, naming the field."""
    spec = {"teacher": {"kind": "local_dir", "path": str(tiny_teacher)}, "corpus": str(corpus_dir / "corpus.jsonl"),
            "student": str(tiny_student), "storage_root": str(tmp_path / "out"), "adapter": adapter}
    code, record, _ = cli(capsys, "run", _spec_file(tmp_path, **spec), "--json")
    assert code == 2 and (record["code"], record["field"]) == ("invalid_adapter_name", "adapter"), record
    assert not (tmp_path / "out").exists()
