"""Held-out evaluation: the metrics against a naive full-logits float64 reference, the CLI, refusals.

The reference here is written independently of ``kiln_core``: the model's own ``logits`` (all rows,
the whole vocabulary), then the three definitions in float64 numpy. Tolerance: 1e-5 absolute on
``reverse_kl`` and ``teacher_token_nll`` (fp32 model, fp32 vs float64 reductions), exact on
``top1_agreement`` (the tiny models have no near-ties at the argmax; checked below).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

CLI = [sys.executable, "-m", "flows.cli"]
TOL = 1e-5

PROMPTS = [
    ("What is two plus two?", "Two plus two is four."),
    ("What is the capital of France?", "Paris."),
    ("List files under src/", "src/lib.rs src/main.rs README.md"),
    ("Translate to French: good morning", "bonjour"),
]


def examples(pairs):
    return [{"messages": [{"role": "user", "content": q}], "teacher_response": a} for q, a in pairs]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def score(tmp, name, pairs, teacher, student):
    from kiln_core.scoring import score_examples

    source = write_jsonl(tmp / f"{name}-examples.jsonl", examples(pairs))
    out = tmp / f"{name}.jsonl"
    score_examples(str(source), teacher_dir=str(teacher), student_dir=str(student), top_k=16, out_uri=str(out))
    return out


@pytest.fixture(scope="module")
def heldout(tmp_path_factory, tiny_teacher, tiny_student):
    return score(tmp_path_factory.mktemp("eval"), "heldout", PROMPTS, tiny_teacher, tiny_student)


@pytest.fixture(scope="module")
def tables(heldout, tiny_student):
    from kiln_core.evaluation import admit_eval_corpus

    return admit_eval_corpus(str(heldout), str(tiny_student), top_k=16).tables


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_student):
    """A PEFT adapter with non-zero random weights on the tiny student (so it changes the outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    model.save_pretrained(out)
    return out


def naive_metrics(model, tables):
    """Reference: every row's full logits, then the definitions in float64."""
    import torch

    kl, agree, nll, tokens = [], [], [], 0
    for example in tables:
        ids = torch.as_tensor(example.input_ids, dtype=torch.long)
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].double().numpy()  # [L, V]
        for q, cand, ell in zip(example.action_positions, example.teacher_ids, example.teacher_logprobs):
            row = logits[q - 1]
            full = row - np.log(np.exp(row - row.max()).sum()) - row.max()  # log softmax over V
            nll.append(-full[example.input_ids[q]])
            agree.append(int(np.argmax(row) == cand[0]))
            top = np.sort(row)[-2:]
            assert top[1] - top[0] > 1e-4  # no near-tie: the exact agreement comparison is meaningful
            s, t = row[cand], ell.astype(np.float64)
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()  # student over the K ids
            r = np.exp(t - t.max()) / np.exp(t - t.max()).sum()  # teacher over the K ids
            kl.append(float((p * (np.log(p) - np.log(r))).sum()))
            tokens += 1
    return {"reverse_kl": np.mean(kl), "top1_agreement": np.mean(agree), "teacher_token_nll": np.mean(nll),
            "tokens": tokens}


def assert_close(metrics, reference):
    assert metrics.tokens == reference["tokens"] > 0
    assert abs(metrics.reverse_kl - reference["reverse_kl"]) < TOL
    assert abs(metrics.teacher_token_nll - reference["teacher_token_nll"]) < TOL
    assert metrics.top1_agreement == pytest.approx(reference["top1_agreement"], abs=1e-12)


def test_metrics_match_the_naive_full_logits_reference(tables, tiny_student):
    import torch
    from transformers import AutoModelForCausalLM

    from kiln_core.evaluation import evaluate_tables, load_eval_model

    reference = naive_metrics(AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32).eval(), tables)
    assert_close(evaluate_tables(load_eval_model(tiny_student, device="cpu"), tables), reference)
    # One-row chunks give the same numbers: the chunked argmax and the tiled logsumexp are exact.
    assert_close(evaluate_tables(load_eval_model(tiny_student, device="cpu"), tables, chunk_rows=1), reference)


def test_metrics_with_an_adapter_match_the_merged_model(tables, tiny_student, adapter_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kiln_core.evaluation import evaluate_tables, load_eval_model

    base = AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
    reference = naive_metrics(merged, tables)
    with_adapter = evaluate_tables(load_eval_model(tiny_student, adapter_dir, device="cpu"), tables)
    assert abs(with_adapter.reverse_kl - reference["reverse_kl"]) < 1e-4  # merged weights round differently
    assert abs(with_adapter.teacher_token_nll - reference["teacher_token_nll"]) < 1e-4
    assert with_adapter.top1_agreement == pytest.approx(reference["top1_agreement"])
    without = evaluate_tables(load_eval_model(tiny_student, device="cpu"), tables)
    assert with_adapter.teacher_token_nll != pytest.approx(without.teacher_token_nll, abs=1e-3)


def test_the_teacher_scored_on_its_own_corpus_agrees_with_itself(heldout, tiny_teacher, tiny_student):
    """KL 0 and agreement 1 for the teacher that scored the corpus; its NLL is the corpus's own logprob."""
    from kiln_core.admission.records import parse_corpus
    from kiln_core.evaluation import admit_eval_corpus, evaluate_tables, load_eval_model

    tables = admit_eval_corpus(str(heldout), str(tiny_student), top_k=16).tables
    metrics = evaluate_tables(load_eval_model(tiny_teacher, device="cpu"), tables)
    assert abs(metrics.reverse_kl) < 1e-5 and metrics.top1_agreement == 1.0
    parsed = parse_corpus(heldout.read_bytes())
    corpus_lines = [json.loads(line) for line in heldout.read_text().splitlines()[1:]]
    logprobs = [token["logprob"] for record in corpus_lines for token in record["teacher_tokens"]]
    assert parsed.num_examples == len(PROMPTS)
    assert metrics.teacher_token_nll == pytest.approx(-np.mean(logprobs), abs=1e-5)


def test_the_trainers_student_can_be_evaluated_directly(tables, tiny_student):
    """The trainer's ``Student`` (fresh LoRA: B = 0) is an evaluation model: same numbers as the base."""
    from kiln_core.evaluation import evaluate_examples, evaluate_tables, load_eval_model
    from kiln_core.training.student import load_student

    student = load_student(tiny_student, rank=4, alpha=8.0, seed=3, device="cpu")
    sliced = evaluate_examples(student, (tables.example(i) for i in range(2)))
    base = evaluate_tables(load_eval_model(tiny_student, device="cpu"), tables, limit=2)
    assert sliced.examples == 2 and sliced.tokens == base.tokens
    assert abs(sliced.reverse_kl - base.reverse_kl) < 1e-6 and abs(sliced.teacher_token_nll - base.teacher_token_nll) < 1e-6


# ---------------------------------------------------------------------------------------------
# The CLI


def run_eval(*args):
    return subprocess.run([*CLI, "eval", *args], capture_output=True, text=True, timeout=600)


def last_json(result):
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_eval_cli_json_and_table(heldout, tables, tiny_student, tiny_teacher, adapter_dir):
    import torch
    from transformers import AutoModelForCausalLM

    result = run_eval("--student", str(tiny_student), "--corpus", str(heldout), "--top-k", "16", "--json")
    assert result.returncode == 0, result.stderr
    payload = last_json(result)
    assert payload["status"] == "evaluated" and payload["examples"] == len(PROMPTS)
    reference = naive_metrics(AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32).eval(), tables)
    assert payload["tokens"] == reference["tokens"]
    assert abs(payload["reverse_kl"] - reference["reverse_kl"]) < TOL
    table = run_eval("--student", str(tiny_student), "--adapter", str(adapter_dir), "--corpus", str(heldout),
                     "--top-k", "16", "--teacher", str(tiny_teacher), "--generate", "2", "--max-new-tokens", "3")
    assert table.returncode == 0, table.stderr
    for word in ("reverse_kl", "top1_agreement", "teacher_token_nll", "teacher", "base_student", "distilled_student",
                 PROMPTS[0][0], PROMPTS[1][0]):
        assert word in table.stdout


def test_eval_cli_generate_needs_a_teacher(heldout, tiny_student):
    result = run_eval("--student", str(tiny_student), "--corpus", str(heldout), "--generate", "2", "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "invalid_option"


def test_corpus_scored_by_another_teacher_is_refused(tmp_path, heldout, tiny_student):
    from kiln_core.contracts.identity import build_manifest_line, parse_manifest_line

    identity = parse_manifest_line(heldout.read_text().splitlines()[0]).teacher_identity
    other = tmp_path / "other-teacher.manifest"
    other.write_text(build_manifest_line(identity.model_copy(update={"served_model_id": "another-teacher"})) + "\n")
    result = run_eval("--student", str(tiny_student), "--corpus", str(heldout), "--top-k", "16",
                      "--teacher-manifest", str(other), "--json")
    assert result.returncode == 2
    assert last_json(result)["code"] == "identity_mismatch" and "served_model_id" in last_json(result)["message"]
    same = tmp_path / "same.manifest"
    same.write_text(heldout.read_text().splitlines()[0] + "\n")
    ok = run_eval("--student", str(tiny_student), "--corpus", str(heldout), "--top-k", "16", "--teacher-manifest", str(same), "--json")
    assert ok.returncode == 0, ok.stdout


def test_corpus_overlapping_the_training_corpus_is_refused(tmp_path, heldout, tiny_teacher, tiny_student):
    """Overlap = the same prompt messages; the answer does not matter."""
    train = score(tmp_path, "train", [("What is five plus one?", "Six."), (PROMPTS[2][0], "something else")],
                  tiny_teacher, tiny_student)
    result = run_eval("--student", str(tiny_student), "--corpus", str(heldout), "--top-k", "16",
                      "--train-corpus", str(train), "--json")
    assert result.returncode == 2
    payload = last_json(result)
    assert payload["code"] == "eval_train_overlap" and payload["line"] == 4  # manifest on line 1, third example
    assert "line 3 of the training corpus" in payload["message"]
    disjoint = score(tmp_path, "train2", [("What is five plus one?", "Six.")], tiny_teacher, tiny_student)
    ok = run_eval("--student", str(tiny_student), "--corpus", str(heldout), "--top-k", "16", "--train-corpus", str(disjoint), "--json")
    assert ok.returncode == 0, ok.stdout


def test_student_with_another_vocabulary_is_refused(tmp_path, heldout, tiny_student, tiny_teacher):
    from kiln_core.tiny_models import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1, tokenizer_vocab_size=320)  # same width, other tokens
    result = run_eval("--student", str(other), "--corpus", str(heldout), "--top-k", "16", "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "vocabulary_mismatch"
    result = run_eval("--student", str(tiny_student), "--corpus", str(heldout), "--top-k", "16", "--teacher", str(other),
                      "--generate", "1", "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "vocabulary_mismatch"


def test_adapter_of_another_model_is_refused(tmp_path, heldout, tiny_student, tiny_teacher):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    wide = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_teacher, dtype=torch.float32),
                          LoraConfig(r=4, target_modules=["q_proj"]))
    wide.save_pretrained(tmp_path / "wide-adapter")
    result = run_eval("--student", str(tiny_student), "--adapter", str(tmp_path / "wide-adapter"), "--corpus", str(heldout),
                      "--top-k", "16", "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "adapter_mismatch"
    result = run_eval("--student", str(tiny_student), "--adapter", str(tmp_path), "--corpus", str(heldout), "--top-k", "16", "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "adapter_mismatch"
