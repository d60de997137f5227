"""Fixtures for tests against a real Prefect server: server, work pool, worker, deployment, data.

One server per test session, shared by the deployment and the UI tests. The deployment is created
exactly as a user creates it: ``prefect --no-prompt deploy --prefect-file deployments/prefect.yaml``
against a ``gpu`` process pool, served by a ``prefect worker start`` child whose working directory
is a scratch folder (relative paths in the yaml's default parameters can never touch the checkout).
The session's in-process ``prefect_harness`` is never started here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .server import PrefectServer

FLOW_NAME = "opd-distill"
DEPLOYMENT_NAME = "nightly"
POOL = "gpu"


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    """A real ``prefect server start`` (own PREFECT_HOME, scheduler on) with a ``gpu`` process pool."""
    server = PrefectServer(tmp_path_factory.mktemp("prefect-server"))
    try:
        server.start(timeout=240)
        server.cli(["work-pool", "create", POOL, "--type", "process"])
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def deployment(live_server: PrefectServer) -> dict[str, Any]:
    """``opd-distill/nightly`` deployed from deployments/prefect.yaml (the route users take)."""
    live_server.cli(["--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "-n", DEPLOYMENT_NAME])
    return live_server.deployment(FLOW_NAME, DEPLOYMENT_NAME)


@pytest.fixture(scope="session")
def worker(live_server: PrefectServer, deployment, tmp_path_factory):
    """A process worker on the ``gpu`` pool; its cwd is a scratch directory."""
    cwd = tmp_path_factory.mktemp("worker-cwd")
    proc = live_server.start_worker(POOL, "itest-gpu", cwd=cwd, limit=1)
    yield proc
    assert proc.poll() is None, f"the worker exited early ({proc.returncode})\n{live_server.tails()}"


@pytest.fixture(autouse=True)
def _server_logs_on_failure(request):
    """Print the tails of the server/worker/CLI logs when a test using the live server fails."""
    yield
    report = getattr(request.node, "_report_call", None)
    if report is not None and report.failed and "live_server" in request.fixturenames:
        print(request.getfixturevalue("live_server").tails(120))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        item._report_call = outcome.get_result()


# -- data -------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def teacher_manifest_line(tiny_teacher) -> str:
    """The manifest line ``opd_distill`` derives for the local teacher directory (max_top_k 32)."""
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.local_teacher import local_teacher_identity

    return build_manifest_line(local_teacher_identity(tiny_teacher, max_top_k=32))


def _corpus(root: Path, student: Path, manifest_line: str, n_examples: int, seed: int) -> Path:
    from kiln_core.synthetic import synthesize_corpus

    return synthesize_corpus(student, root / f"corpus-{n_examples}.jsonl", n_examples=n_examples, top_k=16,
                             seed=seed, manifest_line=manifest_line)


@pytest.fixture(scope="session")
def pipeline_inputs(tmp_path_factory, tiny_student, tiny_teacher, teacher_manifest_line) -> dict[str, Path]:
    """Tiny student and teacher, a short corpus (4 examples), a long one (60), a storage root."""
    root = tmp_path_factory.mktemp("pipeline")
    return {
        "student": tiny_student,
        "teacher": tiny_teacher,
        "short_corpus": _corpus(root, tiny_student, teacher_manifest_line, 4, seed=11),
        "long_corpus": _corpus(root, tiny_student, teacher_manifest_line, 60, seed=12),
        "storage_root": root / "kiln-data",
    }


def pipeline_spec(inputs: dict[str, Path], corpus: Path, adapter: str, *, epochs: int = 1,
                  checkpoint_interval: int = 2) -> dict[str, Any]:
    """A ``PipelineSpec`` as JSON, exactly what the UI form submits for the ``spec`` parameter: every field
    the form requires (its numbers) included, as the form sends them."""
    return as_the_form_sends(_sparse_spec(inputs, corpus, adapter, epochs, checkpoint_interval))


def as_the_form_sends(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with every field the form shows and requires (its numbers) that it leaves out, as the form
    holds them: null, or the field's default."""
    from kiln_core.contracts.form_choices import complete_for_form
    from kiln_core.contracts.pipeline import PipelineSpec

    return complete_for_form(spec, PipelineSpec.model_json_schema(by_alias=True))


def _sparse_spec(inputs: dict[str, Path], corpus: Path, adapter: str, epochs: int,
                 checkpoint_interval: int) -> dict[str, Any]:
    return {
        "teacher": {"kind": "local_dir", "path": str(inputs["teacher"])},
        "source": {"kind": "corpus", "corpus": str(corpus)},
        "student": str(inputs["student"]),
        "storage_root": str(inputs["storage_root"]),
        "adapter": adapter,
        "config": {
            "top_k": 16,
            "epochs": epochs,
            "checkpoint_interval": checkpoint_interval,
            "learning_rate": 0.01,
            "seed": 5,
            "optimizer": {"kind": "adam_w"},
        },
        "options": {"train_retries": 0, "progress_every_seconds": 2.0, "cancel_poll_seconds": 1.0},
    }
