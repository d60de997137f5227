"""What a Ray run prints: the run's own lines, not Ray's and Prefect's noise from every worker (issue 32).

Before: ``train --ray local`` printed Ray's token-authentication notice, a ``PreemptionWatcher`` error from
Ray Train's node-preemption watcher as the local instance stopped, every few seconds "State API may be
temporarily unavailable" from its placement-group cleaner, and each rank's own "Loading weights" bar and
transformers ``FutureWarning``; ``score --ray local`` started a temporary Prefect API server inside every
Ray worker, each logging "Failed to send telemetry" at ERROR (the driver's own did too).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOISE = ("Token authentication is enabled", "PreemptionWatcher", "State API may be temporarily unavailable",
         "Loading weights", "FutureWarning", "Failed to send telemetry")


def test_a_ray_session_starts_its_workers_quiet(monkeypatch):
    """What ``ray_session`` asks of Ray, without starting it: worker progress bars off, the worker setup hook,
    the caller's worker environment, and on a local instance no preemption watcher."""
    from kiln_core.contracts.spec_blocks import RayOptions
    from kiln_core.training.distributed import ray_launcher

    calls = []

    class FakeRay:
        __version__ = "test"

        def is_initialized(self):
            return False

        def init(self, **kwargs):
            calls.append(kwargs)

        def shutdown(self):
            pass

    monkeypatch.setattr(ray_launcher, "import_ray", lambda: FakeRay())
    monkeypatch.setattr(ray_launcher, "_probe", lambda address, timeout: None)
    for address in ("local", "ray://cluster:10001"):
        with ray_launcher.ray_session(RayOptions(address=address), 1, worker_env={"PREFECT_API_URL": "http://api"}):
            pass
    local, cluster = (call["runtime_env"] for call in calls)
    for runtime_env in (local, cluster):
        assert runtime_env["env_vars"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        assert runtime_env["env_vars"]["PREFECT_API_URL"] == "http://api"
        assert runtime_env["worker_process_setup_hook"] == "kiln_core.training.distributed.ray_worker.quiet_worker"
    assert local["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in cluster["env_vars"]  # a cluster's nodes can be preempted
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    record = notice.makeRecord(notice.name, logging.WARNING, "x.py", 1, "Token authentication is enabled for this Ray "
                               "cluster. Set RAY_AUTH_MODE=disabled to opt out.", (), None)
    assert not notice.filter(record)  # the local instance's default notice is dropped, other records are not
    assert notice.filter(notice.makeRecord(notice.name, logging.WARNING, "x.py", 1, "something else", (), None))


def test_the_worker_hook_drops_library_deprecations_and_the_state_api_notice():
    from kiln_core.training.distributed.ray_worker import quiet_worker

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_worker()
        warnings.warn_explicit("internals", FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils")
        warnings.warn_explicit("ours", FutureWarning, "x.py", 1, module="kiln_core.x")
    assert [str(warning.message) for warning in seen] == ["ours"]
    cleaner = logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner")
    record = cleaner.makeRecord(cleaner.name, logging.WARNING, "x.py", 1, "Failed to query Ray Train Controller actor "
                                "state. State API may be temporarily unavailable. Continuing to monitor.", (), None)
    assert not cleaner.filter(record)


def _cli(*argv, cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PREFECT_API_URL", "KILN_FLOWS_DEBUG")}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
                "PREFECT_HOME": str(cwd / "prefect-home"), "OMP_NUM_THREADS": "1"})
    return subprocess.run([sys.executable, "-m", "flows.cli", *map(str, argv)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=900)


@pytest.mark.integration
@pytest.mark.slow
def test_ray_runs_print_the_runs_lines_only(tiny_student, tiny_teacher, tmp_path):
    from flows.demo import demo_examples
    from kiln_core.synthetic import synthesize_corpus

    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps(example) + "\n" for example in demo_examples(4)))
    corpus = synthesize_corpus(tiny_student, tmp_path / "corpus.jsonl", n_examples=4, top_k=16, seed=4)
    (tmp_path / "manifest.jsonl").write_text(corpus.read_text().splitlines()[0] + "\n")
    (tmp_path / "request.json").write_text(json.dumps({
        "dataset_path": "corpus.jsonl", "teacher": "manifest.jsonl",
        "config": {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "lora_rank": 4, "lora_alpha": 8.0,
                   "seed": 3, "checkpoint_interval": 2}}))
    trained = _cli("train", "--request", tmp_path / "request.json", "--adapter", "quiet-ray", "--student", tiny_student,
                   "--out", tmp_path / "out", "--ray", "local", "--workers", "2", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [noise for noise in NOISE if noise in trained.stderr] == [], trained.stderr[-3000:]

    scored = _cli("score", examples, "--teacher", tiny_teacher, "--student", tiny_student, "--top-k", "16", "--out",
                  tmp_path / "scored", "--shard-size", "64KiB", "--ray", "local", cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert [noise for noise in NOISE if noise in scored.stderr] == [], scored.stderr[-3000:]
    assert scored.stderr.count("Starting temporary server") == 1, scored.stderr[-3000:]  # the driver's, no worker's
