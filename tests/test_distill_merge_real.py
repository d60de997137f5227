"""``distill merge`` on SmolLM2-135M-Instruct: the merged student moves toward each source on that source's prompts.

Two source LoRAs are trained through the real pipeline on disjoint prompt sets with different system styles
(fruit colours, sums), each against its own depth-pruned SmolLM2 teacher, so each source is a distinct shift of
the base. ``kiln-flows distill merge`` then distils both into one student. On each source's held-out prompts,
scored by that source adapter as teacher, the merged student's reverse KL (``kiln-flows eval``) must be lower
than the base student's, for both sources. The measured numbers are printed (``-s`` shows them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_models import smollm2_dir  # noqa: F401 - the session fixture that imports SmolLM2 from its wheel

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

FRUITS = [("banana", "yellow"), ("cherry", "red"), ("lime", "green"), ("plum", "purple"), ("lemon", "yellow"),
          ("strawberry", "red"), ("kiwi", "green"), ("blueberry", "blue"), ("orange", "orange"),
          ("raspberry", "red"), ("grape", "purple"), ("pear", "green")]
SUMS = [(2, 3), (4, 4), (5, 1), (6, 2), (7, 3), (8, 1), (3, 9), (2, 6), (5, 5), (4, 7), (9, 2), (6, 6)]
TRAIN, HELD_OUT = slice(0, 8), slice(8, 12)
SOURCE_CONFIG = {"training_mode": "off_policy", "top_k": 32, "epochs": 2, "learning_rate": 1e-3, "lora_rank": 8,
                 "lora_alpha": 16, "optimizer": {"kind": "adam_w"}, "seed": 5, "checkpoint_interval": None}


def fruit_examples(rows) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "You are a fruit expert. Answer in one sentence."},
                          {"role": "user", "content": f"What color is a {fruit}?"}],
             "teacher_response": f"A ripe {fruit} is {color}."} for fruit, color in rows]


def sum_examples(rows) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "You are a calculator. Reply with one short sentence."},
                          {"role": "user", "content": f"What is {a} plus {b}?"}],
             "teacher_response": f"{a} plus {b} equals {a + b}."} for a, b in rows]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def cli_json(capsys, *argv: str) -> dict:
    from flows.cli import main

    code = main([*argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0, out[-1:]
    return json.loads(out[-1])


def train_source(name: str, examples: list[dict], teacher: Path, student: Path, root: Path, work: Path) -> Path:
    """A source adapter: the pipeline scores the examples with ``teacher`` and trains a LoRA on ``student``."""
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine.pipeline import LocalStages, run_pipeline

    spec = parse_spec({"teacher": {"kind": "local_dir", "path": str(teacher)}, "student": str(student),
                       "examples": str(write_jsonl(work / f"{name}-train.jsonl", examples)),
                       "storage_root": str(root), "adapter": name, "config": SOURCE_CONFIG})
    result = run_pipeline(spec, LocalStages(handle_signals=False), device="cpu")
    assert result.status == "success", result.failure_message
    adapter = Path(result.adapter)
    if not (adapter / "replay.jsonl").exists():  # until every published adapter writes its own
        write_jsonl(adapter / "replay.jsonl", [
            {"prompts": [{"messages": row["messages"] + [{"role": "assistant", "content": row["teacher_response"]}]}]}
            for row in examples])
    return adapter


def test_the_merged_student_is_closer_to_each_source_than_the_base_on_its_held_out_prompts(
        smollm2_dir, tmp_path, capsys):  # noqa: F811
    from kiln_core.scoring import score_examples

    work, root = tmp_path, tmp_path / "root"
    teachers = {}
    for name, layers in (("teacher-a", "every:2"), ("teacher-b", ",".join(str(i) for i in range(0, 30, 3)))):
        cli_json(capsys, "models", "derive-student", str(smollm2_dir), "--keep-layers", layers, "--out", str(work / name))
        teachers[name] = work / name
    sets = {"fruit-colors": (fruit_examples(FRUITS), teachers["teacher-a"]),
            "small-sums": (sum_examples(SUMS), teachers["teacher-b"])}
    adapters = {name: train_source(name, examples[TRAIN], teacher, smollm2_dir, root, work)
                for name, (examples, teacher) in sets.items()}

    request = {"name": "fruit-and-sums", "sources": [{"adapter": name} for name in sets], "rollout_budget": 16 * 2,
               "config": {**SOURCE_CONFIG, "seed": 9}}
    merge_file = write_jsonl(work / "merge.json", [request])
    merged = cli_json(capsys, "distill", "merge", "--request", str(merge_file), "--student", str(smollm2_dir),
                      "--out", str(root), "--device", "cpu", "--quiet")
    assert merged["status"] == "success" and merged["steps"] == 32

    measured = {}
    for name, (examples, _) in sets.items():
        held_out = work / f"{name}-held-out-by-source.jsonl"
        score_examples(str(write_jsonl(work / f"{name}-held-out.jsonl", examples[HELD_OUT])),
                       teacher_dir=str(adapters[name]), student_dir=str(smollm2_dir), top_k=32, out_uri=str(held_out),
                       device="cpu")
        base = cli_json(capsys, "eval", "--student", str(smollm2_dir), "--corpus", str(held_out), "--device", "cpu")
        student = cli_json(capsys, "eval", "--student", str(smollm2_dir), "--adapter", merged["adapter"],
                           "--corpus", str(held_out), "--device", "cpu")
        measured[name] = (base["reverse_kl"], student["reverse_kl"])
    print("reverse KL to each source on its held-out prompts (base student, merged student):", measured)
    for name, (base_kl, merged_kl) in measured.items():
        assert merged_kl < base_kl, (name, measured)
