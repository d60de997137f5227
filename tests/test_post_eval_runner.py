"""End to end on the tiny deterministic student: generate, score, reduce and decide, with real PEFT adapters.

The suites are built from what the models themselves answer, so each outcome is known in advance:
targets = the base student's greedy answers makes an adapter that changes answers a regression;
targets = the adapter's answers makes it a significant improvement; unreachable targets demote.
"""

from __future__ import annotations

import json

import pytest
import torch

from kiln_core.post_eval import PostEvalRejection, load_suite, parse_post_eval_config, run_post_eval
from kiln_core.post_eval.runner import generate, load_arm, render_prompt, run_suite
from kiln_core.post_eval.stats import derive_eval_completion_seed, sign_test_p_value
from kiln_core.contracts.post_eval.suite import EvalChatMessage, EvalGenerationParams

PROMPTS = [f"What is {i} plus {i + 3}?" for i in range(20)]
MAX_TOKENS = 3


def make_adapter(student_dir, out_dir, *, seed: int, scale: float) -> str:
    """A PEFT LoRA adapter with seeded random A and B (scale 0 = an adapter that changes nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(student_dir), local_files_only=True)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(peft.named_parameters()):
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    peft.save_pretrained(str(out_dir))
    return str(out_dir)


def greedy_answers(student_dir, adapter_dir=None) -> list[str]:
    arm = load_arm(str(student_dir), adapter_dir)
    params = EvalGenerationParams(max_tokens=MAX_TOKENS)
    return [generate(arm, render_prompt(arm, [EvalChatMessage(role="user", content=p)], None, None, params), params, 0)[0]
            for p in PROMPTS]


@pytest.fixture(scope="module")
def models(tiny_student, tmp_path_factory):
    root = tmp_path_factory.mktemp("post-eval-adapters")
    changed = make_adapter(tiny_student, root / "changed", seed=3, scale=0.6)
    noop = make_adapter(tiny_student, root / "noop", seed=4, scale=0.0)
    base_answers, changed_answers = greedy_answers(tiny_student), greedy_answers(tiny_student, changed)
    differing = sum(a != b for a, b in zip(base_answers, changed_answers))
    assert differing >= 10, "the changed adapter must change most answers for these tests to mean anything"
    return {"student": str(tiny_student), "changed": changed, "noop": noop, "base_answers": base_answers,
            "changed_answers": changed_answers, "differing": differing}


def suite_with_targets(targets, **overrides):
    doc = {"name": "arith", "default_scorer": {"kind": "exact_match", "strip_whitespace": False},
           "generation": {"max_tokens": MAX_TOKENS},
           "examples": [{"id": f"q{i}", "messages": [{"role": "user", "content": p}], "target": t}
                        for i, (p, t) in enumerate(zip(PROMPTS, targets))]}
    doc.update(overrides)
    return load_suite(json.dumps(doc))


def gated(min_accuracy=0.8, **extra):
    return parse_post_eval_config({"suite": "arith", "min_accuracy": min_accuracy, **extra})


def test_adapter_that_breaks_answers_is_a_regression(models):
    suite = suite_with_targets(models["base_answers"])
    result = run_post_eval(gated(0.0), suite, student_dir=models["student"], candidate_adapter=models["changed"],
                           candidate_name="changed", seed=7)
    evidence = result.evidence
    assert result.outcome == "regression", result.verdict
    assert (evidence.improved, evidence.regressed, evidence.paired_examples) == (0, models["differing"], 20)
    assert evidence.baseline_accuracy == 1.0 and evidence.baseline_adapter is None
    assert evidence.exact_sign_test_p_value == pytest.approx(sign_test_p_value(0, models["differing"]))
    assert result.verdict.startswith("REGRESSION: `changed` vs `base`: candidate is significantly worse")
    assert result.baseline.metrics["accuracy"] == 1.0
    assert result.candidate.metrics["num_pass"] == 20 - models["differing"]


def test_adapter_that_gives_the_target_answers_is_promoted_or_kept(models):
    suite = suite_with_targets(models["changed_answers"])
    promoted = run_post_eval(gated(0.8), suite, student_dir=models["student"], candidate_adapter=models["changed"],
                             candidate_name="changed", seed=7)
    assert promoted.outcome == "promoted", promoted.verdict
    assert (promoted.evidence.improved, promoted.evidence.regressed) == (models["differing"], 0)
    assert promoted.evidence.candidate_accuracy == 1.0
    assert promoted.evidence.candidate_accuracy_lower_bound >= 0.8
    assert promoted.verdict.endswith("adapter `changed` promoted to active")


def test_adapter_that_changes_nothing_ties_and_is_inconclusive(models):
    suite = suite_with_targets(models["base_answers"])
    result = run_post_eval(gated(0.5), suite, student_dir=models["student"], candidate_adapter=models["noop"],
                           candidate_name="noop", seed=7)
    assert result.outcome == "inconclusive"
    assert (result.evidence.improved, result.evidence.regressed, result.evidence.tied) == (0, 0, 20)
    assert result.decision_reason.startswith("no significant paired improvement")
    assert [o.completion_text for o in result.candidate.outcomes] == [o.completion_text for o in result.baseline.outcomes]


def test_unreachable_targets_demote(models):
    suite = suite_with_targets(["<never said>"] * 20)
    result = run_post_eval(gated(0.5), suite, student_dir=models["student"], candidate_adapter=models["changed"],
                           candidate_name="changed", seed=7)
    assert result.outcome == "demoted"
    assert result.evidence.candidate_accuracy_upper_bound < 0.5
    assert result.verdict.startswith("FAILED: candidate 95% Wilson upper bound")


def test_previous_adapter_is_the_baseline_unless_it_has_the_candidates_name(models):
    suite = suite_with_targets(models["changed_answers"])
    against_changed = run_post_eval(gated(0.5), suite, student_dir=models["student"], candidate_adapter=models["changed"],
                                    candidate_name="changed-v2", baseline_adapter=models["changed"],
                                    baseline_name="changed", seed=7)
    assert against_changed.evidence.baseline_adapter == "changed"
    assert against_changed.evidence.baseline_accuracy == 1.0 and against_changed.outcome == "inconclusive"
    same_name = run_post_eval(gated(0.5), suite, student_dir=models["student"], candidate_adapter=models["changed"],
                              candidate_name="changed", baseline_adapter=models["changed"], baseline_name="changed", seed=7,
                              auto_load_on_pass=False)
    assert same_name.evidence.baseline_adapter is None and same_name.outcome == "kept"
    first = run_post_eval(gated(0.5), suite, student_dir=models["student"], candidate_adapter=models["changed"],
                          candidate_name="changed", seed=7, time_limit_s=0.0)
    assert first.eval_job_id == same_name.eval_job_id  # a repeated evaluation replaces its own evidence entry


def test_time_limit_makes_the_gate_an_error_not_an_exception(models):
    suite = suite_with_targets(models["base_answers"])
    result = run_post_eval(gated(0.5), suite, student_dir=models["student"], candidate_adapter=models["changed"],
                           candidate_name="changed", seed=7, time_limit_s=0.0)
    assert result.outcome == "error" and result.evidence is None
    assert result.verdict == "post-eval did not complete (state: Failed) — adapter `changed` left on disk, NOT promoted"
    assert "time limit" in result.error


def test_ungated_eval_runs_the_candidate_and_optional_base_model(models):
    suite = suite_with_targets(models["base_answers"])
    config = parse_post_eval_config({"suite": "arith", "include_baseline": True})
    result = run_post_eval(config, suite, student_dir=models["student"], candidate_adapter=models["noop"],
                           candidate_name="noop", seed=7)
    assert (result.gated, result.outcome, result.verdict, result.baseline) == (False, None, None, None)
    assert result.candidate.metrics["accuracy"] == 1.0 and result.base_model.metrics["accuracy"] == 1.0
    assert result.base_model.adapter is None


def test_include_baseline_reuses_the_gates_base_model_arm(models):
    suite = suite_with_targets(models["base_answers"])
    result = run_post_eval(gated(0.5, include_baseline=True), suite, student_dir=models["student"],
                           candidate_adapter=models["noop"], candidate_name="noop", seed=7)
    assert result.base_model is result.baseline


def test_seeded_sampling_pairs_both_arms_and_reproduces(models):
    suite = suite_with_targets(models["base_answers"][:6], schema_version=2,
                               generation={"max_tokens": MAX_TOKENS, "temperature": 1.5, "top_k": 50, "top_p": 0.95, "n": 3},
                               aggregation={"kind": "pass_at_k", "k": 3})
    base_arm, noop_arm = load_arm(models["student"]), load_arm(models["student"], models["noop"])
    first = run_suite(suite, base_arm, adapter_label=None, override=None, effective_seed=11)
    again = run_suite(suite, noop_arm, adapter_label="noop", override=None, effective_seed=11)
    other = run_suite(suite, base_arm, adapter_label=None, override=None, effective_seed=12)
    texts = [o.completion_text for o in first.outcomes]
    assert texts == [o.completion_text for o in again.outcomes]  # same seeds, same model → same samples
    assert texts != [o.completion_text for o in other.outcomes]
    assert len(set(texts)) > 6  # sampling really samples: an example's 3 completions are not all equal
    assert [o.generation_seed for o in first.outcomes] == [
        derive_eval_completion_seed(11, f"q{i}", c) for i in range(6) for c in range(3)]
    assert len(first.reduced) == 6 and first.metrics["num_completions"] == 18
    assert first.effective_generation_hash != other.effective_generation_hash
    assert first.suite_hash == other.suite_hash


def test_example_generation_seed_overrides_the_job_seed(models):
    suite = suite_with_targets(models["base_answers"])
    pinned = suite.model_copy(update={"examples": [
        suite.examples[0].model_copy(update={"generation": EvalGenerationParams(max_tokens=2, seed=5)})]})
    run = run_suite(pinned, load_arm(models["student"]), adapter_label=None, override=None, effective_seed=11)
    assert run.outcomes[0].generation_seed == derive_eval_completion_seed(5, "q0", 0)
    assert run.outcomes[0].completion_tokens <= 2


def test_max_tokens_and_stop_strings(models):
    arm = load_arm(models["student"])
    prompt = render_prompt(arm, [EvalChatMessage(role="user", content=PROMPTS[0])], None, None, EvalGenerationParams())
    long_text, produced = generate(arm, prompt, EvalGenerationParams(max_tokens=12), 0)
    assert produced <= 12
    stop = long_text[3:5]
    assert stop and long_text.find(stop) >= 1
    cut, _ = generate(arm, prompt, EvalGenerationParams(max_tokens=12, stop=[stop]), 0)
    assert cut == long_text[:long_text.find(stop)]
    assert generate(arm, prompt, EvalGenerationParams(max_tokens=0), 0) == ("", 0)


def test_broken_examples_become_error_outcomes_not_a_failed_run(models):
    doc = {"name": "broken", "default_scorer": {"kind": "numeric_tolerance"}, "generation": {"max_tokens": 2},
           "examples": [{"id": "too-long", "messages": [{"role": "user", "content": "one two " * 2000}], "target": "1"},
                        {"id": "no-target", "messages": [{"role": "user", "content": "hi"}]},
                        {"id": "judge", "messages": [{"role": "user", "content": "hi"}], "target": "x",
                         "scorer": {"kind": "llm_judge"}}]}
    run = run_suite(load_suite(json.dumps(doc)), load_arm(models["student"]), adapter_label=None, override=None,
                    effective_seed=1)
    by_id = {o.example_id: o for o in run.outcomes}
    assert by_id["too-long"].kind == "error" and by_id["too-long"].detail.startswith("prepare failed: prompt has")
    assert by_id["no-target"].kind == "error" and by_id["no-target"].detail.startswith("scorer error: scorer `numeric")
    assert (by_id["judge"].kind, by_id["judge"].detail) == ("invalid", "judge runner unavailable")
    assert run.metrics["num_error"] == 2 and run.metrics["accuracy"] == 0.0


def test_a_suite_built_in_code_is_validated_before_any_model_work():
    suite = suite_with_targets(["4"] * 20).model_copy(update={"name": "bad/name"})
    with pytest.raises(PostEvalRejection) as caught:
        run_suite(suite, None, adapter_label=None, override=None, effective_seed=1)
    assert caught.value.code == "eval_suite_invalid"


def test_a_generation_override_that_breaks_the_aggregation_is_an_error_outcome(models):
    suite = suite_with_targets(models["base_answers"], schema_version=2, generation={"n": 3},
                               aggregation={"kind": "pass_at_k", "k": 3})
    config = gated(0.5, generation={"n": 1})
    result = run_post_eval(config, suite, student_dir=models["student"], candidate_adapter=models["noop"],
                           candidate_name="noop", seed=1)
    assert result.outcome == "error"
    assert result.error == 'example "q0" generation.n 1 does not match aggregation pass@3 (k=3)'


def test_effective_seed_falls_back_to_the_post_eval_generation_seed(models):
    suite = suite_with_targets(models["base_answers"])
    config = parse_post_eval_config({"suite": "arith", "generation": {"max_tokens": 2, "seed": 99}})
    result = run_post_eval(config, suite, student_dir=models["student"], candidate_adapter=models["noop"],
                           candidate_name="noop")
    assert result.effective_seed == 99
    assert all(o.completion_tokens <= 2 for o in result.candidate.outcomes)  # the override's max_tokens
