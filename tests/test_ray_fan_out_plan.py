"""Where a flow admits a set of shards for a spec's ``distributed`` block (``tasks.ray_fan_out.plan_fan_out``).

What a user depends on: a Ray spec sends the shard tasks to its cluster; without Ray they stay on the flow's
threads; a cluster other than ``local`` with a local storage root is refused before any admission
(``unshared_storage``, the rule training applies), and shards given as local paths stay on this machine
(the cluster's nodes could not read them), with the reason for the run's log. A shard task that Ray itself
lost (its worker died, its node could not import kiln-flows) is an environment failure naming the shard
(exit 3), while the task's own rejection stays what it is. No Ray is started here.
"""

from __future__ import annotations

import pytest

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.contracts.spec_blocks import DistributedOptions
from tasks.ray_fan_out import plan_fan_out, runner_failure


def ray_block(address: str = "local") -> DistributedOptions:
    return DistributedOptions(engine="ray", address=address, workers=2)


def test_without_ray_the_shards_stay_on_the_flows_threads():
    assert plan_fan_out(None, "/data/shards", "/data/kiln").ray is None
    assert plan_fan_out(DistributedOptions(nproc=2), "/data/shards", "/data/kiln").ray is None


def test_a_local_ray_instance_admits_local_shards_into_a_local_root():
    fan_out = plan_fan_out(ray_block("local"), "/data/shards", "/data/kiln")
    assert (fan_out.ray.address, fan_out.reason) == ("local", None)


def test_a_cluster_admits_shards_on_shared_storage():
    fan_out = plan_fan_out(ray_block("ray://head:10001"), "s3://bucket/shards/", "s3://bucket/kiln")
    assert (fan_out.ray.address, fan_out.reason) == ("ray://head:10001", None)


@pytest.mark.parametrize(("student", "on_workers"), [("s3://bucket/student", "s3://bucket/student"),
                                                     ("/models/student", None), ("file:///models/student", None)])
def test_the_workers_open_a_remote_student_from_its_uri(student, on_workers):
    """A student URI goes to the workers (each node copies it); a local one is the path this machine uses."""
    fan_out = plan_fan_out(ray_block("auto"), "s3://bucket/shards/", "s3://bucket/kiln", student)
    assert fan_out.worker_student == on_workers


@pytest.mark.parametrize("root", ["/data/kiln", "file:///data/kiln"])
def test_a_cluster_with_a_local_storage_root_is_refused_naming_the_rule(root):
    with pytest.raises(ConfigError) as caught:
        plan_fan_out(ray_block("auto"), "s3://bucket/shards/", root)
    assert (caught.value.code, caught.value.field) == ("unshared_storage", "storage_root")
    assert "shared by every node" in caught.value.message


def test_memory_storage_is_refused_even_on_a_local_instance():
    with pytest.raises(ConfigError) as caught:
        plan_fan_out(ray_block("local"), "/data/shards", "memory://kiln")
    assert caught.value.code == "unshared_storage"


def test_local_shards_with_a_cluster_are_admitted_here_and_the_log_says_why():
    fan_out = plan_fan_out(ray_block("ray://head:10001"), "/data/shards", "s3://bucket/kiln")
    assert fan_out.ray is None
    assert "local paths" in fan_out.reason and "ray://head:10001" in fan_out.reason


def test_a_shard_task_ray_lost_is_an_environment_failure_naming_the_shard():
    from ray.exceptions import WorkerCrashedError

    from kiln_core.errors import AdmissionError, EnvironmentFailure

    failure = runner_failure(WorkerCrashedError(), "part-02.jsonl")
    assert isinstance(failure, EnvironmentFailure) and failure.exit_code == 3
    assert (failure.code, failure.file) == ("ray_task_failed", "part-02.jsonl")
    assert "WorkerCrashedError" in failure.message and "kiln-flows installed" in failure.message
    rejection = AdmissionError("invalid_json", 3, "line 3 is not JSON", file="part-02.jsonl")
    assert runner_failure(rejection, "part-02.jsonl") is rejection


# --- scoring on Ray: what score_corpus and ``kiln-flows score --ray`` refuse before reading anything --------


def score_on_ray(tmp_path, **options):
    """The flow's body, with inputs that do not exist: every refusal here comes before anything is read."""
    from flows.score_corpus import score_corpus

    options = {"shard_size": "1MiB", "ray_address": "local", **options}
    return score_corpus.fn(str(tmp_path / "examples.jsonl"), str(tmp_path / "student"), teacher_dir=str(tmp_path),
                           storage_root=str(tmp_path / "root"), **options)


def test_scoring_on_ray_needs_a_shard_size(tmp_path):
    with pytest.raises(ConfigError) as caught:
        score_on_ray(tmp_path, shard_size=None)
    assert (caught.value.code, caught.value.field) == ("ray_needs_shard_size", "shard_size")
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("address", ["http://head:8265", "ray://", "ray://user:secret@head:10001"])
def test_scoring_on_ray_refuses_a_bad_address_naming_the_field(tmp_path, address):
    with pytest.raises(ConfigError) as caught:
        score_on_ray(tmp_path, ray_address=address)
    assert (caught.value.code, caught.value.field) == ("invalid_ray_address", "ray_address")
    assert "secret" not in caught.value.message
    assert not (tmp_path / "root").exists()


def test_scoring_on_a_cluster_into_a_local_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError) as caught:
        score_on_ray(tmp_path, ray_address="ray://head:10001", out=str(tmp_path / "scored"))
    assert caught.value.code == "unshared_storage" and "shared by every node" in caught.value.message


def test_scoring_on_a_cluster_refuses_local_examples_naming_them(tmp_path):
    with pytest.raises(ConfigError) as caught:
        score_on_ray(tmp_path, ray_address="auto", out="s3://bucket/scored/")
    assert (caught.value.code, caught.value.field) == ("unshared_storage", "examples")
    assert str(tmp_path / "examples.jsonl") in caught.value.message


def test_a_scoring_task_ray_lost_names_the_shard_and_says_scoring():
    from ray.exceptions import WorkerCrashedError

    from kiln_core.scoring import ScoringError

    failure = runner_failure(WorkerCrashedError(), "shard-00001.jsonl", doing="scoring")
    assert (failure.code, failure.file, failure.exit_code) == ("ray_task_failed", "shard-00001.jsonl", 3)
    assert "task scoring it failed" in failure.message
    rejection = ScoringError("teacher_mismatch", "the teacher's manifest differs from the pinned manifest")
    assert runner_failure(rejection, "shard-00001.jsonl", doing="scoring") is rejection


def run_score_cli(capsys, tmp_path, *options) -> tuple[int, str]:
    from flows.cli import main

    code = main(["score", str(tmp_path / "examples.jsonl"), "--teacher", str(tmp_path), "--student",
                 str(tmp_path / "student"), "--top-k", "16", "--out", str(tmp_path / "scored"), *options])
    return code, capsys.readouterr().err


def test_cli_score_on_ray_without_a_shard_size_exits_2_naming_the_rule(tmp_path, capsys):
    code, err = run_score_cli(capsys, tmp_path, "--ray", "local")
    assert code == 2 and "ray_needs_shard_size" in err and "Traceback" not in err
    assert not (tmp_path / "scored").exists()


def test_cli_score_on_ray_refuses_a_bad_address(tmp_path, capsys):
    code, err = run_score_cli(capsys, tmp_path, "--ray", "https://head:8265", "--shard-size", "1MiB")
    assert code == 2 and "invalid_ray_address" in err and "Traceback" not in err


@pytest.mark.parametrize("option", [["--batch-size", "4"], ["--workers", "2"], ["--device", "cpu"]])
def test_cli_score_on_ray_refuses_options_the_flow_does_not_take(tmp_path, capsys, option):
    code, err = run_score_cli(capsys, tmp_path, "--ray", "local", "--shard-size", "1MiB", *option)
    assert code == 2 and option[0] in err and "cannot be combined with --ray" in err
    assert not (tmp_path / "scored").exists()


# ---- scoring's shard tasks (no Ray: the flow's side of a failing shard)

SCORE_SHARD_SIZE = 40_000  # the tiny teacher's six scored examples make three shards (tests/test_ray_fan_out.py)


def test_a_shard_tasks_rejection_keeps_its_code_and_the_finished_shards_stay_for_the_rerun(
        prefect_harness, tiny_teacher, tiny_student, tmp_path, monkeypatch):
    """The flow's side of a failing shard, on the thread task runner (a spy cannot reach a Ray worker): the
    rejection raised in shard 1's task is the one raised, no index is written, and shard 0 is committed."""
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner
    from test_scoring import EXAMPLES, TOP_K, write_jsonl

    import tasks.score_shards
    from kiln_core.scoring import ScoringError

    examples = write_jsonl(tmp_path / "examples.jsonl", EXAMPLES)
    real = tasks.score_shards.score_shard_job

    def reject_shard_one(job):
        if job.shard.number == 1:
            raise ScoringError("teacher_mismatch", "the teacher's manifest differs from the pinned manifest")
        return real(job)

    monkeypatch.setattr(tasks.score_shards, "score_shard_job", reject_shard_one)

    @flow
    def score_on_threads():
        with ThreadPoolTaskRunner(max_workers=2) as runner:
            return tasks.score_shards.score_set_with_tasks(
                str(examples), task_runner=runner, student_dir=str(tiny_student), teacher_dir=str(tiny_teacher),
                top_k=TOP_K, out_uri=str(tmp_path / "scored"), shard_size=SCORE_SHARD_SIZE)

    with pytest.raises(ScoringError) as caught:
        score_on_threads()
    assert caught.value.code == "teacher_mismatch"
    assert not (tmp_path / "scored" / "index.json").exists()
    assert (tmp_path / "scored" / "shard-00000.jsonl").is_file()  # committed: the rerun skips it
