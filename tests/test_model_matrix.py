"""Every family kiln-flows claims trains the objective it records, measured against transformers' own logits.

The matrix (``tests/model_matrix.py``) builds a tiny seeded student and teacher per family. Tolerance: 1e-5
absolute, fp32, against ``model(...).logits`` (eager attention). The scoring and untrained-student checks load no
optimizer and run in the fast tier; the training ones (step 1, resume, on-policy, the support table) are slow.
``docs/models.md`` is rendered from the same measurements (``test_docs_models_md_is_the_matrix``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_matrix import (BF16_TOLERANCE, REFUSED, SUPPORTED, TOLERANCE, FamilyCase, describe_head,
                          render_support_table)

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"

# What each family's decoder layers project with (transformers' module names): the LoRA must cover all of them.
EXPECTED_TARGETS = {family: ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
                    for family in SUPPORTED}
EXPECTED_TARGETS["phi3"] = ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")
EXPECTED_TARGETS["qwen3_moe"] = ("k_proj", "o_proj", "q_proj", "v_proj", "mlp.experts.down_proj",
                                 "mlp.experts.gate_up_proj")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, FamilyCase]:
    root = tmp_path_factory.mktemp("matrix")
    cases = {}
    for family in (*SUPPORTED, *REFUSED):
        (root / family).mkdir()
        cases[family] = FamilyCase(family, root / family)
    return cases


# ------------------------------------------------------------------------------------------------ fast


@pytest.mark.parametrize("family", SUPPORTED)
def test_scoring_writes_the_log_softmax_of_the_models_own_logits(matrix, family):
    assert matrix[family].scoring_difference() <= TOLERANCE


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_untrained_student_on_its_own_scores_has_zero_kl_and_full_agreement(matrix, family):
    reverse_kl, top1 = matrix[family].untrained()
    assert abs(reverse_kl) <= TOLERANCE and top1 == 1.0


@pytest.mark.parametrize("family", SUPPORTED)
def test_lora_adapts_every_projection_the_family_has(matrix, family):
    from kiln_core.training.lora_targets import resolve_lora_targets

    targets = resolve_lora_targets(matrix[family].student)
    assert (*targets.modules, *targets.parameters) == EXPECTED_TARGETS[family]


@pytest.mark.parametrize("family", REFUSED)
def test_a_family_whose_logits_cannot_be_reproduced_is_refused_before_training(matrix, family):
    from kiln_core.logit_head import UnsupportedArchitecture
    from kiln_core.training.student import load_student

    with pytest.raises(UnsupportedArchitecture) as refused:
        load_student(matrix[family].student, rank=4, alpha=8.0, seed=1, device="cpu")
    assert refused.value.code == "unsupported_architecture" and repr(family) in refused.value.message


# ------------------------------------------------------------------------------------------------ slow: training


@pytest.mark.slow
@pytest.mark.parametrize("family", SUPPORTED)
def test_the_first_step_trains_the_models_own_objective(matrix, family, one_torch_thread):
    loss, difference = matrix[family].first_step_difference()
    assert loss > 1e-3 and difference <= TOLERANCE, (loss, difference)  # a real divergence, the same one


@pytest.mark.slow
@pytest.mark.parametrize("family", SUPPORTED)
def test_an_interrupted_run_resumes_byte_identically(matrix, family, one_torch_thread):
    case = matrix[family]
    assert case.resumes_byte_identically()
    run = case.root / "reference"
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    targets = EXPECTED_TARGETS[family]
    assert (*sorted(config["target_modules"]), *sorted(config.get("target_parameters") or [])) == targets
    receipt = json.loads((run / "train_receipt.json").read_text())
    recorded = receipt["hyperparameters"]["lora_targets"]
    assert (*recorded["modules"], *recorded.get("parameters", [])) == targets
    # every adapted layer trained (its lora_B left zero), and every projection the family has is among them
    from safetensors.torch import load_file

    lora_b = {name: value for name, value in load_file(str(run / "adapter" / "adapter_model.safetensors")).items()
              if ".lora_B" in name}
    assert lora_b and all(float(value.abs().max()) > 0 for value in lora_b.values())
    owners = {name.split(".lora_B")[0] for name in lora_b}
    modules = [target for target in targets if not target.startswith("mlp.experts.")]
    assert set(modules) <= {owner.rsplit(".", 1)[-1] for owner in owners}
    experts = [owner for owner in owners if ".layers.0.mlp.experts" in owner]
    assert len(experts) == len(targets) - len(modules)  # PEFT wraps each expert tensor once per layer


@pytest.mark.slow
@pytest.mark.parametrize("family", SUPPORTED)
def test_on_policy_rollouts_are_sampled_scored_and_trained(matrix, family, one_torch_thread):
    result = matrix[family].on_policy()
    assert result.status == "success" and result.steps >= 1


@pytest.mark.slow
@pytest.mark.parametrize("family", REFUSED)
def test_eval_refuses_the_family_in_one_line(matrix, family, tmp_path):
    case = matrix[family]
    corpus, _ = case.scored(case.student, "self-scored")  # scoring reads model(...).logits itself: it works
    done = subprocess.run([sys.executable, "-m", "flows.cli", "eval", "--student", str(case.student), "--corpus",
                           str(corpus), "--top-k", "16", "--device", "cpu"], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() + done.stdout.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "[unsupported_architecture]" in lines[0], done
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_docs_models_md_is_the_matrix(matrix, one_torch_thread):
    from kiln_core.training.lora_targets import resolve_lora_targets

    rows = []
    for family in SUPPORTED:
        case = matrix[family]
        reverse_kl, top1 = case.untrained()
        _, step1 = case.first_step_difference()
        checks = {
            "scoring": case.scoring_difference() <= TOLERANCE,
            "untrained": abs(reverse_kl) <= TOLERANCE and top1 == 1.0,
            "step1": step1 <= TOLERANCE,
            "resume": case.resumes_byte_identically(),
            "on_policy": case.on_policy().status == "success",
            "bf16": case.bf16_difference() <= BF16_TOLERANCE,
        }
        config = json.loads((case.student / "config.json").read_text())
        rows.append({
            "family": f"`{family}`", "class": f"`{config['architectures'][0]}`", "logits": describe_head(case.student),
            "lora": ", ".join(f"`{name}`" for name in (lambda t: (*t.modules, *t.parameters))(
                resolve_lora_targets(case.student))),
            **{name: ("✗" if not ok else f"✓ (≤ {TOLERANCE:g})" if name in ("scoring", "step1")
                      else "✓ KL 0, top-1 100 %" if name == "untrained"
                      else f"✓ (≤ {BF16_TOLERANCE:.0%})" if name == "bf16" else "✓")
               for name, ok in checks.items()},
            "verdict": "supported" if all(checks.values()) else "**broken**",
        })
    for family in REFUSED:
        config = json.loads((matrix[family].student / "config.json").read_text())
        rows.append({"family": f"`{family}`", "class": f"`{config['architectures'][0]}`",
                     "logits": "not reproduced", "lora": "—", "scoring": "✓ (its own forward)", "untrained": "—",
                     "step1": "—", "resume": "—", "on_policy": "—", "bf16": "—",
                     "verdict": "refused: `unsupported_architecture`"})
    table = render_support_table(rows)
    if os.environ.get("KILN_FLOWS_WRITE_MODELS_DOC") == "1":
        DOC.write_text(table, encoding="utf-8")
    assert all(row["verdict"] == "supported" for row in rows[: len(SUPPORTED)])
    assert DOC.read_text(encoding="utf-8") == table, (
        "docs/models.md differs from what the matrix measured: regenerate it with "
        "KILN_FLOWS_WRITE_MODELS_DOC=1 python -m pytest -n 0 tests/test_model_matrix.py")


@pytest.mark.slow
def test_a_checkpoint_of_other_lora_targets_is_refused_on_resume(matrix, one_torch_thread):
    """Phi-3 trained with the old fixed list adapted o_proj and down_proj only: such a run cannot resume under
    the targets resolved from the model (its tensors would not fit), and says so by name."""
    from kiln_core.contracts.checkpoint import ResumeError
    from kiln_core.contracts.lora_targets import LoraTargets
    from kiln_core.storage import resolve
    from kiln_core.training.checkpoint import latest_checkpoint

    case = matrix["phi3"]

    class Interrupted(Exception):
        pass

    def interrupt(step):
        if step == 2:
            raise Interrupted()

    with pytest.raises(Interrupted):
        case.train("half-adapted", on_step_committed=interrupt,
                   lora_targets=LoraTargets(modules=("down_proj", "o_proj")))
    extension = json.loads((case.root / "half-adapted" / "matrix-checkpoint-step-00000002.kiln-checkpoint"
                            / "kiln_flows_state.json").read_text())
    assert extension["lora_targets"] == {"modules": ["down_proj", "o_proj"]}
    with pytest.raises(ResumeError) as refused:
        case.train("half-adapted", resume=latest_checkpoint(resolve(str(case.root / "half-adapted")), "matrix"))
    assert refused.value.code == "resume_lora_targets"
    assert "down_proj, o_proj" in refused.value.message and "qkv_proj" in refused.value.message


def test_kiln_targets_write_no_record_into_the_checkpoint_state(tiny_student):
    """A Llama/Qwen student's targets are Kiln's seven: nothing is added, so today's checkpoints keep their bytes."""
    from kiln_core.training.lora_targets import resolve_lora_targets

    assert resolve_lora_targets(tiny_student).is_kiln_default


@pytest.mark.slow
@pytest.mark.parametrize("family", SUPPORTED)
def test_bf16_on_the_cpu_trains_the_fp32_objective_within_its_rounding(matrix, family, one_torch_thread):
    assert matrix[family].bf16_difference() <= BF16_TOLERANCE
