"""The model matrix: tiny seeded models of every architecture family kiln-flows claims, measured the way a user runs.

Each family gets a student (seed 3) and a teacher of the same family (seed 4), built by
``kiln_core.tiny_models.build_tiny_model`` with the tiny ChatML tokenizer. Every measurement compares kiln-flows
with transformers' own ``model(...).logits`` (fp32, eager attention), never with kiln-flows' projection:

* **scoring** — the corpus ``score_examples`` writes (the student scoring its own examples) against the
  log-softmax of ``model(...).logits`` at the action rows;
* **untrained** — the untrained student evaluated on its own scores (``kiln-flows eval``'s function): reverse KL 0,
  top-1 agreement 100 %;
* **step 1** — the first step's loss of a run on the teacher's scores against the top-K reverse KL computed from the
  student's ``model(...).logits`` (``naive_losses.reverse_kl_from_logits``);
* **resume** — a run interrupted after step 3 and resumed from its newest checkpoint ends with the same adapter
  bytes as the run that was never interrupted;
* **on-policy** — the student samples rollouts that the teacher scores, and they train.

``docs/models.md`` is rendered from these measurements (``render_support_table``); ``tests/test_model_matrix.py``
checks the file against them, and writes it with ``KILN_FLOWS_WRITE_MODELS_DOC=1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from naive_losses import reverse_kl_from_logits

TOP_K = 16
ADAPTER = "matrix"
TOLERANCE = 1e-5
"""fp32 tolerance of every comparison with ``model(...).logits`` (absolute; the issue's bound)."""
BF16_TOLERANCE = 0.05
"""bf16 (weights and autocast, fp32 loss math) against fp32: the step-1 loss within 5 % (relative). bf16 keeps 8
bits of mantissa, so every activation carries about 0.4 % of rounding, and two layers of it move the top-K logits'
softmax by a few percent at most."""

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "cohere",
             "granite", "phi3", "olmo2")
REFUSED = {"falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {"lm_head_multiplier": 0.5})}
"""Families transformers ships whose logits kiln-flows does not reproduce, with their tiny configuration."""

EXAMPLES = [
    {"messages": [{"role": "user", "content": "What is two plus two?"}], "teacher_response": "Two plus two is four."},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"}], "teacher_response": "Paris."},
    {"messages": [{"role": "user", "content": "List files under src/."}],
     "teacher_response": "src/lib.rs src/main.rs README.md"},
    {"messages": [{"role": "user", "content": "Translate to French: good morning"}], "teacher_response": "bonjour"},
]
PROMPTS = [
    {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "Summarize the text in one sentence."},
                  {"role": "assistant", "content": ""}]},
]


def build_family(root: Path, family: str, seed: int) -> Path:
    """A tiny model of ``family`` (a ``TINY_ARCHITECTURES`` key, or a ``REFUSED`` one) in ``root/family-seed``."""
    from kiln_core.tiny_models import TINY_ARCHITECTURES, build_tiny_model

    out = root / f"{family}-{seed}"
    if (out / "config.json").exists():
        return out
    if family in TINY_ARCHITECTURES:
        return build_tiny_model(out, architecture=family, seed=seed)
    return _build_unsupported(out, family, seed)


def _build_unsupported(out: Path, family: str, seed: int) -> Path:
    import transformers

    from kiln_core.tiny_models import build_tiny_tokenizer

    config_name, model_name, extra = REFUSED[family]
    build_tiny_tokenizer(out)
    config = getattr(transformers, config_name)(vocab_size=400, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                bos_token_id=None, eos_token_id=2, pad_token_id=0, **extra)
    torch.manual_seed(seed)
    getattr(transformers, model_name)(config).save_pretrained(str(out))
    return out


def own_logits(model_dir: Path, input_ids: np.ndarray) -> torch.Tensor:
    """``model(...).logits[0]`` of one sequence, fp32, eager attention: what transformers itself computes."""
    return _reference_model(str(model_dir))(input_ids=torch.as_tensor(input_ids, dtype=torch.long)[None]).logits[0]


_MODELS: dict[str, Any] = {}


def _reference_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    if model_dir not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        _MODELS[model_dir] = model.eval().requires_grad_(False)
    return _MODELS[model_dir]


def measurement(name: str):
    """Compute a ``FamilyCase`` measurement once; later calls (another test, the doc table) read it back."""
    def wrap(method):
        def measured(self):
            if name not in self.results:
                self.results[name] = method(self)
            return self.results[name]
        measured.__doc__ = method.__doc__
        return measured
    return wrap


@dataclass
class FamilyCase:
    """One family's models, corpora and measurements (each computed once, on first use)."""

    family: str
    root: Path
    results: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def student(self) -> Path:
        return build_family(self.root, self.family, seed=3)

    @cached_property
    def teacher(self) -> Path:
        return build_family(self.root, self.family, seed=4)

    @cached_property
    def examples(self) -> Path:
        path = self.root / "examples.jsonl"
        path.write_text("".join(json.dumps(example) + "\n" for example in EXAMPLES), encoding="utf-8")
        return path

    def scored(self, teacher: Path, name: str):
        """The examples scored by ``teacher`` for the student, admitted: ``(corpus path, tables)``."""
        from kiln_core.admission import admit_corpus
        from kiln_core.scoring import score_examples

        out = self.root / f"{name}.jsonl"
        if not out.exists():
            score_examples(str(self.examples), teacher_dir=str(teacher), student_dir=str(self.student), top_k=TOP_K,
                           out_uri=str(out), device="cpu")
        return out, admit_corpus(str(out), str(self.student), top_k=TOP_K).tables

    # -- measurements -----------------------------------------------------------------------------------------

    @measurement("scoring")
    def scoring_difference(self) -> float:
        """Largest |corpus logprob − log_softmax(model(...).logits)| at every action row's K ids (self-scored)."""
        _, tables = self.scored(self.student, "self-scored")
        worst = 0.0
        with torch.no_grad():
            for index in range(tables.num_examples):
                example = tables.example(index)
                logprobs = torch.log_softmax(own_logits(self.student, example.input_ids), dim=-1)
                rows = logprobs[torch.as_tensor(example.action_positions, dtype=torch.long) - 1]
                expected = rows.gather(1, torch.as_tensor(example.teacher_ids, dtype=torch.long))
                worst = max(worst, float((expected - torch.as_tensor(example.teacher_logprobs)).abs().max()))
        return worst

    @measurement("untrained")
    def untrained(self) -> tuple[float, float]:
        """``(reverse KL, top-1 agreement)`` of the untrained student on its own scores (``kiln-flows eval``)."""
        from kiln_core.evaluation import evaluate_tables, load_eval_model

        _, tables = self.scored(self.student, "self-scored")
        metrics = evaluate_tables(load_eval_model(str(self.student), device="cpu"), tables)
        return (metrics.reverse_kl, metrics.top1_agreement)

    def train(self, run: str, **hooks):
        """A 6-step off-policy run on the teacher's scores (checkpoints every 2 steps) into ``root/run``."""
        from kiln_core.contracts.opd_config import OpdConfig
        from kiln_core.contracts.stage_refs import TrainPlan
        from kiln_core.training.trainer import train_opd

        corpus, tables = self.scored(self.teacher, "teacher-scored")
        config = OpdConfig.model_validate(dict(training_mode="off_policy", top_k=TOP_K, lora_rank=4, lora_alpha=8.0,
                                               seed=5, learning_rate=2e-2, checkpoint_interval=2, epochs=2,
                                               optimizer={"kind": "adam_w"}))
        resume, targets = hooks.pop("resume", None), hooks.pop("lora_targets", None)
        plan = TrainPlan.for_config(config, str(self.root / run), ADAPTER, resume=resume, device="cpu",
                                    lora_targets=targets)
        return train_opd(plan, tables, dataset_sha256="sha256:" + "ab" * 32, dataset_path=str(corpus),
                         student_dir=str(self.student), teacher_alias="matrix-teacher", **hooks)

    @cached_property
    def reference_run(self):
        return self.train("reference")

    @measurement("step1")
    def first_step_difference(self) -> tuple[float, float]:
        """``(kiln-flows' step-1 loss, |it − the loss from model(...).logits|)`` (LoRA B is 0 at step 1)."""
        _, tables = self.scored(self.teacher, "teacher-scored")
        example = tables.example(0)
        with torch.no_grad():
            logits = own_logits(self.student, example.input_ids)
            rows = logits[torch.as_tensor(example.action_positions, dtype=torch.long) - 1]
            expected = reverse_kl_from_logits(rows, torch.as_tensor(example.teacher_ids, dtype=torch.long),
                                              torch.as_tensor(example.teacher_logprobs))
        loss = self.reference_run.loss_history[0]
        return (loss, abs(loss - float(expected)))

    @measurement("bf16")
    def bf16_difference(self) -> float:
        """Relative difference of the step-1 loss with the student in bf16 (weights and autocast) against fp32."""
        from kiln_core.contracts.opd_config import OpdConfig
        from kiln_core.training.objectives import step_loss
        from kiln_core.training.step import sequence_loss
        from kiln_core.training.student import load_student

        _, tables = self.scored(self.teacher, "teacher-scored")
        config = OpdConfig.model_validate(dict(training_mode="off_policy", top_k=TOP_K))
        losses = {}
        for precision in ("fp32", "bf16"):
            student = load_student(str(self.student), rank=4, alpha=8.0, seed=5, device="cpu", precision=precision)
            with torch.no_grad():
                loss, _, _ = sequence_loss(student, tables.example(0).to_torch(student.device), step_loss("teacher_top_k"),
                                           config)
            losses[precision] = float(loss)
        return abs(losses["bf16"] - losses["fp32"]) / losses["fp32"]

    @measurement("resume")
    def resumes_byte_identically(self) -> bool:
        """Interrupted after step 3, resumed from the newest checkpoint (step 2): the same adapter bytes."""
        from kiln_core.training.checkpoint import latest_checkpoint
        from kiln_core.storage import resolve

        class Interrupted(Exception):
            pass

        def interrupt_after_step_3(step):
            if step == 3:
                raise Interrupted()

        try:
            self.train("interrupted", on_step_committed=interrupt_after_step_3)
        except Interrupted:
            pass
        newest = latest_checkpoint(resolve(str(self.root / "interrupted")), ADAPTER)
        resumed = self.train("interrupted", resume=newest)
        reference = self.reference_run
        same = (resumed.status == reference.status == "success" and resumed.resumed_from == newest
                and _adapter_bytes(self.root / "interrupted") == _adapter_bytes(self.root / "reference"))
        return same

    @measurement("on_policy")
    def on_policy(self):
        """Two prompts, two rollouts each, sampled by the student and scored by the teacher, trained."""
        from kiln_core.contracts.opd_config import parse_opd_request
        from kiln_core.contracts.stage_refs import TrainPlan
        from kiln_core.identity.local_teacher import local_teacher_identity
        from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherSource
        from kiln_core.training.on_policy_trainer import train_on_policy

        identity = local_teacher_identity(str(self.teacher), max_top_k=32, device_kind="cpu")
        loaded = LiveLocalTeacher.load(str(self.teacher), identity=identity, top_k=TOP_K, teacher_id="matrix-teacher",
                                       device="cpu")
        teacher = TeacherSource.loaded(loaded, "matrix-teacher")
        request = parse_opd_request({"teacher": "matrix-teacher", "prompts": PROMPTS,
                                     "config": {"samples_per_prompt": 2, "max_tokens": 6, "top_k": TOP_K,
                                                "lora_rank": 4, "lora_alpha": 8.0, "seed": 7, "learning_rate": 2e-2,
                                                "checkpoint_interval": None}})
        plan = TrainPlan.for_config(request.config, str(self.root / "on-policy"), ADAPTER, top_k=TOP_K,
                                    samples_per_prompt=2, device="cpu")
        result = train_on_policy(plan, request.prompts, student_dir=str(self.student), teacher=teacher)
        return result


def _adapter_bytes(run_dir: Path) -> bytes:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------------ the doc table


def describe_head(model_dir: Path) -> str:
    """The logit post-processing kiln-flows applies for the model in ``model_dir``, in words (the config key that
    carries it and the tiny model's value)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln_core.logit_head import logit_head_of

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    with torch.device("meta"):
        head = logit_head_of(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir))))
    parts = []
    if config.get("logit_scale") is not None:
        parts.append(f"× `logit_scale` ({config['logit_scale']:g} here)")
    if config.get("logits_scaling") is not None:
        parts.append(f"÷ `logits_scaling` ({config['logits_scaling']:g} here)")
    if head.softcap is not None:
        parts.append(f"soft cap `final_logit_softcapping` ({head.softcap:g} here)")
    return ", ".join(parts) or "none"


def render_support_table(rows: list[dict[str, str]]) -> str:
    """``docs/models.md`` from the matrix's rows (each a dict of the table's columns)."""
    columns = ["family", "class", "logits", "lora", "scoring", "untrained", "step1", "resume", "on_policy", "bf16",
               "verdict"]
    header = ["model type", "transformers class", "logit post-processing", "LoRA targets",
              "scoring = model logits", "untrained student on its own scores", "step-1 loss = model logits",
              "interrupted run resumes", "on-policy", "bf16 step-1 loss vs fp32", "verdict"]
    lines = [
        "# Supported models",
        "",
        "<!-- Generated by tests/test_model_matrix.py from its measurements; do not edit by hand. Regenerate with",
        "     KILN_FLOWS_WRITE_MODELS_DOC=1 python -m pytest -n 0 tests/test_model_matrix.py -->",
        "",
        "Every family below was run end to end on a tiny seeded model (2 layers, hidden size 64, 400-token",
        "vocabulary; `kiln_core.tiny_models.TINY_ARCHITECTURES`), the same model as its own student and, for training,",
        "beside a teacher of the same family. Each column compares kiln-flows with transformers' own",
        f"`model(...).logits` in fp32, within {TOLERANCE:g}:",
        "",
        "- **scoring**: the corpus `kiln-flows score` writes holds the log-softmax of the model's own logits;",
        "- **untrained student**: `kiln-flows eval` of the untrained student on its own scores gives reverse KL 0 and",
        "  top-1 agreement 100 %;",
        "- **step-1 loss**: the first training step's loss is the top-K reverse KL of the model's own logits;",
        "- **resume**: a run interrupted after step 3 and resumed from its newest checkpoint publishes the same adapter",
        "  bytes as an uninterrupted one;",
        "- **on-policy**: the student samples rollouts, the teacher scores them, the run trains;",
        f"- **bf16**: the step-1 loss with the student in bf16 (weights and autocast; the loss math stays fp32) is",
        f"  within {BF16_TOLERANCE:.0%} of the fp32 one: bf16 keeps 8 bits of mantissa, so each activation carries about",
        "  0.4 % of rounding (on CUDA, bf16 is the default precision; on the CPU, fp32).",
        "",
        "The logits are the model's own: the LM head and, where the family has them, its scale (Cohere, Granite) or",
        "soft cap (Gemma 2, Gemma 3), proven against `model(...).logits` whenever a model loads",
        "(`kiln_core.logit_head.check_own_logits`). A model whose logits cannot be reproduced is refused before any",
        "training with `unsupported_architecture`. LoRA adapts every linear projection of attention and MLP, as the",
        "model names them (`kiln_core.training.lora_targets`); an `mlp.experts.*` entry is a mixture of experts'",
        "3-D expert tensor, adapted through PEFT's `target_parameters`.",
        "",
        "The model's chat template decides which tokens it trains on. The matrix's tiny models speak ChatML; the",
        "templates the families ship (Gemma 1/2 without a system role, Gemma 3, Qwen3's thinking template, Llama 3's",
        "and Mistral's BOS and EOS) and what kiln-flows does with each, as Kiln does, are in",
        "[chat-templates.md](chat-templates.md).",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    lines += ["| " + " | ".join(row[column] for column in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"
