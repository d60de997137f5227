"""Recipe files whose steps are Kiln's distillation recipes, end to end on the tiny models (the ``run_recipe`` flow).

* two ``opd`` steps train two sources on disjoint corpora, and a ``distill_merge`` step merges them: the merge
  reads the replay logs the first two steps wrote, pins their LoRA digests, and records them in its receipt;
* a ``distill_pump`` step (a registered teacher, its ``prompt_bank`` option taken relative to the recipe file) and
  a ``distill_self`` step chained onto it (its warm start the pump's adapter).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_recipe import OFF_POLICY, data, opd, run_flow, write_recipe  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

ALIAS = "tiny-teacher"
TRAIN = {"training_mode": "off_policy", "top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3,
         "learning_rate": 0.02, "checkpoint_interval": 10, "optimizer": {"kind": "adam_w"}}


def step_summaries(state) -> dict[str, dict]:
    assert state.is_completed(), state.message
    return {step["name"]: step["summary"] for step in state.result()["steps"]}


def test_a_recipe_trains_two_sources_then_merges_them_from_their_replay_logs(data, tiny_student, prefect_harness,  # noqa: F811
                                                                             tmp_path):
    from kiln_core.identity.hashing import adapter_config_sha256, adapter_weights_sha256

    merge = {"kind": "distill_merge", "name": "merged", "sources": [{"adapter": "src-a", "weight": 4.0},
                                                                    {"adapter": "src-b", "weight": 3.0}],
             "rollout_budget": 7, "config": TRAIN}
    recipe = write_recipe(data, "two-then-merge", [opd("src-a"), opd("src-b", corpus="heldout.jsonl"), merge])
    root = tmp_path / "root"
    steps = step_summaries(run_flow(recipe, tiny_student, root))
    assert all(summary["status"] == "success" for summary in steps.values())
    receipt = json.loads(Path(steps["merged"]["receipt"]).read_text())
    record = receipt["recipe"]
    assert (record["kind"], record["recipe"], record["step"]) == ("distill_merge", "two-then-merge", 2)
    assert record["teacher"]["alias"] == "merge-multi:merged"
    assert [(source["adapter"], source["prompts"]) for source in record["sources"]] == [("src-a", 4), ("src-b", 3)]
    for source in record["sources"]:
        adapter = Path(json.loads((root / "runs" / source["adapter"] / "latest.json").read_text())["adapter"])
        assert source["weights_sha256"] == adapter_weights_sha256(adapter)
        assert source["config_sha256"] == adapter_config_sha256(adapter)
    assert receipt["data"]["examples_trained"] == 7 and receipt["config"]["base_adapter"] is None  # merge never chains
    # the merged adapter has its own replay log: the seven prompts it learned, so it can be merged in turn
    replay = (Path(steps["merged"]["adapter"]) / "replay.jsonl").read_text().splitlines()
    assert len(replay) == 7


def test_a_pump_step_then_a_self_step_chained_onto_it(tiny_student, tiny_teacher, prefect_harness, tmp_path):
    from flows.cli import main

    root = tmp_path / "root"
    assert main(["teachers", "register", ALIAS, str(tiny_teacher), "--out", str(root), "--device", "cpu",
                 "--json"]) == 0
    bank = tmp_path / "bank.jsonl"
    bank.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {n}."}]}) + "\n"
                            for n in range(3)))
    answered = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a in [("What is two plus two?", "Two plus two is four, as you can check on your fingers."),
                             ("Name a colour.", "Blue is a colour, and so are red and green.")]]
    pump = {"kind": "distill_pump", "name": "pumped", "teacher": ALIAS, "mode": {"domain": "counting"},
            "prompt_bank": "bank.jsonl", "config": {**TRAIN, "training_mode": "on_policy", "samples_per_prompt": 1,
                                                    "max_tokens": 4}}
    self_step = {"kind": "distill_self", "name": "terse", "mode": "conciseness", "prompts": answered, "config": TRAIN}
    recipe = write_recipe(tmp_path, "pump-then-self", [pump, self_step])
    steps = step_summaries(run_flow(recipe, tiny_student, root))
    pumped = json.loads(Path(steps["pumped"]["receipt"]).read_text())
    assert (pumped["recipe"]["kind"], pumped["recipe"]["mode"]) == ("distill_pump", "domain")
    assert pumped["recipe"]["teacher"]["alias"] == ALIAS and pumped["data"]["examples_trained"] >= 1
    terse = json.loads(Path(steps["terse"]["receipt"]).read_text())
    assert (terse["recipe"]["kind"], terse["recipe"]["mode"], terse["recipe"]["step"]) == ("distill_self", "conciseness", 1)
    assert terse["recipe"]["teacher"]["alias"] == "self-terse:Conciseness"
    assert terse["config"]["base_adapter"] == "pumped"  # chained as Kiln chains a distill_self step
    latest = json.loads((root / "runs" / "pumped" / "latest.json").read_text())
    assert terse["adapters"]["base"]["adapter_model_sha256"] == latest["adapter_model_sha256"]
