"""Shared test harness.

* Prefect state goes to a throwaway ``PREFECT_HOME`` set before anything imports Prefect, so cache
  records from earlier sessions can never produce false ``Cached`` hits.
* One session-scoped Prefect test server, started only by tests that ask for ``prefect_harness``
  (pure unit tests never pay for it).
* Tiny, deterministic student and teacher model directories built once per session.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

_PREFECT_HOME = tempfile.mkdtemp(prefix="kiln-flows-prefect-test-")
os.environ.update(
    {
        "PREFECT_HOME": _PREFECT_HOME,
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": os.path.join(_PREFECT_HOME, "storage"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
)
os.environ.pop("PREFECT_API_URL", None)

import pytest  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# Property tests are reproducible in CI: the same examples on every run (past failures are pinned with
# @example on each test). Locally they keep exploring; HYPOTHESIS_PROFILE=ci reproduces a CI run.
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
hypothesis_settings.register_profile("dev", print_blob=True)
hypothesis_settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI", "").lower() == "true" else "dev"))


@pytest.fixture(scope="session")
def prefect_harness():
    """A Prefect API server for the whole session (started on first use)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(autouse=True)
def prefect_console_on_this_tests_stderr():
    """Point Prefect's console log handlers at this test's ``sys.stderr``.

    A ``PrefectConsoleHandler`` keeps the stream it was built with. Under pytest that is the capture
    stream of the first test that logged, closed when that test ends; the next in-process flow run then
    fails writing to it (rich retries its buffer until a RecursionError ends the flow run). A real
    process has one stderr for its whole life, so only the harness needs this.
    """
    import logging
    import sys

    handlers_module = sys.modules.get("prefect.logging.handlers")  # only once Prefect has logged
    if handlers_module is not None:
        loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                           if isinstance(logger, logging.Logger)]
        for handler in {handler for logger in loggers for handler in logger.handlers}:
            if isinstance(handler, handlers_module.PrefectConsoleHandler):
                handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
                handler.console.file = sys.stderr
    yield


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_student(models_dir) -> Path:
    """A tiny Qwen3-shaped student with a ChatML template carrying ``{% generation %}`` blocks."""
    from kiln_core.tiny_models import build_tiny_model

    return build_tiny_model(models_dir / "student", seed=1)


@pytest.fixture(scope="session")
def tiny_teacher(models_dir) -> Path:
    """A tiny teacher: same tokenizer as the student, different (seeded) weights, wider model."""
    from kiln_core.tiny_models import build_tiny_model

    return build_tiny_model(models_dir / "teacher", seed=2, hidden_size=96, num_layers=2)


@pytest.fixture(scope="session")
def tiny_student_plain(models_dir) -> Path:
    """The same student with a ChatML template *without* generation blocks (fallback masks)."""
    from kiln_core.tiny_models import build_tiny_model

    return build_tiny_model(models_dir / "student-plain", seed=1, generation_blocks=False)


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance (2 CPUs) for the rest of a module: ``--ray local`` runs and flows with a Ray
    spec join a session already open instead of starting their own, and it is shut down after the module."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def one_torch_thread():
    """One torch thread for the duration of a test: tiny matrices run faster and steadier on one thread
    than on two on a shared runner, and a subprocess driver set to one thread runs the very same kernels.
    Modules that train use it for every test: ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ the fast tier
# `python -m pytest -m fast` runs the fast tier: every product module (kiln_core, tasks, flows, drills)
# exercised in a few minutes, for a change-by-change loop. `python -m pytest` (the README's command, and
# CI) still runs everything. This hook is the one place that decides which tests are fast:
#
# * a test marked slow/integration/browser/real is not fast (it trains end to end or starts a server);
# * a test that trains a model is not fast: modules that train take the `one_torch_thread` fixture for
#   every test (see the fixture above), so a test there that also needs a model fixture trains one;
# * FAST_REPRESENTATIVES name the few short training and end-to-end tests that keep the modules only
#   such tests reach in the tier; NOT_FAST names tests that pass the rules above yet take too long.
#
# tests/fast_tier_map.json records, for every product module, fast test files that exercise it (not just
# import it); tests/test_fast_tier.py checks it against this hook, and tools/fast_tier_map.py rebuilds it.
NOT_FAST_MARKS = frozenset({"slow", "integration", "browser", "real"})
MODEL_FIXTURES = frozenset({"tiny_student", "tiny_teacher", "tiny_student_plain"})
FAST_REPRESENTATIVES = frozenset({
    "tests/test_trainer.py::test_loss_falls_with_a_high_learning_rate",  # the off-policy loop
    "tests/test_on_policy_trainer.py::test_progress_reports_rollout_throughput_and_teacher_tokens",  # on-policy
    "tests/test_train_cli.py::test_train_end_to_end_json",  # kiln-flows train through the engine
    "tests/test_on_policy_cli.py::test_an_on_policy_request_trains_through_the_engine",
    "tests/test_eval_watch.py::test_a_watch_the_run_cannot_keep_is_refused_before_anything_is_written",
    "tests/test_eval_watch_sources.py::test_admit_builds_the_slice_from_the_scored_corpus",
    "tests/fault_drills/test_drills.py::test_drill_cli_prints_one_json_object_per_drill",
    "tests/test_pipeline_flow.py::test_rejected_corpus_fails_in_admit_and_writes_nothing",  # opd_distill, tasks
    "tests/test_on_policy_vllm.py::test_a_server_that_is_down_is_an_environment_failure",  # the vLLM teacher
})
NOT_FAST = frozenset({  # over 5 CPU-seconds each when measured (they load or train models, or fuzz at length)
    "tests/test_evaluation.py::test_eval_cli_json_and_table",
    "tests/test_evaluation.py::test_adapter_of_another_model_is_refused",
    "tests/test_evaluation.py::test_corpus_overlapping_the_training_corpus_is_refused",
    "tests/test_evaluation.py::test_corpus_scored_by_another_teacher_is_refused",
    "tests/test_evaluation.py::test_student_with_another_vocabulary_is_refused",
    "tests/test_post_eval_runner.py::test_adapter_that_breaks_answers_is_a_regression",
    "tests/test_post_eval_runner.py::test_previous_adapter_is_the_baseline_unless_it_has_the_candidates_name",
    "tests/test_post_eval_runner.py::test_seeded_sampling_pairs_both_arms_and_reproduces",
    "tests/test_post_eval_runner.py::test_adapter_that_gives_the_target_answers_is_promoted_or_kept",
    "tests/test_post_eval_runner.py::test_include_baseline_reuses_the_gates_base_model_arm",
    "tests/test_post_eval_runner.py::test_unreachable_targets_demote",
    "tests/test_post_eval_runner.py::test_ungated_eval_runs_the_candidate_and_optional_base_model",
    "tests/test_post_eval_runner.py::test_adapter_that_changes_nothing_ties_and_is_inconclusive",
    "tests/test_on_policy_sampler.py::test_cached_decode_samples_the_same_tokens_as_the_naive_loop",
    "tests/test_models.py::test_derive_refusals_write_nothing",
    "tests/test_loss_quality.py::test_the_trainer_trains_each_quality_loss_on_the_right_targets",
    "tests/test_admission_paths.py::test_parsers_produce_identical_parsed_corpora",
    "tests/test_admission_paths.py::test_mutated_corpora_end_in_one_verdict",
    "tests/test_cache_policy.py::test_artifact_key_is_always_a_valid_prefect_key",
    "tests/test_cache_policy.py::test_key_is_stable_across_processes",
    "tests/test_admit_cli.py::test_installed_console_script",
    # two real training processes each (the local lock stays in the tier through its quicker tests)
    "tests/test_run_lock.py::test_two_train_processes_second_exits_3_naming_the_first_and_wait_finds_it_finished",
    "tests/test_run_lock.py::test_pipeline_flow_run_exits_3_run_in_progress_while_the_run_key_is_held",
    "tests/test_run_lock.py::test_train_takes_over_the_lock_of_a_dead_run",
    "tests/test_run_lock.py::test_s3_dead_pid_and_expired_lease_are_taken_over_a_live_lease_is_not",
    "tests/test_run_lock.py::test_s3_second_process_in_progress_then_released",
    "tests/test_run_lock.py::test_s3_heartbeat_keeps_a_short_lease_alive_and_wait_takes_it_after_release",
    "tests/test_error_model.py::test_a_frozen_s3_endpoint_fails_a_write_in_bounded_time",  # waits out real timeouts
    # the benches at test size (generate corpora, spawn admission workers, train in a fresh process)
    "tests/test_bench_scripts.py::test_generated_shards_are_cached_distinct_and_pin_one_teacher",
    "tests/test_bench_scripts.py::test_shard_bench_prints_its_figures_with_the_load_average",
    "tests/test_bench_scripts.py::test_stream_memory_bench_reads_rss_at_the_steps_asked_for",
    "tests/test_bench_scripts.py::test_stream_memory_bench_trains_across_the_shards_of_a_set",
    # sharded scoring under the Prefect harness and against a fake vLLM server (about 10-20 s of setup each)
    "tests/test_score_shards.py::test_score_corpus_flow_shards_and_names_the_index",
    "tests/test_score_shards.py::test_vllm_shards_scored_in_parallel_equal_the_sequential_set_and_are_admitted",
    "tests/test_score_shards.py::test_a_vllm_failure_mid_set_keeps_the_committed_shards_for_the_rerun",
})


def is_fast(item: pytest.Item) -> bool:
    """Whether ``item`` belongs to the fast tier (the rules above; a name without ``[params]`` names all)."""
    names = {item.nodeid, item.nodeid.split("[", 1)[0]}
    if names & FAST_REPRESENTATIVES:
        return True
    if names & NOT_FAST or any(mark.name in NOT_FAST_MARKS for mark in item.iter_markers()):
        return False
    fixtures = set(getattr(item, "fixturenames", ()))
    return not ("one_torch_thread" in fixtures and fixtures & MODEL_FIXTURES)


DURATIONS = Path(__file__).with_name("test_durations.json")
SECONDS_PER_SLOW_TEST = 20.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_tests_per_file: dict[str, int] = {}
    for item in items:
        if is_fast(item):
            item.add_marker(pytest.mark.fast)
        else:
            slow_tests_per_file[str(item.path)] = slow_tests_per_file.get(str(item.path), 0) + 1
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A parallel run hands out whole files in collection order (--dist loadfile). The longest files go
        # first (tests/test_durations.json, rebuilt by tools/test_durations.py; a file it does not know yet
        # counts SECONDS_PER_SLOW_TEST per slow test), so the run does not end with one worker on a long
        # file while the other idles; a file's own tests keep their order, a one-process run the plain order.
        recorded = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}
        root = Path(str(config.rootpath))
        first_seen: dict[str, int] = {}
        for index, item in enumerate(items):
            first_seen.setdefault(str(item.path), index)

        def expected_seconds(path: str) -> float:
            name = Path(path).relative_to(root).as_posix() if Path(path).is_relative_to(root) else path
            return recorded.get(name, SECONDS_PER_SLOW_TEST * slow_tests_per_file.get(path, 0))

        items.sort(key=lambda item: (-expected_seconds(str(item.path)), first_seen[str(item.path)]))


# ------------------------------------------------------------------------------------------ parallel workers
MAX_WORKERS = 4  # each worker holds torch, Prefect and a tiny model or two; more rarely pays on one machine


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per core this process may use, at most ``MAX_WORKERS``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))
