"""The rollout sampler: Kiln's sampling rule, the seeded draw, and the KV-cached decode loop.

What a user depends on: rollouts follow Kiln's sampling semantics (penalties over generated tokens
only, Kiln's order of filters, stop at EOS without keeping it, at most ``max_tokens``), and the same
weights and seed give the same tokens (that is what makes a resumed run bit-exact). The rule is
checked against a reference written here from Kiln's ``sampling.rs``, token by token in f32; the
cached decode against a loop that re-runs the whole sequence every step.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from kiln_core.on_policy.sampler import SamplingParams, sample_next_token, sample_rollout, uniform_draw
from kiln_core.on_policy.schedule import token_seed

F = np.float32


def reference_draw(seed: int) -> np.float32:
    """SplitMix64 (Steele, Lea & Flood 2014; Vigna's reference code), top 24 bits → [0, 1)."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z = z ^ (z >> 31)
    return F((z >> 40) / float(1 << 24))


def reference_token(logits, params: SamplingParams, history, seed: int) -> int:
    """Kiln's ``sample_step`` written as plain loops over f32 scalars."""
    x = [F(v) for v in logits]
    vocab = len(x)
    temperature = F(params.temperature)
    if temperature == 0 or (params.top_k == 1 and math.isfinite(temperature) and temperature > 0):
        return max(range(vocab), key=lambda i: (x[i], -i))
    rep, pres, freq = F(params.repetition_penalty), F(params.presence_penalty), F(params.frequency_penalty)
    if history and not (rep == 1 and pres == 0 and freq == 0):
        counts = Counter(history)
        for token in sorted(counts):
            original = new = x[token]
            if math.isfinite(rep) and rep > 0 and abs(float(rep) - 1.0) > float(np.finfo(F).eps):
                new = F(new / rep) if new > 0 else F(new * rep)
            if math.isfinite(pres) and pres != 0:
                new = F(new - pres)
            if math.isfinite(freq) and freq != 0:
                new = F(new - F(freq * F(counts[token])))
            x[token] = F(original + F(new - original))
    inverse = F(1.0 / float(temperature))
    scaled = [F(v * inverse) for v in x]
    min_p, top_p = F(params.min_p), F(params.top_p)
    r = reference_draw(seed)
    nucleus = 0 < top_p < 1
    if not nucleus and (params.top_k == 0 or params.top_k >= vocab) and not min_p > 0:
        top = max(v for v in scaled if math.isfinite(v))
        weights = [F(np.exp(F(v - top))) if math.isfinite(v) else F(0) for v in scaled]
        total = F(0)
        for w in weights:
            total = F(total + w)
        weights = [F(w / total) for w in weights]
        total = F(0)
        for w in weights:
            total = F(total + w)
        threshold, running = F(r * total), F(0)
        for index, w in enumerate(weights):
            running = F(running + w)
            if threshold < running:
                return index
        return vocab - 1
    order = sorted(range(vocab), key=lambda i: (-scaled[i], i))
    candidates = order[: params.top_k] if 0 < params.top_k < vocab else order
    top = scaled[candidates[0]]
    probs = [F(np.exp(F(scaled[i] - top))) for i in candidates]

    def normalized(values):
        total = F(0)
        for v in values:
            total = F(total + v)
        return [F(v / total) for v in values] if total > 0 else values

    probs = normalized(probs)
    if min_p > 0:
        keep = [i for i, p in enumerate(probs) if p >= F(min_p * probs[0])]
        candidates, probs = [candidates[i] for i in keep], normalized([probs[i] for i in keep])
    if nucleus:
        running, cutoff = F(0), len(probs)
        for i, p in enumerate(probs):
            running = F(running + p)
            if running >= top_p:
                cutoff = i + 1
                break
        candidates, probs = candidates[:cutoff], normalized(probs[:cutoff])
    running = F(0)
    for token, p in zip(candidates, probs):
        running = F(running + p)
        if r < running:
            return token
    return candidates[-1]


def test_the_draw_is_splitmix64_in_unit_interval():
    mask = (1 << 64) - 1
    z = (1234567 + 0x9E3779B97F4A7C15) & mask  # published SplitMix64 vector: seed 1234567 -> 6457827717110365317
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    assert z ^ (z >> 31) == 6457827717110365317
    seeds = [0, 1, 1234567, 2**63, 2**64 - 1] + list(range(100, 1100))
    draws = [uniform_draw(s) for s in seeds]
    assert [float(d) for d in draws] == [float(reference_draw(s)) for s in seeds]
    assert all(0.0 <= d < 1.0 for d in draws) and len(set(map(float, draws))) > 990


def test_rule_matches_the_reference_token_for_token():
    rng = np.random.default_rng(7)
    grid = [dict(temperature=t, top_p=p, top_k=k, min_p=m, repetition_penalty=rp, presence_penalty=pp,
                 frequency_penalty=fp)
            for t in (0.0, 0.7, 1.0, 1.6) for p in (0.5, 0.9, 1.0) for k in (0, 1, 5, 20, 64)
            for m in (0.0, 0.2) for rp, pp, fp in ((1.0, 1.5, 0.0), (1.3, 0.0, 0.4), (1.0, 0.0, 0.0))]
    checked = 0
    for index, fields in enumerate(grid):
        params = SamplingParams(**fields)
        for trial in range(3):
            logits = rng.normal(0, 3, size=48).astype(np.float32)
            if trial == 2:
                logits = np.round(logits)  # many exact ties: ranking must break them by the lower id
            history = rng.integers(0, 48, size=rng.integers(0, 6)).tolist()
            seed = int(rng.integers(0, 2**63))
            assert sample_next_token(logits, params, history, seed) == reference_token(logits, params, history, seed), \
                (fields, trial)
            checked += 1
    assert checked == len(grid) * 3


def test_draws_follow_the_truncated_distribution():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.06, 0.04], dtype=np.float32))
    full = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, presence_penalty=0.0)
    counts = np.bincount([sample_next_token(logits, full, [], s) for s in range(20_000)], minlength=5) / 20_000
    np.testing.assert_allclose(counts, [0.5, 0.25, 0.15, 0.06, 0.04], atol=0.015)
    nucleus = SamplingParams(temperature=1.0, top_p=0.85, top_k=20)  # keeps 0.5 + 0.25 + 0.15 = 0.90 ≥ 0.85
    counts = np.bincount([sample_next_token(logits, nucleus, [], s) for s in range(20_000)], minlength=5) / 20_000
    np.testing.assert_allclose(counts, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0], atol=0.015)
    top2 = SamplingParams(temperature=1.0, top_p=1.0, top_k=2)
    assert {sample_next_token(logits, top2, [], s) for s in range(2000)} == {0, 1}


def test_penalties_act_on_generated_tokens_only_and_never_on_greedy():
    logits = np.array([3.0, 2.0, -1.0, 0.0], dtype=np.float32)
    default, plain = SamplingParams(temperature=1.0, top_p=1.0), SamplingParams(temperature=1.0, top_p=1.0,
                                                                                   presence_penalty=0.0)
    seeds = range(3000)
    first = [sample_next_token(logits, default, [], s) for s in seeds]
    assert first == [sample_next_token(logits, plain, [], s) for s in seeds]  # nothing generated yet: no penalty
    after = [sample_next_token(logits, default, [0], s) for s in seeds]  # token 0 was generated once
    assert after.count(0) < first.count(0) - 600 and after == [sample_next_token(logits - [1.5, 0, 0, 0], plain, [], s)
                                                               for s in seeds]
    assert sample_next_token(logits, SamplingParams(temperature=0.0), [0, 0, 0], 1) == 0  # greedy: no penalties


@pytest.fixture(scope="module")
def student_model(tiny_student):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_student, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a LoRA that is not at its zero init, as after some training steps
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    model.eval()
    return model


def naive_rollout(model, prompt, *, params, max_tokens, eos, seed):
    """Re-run the whole sequence every step, no cache."""
    import torch

    tokens: list[int] = []
    with torch.no_grad():
        for i in range(max_tokens):
            logits = model(input_ids=torch.tensor([list(prompt) + tokens]), use_cache=False).logits[0, -1]
            token = sample_next_token(logits.float().numpy(), params, tokens, token_seed(seed, i))
            if token in eos:
                break
            tokens.append(token)
    return tokens


PROMPT = [1, 87, 34, 120, 2, 208, 1, 75, 199, 5]


def test_cached_decode_samples_the_same_tokens_as_the_naive_loop(student_model):
    params = SamplingParams.for_rollouts(temperature=1.0, top_p=0.9)
    rollouts = []
    for seed in (0, 11, 2**64 - 5):
        cached = sample_rollout(student_model, PROMPT, params=params, max_tokens=24, eos_token_ids=[], seed=seed)
        assert cached == naive_rollout(student_model, PROMPT, params=params, max_tokens=24, eos=set(), seed=seed)
        assert len(cached) == 24  # never more than max_tokens
        rollouts.append(cached)
    assert len({tuple(r) for r in rollouts}) == 3
    assert rollouts[0] == sample_rollout(student_model, PROMPT, params=params, max_tokens=24, eos_token_ids=[],
                                         seed=0)  # same weights, same seed: same tokens


def test_generation_stops_at_eos_which_is_not_kept(student_model):
    params = SamplingParams.for_rollouts(temperature=1.0, top_p=0.9)
    free = sample_rollout(student_model, PROMPT, params=params, max_tokens=24, eos_token_ids=[], seed=5)
    stop_at = next(j for j in range(3, 24) if free[j] not in free[:j])
    stopped = sample_rollout(student_model, PROMPT, params=params, max_tokens=24, eos_token_ids=[free[stop_at]], seed=5)
    assert stopped == free[:stop_at]
    assert sample_rollout(student_model, PROMPT, params=params, max_tokens=24, eos_token_ids=[free[0]], seed=5) == []
    assert sample_rollout(student_model, PROMPT, params=params, max_tokens=0, eos_token_ids=[], seed=5) == []
    with pytest.raises(ValueError):
        sample_rollout(student_model, [], params=params, max_tokens=4, eos_token_ids=[], seed=5)
