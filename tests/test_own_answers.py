"""The student's own greedy answers measured against the teacher (``eval --generate``'s ``own_answers``).

The reference is written here: a token-by-token greedy loop over the model's full logits, then every metric's
definition in float64 numpy over the teacher's and the student's full logits. Tolerance 1e-5 absolute on the
reverse KL and the teacher NLL (fp32 models, fp32 vs float64 reductions), exact on agreement and lengths.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from test_evaluation import PROMPTS, adapter_dir, heldout, last_json, run_eval  # noqa: F401

TOL = 1e-5
K = 16
MAX_NEW = 6


def greedy(model, prompt_ids: list[int], eos: int | None, max_new: int) -> list[int]:
    import torch

    ids, answer = list(prompt_ids), []
    for _ in range(max_new):
        with torch.no_grad():
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        answer.append(token)
        ids.append(token)
        if token == eos:
            break
    return answer


def log_softmax(row: np.ndarray) -> np.ndarray:
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def naive_own_metrics(student, teacher, tokenizer, prompts) -> dict:
    import torch

    kl, agree, nll, lengths = [], [], [], []
    for messages in prompts:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = greedy(student, prompt_ids, tokenizer.eos_token_id, MAX_NEW)
        lengths.append(len(answer))
        ids = torch.tensor([prompt_ids + answer])
        with torch.no_grad():
            s_logits, t_logits = student(input_ids=ids).logits[0].double().numpy(), teacher(input_ids=ids).logits[0].double().numpy()
        for q in range(len(prompt_ids), len(prompt_ids) + len(answer)):
            s_row, t_full = s_logits[q - 1], log_softmax(t_logits[q - 1])
            candidates = np.argsort(-t_full, kind="stable")[:K]
            nll.append(-t_full[ids[0, q].item()])
            agree.append(int(np.argmax(s_row) == candidates[0]))
            p = np.exp(log_softmax(s_row[candidates]))
            r = np.exp(log_softmax(t_full[candidates]))
            kl.append(float((p * (np.log(p) - np.log(r))).sum()))
    return {"reverse_kl": np.mean(kl), "top1_agreement": np.mean(agree), "teacher_nll": np.mean(nll),
            "answer_tokens": np.mean(lengths), "tokens": len(kl)}


@pytest.mark.usefixtures("one_torch_thread")
def test_own_answer_metrics_match_a_naive_greedy_and_full_logits_reference(tiny_student, tiny_teacher, adapter_dir):  # noqa: F811
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln_core.evaluation import load_eval_model
    from kiln_core.evaluation.own_answers import own_answer_metrics

    prompts = [[{"role": "user", "content": question}] for question, _ in PROMPTS]
    student = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32),
                                        str(adapter_dir)).eval()
    teacher = AutoModelForCausalLM.from_pretrained(tiny_teacher, dtype=torch.float32).eval()
    reference = naive_own_metrics(student, teacher, AutoTokenizer.from_pretrained(tiny_student), prompts)

    got = own_answer_metrics(load_eval_model(tiny_student, adapter_dir, device="cpu"),
                             load_eval_model(tiny_teacher, device="cpu"), prompts, max_new_tokens=MAX_NEW, top_k=K)
    assert got["tokens"] == reference["tokens"] > 0 and got["examples"] == len(prompts)
    assert got["answer_tokens"] == pytest.approx(reference["answer_tokens"], abs=1e-12)
    assert abs(got["reverse_kl"] - reference["reverse_kl"]) < TOL
    assert abs(got["teacher_nll"] - reference["teacher_nll"]) < TOL
    assert got["top1_agreement"] == pytest.approx(reference["top1_agreement"], abs=1e-12)


@pytest.mark.fast
def test_the_teachers_own_answers_have_no_divergence_from_itself(tiny_teacher):
    from kiln_core.evaluation import load_eval_model
    from kiln_core.evaluation.own_answers import own_answer_metrics

    teacher = load_eval_model(tiny_teacher, device="cpu")
    prompts = [[{"role": "user", "content": question}] for question, _ in PROMPTS[:2]]
    own = own_answer_metrics(teacher, teacher, prompts, max_new_tokens=MAX_NEW, top_k=K)
    assert abs(own["reverse_kl"]) < 1e-6 and own["top1_agreement"] == 1.0 and own["tokens"] > 0


@pytest.mark.usefixtures("one_torch_thread")
def test_eval_generate_reports_each_students_own_answers(heldout, tiny_student, tiny_teacher, adapter_dir):  # noqa: F811
    result = run_eval("--student", str(tiny_student), "--adapter", str(adapter_dir), "--corpus", str(heldout),
                      "--top-k", "16", "--teacher", str(tiny_teacher), "--generate", "2", "--max-new-tokens", "4",
                      "--json")
    assert result.returncode == 0, result.stderr
    own = last_json(result)["own_answers"]
    assert set(own) == {"base_student", "distilled_student"}
    for metrics in own.values():
        assert set(metrics) == {"reverse_kl", "top1_agreement", "teacher_nll", "answer_tokens", "tokens", "examples"}
        assert metrics["examples"] == 2 and 0 < metrics["answer_tokens"] <= 4
    table = run_eval("--student", str(tiny_student), "--adapter", str(adapter_dir), "--corpus", str(heldout),
                     "--top-k", "16", "--teacher", str(tiny_teacher), "--generate", "2", "--max-new-tokens", "4")
    assert table.returncode == 0 and "own greedy answers" in table.stdout and "tokens/answer" in table.stdout
