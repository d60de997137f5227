"""The student's rollout sampler: Kiln's sampling rule, a documented seeded draw, a KV-cached decode.

Rule (``crates/kiln-model/src/sampling.rs`` · ``sample_step``, ``sample_with_full_params``,
``sample_with_params``; ``crates/kiln-core/src/sampling.rs`` · ``SamplingParams::default``; reference
B.5). Rollouts use Kiln's default ``SamplingParams`` (the Qwen "thinking general" preset: top-k 20,
min-p 0, presence penalty 1.5, repetition 1.0, frequency 0) with only ``temperature`` and ``top_p``
taken from the request. For one token, in f32:

1. greedy (argmax) when the temperature is 0, or top-k is 1 with a positive finite temperature;
2. penalties over the tokens generated so far (never the prompt; none for the first token): for each
   distinct id, repetition (divide a positive logit, multiply a negative one), then subtract the
   presence penalty, then ``frequency · count``; the change is added back to the logit;
3. multiply by ``1 / temperature``;
4. keep the top-k (all when 0 or ≥ the vocabulary), softmax over them; drop those below
   ``min_p · p_max``; keep the shortest prefix whose cumulative probability reaches ``top_p``
   (disabled outside (0, 1)); renormalize after each filter;
5. draw ``r`` in [0, 1) and return the first candidate whose running sum exceeds ``r`` (the last one
   if rounding leaves none). With top-p, top-k and min-p all off the draw runs over the whole
   vocabulary unsorted, ``r`` scaled by the weights' sum.

Generation stops at an EOS id (not kept) or after ``max_tokens`` tokens; token ``i`` draws with seed
``candidate_seed + i``.

The draw. Kiln seeds ``rand``'s ``StdRng`` per token; that generator is not reproducible here, so
kiln-flows uses its own documented draw, ``kiln-flows.splitmix64-f32.v1``: one SplitMix64 output
of the seed (``z = seed + 0x9E3779B97F4A7C15``, then the two xor-shift-multiply rounds and the final
xor-shift), whose top 24 bits scaled by 2^-24 give ``r``. Same weights and seed → same tokens on
CPU, which is what makes an interrupted run resume bit-exactly. Ranking ties are broken by the
lower token id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from kiln_core.on_policy.schedule import token_seed

__all__ = ["DRAW_ALGORITHM", "LocalRolloutBackend", "RolloutBackend", "SamplingParams", "sample_next_token",
           "sample_rollout", "uniform_draw"]

DRAW_ALGORITHM = "kiln-flows.splitmix64-f32.v1"
_MASK64 = 2**64 - 1
_F32_EPSILON = float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class SamplingParams:
    """Kiln's ``SamplingParams`` fields that decide a token (defaults = ``SamplingParams::default``).

    Example:
        >>> SamplingParams.for_rollouts(temperature=1.0, top_p=0.9).presence_penalty
        1.5
    """

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 20
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 1.5
    frequency_penalty: float = 0.0

    @classmethod
    def for_rollouts(cls, *, temperature: float, top_p: float) -> "SamplingParams":
        """The rollout sampler: the defaults with the request's ``temperature`` and ``top_p``."""
        return cls(temperature=temperature, top_p=top_p)


def uniform_draw(seed: int) -> np.float32:
    """``r`` in [0, 1) for one seeded draw (``kiln-flows.splitmix64-f32.v1``).

    Example:
        >>> float(uniform_draw(0))
        0.8833107948303223
    """
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return np.float32((z >> 40) * 2.0**-24)


def _penalized(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> np.ndarray:
    repetition = np.float32(params.repetition_penalty)
    presence = np.float32(params.presence_penalty)
    frequency = np.float32(params.frequency_penalty)
    repetition_on = np.isfinite(repetition) and repetition > 0 and abs(float(repetition) - 1.0) > _F32_EPSILON
    presence_on = np.isfinite(presence) and presence != 0
    frequency_on = np.isfinite(frequency) and frequency != 0
    ids, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
    original = logits[ids]
    new = original.copy()
    if repetition_on:
        new = np.where(new > 0, new / repetition, new * repetition).astype(np.float32)
    if presence_on:
        new = new - presence
    if frequency_on:
        new = new - frequency * counts.astype(np.float32)
    adjusted = logits.copy()
    adjusted[ids] = original + (new - original)  # Kiln adds the delta (index_add), it does not assign
    return adjusted


def _ranked(scaled: np.ndarray, top_k: int) -> np.ndarray:
    """Ids of the ``top_k`` largest values (all when 0 or ≥ V), descending, ties by lower id."""
    if 0 < top_k < scaled.shape[0]:
        kth = np.partition(scaled, scaled.shape[0] - top_k)[scaled.shape[0] - top_k]
        pool = np.flatnonzero(scaled >= kth)  # every tie of the k-th value, ascending ids
    else:
        pool = np.arange(scaled.shape[0])
    order = np.argsort(-scaled[pool], kind="stable")
    return pool[order][: top_k if top_k > 0 else None]


def _renormalized(probs: np.ndarray) -> np.ndarray:
    total = np.cumsum(probs, dtype=np.float32)[-1]  # Rust's iter().sum(): sequential f32
    return probs / total if total > 0 else probs


def sample_next_token(logits: Any, params: SamplingParams, history: Sequence[int], seed: int) -> int:
    """One token from the last position's logits under Kiln's rule (see the module docstring).

    Args:
        logits: ``[V]`` logits (any float dtype; computed in f32).
        params: Sampling parameters.
        history: Tokens generated so far in this rollout (not the prompt).
        seed: This token's seed.

    Example:
        >>> sample_next_token(np.array([0.0, 5.0, 1.0]), SamplingParams(temperature=0.0), [], 0)
        1
    """
    values = np.asarray(logits, dtype=np.float32).reshape(-1)
    temperature = np.float32(params.temperature)
    if temperature == 0 or (params.top_k == 1 and np.isfinite(temperature) and temperature > 0):
        return int(np.argmax(values))
    if history and not (params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
                        and params.frequency_penalty == 0.0):
        values = _penalized(values, history, params)
    scaled = values * np.float32(1.0 / float(temperature))
    vocab = scaled.shape[0]
    min_p = np.float32(params.min_p)
    min_p_on = bool(np.isfinite(min_p) and min_p > 0)
    top_p = np.float32(params.top_p)
    top_p_on = 0 < top_p < 1
    r = uniform_draw(seed)

    if not top_p_on and (params.top_k == 0 or params.top_k >= vocab) and not min_p_on:
        finite = np.isfinite(scaled)
        if not finite.any():
            return vocab - 1
        weights = np.where(finite, np.exp(scaled - scaled[finite].max()), np.float32(0)).astype(np.float32)
        total = np.cumsum(weights, dtype=np.float32)[-1]
        if not np.isfinite(total) or total <= 0:
            return vocab - 1
        running = np.cumsum(weights / total, dtype=np.float32)  # zero weights add nothing
        hit = np.flatnonzero((r * running[-1]) < running)
        return int(hit[0]) if hit.size else vocab - 1

    ids = _ranked(scaled, params.top_k)
    probs = np.exp(scaled[ids] - scaled[ids[0]]).astype(np.float32)
    total = np.cumsum(probs, dtype=np.float32)[-1]
    if not np.isfinite(total) or total <= 0:
        return int(ids[0])
    probs = probs / total
    if min_p_on:
        keep = probs >= min_p * probs[0]
        ids, probs = ids[keep], _renormalized(probs[keep])
    if top_p_on:
        reached = np.flatnonzero(np.cumsum(probs, dtype=np.float32) >= top_p)
        cutoff = int(reached[0]) + 1 if reached.size else probs.shape[0]
        ids, probs = ids[:cutoff], _renormalized(probs[:cutoff])
    hit = np.flatnonzero(r < np.cumsum(probs, dtype=np.float32))
    return int(ids[hit[0]]) if hit.size else int(ids[-1])


def sample_rollout(model: Any, prompt_ids: Sequence[int], *, params: SamplingParams, max_tokens: int,
                   eos_token_ids: Sequence[int], seed: int) -> list[int]:
    """Sample one rollout from ``model`` after ``prompt_ids`` with a KV cache.

    Args:
        model: A transformers causal LM (PEFT-wrapped or not) on its device.
        prompt_ids: The rollout prefix.
        params: Sampling parameters (``SamplingParams.for_rollouts``).
        max_tokens: Most new tokens.
        eos_token_ids: Ids that end the rollout (``kiln_eos_token_ids``); never returned.
        seed: The candidate seed (``candidate_seed``); token i uses ``seed + i``.

    Returns:
        The sampled ids, possibly empty (EOS first).

    Example:
        >>> sample_rollout(model, [1, 5, 9], params=SamplingParams.for_rollouts(temperature=1.0, top_p=0.9),
        ...                max_tokens=32, eos_token_ids=[0, 2], seed=123)  # doctest: +SKIP
        [17, 4, 88]
    """
    import torch

    if len(prompt_ids) == 0:
        raise ValueError("sample_rollout: prompt empty")
    device = next(model.parameters()).device
    cache_argument = _cache_argument(model)
    stop = set(int(i) for i in eos_token_ids)
    generated: list[int] = []
    with torch.inference_mode():
        ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64), device=device)[None]
        logits, cache = _decode_step(model, ids, None, cache_argument)
        for i in range(max_tokens):
            token = sample_next_token(logits, params, generated, token_seed(seed, i))
            if token in stop:
                break
            generated.append(token)
            if i + 1 < max_tokens:
                logits, cache = _decode_step(model, torch.tensor([[token]], device=device), cache, cache_argument)
    return generated


def _cache_argument(model: Any) -> str:
    """The forward argument that carries the KV cache: ``cache`` (transformers ≥ 5.2x) or ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _decode_step(model: Any, ids: Any, cache: Any, cache_argument: str) -> tuple[np.ndarray, Any]:
    """One forward over ``ids`` after ``cache``: the last position's f32 logits and the grown cache."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_argument: cache})
    grown = out.cache if cache_argument == "cache" else out.past_key_values
    return out.logits[0, -1].float().cpu().numpy(), grown


class RolloutBackend(Protocol):
    """Where rollouts are sampled: the training model itself, or (optionally) an inference server.

    A backend that samples from a *copy* of the weights (``kiln_core.on_policy.vllm_rollouts``) also
    defines ``sync_weights(global_step)``: the collector calls it before every rollout it samples (not
    before one read back from the store), with the number of optimizer steps the trainer's weights have
    taken, so the copy is refreshed exactly when the weights changed. It may define ``close()``, called
    when the run ends, and ``receipt_label`` (``local`` when absent), recorded in the receipt.
    """

    def sample(self, prompt_ids: Sequence[int], *, params: SamplingParams, max_tokens: int,
               eos_token_ids: Sequence[int], seed: int) -> list[int]:
        """Sample one rollout with the current policy (see ``sample_rollout``)."""
        ...


class LocalRolloutBackend:
    """Rollouts from the in-process model that is being trained (its current LoRA weights).

    Example:
        >>> backend = LocalRolloutBackend(student.model)  # doctest: +SKIP
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def sample(self, prompt_ids: Sequence[int], *, params: SamplingParams, max_tokens: int,
               eos_token_ids: Sequence[int], seed: int) -> list[int]:
        return sample_rollout(self.model, prompt_ids, params=params, max_tokens=max_tokens,
                              eos_token_ids=eos_token_ids, seed=seed)
