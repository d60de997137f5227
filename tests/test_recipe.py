"""Kiln recipe files as one Prefect flow: ``kiln-flows recipe run|list`` and ``run_recipe``.

The rules first (no models): every way ``plan_recipe`` refuses a recipe before its first step, naming the
field (``steps[2].adapter``), chaining as Kiln chains, a ``post_eval`` step turned into the gate of the step before
it, the run record a retry resumes from, and the list of recipes. Then on the tiny models, against the Prefect test
harness: a two-step opd recipe end to end through the CLI, a failing gate that stops the recipe before its next
step, a failed recipe retried that resumes at its first unfinished step, and the steps as subflows in the UI.
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

from kiln_core.errors import Rejection

REPO = Path(__file__).resolve().parents[1]
OFF_POLICY = {"training_mode": "off_policy", "top_k": 16, "epochs": 1, "checkpoint_interval": 4,
              "learning_rate": 0.05, "lora_rank": 4, "lora_alpha": 8, "optimizer": {"kind": "adam_w"}, "seed": 5}


def opd(name: str, corpus: str = "corpus.jsonl", teacher: str = "manifest.jsonl", **config) -> dict:
    return {"kind": "opd", "name": name, "teacher": teacher, "prompts_from": {"dataset": corpus},
            "config": {**OFF_POLICY, **config}}


def gate(adapter: str, suite: str = "far", score: float = 0.0) -> dict:
    return {"kind": "post_eval", "suite": suite, "adapter": adapter, "require_min_score": score}


def refused(value, **options) -> Rejection:
    from kiln_core.recipes.recipe_plan import plan_recipe

    with pytest.raises(Rejection) as caught:
        plan_recipe(value, **options)
    return caught.value


# ------------------------------------------------------------------------------------------ fake engines
# The distill recipes are built elsewhere; these stand in for their check/prepare pair so that the recipe-level
# rules that concern them (chaining, Kiln's default config, cycles through merge sources) are tested here.
SEEN: list[dict] = []


def fake_check(value, *, file=None):
    SEEN.append(value)
    if not isinstance(value.get("name"), str):
        raise Rejection("invalid_request", "name is required", field="name")
    if value.get("config", {}).get("top_k") == 0:
        raise Rejection("invalid_config", "OPD top_k must be > 0", field="config.top_k")
    return value


def fake_prepare(request, **options):  # pragma: no cover - never reached by the rules tests
    raise AssertionError("not run")


@pytest.fixture
def fake_distill(monkeypatch):
    from kiln_core.recipes import recipe_plan

    SEEN.clear()
    for kind in ("distill_self", "distill_merge", "distill_pump"):
        monkeypatch.setitem(recipe_plan.STEP_ENGINES, kind, ("test_recipe", "fake_check", "fake_prepare"))
    return SEEN


# ------------------------------------------------------------------------------------------ the rules


@pytest.mark.fast
@pytest.mark.parametrize("value, code, field", [
    ([], "invalid_recipe", None),
    ({"steps": [opd("a")]}, "invalid_recipe", "name"),
    ({"name": "r", "steps": []}, "invalid_recipe", "steps"),
    ({"name": "r", "steps": [opd("a")], "inputs": {}}, "invalid_recipe", "inputs"),
    ({"name": "no/slash", "steps": [opd("a")]}, "invalid_recipe", "name"),
    ({"name": "r", "steps": [{"kind": "opd_v2", "name": "a"}]}, "recipe_step_unknown_kind", "steps[0].kind"),
    ({"name": "r", "steps": [{"name": "a"}]}, "recipe_step_unknown_kind", "steps[0].kind"),
    ({"name": "r", "steps": [opd("a"), opd("a")]}, "recipe_duplicate_step_name", "steps[1].name"),
    ({"name": "r", "steps": [opd("a b")]}, "invalid_adapter_name", "steps[0].name"),
    ({"name": "r", "steps": [gate("a"), opd("a")]}, "recipe_post_eval_misplaced", "steps[0]"),
    ({"name": "r", "steps": [opd("a"), gate("a"), gate("a")]}, "recipe_post_eval_misplaced", "steps[2]"),
    ({"name": "r", "steps": [opd("a"), {**gate("a"), "min_accuracy": 0.5}]}, "invalid_recipe", "steps[1].min_accuracy"),
    ({"name": "r", "steps": [opd("a"), gate("a", score=1.5)]}, "post_eval_min_accuracy_out_of_range",
     "steps[1].require_min_score"),
    ({"name": "r", "steps": [{**opd("a"), "post_eval": {"suite": "s"}}]}, "invalid_recipe", "steps[0].post_eval"),
    ({"name": "r", "steps": [opd("a", base_adapter="a")]}, "recipe_name_cycle", "steps[0].config.base_adapter"),
    ({"name": "r", "steps": [opd("a", base_adapter="b"), opd("b")]}, "recipe_name_cycle",
     "steps[0].config.base_adapter"),
    ({"name": "r", "steps": [opd("a", top_k=0)]}, "invalid_config", "steps[0].config.top_k"),
    ({"name": "r", "steps": [{**opd("a"), "config": {"lora_rnak": 8, "training_mode": "off_policy"}}]},
     "invalid_request", "steps[0].config.lora_rnak"),
    ({"name": "r", "steps": [{**opd("a"), "prompts_from": {"dataset": "c", "prompts": []}}]}, "invalid_request",
     "steps[0].prompts_from"),
    ({"name": "r", "steps": [{**opd("a"), "prompts_from": {"prompts": [{"messages": []}]}}]}, "prompt_no_messages",
     "steps[0].prompts_from.prompts[0].messages"),
    ({"name": "r", "steps": [opd("a", corpus="agent_traces:user-pi")]}, "unsupported", "steps[0].prompts_from.dataset"),
])
def test_a_recipe_is_refused_before_any_step_naming_the_field(value, code, field):
    error = refused(value)
    assert (error.code, error.field) == (code, field), error.describe()


@pytest.mark.fast
def test_a_post_eval_naming_another_adapter_is_refused_with_kilns_text():
    error = refused({"name": "chain", "steps": [opd("a"), opd("b"), gate("a")]})
    assert error.code == "recipe_post_eval_adapter_mismatch" and error.field == "steps[2].adapter"
    assert error.message == ("recipe chain step 2: PostEval adapter 'a' does not match the preceding step's output "
                             "adapter 'b'")


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["sft", "distill_refresh"])
def test_sft_and_refresh_steps_are_refused_saying_what_to_do(kind):
    error = refused({"name": "r", "steps": [{"kind": kind, "name": "a"}]})
    assert error.code == "recipe_step_unsupported" and error.field == "steps[0].kind"
    assert "instead" in error.message or "Replace" in error.message


@pytest.mark.fast
def test_an_opd_step_on_a_corpus_takes_kilns_on_policy_default_and_says_to_set_off_policy():
    step = opd("a")
    del step["config"]["training_mode"]
    error = refused({"name": "r", "steps": [step]})
    assert error.code == "invalid_config" and error.field == "steps[0].config.training_mode"
    assert 'training_mode="off_policy"' in error.message


@pytest.mark.fast
def test_a_gate_on_a_suite_that_is_not_installed_is_refused_when_the_installed_suites_are_given(tmp_path):
    from kiln_core.post_eval.registry import SuiteRegistry

    error = refused({"name": "r", "steps": [opd("a"), gate("a", suite="missing")]},
                    suites=SuiteRegistry.for_storage_root(str(tmp_path)))
    assert error.code == "post_eval_suite_not_installed" and error.field == "steps[1].suite"


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["opd", "distill_self", "distill_merge", "distill_pump"])
def test_every_step_kind_this_build_ships_has_its_check_and_prepare(kind):
    """The runner finds each kind's pair by name at run time (``STEP_ENGINES``): a module split must keep both."""
    from kiln_core.recipes.recipe_plan import STEP_ENGINES, step_functions

    check, prepare = step_functions(kind)
    assert (check.__name__, prepare.__name__) == STEP_ENGINES[kind][1:] and callable(check) and callable(prepare)


@pytest.mark.fast
def test_a_step_kind_this_build_does_not_ship_is_refused_by_name(monkeypatch):
    from kiln_core.recipes import recipe_plan

    monkeypatch.setitem(recipe_plan.STEP_ENGINES, "distill_self", ("kiln_core.recipes.not_shipped", "c", "p"))
    error = refused({"name": "r", "steps": [{"kind": "distill_self", "name": "s", "mode": "conciseness"}]})
    assert error.code == "recipe_step_unsupported" and error.field == "steps[0].kind"
    assert "kiln_core.recipes.not_shipped" in error.message


@pytest.mark.fast
def test_steps_chain_as_kiln_chains_them_and_a_post_eval_becomes_the_gate(fake_distill):
    from kiln_core.recipes.recipe_plan import plan_recipe

    plan = plan_recipe({"name": "chain", "steps": [
        opd("a"), gate("a", suite="math", score=0.75),
        {"kind": "distill_self", "name": "s", "mode": "conciseness"},
        {"kind": "distill_pump", "name": "p", "teacher": "big", "mode": {"examples": []}},
        {"kind": "distill_merge", "name": "m", "sources": [{"adapter": "a"}, {"adapter": "p"}]},
        opd("o", base_adapter="a"),
    ]})
    assert [(step.index, step.name, step.base_adapter) for step in plan.steps] == [
        (0, "a", None), (2, "s", "a"), (3, "p", "s"), (4, "m", None), (5, "o", None)]
    assert plan.steps[0].gate == {"suite": "math", "min_accuracy": 0.75} and plan.steps[0].gate_step == 1
    assert all(step.gate is None for step in plan.steps[1:])
    # Kiln's plain OpdConfig default for every step kind: on_policy unless the file says otherwise
    assert [seen["config"] for seen in fake_distill] == [{"training_mode": "on_policy"}] * 3
    assert all("kind" not in seen for seen in fake_distill)


@pytest.mark.fast
def test_a_merge_may_not_learn_from_a_later_step_or_itself(fake_distill):
    later = refused({"name": "r", "steps": [
        {"kind": "distill_merge", "name": "m", "sources": [{"adapter": "x"}, {"adapter": "b"}]}, opd("b")]})
    assert (later.code, later.field) == ("recipe_name_cycle", "steps[0].sources[1].adapter")
    assert "steps[1]" in later.message
    itself = refused({"name": "r", "steps": [{"kind": "distill_merge", "name": "m", "student": "m",
                                              "sources": [{"adapter": "x"}]}]})
    assert (itself.code, itself.field) == ("recipe_name_cycle", "steps[0].student")


@pytest.mark.fast
def test_a_distill_steps_own_rules_are_named_within_the_recipe(fake_distill):
    error = refused({"name": "r", "steps": [opd("a"), {"kind": "distill_self", "name": "s", "config": {"top_k": 0}}]})
    assert (error.code, error.field) == ("invalid_config", "steps[1].config.top_k")


@pytest.mark.fast
def test_recipe_files_are_read_safely(tmp_path):
    from kiln_core.contracts.recipe import load_recipe

    deep = tmp_path / "deep.yaml"
    deep.write_text("name: r\nsteps: " + "[" * 200 + "]" * 200 + "\n")
    with pytest.raises(Rejection) as caught:
        load_recipe(str(deep))
    assert caught.value.code == "nesting_too_deep"
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("name: !!python/object/apply:os.system ['true']\nsteps: []\n")
    with pytest.raises(Rejection) as caught:
        load_recipe(str(unsafe))
    assert caught.value.code == "invalid_recipe" and "not valid YAML" in caught.value.message
    with pytest.raises(Rejection) as caught:
        load_recipe(str(tmp_path / "missing.yaml"))
    assert caught.value.code == "invalid_recipe" and "cannot read" in caught.value.message


@pytest.mark.fast
def test_a_finished_step_counts_only_while_latest_json_points_at_its_run(tmp_path):
    from kiln_core.contracts.latest import LatestPointer, encode_latest
    from kiln_core.recipes.recipe_run import (
        StepRecord,
        finished_run,
        read_run_record,
        recipe_digest,
        write_run_record,
    )

    digest = recipe_digest({"name": "r"}, "/student")
    assert digest != recipe_digest({"name": "r"}, "/other-student")
    record = read_run_record(str(tmp_path), "r", digest, "/student")
    run = str(tmp_path / "runs" / "a" / "k1")
    record = record.with_step(StepRecord(index=0, name="a", run=run, receipt=run + "/train_receipt.json",
                                         finished_at="2026-12-02T10:00:00Z"))
    write_run_record(str(tmp_path), record)
    again = read_run_record(str(tmp_path), "r", digest, "/student")
    assert again == record
    assert finished_run(again, 0, "a", str(tmp_path)) is None  # nothing published: run it

    def publish(run_dir: str) -> None:
        latest = tmp_path / "runs" / "a" / "latest.json"
        latest.parent.mkdir(parents=True, exist_ok=True)
        latest.write_bytes(encode_latest(LatestPointer(adapter=run_dir + "/adapter", receipt=run_dir + "/r.json",
                                                       receipt_sha256="sha256:" + "0" * 64, run=run_dir,
                                                       adapter_model_sha256="sha256:" + "0" * 64, dataset_sha256=None,
                                                       produced_at="2026-12-02T10:00:00Z")))

    publish(run)
    assert finished_run(again, 0, "a", str(tmp_path)).run == run
    assert finished_run(again, 1, "a", str(tmp_path)) is None  # another step
    publish(str(tmp_path / "runs" / "a" / "k2"))  # published again since: the step runs again
    assert finished_run(again, 0, "a", str(tmp_path)) is None


@pytest.mark.fast
def test_recipe_list_shows_the_bundled_recipes_and_with_all_kilns_marked_not_runnable(capsys):
    from flows.cli import main

    assert main(["recipe", "list", "--json"]) == 0
    bundled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {entry["name"] for entry in bundled} == {"distill-and-gate", "general-then-domain"}
    assert all(entry["runnable"] and entry["source"] == "bundled" and "Needs" in entry["description"]
               for entry in bundled)
    assert main(["recipe", "list", "--all", "--json"]) == 0
    everything = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kiln = {entry["name"]: entry for entry in everything if entry["source"] == "kiln"}
    assert len(kiln) == 10 and not any(entry["runnable"] for entry in kiln.values())
    assert "distill_refresh" in kiln["recover-instruction-following"]["reason"]
    assert "prompt_bank" in kiln["frontier-pump"]["reason"]
    assert "off_policy" in kiln["merge-my-loras"]["reason"]
    assert "sft" in kiln["coding-assistant-from-repo"]["reason"]
    assert main(["recipe", "list", "--all"]) == 0
    text = capsys.readouterr().out
    assert "distill-and-gate  [bundled, runnable]" in text and "merge-my-loras  [kiln, not runnable]" in text


@pytest.mark.fast
def test_recipe_run_refuses_a_bad_recipe_with_exit_2_before_prefect_loads(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump({"name": "bad", "steps": [opd("a"), gate("b")]}))
    done = subprocess.run([sys.executable, "-c", "import sys; from flows.cli import main; code = main(sys.argv[1:]); "
                           "assert 'prefect' not in sys.modules and 'torch' not in sys.modules; sys.exit(code)",
                           "recipe", "run", str(recipe), "--student", str(tmp_path), "--out", str(tmp_path), "--json"],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    error = json.loads(done.stdout.strip().splitlines()[-1])
    assert (error["status"], error["code"], error["field"]) == ("rejected", "recipe_post_eval_adapter_mismatch",
                                                                "steps[1].adapter")


@pytest.mark.fast
def test_the_recipe_deployment_is_schedulable_with_a_recipe_that_plans():
    from kiln_core.recipes.recipe_plan import plan_recipe

    deployments = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())["deployments"]
    entry = next(item for item in deployments if item["name"] == "recipe")
    assert entry["entrypoint"] == "flows.recipe.run_recipe" and entry["schedules"][0]["cron"]
    recipe = entry["parameters"]["recipe"]
    assert [step.name for step in plan_recipe(recipe).steps] == ["general", "domain"]
    bundled = yaml.safe_load((REPO / "kiln_core" / "recipes" / "bundled" / "general-then-domain.yaml").read_text())
    assert recipe["steps"] == bundled["steps"]  # the deployment's default is the bundled recipe


@pytest.mark.fast
def test_a_bundled_recipe_runs_by_name_and_is_checked_against_the_storage_root(tmp_path):
    done = subprocess.run([sys.executable, "-m", "flows.cli", "recipe", "run", "distill-and-gate", "--student",
                           str(tmp_path), "--out", str(tmp_path / "root"), "--json"], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    error = json.loads(done.stdout.strip().splitlines()[-1])
    assert (error["code"], error["field"]) == ("post_eval_suite_not_installed", "steps[1].suite")
    assert error["file"].endswith("kiln_core/recipes/bundled/distill-and-gate.yaml")
    assert "'held-out'" in error["message"]


# ------------------------------------------------------------------------------------------ on the tiny models

@pytest.fixture(scope="module")
def data(tiny_student, tmp_path_factory):
    """corpus.jsonl (4 examples), heldout.jsonl, manifest.jsonl, and a suite no tiny model can pass."""
    from gate_support import training_and_held_out

    directory = training_and_held_out(tiny_student, tmp_path_factory.mktemp("recipe"))
    suite = {"name": "far", "default_scorer": {"kind": "exact_match"}, "generation": {"max_tokens": 2},
             "examples": [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Name {i} colors."}],
                           "target": "unreachable"} for i in range(24)]}
    (directory / "far.json").write_text(json.dumps(suite))
    return directory


def write_recipe(directory: Path, name: str, steps: list[dict]) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "description": "test", "steps": steps}, sort_keys=False))
    return path


def run_flow(recipe: Path, student, root: Path):
    from flows.recipe import run_recipe

    return run_recipe(yaml.safe_load(recipe.read_text()), str(student), str(root), recipe_file=str(recipe),
                      return_state=True)


def flow_runs_named(*names: str, timeout: float = 60.0) -> dict:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=list(names))))
        found = {run.name: run for run in runs}
        if set(found) == set(names) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_an_on_policy_opd_step_becomes_a_prompts_spec_with_its_teacher_and_record(data, tiny_student, tiny_teacher,
                                                                                   tmp_path):
    from kiln_core.contracts.opd_prompt import prompts_content_sha256
    from kiln_core.recipes.recipe_plan import plan_recipe, prepare_step
    from kiln_core.teachers.local_registry import register_local_teacher

    prompts = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": ""}]}
               for i in range(3)]
    step = {"kind": "opd", "name": "live", "teacher": "tiny", "prompts_from": {"prompts": prompts},
            "config": {"top_k": 16, "max_tokens": 4}}
    plan = plan_recipe({"name": "on-policy", "steps": [opd("warm"), step]}, file=str(data / "r.yaml"))
    live = plan.steps[1]
    assert live.body["config"]["training_mode"] == "on_policy" and live.base_adapter == "warm"
    with pytest.raises(Rejection) as caught:  # not registered (and no such file beside the recipe)
        prepare_step(live, recipe="on-policy", student_dir=str(tiny_student), storage_root=str(tmp_path),
                     recipe_file=str(data / "r.yaml"))
    assert caught.value.code == "teacher_not_registered" and caught.value.field == "teacher"
    entry = register_local_teacher(tmp_path, "tiny", tiny_teacher, device_kind="cpu")
    spec = prepare_step(live, recipe="on-policy", student_dir=str(tiny_student), storage_root=str(tmp_path),
                        recipe_file=str(data / "r.yaml"))
    assert spec.adapter == "live" and spec.config.training_mode == "on_policy" and spec.config.base_adapter == "warm"
    assert spec.teacher.kind == "local_registry" and spec.teacher.alias == "tiny"
    from kiln_core.contracts.opd_prompt import OpdPrompt

    digest = prompts_content_sha256([OpdPrompt.model_validate(prompt) for prompt in prompts])
    assert Path(spec.prompts) == tmp_path / "prompts" / f"{digest}.jsonl" and Path(spec.prompts).is_file()
    record = spec.recipe
    assert (record.kind, record.name, record.recipe, record.step) == ("opd", "live", "on-policy", 1)
    assert record.teacher.alias == "tiny" and record.teacher_identity_revision == entry.identity_revision
    assert record.request["config"]["base_adapter"] == "warm" and len(record.request["prompts_from"]["prompts"]) == 3
    # a manifest file cannot teach on-policy (Kiln's remote_teacher_on_policy)
    manifest_step = plan_recipe({"name": "r", "steps": [{**step, "teacher": "manifest.jsonl"}]},
                                file=str(data / "r.yaml")).steps[0]
    with pytest.raises(Rejection) as caught:
        prepare_step(manifest_step, recipe="r", student_dir=str(tiny_student), storage_root=str(tmp_path),
                     recipe_file=str(data / "r.yaml"))
    assert caught.value.code == "remote_teacher_on_policy"


def test_the_flow_fails_with_one_line_for_a_refused_recipe_or_a_step_refused_while_prepared(
        data, tiny_student, prefect_harness, tmp_path):
    from flows.recipe import run_recipe
    from kiln_core.recipes.recipe_run import RecipeStepFailed

    state = run_recipe({"name": "bad", "steps": [opd("a"), gate("b")]}, str(tiny_student), str(tmp_path),
                       return_state=True)
    assert state.is_failed()
    assert state.message == ("rejected (recipe_post_eval_adapter_mismatch) steps[1].adapter: recipe bad step 1: "
                             "PostEval adapter 'b' does not match the preceding step's output adapter 'a'")
    recipe = write_recipe(data, "unregistered", [opd("u", teacher="nobody"), opd("v")])
    state = run_flow(recipe, tiny_student, tmp_path)
    assert state.is_failed() and state.message.startswith(
        "recipe unregistered stopped at steps[0] opd 'u': rejected (teacher_not_registered) teacher: ")
    assert state.message.endswith("; not run: v")
    with pytest.raises(RecipeStepFailed) as caught:
        state.result()
    assert caught.value.exit_code == 3 and caught.value.field == "steps[0]"
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_two_step_opd_recipe_runs_end_to_end_through_the_cli(data, tiny_student, prefect_harness, tmp_path):
    import prefect.settings

    recipe = write_recipe(data, "two-steps", [opd("first"), opd("second", corpus="heldout.jsonl")])
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": prefect.settings.PREFECT_API_URL.value()}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "recipe", "run", str(recipe), "--student",
                           str(tiny_student), "--out", str(root), "--json"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(step["index"], step["name"], step["skipped"]) for step in summary["steps"]] == [
        (0, "first", False), (1, "second", False)]
    second = summary["steps"][1]["summary"]
    assert second["status"] == "success" and second["latest"] == str(root / "runs" / "second" / "latest.json")
    receipt = json.loads(Path(second["receipt"]).read_text())
    assert receipt["recipe"]["kind"] == "opd" and receipt["recipe"]["recipe"] == "two-steps"
    assert receipt["recipe"]["step"] == 1 and receipt["recipe"]["request"]["config"]["base_adapter"] == "first"
    manifest = json.loads((data / "manifest.jsonl").read_text().splitlines()[0])
    teacher = receipt["recipe"]["teacher"]
    assert teacher["alias"] == "manifest.jsonl" and teacher["identity"] == manifest["teacher_identity"]
    assert teacher["model_version_hash"] == receipt["recipe"]["teacher_identity_revision"]
    assert receipt["recipe"]["teacher_identity_revision"].startswith("sha256:")
    legacy = json.loads((Path(second["adapter"]) / "receipt.json").read_text())
    assert legacy["source_kind"] == "opd" and legacy["adapter"] == "second"
    # the second step warm-started from the first step's published adapter
    first_latest = json.loads((root / "runs" / "first" / "latest.json").read_text())
    assert receipt["adapters"]["base"]["adapter_model_sha256"] == first_latest["adapter_model_sha256"]
    record = json.loads(Path(summary["record"]).read_text())
    assert [step["name"] for step in record["steps"]] == ["first", "second"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_failing_gate_stops_the_recipe_before_its_next_step(data, tiny_student, prefect_harness, tmp_path):
    """Through the CLI (exit 4, one JSON object), and as the UI shows it: the flow run's state names the step."""
    import prefect.settings
    from prefect.artifacts import Artifact

    from kiln_core.post_eval import SuiteRegistry

    root = tmp_path / "root"
    SuiteRegistry.for_storage_root(str(root)).register(str(data / "far.json"))
    recipe = write_recipe(data, "gated", [opd("gated-a"), gate("gated-a"), opd("gated-b")])
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": prefect.settings.PREFECT_API_URL.value()}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "recipe", "run", str(recipe), "--student",
                           str(tiny_student), "--out", str(root), "--json"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    error = json.loads(done.stdout.strip().splitlines()[-1])
    assert (error["status"], error["code"], error["field"]) == ("held_back", "recipe_gate_held_back", "steps[1]")
    expected = ("recipe gated stopped at steps[0] opd 'gated-a': its post_eval gate (steps[1]) held the adapter back "
                "(inconclusive)")
    assert error["message"].startswith(expected) and error["message"].endswith("; not run: gated-b")
    assert not (root / "runs" / "gated-b").exists()  # the next step never ran
    assert not (root / "runs" / "gated-a" / "latest.json").exists()
    parent = flow_runs_named("recipe-gated")["recipe-gated"]
    assert parent.state.is_failed() and parent.state.message.startswith(expected)
    step = flow_runs_named("0-opd-gated-a")["0-opd-gated-a"]
    assert step.state.is_completed() and step.parent_task_run_id is not None  # a subflow of the recipe's run
    artifact = Artifact.get("recipe-gated-gated-a")
    assert "inconclusive" in artifact.data and "latest.json not moved" in artifact.data


def test_a_flow_run_whose_later_step_input_is_missing_fails_before_its_first_step(data, tiny_student, prefect_harness,
                                                                                  tmp_path):
    recipe = write_recipe(data, "missing-later", [opd("early-a"), opd("early-b", corpus="absent.jsonl")])
    state = run_flow(recipe, tiny_student, tmp_path / "root")
    assert state.is_failed()
    assert state.message.startswith(f"rejected (file_not_found) {recipe} steps[1].prompts_from.dataset: "), state.message
    assert not (tmp_path / "root" / "runs").exists()  # steps[0] never ran


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_retried_recipe_resumes_at_its_first_unfinished_step(data, tiny_student, prefect_harness, tmp_path):
    from kiln_core.recipes.recipe_run import RecipeStepFailed
    from test_pipeline_flow import task_runs

    work = tmp_path / "work"
    work.mkdir()
    for name in ("corpus.jsonl", "manifest.jsonl"):
        (work / name).write_bytes((data / name).read_bytes())
    root = tmp_path / "root"
    recipe = write_recipe(work, "resumed", [opd("resumed-a"), opd("resumed-b", corpus="later.jsonl")])
    # A missing input file is refused before the first step (check_step_inputs); one that is there but not a
    # corpus fails its own step, after the steps before it finished.
    (work / "later.jsonl").write_text("not a corpus\n")
    first = run_flow(recipe, tiny_student, root)
    assert first.is_failed() and first.message.startswith("recipe resumed stopped at steps[1] opd 'resumed-b': "
                                                          "rejected (invalid_json)"), first.message
    with pytest.raises(RecipeStepFailed):
        first.result()
    latest_a = (root / "runs" / "resumed-a" / "latest.json").read_bytes()

    (work / "later.jsonl").write_bytes((data / "heldout.jsonl").read_bytes())  # the input fixed
    second = run_flow(recipe, tiny_student, root)
    assert second.is_completed(), second.message
    summary = second.result()
    assert [(step["name"], step["skipped"]) for step in summary["steps"]] == [("resumed-a", True), ("resumed-b", False)]
    assert (root / "runs" / "resumed-a" / "latest.json").read_bytes() == latest_a
    # step 0 ran as a subflow once, in the first attempt only; step 1 twice (refused, then trained)
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    flow_runs_named("0-opd-resumed-a", "1-opd-resumed-b")  # wait until the server has them
    with get_client(sync_client=True) as client:
        named = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=["0-opd-resumed-a", "1-opd-resumed-b"])))
    assert sorted(run.name for run in named) == ["0-opd-resumed-a", "1-opd-resumed-b", "1-opd-resumed-b"]
    # the subflow shows its stages: the step's teacher work, then the pipeline's
    trained = [run for run in named if run.name == "1-opd-resumed-b" and run.state.is_completed()][0]
    stages = task_runs(trained.id, ("prepare", "manifest", "admit", "train", "publish"))
    assert stages["train"].state.is_completed() and trained.parent_task_run_id is not None
