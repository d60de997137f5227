"""Run a suite on a local transformers student (with or without a PEFT adapter) and decide the gate.

Mirrors crates/kiln-server/src/eval/executor.rs · run_suite_inner and training_queue.rs ·
enqueue_post_training_eval: per example, the effective generation (example > post_eval > suite)
decides decoding; completion i of example e is decoded with seed
``derive_eval_completion_seed(generation.seed or effective_seed, e, i)``; a prompt that cannot be
rendered, a failed generation or a scorer error becomes that completion's ``error`` outcome. With a
gate, the baseline arm (the previously active adapter, or the base model) and the candidate arm run
the same suite with the same seeds, and ``evaluate_paired_promotion`` decides.

Decoding is a plain KV-cached loop: greedy when ``temperature`` is 0 (or ``top_k`` is 1), else
temperature → top-k → top-p → a categorical draw from a CPU ``torch.Generator`` seeded per
completion. It stops at the tokenizer's end-of-sequence tokens, after ``max_tokens`` new tokens, at
the model's context length, or at a ``stop`` string (cut off, not included). Only one logits row
lives at a time. Kiln's own sampler (penalties, its RNG) cannot be reproduced bit for bit, so equal
seeds pair the two arms here but do not reproduce Kiln's sampled text; greedy decoding is exact.
"""

from __future__ import annotations

import inspect
import secrets
import time
from dataclasses import dataclass
from typing import Any

import torch

from kiln_core.post_eval.gate import SuiteRun
from kiln_core.post_eval.reduce import AggregationError, CompletionOutcome, aggregate_example_outcomes, suite_metrics
from kiln_core.contracts.post_eval.scorers import JudgeRunner, ScorerError, score_completion
from kiln_core.post_eval.stats import derive_eval_completion_seed
from kiln_core.post_eval.identity import effective_generation_sha256, suite_sha256
from kiln_core.contracts.post_eval.suite import EvalGenerationParams, EvalSuite, effective_generation
from kiln_core.serde_json import rust_debug_str

__all__ = ["Arm", "PostEvalTimeout", "load_arm", "render_prompt", "generate", "run_suite", "resolve_effective_seed"]

EOS_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|end|>", "</s>")  # Kiln's eos_token_ids set


class PostEvalTimeout(RuntimeError):
    """The eval ran past its time limit; the job did not complete (gate outcome ``error``)."""


@dataclass
class Arm:
    """One loaded model to generate with: the base student, optionally wearing an adapter."""

    model: Any
    tokenizer: Any
    device: torch.device
    eos_ids: frozenset[int]
    max_positions: int | None
    cache_name: str = "cache"
    """The KV-cache keyword: ``cache`` in transformers ≥ 5.2x, ``past_key_values`` before."""

    def forward(self, ids: list[list[int]], cache: Any = None) -> tuple[torch.Tensor, Any]:
        """Last-position logits ``[V]`` and the updated KV cache."""
        extra = {} if cache is None else {self.cache_name: cache}
        output = self.model(input_ids=torch.tensor(ids, device=self.device), use_cache=True, logits_to_keep=1, **extra)
        return output.logits[0, -1], getattr(output, self.cache_name)


def load_arm(student_dir: str, adapter_dir: str | None = None, *, device: str | None = None) -> Arm:
    """Load the student (fp32 on CPU, bf16 on CUDA) and, if given, a PEFT adapter on top.

    Example:
        >>> arm = load_arm("./student", "kiln-data/runs/demo/adapter")  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln_core.storage import localize_directory
    from kiln_core.training.student import resolve_device

    device_ = resolve_device(device)
    dtype = torch.bfloat16 if device_.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=dtype, local_files_only=True)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, localize_directory(adapter_dir), is_trainable=False)
    model.to(device_).eval()
    added = {token.content: index for index, token in tokenizer.added_tokens_decoder.items()}
    eos = {added[name] for name in EOS_TOKENS if name in added}
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    base = model.get_base_model() if adapter_dir is not None else model
    cache_name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    return Arm(model, tokenizer, device_, frozenset(eos), getattr(model.config, "max_position_embeddings", None),
               cache_name)


def render_prompt(arm: Arm, messages: list[Any], system_prompt: str | None, tools: list[Any] | None,
                  params: EvalGenerationParams) -> list[int]:
    """The example's chat, system prompt prepended unless it starts with one, rendered and encoded as Kiln's eval
    generator does (``crates/kiln-server/src/eval/generator.rs`` · ``prepare``: the server's chat-template render,
    so no BOS or EOS from the tokenizer, nothing encoded with special tokens; docs/chat-templates.md).

    Raises:
        RenderError: the template refuses the chat (the caller makes it the example's ``error`` outcome).
        ValueError: the prompt fills the model's context.
    """
    from kiln_core.on_policy.render import encode_text, render_for_generation

    chat = [message.wire() for message in messages]
    if system_prompt is not None and (not chat or chat[0]["role"] != "system"):
        chat.insert(0, {"role": "system", "content": system_prompt})
    text = render_for_generation(arm.tokenizer.chat_template, chat, tools=tools,
                                 template_kwargs=params.chat_template_kwargs)
    ids = encode_text(arm.tokenizer, text).tolist()
    if arm.max_positions is not None and len(ids) >= arm.max_positions:
        raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {arm.max_positions}")
    return ids


def _next_token(logits: torch.Tensor, params: EvalGenerationParams, generator: torch.Generator) -> int:
    if params.temperature <= 0.0 or params.top_k == 1:
        return int(torch.argmax(logits))
    scaled = logits.float().cpu() / params.temperature
    if 0 < params.top_k < scaled.numel():
        threshold = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # the first token always stays
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate(arm: Arm, prompt_ids: list[int], params: EvalGenerationParams, seed: int) -> tuple[str, int]:
    """Decode one completion; returns its text and its number of new tokens."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    limit = params.max_tokens
    if arm.max_positions is not None:
        limit = min(limit, arm.max_positions - len(prompt_ids))
    new_ids: list[int] = []
    text = ""
    if limit <= 0:
        return text, 0
    logits, cache = arm.forward([prompt_ids])
    while len(new_ids) < limit:
        token = _next_token(logits, params, generator)
        if token in arm.eos_ids:
            break
        new_ids.append(token)
        if params.stop:
            text = arm.tokenizer.decode(new_ids, skip_special_tokens=True)
            cut = min((text.find(stop) for stop in params.stop if stop and stop in text), default=-1)
            if cut >= 0:
                return text[:cut], len(new_ids)
        if len(new_ids) == limit:
            break
        logits, cache = arm.forward([[token]], cache)
    return arm.tokenizer.decode(new_ids, skip_special_tokens=True), len(new_ids)


def run_suite(suite: EvalSuite, arm: Arm, *, adapter_label: str | None, override: EvalGenerationParams | None,
              effective_seed: int, judge: JudgeRunner | None = None, deadline: float | None = None) -> SuiteRun:
    """Generate, score and reduce every example of ``suite`` with one arm.

    Raises:
        PostEvalRejection: The suite breaks one of Kiln's suite rules (a suite built in code; registry
            suites were validated when loaded).
        AggregationError: An effective ``n`` differs from the aggregation's k (Kiln refuses the run).
        PostEvalTimeout: ``deadline`` (a ``time.monotonic()`` value) passed.
    """
    suite.validate_rules()
    k = suite.aggregation.k
    for example in suite.examples:
        params, _ = effective_generation(suite, example, override)
        if params.n != k:
            raise AggregationError(f"example {rust_debug_str(example.resolved_id())} generation.n {params.n} does not "
                                   f"match aggregation {suite.aggregation.label()} (k={k})")
    started = time.monotonic()
    outcomes: list[CompletionOutcome] = []
    for example in suite.examples:
        params, _ = effective_generation(suite, example, override)
        example_id = example.resolved_id()
        scorer = example.scorer or suite.default_scorer
        base = dict(tags=list(example.tags), metadata=example.metadata)
        seeds = [derive_eval_completion_seed(params.seed if params.seed is not None else effective_seed, example_id, i)
                 for i in range(params.n)]
        try:
            prompt = render_prompt(arm, example.messages, suite.system_prompt,
                                   example.tools if example.tools is not None else suite.tools, params)
            prompt_error = None
        except Exception as error:  # a template or tokenizer failure is this example's error, not the run's
            prompt, prompt_error = [], f"prepare failed: {error}"
        for index, seed in enumerate(seeds):
            if deadline is not None and time.monotonic() > deadline:
                raise PostEvalTimeout(f"eval time limit reached after {len(outcomes)} completions")
            if prompt_error is not None:
                outcomes.append(CompletionOutcome(example_id, index, "error", 0.0, seed, detail=prompt_error, **base))
                continue
            began = time.perf_counter()
            try:
                text, produced = generate(arm, prompt, params, seed)
            except (RuntimeError, ValueError) as error:
                outcomes.append(CompletionOutcome(example_id, index, "error", 0.0, seed,
                                                  detail=f"generation failed: {error}", **base))
                continue
            latency_ms = (time.perf_counter() - began) * 1e3
            try:
                scored = score_completion(scorer, example, text, judge)
                kind, score, detail = scored.kind, scored.score, scored.detail
                reasoning, unclosed = scored.reasoning_text, scored.unclosed_thinking
            except ScorerError as error:
                kind, score, detail, reasoning, unclosed = "error", 0.0, f"scorer error: {error}", None, False
            outcomes.append(CompletionOutcome(
                example_id, index, kind, score, seed, completion_text=text, raw_completion_text=text, detail=detail,
                prompt_tokens=len(prompt), completion_tokens=produced, latency_ms=latency_ms,
                reasoning_text=reasoning, unclosed_thinking=unclosed, **base))
    reduced = aggregate_example_outcomes(outcomes, suite.aggregation)
    weights = {example.resolved_id(): example.weight for example in suite.examples}
    return SuiteRun(suite.name, adapter_label, suite.aggregation, reduced, suite_sha256(suite),
                    effective_generation_sha256(suite, override, effective_seed), effective_seed, outcomes,
                    suite_metrics(reduced, outcomes, weights, time.monotonic() - started))


def resolve_effective_seed(seed: int | None, config: Any, suite: EvalSuite) -> int:
    """Kiln's order: the job's seed, then ``post_eval.generation.seed``, then the suite's, else random."""
    for candidate in (seed, config.generation.seed if config.generation else None, suite.generation.seed):
        if candidate is not None:
            return int(candidate) % 2**64
    return secrets.randbits(64)
