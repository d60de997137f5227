"""What a new user meets on the command line (issue 32, the CLI half), each case in a ``kiln-flows`` subprocess:

1. every output goes where it says: a storage root that cannot be written as given (``s3:/bucket`` with one
   slash, ``gs://`` without gcsfs, a bucket that does not exist, no credentials) is refused before any work and
   never becomes a local directory named ``s3:``; a root that can be written (moto's S3 server) gets the demo;
2. a set is read whole or refused: a directory holding an ``index.json`` is read through it (a listed shard gone:
   ``shard_missing``; an unlisted ``*.jsonl``: ``shard_unlisted``; a broken index: ``shard_index_invalid``);
3. bounds: a LoRA rank above the student's hidden size, a run projected past its time bound, a ``score --top-k``
   admission would refuse;
4. ``demo`` validates its own options;
5. each error names its real cause and place (a flag, a recipe's dataset, an unreadable weights file, a stopped
   Prefect server, a Hugging Face cache folder, a refused Ray run, a Ray address);
6. ``--json`` of a run that failed carries ``code`` and ``message``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln_core.admission.shard_sources import build_index
from kiln_core.synthetic import synthesize_corpus

REPO = Path(__file__).resolve().parent.parent
CONFIG = {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
          "checkpoint_interval": None}


def kiln(*argv, cwd: Path, env: dict | None = None, prelude: str = "", timeout: float = 600,
         preexec_fn=None) -> subprocess.CompletedProcess:
    """``kiln-flows ARGV`` in a fresh process on this tree, from ``cwd``; ``prelude`` runs first (as if a package
    were missing, …)."""
    base = {key: value for key, value in os.environ.items() if key not in ("KILN_FLOWS_DEBUG", "PREFECT_API_URL")}
    base["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [base.get("PYTHONPATH")])])
    code = f"{prelude}\nimport sys\nfrom flows.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, cwd=cwd,
                          env={**base, **(env or {})}, timeout=timeout, preexec_fn=preexec_fn)


def refusal(done: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed (no traceback, nothing else on stderr)."""
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def last_json(done: subprocess.CompletedProcess) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


def uri_named_folders(directory: Path) -> list[str]:
    """Folders a command made by taking a URI for a path (``s3:``, ``gs:``)."""
    return sorted(entry.name for entry in directory.iterdir() if entry.name.endswith(":"))


@pytest.fixture(scope="module")
def corpus_dir(tiny_student, tmp_path_factory) -> Path:
    """A 4-example scored corpus, its teacher manifest, and a request training on it."""
    directory = tmp_path_factory.mktemp("newcomer")
    synthesize_corpus(tiny_student, directory / "corpus.jsonl", n_examples=4, top_k=16, seed=5)
    (directory / "teacher-manifest.jsonl").write_text((directory / "corpus.jsonl").read_text().splitlines()[0] + "\n")
    write_request(directory, "request.json")
    return directory


def write_request(directory: Path, name: str, dataset: str = "corpus.jsonl", **config) -> Path:
    path = directory / name
    path.write_text(json.dumps({"dataset_path": dataset, "teacher": "teacher-manifest.jsonl",
                                "config": {**CONFIG, **config}}))
    return path


def train(corpus_dir: Path, request: Path, out, *extra, student: Path, adapter: str = "newcomer", **options):
    """``kiln-flows train`` of ``request``, from ``corpus_dir`` unless ``cwd`` says otherwise."""
    options.setdefault("cwd", corpus_dir)
    return kiln("train", "--request", request, "--adapter", adapter, "--student", student, "--out", out, *extra,
                **options)


# ---------------------------------------------------------------------------------------------
# 1. Every output goes where it says


@pytest.mark.parametrize("out", ["s3:/kiln-bucket/demo", "gs:kiln-bucket/demo"])
def test_a_uri_with_a_missing_slash_is_refused_not_written_as_a_local_folder(tmp_path, out):
    done = kiln("demo", "--out", out, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("rejected: [invalid_uri] field --out:") and "two slashes" in line
    assert uri_named_folders(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_gs_without_gcsfs_names_the_package_not_the_teacher(corpus_dir, tiny_student, tmp_path):
    request = corpus_dir / "alias-request.json"
    request.write_text(json.dumps({"dataset_path": "corpus.jsonl", "teacher": "tiny-teacher", "config": CONFIG}))
    done = train(corpus_dir, request, "gs://kiln-bucket/kiln", student=tiny_student, cwd=tmp_path,
                 prelude="import sys; sys.modules['gcsfs'] = None  # as if gcsfs were not installed")
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("rejected: [storage_package_missing] field --out:") and "gcsfs" in line
    assert "teacher" not in line


def test_demo_into_gs_without_gcsfs_writes_nothing_locally(tmp_path):
    done = kiln("demo", "--out", "gs://kiln-bucket/demo", "--json", cwd=tmp_path,
                prelude="import sys; sys.modules['gcsfs'] = None")
    assert done.returncode == 2, done.stderr[-3000:]
    assert (last_json(done)["status"], last_json(done)["code"]) == ("rejected", "storage_package_missing")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's standalone S3 server on loopback, with the bucket ``kiln-newcomer``."""
    from drills.s3_server import S3Server

    server = S3Server(log_path=str(tmp_path_factory.mktemp("moto") / "moto.log"))
    server.start()
    try:
        server.create_bucket("kiln-newcomer")
        yield server
    finally:
        server.stop()


def test_a_bucket_that_does_not_exist_is_refused_before_any_work(s3, tmp_path):
    done = kiln("demo", "--out", "s3://kiln-nonexistent-bucket/demo", cwd=tmp_path, env=s3.environment())
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("rejected: [storage_bucket_missing] field --out:") and "kiln-nonexistent-bucket" in line
    assert list(tmp_path.iterdir()) == []


def test_no_credentials_is_an_environment_failure_before_any_work(s3, tmp_path):
    from drills.s3_server import AWS_VARIABLES

    # Only the endpoint: no key anywhere (no variables, no credentials file, no instance metadata).
    env = {name: "" for name in AWS_VARIABLES} | {"AWS_ENDPOINT_URL_S3": s3.endpoint_url,
                                                  "AWS_EC2_METADATA_DISABLED": "true",
                                                  "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                                                  "AWS_CONFIG_FILE": str(tmp_path / "none")}
    clear_empty = "import os\nfor k in [k for k, v in os.environ.items() if k.startswith('AWS_') and not v]: del os.environ[k]"
    done = kiln("demo", "--out", "s3://kiln-newcomer/no-credentials", cwd=tmp_path, env=env, prelude=clear_empty)
    assert done.returncode == 3, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("failed: [storage_error] field --out:") and "NoCredentialsError" in line
    assert list(tmp_path.iterdir()) == []
    assert s3.list_keys("kiln-newcomer", "no-credentials/") == []


@pytest.mark.integration
def test_demo_into_a_bucket_publishes_there_and_nowhere_else(s3, tmp_path):
    done = kiln("demo", "--out", "s3://kiln-newcomer/demo", "--json", cwd=tmp_path, env=s3.environment())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = last_json(done)
    assert summary["latest"] == "s3://kiln-newcomer/demo/runs/demo/latest.json"
    keys = s3.list_keys("kiln-newcomer", "demo/")
    assert "demo/runs/demo/latest.json" in keys and any(key.endswith("train_receipt.json") for key in keys)
    assert list(tmp_path.iterdir()) == []  # the tiny models live in the temp directory, not under ./s3:


# ---------------------------------------------------------------------------------------------
# 2. A set is read whole or refused


@pytest.fixture
def scored_set(tiny_student, tmp_path) -> Path:
    """``scored/``: four shards and the ``index.json`` that lists them, as ``score --shard-size`` leaves a set."""
    directory = tmp_path / "scored"
    directory.mkdir()
    line = None
    for number in range(4):
        path = synthesize_corpus(tiny_student, directory / f"shard-{number:05d}.jsonl", n_examples=2, top_k=16,
                                 seed=60 + number, manifest_line=line or "auto")
        line = line or path.read_text().splitlines()[0]
    build_index(str(directory / "index.json"), [f"shard-{number:05d}.jsonl" for number in range(4)])
    (tmp_path / "teacher-manifest.jsonl").write_text(line + "\n")
    return directory


def admit(corpus, student, cwd: Path) -> subprocess.CompletedProcess:
    return kiln("admit", corpus, "--student", student, "--top-k", "16", "--json", cwd=cwd)


def test_a_directory_with_an_index_missing_a_shard_is_refused(scored_set, tiny_student, tmp_path):
    (scored_set / "shard-00001.jsonl").unlink()
    done = admit(scored_set, tiny_student, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    record = last_json(done)
    assert (record["code"], record["file"]) == ("shard_missing", "shard-00001.jsonl")


def test_a_jsonl_file_the_index_does_not_list_is_refused(scored_set, tiny_student, tmp_path):
    synthesize_corpus(tiny_student, scored_set / "late.jsonl", n_examples=2, top_k=16, seed=70,
                      manifest_line=(scored_set / "shard-00000.jsonl").read_text().splitlines()[0])
    done = admit(scored_set, tiny_student, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    record = last_json(done)
    assert (record["code"], record["file"]) == ("shard_unlisted", "late.jsonl")
    assert "index.json" in record["message"]


@pytest.mark.parametrize("given", ["directory", "index"])
def test_a_broken_index_is_reported_as_the_index(scored_set, tiny_student, tmp_path, given):
    (scored_set / "index.json").write_text("{not json\n")
    done = admit(scored_set if given == "directory" else scored_set / "index.json", tiny_student, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    record = last_json(done)
    assert (record["code"], record["file"], record["line"]) == ("shard_index_invalid", str(scored_set / "index.json"),
                                                                None)


def test_train_on_a_directory_missing_a_shard_trains_nothing(scored_set, tiny_student, tmp_path):
    (scored_set / "shard-00002.jsonl").unlink()
    request = write_request(tmp_path, "set-request.json", dataset="scored/")
    done = train(tmp_path, request, tmp_path / "out", "--json", student=tiny_student)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert last_json(done)["code"] == "shard_missing"
    assert not (tmp_path / "out" / "runs").exists()


# ---------------------------------------------------------------------------------------------
# 3. Bounds a user would expect


def test_a_lora_rank_above_the_hidden_size_is_refused_before_admission(corpus_dir, tiny_student, tmp_path):
    request = write_request(corpus_dir, "wide-rank.json", lora_rank=128, lora_alpha=128.0)
    done = train(corpus_dir, request, tmp_path / "out", student=tiny_student)
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("rejected: [lora_rank_exceeds_model] field config.lora_rank:")
    assert "hidden size 64" in line and "lora_rank 64 or less" in line
    assert not (tmp_path / "out" / "corpora").exists() and not (tmp_path / "out" / "runs").exists()


def test_a_run_projected_past_its_time_bound_is_refused_after_its_first_steps(corpus_dir, tiny_student, tmp_path):
    request = write_request(corpus_dir, "forever.json", epochs=1_000_000_000)
    started = time.monotonic()
    done = train(corpus_dir, request, tmp_path / "out", "--json", student=tiny_student, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    record = last_json(done)
    assert (record["status"], record["code"], record["field"]) == ("rejected", "training_too_long", "config.epochs")
    assert "4,000,000,000 steps" in record["message"] and "168-hour bound" in record["message"]
    assert time.monotonic() - started < 240
    assert not (tmp_path / "out" / "runs").exists()  # a fresh run refused leaves no directory behind


def test_the_time_bound_is_an_option_and_a_refused_run_can_run_again(corpus_dir, tiny_student, tmp_path):
    request = write_request(corpus_dir, "three-epochs.json", epochs=3, checkpoint_interval=1)
    tight = train(corpus_dir, request, tmp_path / "out", "--max-training-hours", "1e-9", student=tiny_student)
    assert tight.returncode == 2, tight.stderr[-3000:]
    assert "[training_too_long]" in tight.stderr and "1e-09-hour bound" in tight.stderr
    assert not (tmp_path / "out" / "runs").exists()  # its checkpoints of steps 1-3 went with it
    again = train(corpus_dir, request, tmp_path / "out", "--json", student=tiny_student)
    assert again.returncode == 0, again.stderr[-3000:]
    assert last_json(again)["steps"] == 12


def test_score_refuses_a_top_k_admission_would_refuse(tiny_student, tiny_teacher, tmp_path):
    examples = tmp_path / "examples.jsonl"
    examples.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "teacher_response": "Hello."}) + "\n")
    done = kiln("score", examples, "--teacher", tiny_teacher, "--student", tiny_student, "--top-k", "7",
                "--out", tmp_path / "scored.jsonl", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("rejected: [top_k_unsupported]") and "--top-k 16 or more" in line
    assert not (tmp_path / "scored.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# 4. demo validates its options


@pytest.mark.parametrize(("flag", "value"), [("--examples", "0"), ("--examples", "-1"), ("--epochs", "0"),
                                             ("--epochs", "-2")])
def test_demo_refuses_a_count_below_one_before_building_anything(tmp_path, flag, value):
    done = kiln("demo", flag, value, "--out", tmp_path / "demo", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert refusal(done) == f"rejected: [invalid_option] field {flag}: {flag} must be at least 1, got {value}"
    assert not (tmp_path / "demo").exists()


def test_demo_out_naming_a_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    done = kiln("demo", "--out", tmp_path / "notes.txt", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert refusal(done).startswith("rejected: [out_not_directory] field --out:")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_demo_out_under_a_read_only_directory_is_one_line(tmp_path):
    from test_error_model import read_only_directory

    done = kiln("demo", "--out", read_only_directory(tmp_path) / "demo", cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("failed: [storage_error] field --out:") and "not writable" in line


# ---------------------------------------------------------------------------------------------
# 5. Each error names its real cause and place


def test_workers_zero_names_the_flag_not_the_request_file(corpus_dir, tiny_student, tmp_path):
    done = train(corpus_dir, corpus_dir / "request.json", tmp_path / "out", "--ray", "local", "--workers", "0",
                 student=tiny_student)
    assert done.returncode == 2, done.stderr[-3000:]
    assert refusal(done) == "rejected: [invalid_option] field --workers: --workers must be at least 1, got 0"


def test_a_ray_address_is_checked_before_any_work(corpus_dir, tiny_student, tmp_path):
    done = train(corpus_dir, corpus_dir / "request.json", tmp_path / "out", "--ray", "bogus", student=tiny_student)
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("rejected: [invalid_ray_address] field --ray:") and "host:port" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_ray_run_refused_by_the_cluster_leaves_no_run_directory(corpus_dir, tiny_student, tmp_path):
    done = train(corpus_dir, corpus_dir / "request.json", tmp_path / "out", "--ray", "local", "--workers", "1000",
                 student=tiny_student)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "[ray_cluster_too_small]" in done.stderr
    assert not (tmp_path / "out" / "runs").exists()


def test_a_recipe_whose_dataset_is_missing_is_refused_up_front(corpus_dir, tiny_student, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: missing-data\nsteps:\n  - kind: opd\n    name: distilled\n"
                      f"    teacher: {corpus_dir / 'teacher-manifest.jsonl'}\n"
                      "    prompts_from: {dataset: no-such-corpus.jsonl}\n"
                      "    config: {training_mode: off_policy, top_k: 16}\n")
    started = time.monotonic()
    done = kiln("recipe", "run", recipe, "--student", tiny_student, "--out", tmp_path / "out", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)  # one line: no Prefect server was started, no flow ran
    assert line.startswith(f"rejected: [file_not_found] {recipe} field steps[0].prompts_from.dataset:")
    assert str(tmp_path / "no-such-corpus.jsonl") in line
    assert time.monotonic() - started < 20


def _without_dac_override():
    """In the child before exec: root without the capabilities that let it read any file, so permission bits
    apply to it as to any user (tests may run as root, where a chmod alone stops nothing)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_weights_file_without_read_permission_is_the_model_named(corpus_dir, tiny_student, tmp_path):
    student = tmp_path / "student"
    shutil.copytree(tiny_student, student)
    (student / "model.safetensors").chmod(0)
    done = train(corpus_dir, corpus_dir / "request.json", tmp_path / "out", student=student,
                 preexec_fn=_without_dac_override if os.geteuid() == 0 else None)
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith(f"rejected: [model_unreadable] {student / 'model.safetensors'} field student:")
    assert "Permission denied" in line


def test_a_stopped_prefect_server_is_named_with_its_address(corpus_dir, tiny_student, tmp_path):
    from drills.s3_server import free_port

    spec = tmp_path / "pipeline.json"
    spec.write_text(json.dumps({"teacher": {"kind": "manifest_file", "path": str(corpus_dir / "teacher-manifest.jsonl")},
                                "corpus": str(corpus_dir / "corpus.jsonl"), "student": str(tiny_student),
                                "storage_root": str(tmp_path / "out"), "adapter": "offline", "config": CONFIG}))
    address = f"127.0.0.1:{free_port()}"
    done = kiln("run", spec, cwd=tmp_path, env={"PREFECT_API_URL": f"http://{address}/api"})
    assert done.returncode == 3, done.stderr[-3000:]
    line = refusal(done)
    assert line.startswith("failed: [prefect_api_unreachable]")
    assert f"PREFECT_API_URL=http://{address}/api" in line and f"at {address}" in line
    assert not (tmp_path / "out").exists()


def test_a_hugging_face_cache_folder_gets_its_snapshot_named(corpus_dir, tiny_student, tmp_path):
    import hashlib

    repo = tmp_path / "hub" / "models--kiln--student"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for source in tiny_student.iterdir():
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, blob)
        (snapshot / source.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    done = train(corpus_dir, corpus_dir / "request.json", tmp_path / "out", student=repo)
    assert done.returncode == 2, done.stderr[-3000:]
    line = refusal(done)
    assert f"give its snapshot {snapshot}" in line and "Hugging Face cache folder" in line


# ---------------------------------------------------------------------------------------------
# 6. --json of a run that did not succeed: status, code and message


def test_train_json_of_a_failed_run_has_code_and_message(corpus_dir, tiny_student, tmp_path):
    request = write_request(corpus_dir, "diverges.json", learning_rate=1e10, checkpoint_interval=2)
    done = train(corpus_dir, request, tmp_path / "out", "--json", student=tiny_student)
    assert done.returncode == 3, done.stderr[-3000:]
    summary = last_json(done)
    assert (summary["status"], summary["code"]) == ("failed", "training_diverged")
    assert summary["message"].startswith("the publish guard refused")
