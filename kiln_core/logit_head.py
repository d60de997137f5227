"""The model's own logits, a few rows at a time: the one projection the loss, evaluation and the gate use.

A causal LM turns its decoder's final hidden state ``h`` into logits in its ``*ForCausalLM.forward``: the LM head
(``h · Wᵀ + b``, the weight often tied to the embeddings), then, for some families, a post-processing step that a
hand-made ``h @ W.T`` would skip:

* **scaling** — Cohere multiplies by ``config.logit_scale``; Granite divides by ``config.logits_scaling``;
* **soft-capping** — Gemma 2 (and Gemma 3 when configured) squash with ``cap · tanh(z / cap)``,
  ``config.final_logit_softcapping``.

``LogitHead`` is that tail as data (weight, bias, scale, cap), ``z = cap · tanh(scale · (h · Wᵀ + b) / cap)``, with the
memory-bounded operations training needs: the logits at a few ids per row (``gathered``), the full-vocabulary
``logsumexp`` over ``[chunk_rows, chunk_vocab]`` tiles recomputed in backward, and the full-vocabulary ``argmax``.
No ``[T, V]`` tensor exists for a whole sequence; the largest is one tile.

``logit_head_of`` reads the tail from a transformers model, and ``check_own_logits`` proves it at load: the model's
own ``model(...).logits`` and ``LogitHead`` applied to the model's own decoder output must agree (fp32: 1e-5),
on the model's natural hidden states and on the same rows amplified until soft-capping and scaling dominate. A model
whose tail does something else (another family's post-processing) is refused with ``unsupported_architecture``,
never approximated: a student trained through a different projection would optimize another objective than the
one its receipt records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kiln_core.errors import Rejection

__all__ = ["LogitHead", "UnsupportedArchitecture", "check_own_logits", "logit_head_of", "decoder_of"]


class UnsupportedArchitecture(Rejection):
    """``unsupported_architecture``: kiln-flows cannot reproduce this model's logits (or adapt any of its layers)."""


@dataclass(frozen=True)
class LogitHead:
    """The LM head and the model's output post-processing: ``z = cap · tanh(scale · (h · Wᵀ + b) / cap)``.

    Attributes:
        weight: The LM head ``[V, H]`` (frozen in a LoRA student).
        bias: Its bias ``[V]``, or None.
        scale: Multiplies the head's output (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``); 1 elsewhere.
        softcap: ``final_logit_softcapping`` (Gemma 2/3), applied after the scale; None when the model has none.

    Example:
        >>> head = LogitHead(torch.randn(50, 8), softcap=30.0)
        >>> head.gathered(torch.randn(3, 8), torch.tensor([[1, 2], [3, 4], [5, 6]])).shape
        torch.Size([3, 2])
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    def finish(self, raw: torch.Tensor) -> torch.Tensor:
        """The post-processing of raw head outputs (differentiable; identity for a plain head)."""
        z = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def finish_derivative(self, raw: torch.Tensor) -> torch.Tensor | float:
        """``d finish / d raw``, elementwise (a float when it is the same everywhere)."""
        if self.softcap is None:
            return self.scale
        t = torch.tanh(raw * (self.scale / self.softcap))
        return (1.0 - t * t) * self.scale

    def gathered(self, hidden: torch.Tensor, ids: torch.Tensor, *, chunk_rows: int = 1024) -> torch.Tensor:
        """The logits of row ``t`` at ``ids[t, :]``: ``[T, H], [T, K] -> [T, K]`` fp32, chunked over rows."""
        return self.finish(_GatheredRaw.apply(hidden, self.weight, ids, self.bias, chunk_rows))

    def logsumexp(self, hidden: torch.Tensor, *, chunk_rows: int = 1024, chunk_vocab: int = 8192) -> torch.Tensor:
        """``logsumexp`` of each row's logits over the WHOLE vocabulary: ``[T, H] -> [T]`` fp32, tiled."""
        return _FullLogSumExp.apply(hidden, self.weight, self.bias, self, chunk_rows, chunk_vocab)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary fp32 logits ``[R, V]`` of a few rows (a probe, one short answer), never a whole sequence."""
        raw = hidden.float() @ self.weight.float().T
        if self.bias is not None:
            raw = raw + self.bias.float()
        return self.finish(raw)

    def argmax(self, hidden: torch.Tensor, *, chunk_rows: int = 256) -> torch.Tensor:
        """Each row's argmax over the whole vocabulary (ties to the lowest id), ``chunk_rows`` rows at a time."""
        out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for lo in range(0, hidden.shape[0], chunk_rows):
            out[lo : lo + chunk_rows] = self.logits(hidden[lo : lo + chunk_rows]).argmax(dim=-1)
        return out


# ---------------------------------------------------------------------------------------------
# Memory-bounded projections (custom autograd Functions)


class _GatheredRaw(torch.autograd.Function):
    """``raw[t, k] = hidden[t] · W[ids[t, k]] (+ bias[ids[t, k]])`` in fp32, chunked over rows.

    Only the inputs are saved for backward; the gathered ``[chunk, K, H]`` head rows are rebuilt per chunk there,
    so no ``[T, K, H]`` copy of W outlives a chunk. The post-processing is applied outside, on the small ``[T, K]``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, bias, chunk_rows):
        n_rows, k = ids.shape
        out = torch.empty((n_rows, k), dtype=torch.float32, device=hidden.device)  # [T, K]
        for lo in range(0, n_rows, chunk_rows):
            hi = min(lo + chunk_rows, n_rows)
            flat = ids[lo:hi].reshape(-1).long()  # [c*K]
            w = weight.index_select(0, flat).view(hi - lo, k, -1).float()  # [c, K, H]
            s = torch.bmm(w, hidden[lo:hi].float().unsqueeze(-1)).squeeze(-1)  # [c, K]
            if bias is not None:
                s = s + bias.index_select(0, flat).view(hi - lo, k).float()
            out[lo:hi] = s
            del w, s  # free this chunk before the next gather, not after it
        ctx.chunk_rows = chunk_rows
        ctx.save_for_backward(hidden, weight, ids, bias)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, ids, bias = ctx.saved_tensors
        need_h, need_w, _, need_b, _ = ctx.needs_input_grad
        n_rows, k = ids.shape
        grad_h = torch.empty_like(hidden) if need_h else None
        # A frozen head (LoRA) must cost nothing: no [V, H] buffer unless W really needs a gradient.
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        for lo in range(0, n_rows, ctx.chunk_rows):
            hi = min(lo + ctx.chunk_rows, n_rows)
            flat = ids[lo:hi].reshape(-1).long()  # [c*K]
            g = grad_out[lo:hi].float()  # [c, K]
            if need_h:  # dL/dh[t] = sum_k g[t, k] * W[ids[t, k]]
                w = weight.index_select(0, flat).view(hi - lo, k, -1).float()  # [c, K, H]
                grad_h[lo:hi] = torch.bmm(g.unsqueeze(1), w).squeeze(1).to(grad_h.dtype)
                del w
            if need_w:  # dL/dW[v] = sum over (t, k) with ids[t, k] == v of g[t, k] * h[t]
                contrib = g.unsqueeze(-1) * hidden[lo:hi].float().unsqueeze(1)  # [c, K, H]
                grad_w.index_add_(0, flat, contrib.reshape(len(flat), -1).to(grad_w.dtype))
            if need_b:
                grad_b.index_add_(0, flat, g.reshape(-1).to(grad_b.dtype))
        return grad_h, grad_w, None, grad_b, None


class _FullLogSumExp(torch.autograd.Function):
    """``lse[r] = logsumexp_v z[r, v]`` over the FULL vocabulary, tiled, with ``z = head.finish(h · Wᵀ + b)``.

    Forward keeps a running log-add-exp over ``[chunk_rows, chunk_vocab]`` logit tiles; backward recomputes each
    tile to form ``softmax · finish' · grad`` (the only place the full softmax is needed). The vocabulary is the
    outer loop so each head chunk is upcast once and each ``grad_W`` slice is written once, accumulated in fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, head, chunk_rows, chunk_vocab):
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        h32 = hidden.float()  # [R, H]; small next to W
        lse = torch.full((n_rows,), -math.inf, dtype=torch.float32, device=hidden.device)
        for v0 in range(0, vocab, chunk_vocab):
            w, b = _vocab_chunk(weight, bias, v0, v0 + chunk_vocab)
            for r0 in range(0, n_rows, chunk_rows):
                raw = h32[r0 : r0 + chunk_rows] @ w.T  # [c, cv]
                if b is not None:
                    raw = raw + b
                z = head.finish(raw)
                lse[r0 : r0 + chunk_rows] = torch.logaddexp(lse[r0 : r0 + chunk_rows], z.logsumexp(-1))
        ctx.head, ctx.chunks = head, (chunk_rows, chunk_vocab)
        ctx.save_for_backward(hidden, weight, bias, lse)
        return lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lse):
        hidden, weight, bias, lse = ctx.saved_tensors
        need_h, need_w, need_b, _, _, _ = ctx.needs_input_grad
        head, (chunk_rows, chunk_vocab) = ctx.head, ctx.chunks
        vocab = weight.shape[0]
        h32 = hidden.float()
        g = grad_lse.float()
        grad_h = torch.zeros_like(h32) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        for v0 in range(0, vocab, chunk_vocab):
            w, b = _vocab_chunk(weight, bias, v0, v0 + chunk_vocab)
            gw = torch.zeros_like(w) if need_w else None  # fp32 accumulator for this slice
            for r0 in range(0, h32.shape[0], chunk_rows):
                h = h32[r0 : r0 + chunk_rows]
                raw = h @ w.T if b is None else h @ w.T + b  # [c, cv]
                # d lse / d raw = softmax(z) · finish'(raw); scaled by the incoming per-row gradient.
                p = torch.exp(head.finish(raw) - lse[r0 : r0 + chunk_rows, None]) * g[r0 : r0 + chunk_rows, None]
                if head.scale != 1.0 or head.softcap is not None:  # a plain head's derivative is 1: no tile pass
                    p = p * head.finish_derivative(raw)
                if need_h:
                    grad_h[r0 : r0 + chunk_rows] += p @ w
                if need_w:
                    gw += p.T @ h
                if need_b:
                    grad_b[v0 : v0 + chunk_vocab] += p.sum(0).to(grad_b.dtype)
            if need_w:
                grad_w[v0 : v0 + chunk_vocab] = gw.to(grad_w.dtype)
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, grad_b, None, None, None


def _vocab_chunk(weight, bias, v0, v1):
    """fp32 views of head rows ``[v0, v1)`` and their bias (or None)."""
    return weight[v0:v1].float(), (None if bias is None else bias[v0:v1].float())


# ---------------------------------------------------------------------------------------------
# The tail of a transformers model


def decoder_of(model: Any) -> torch.nn.Module:
    """The decoder stack whose ``last_hidden_state`` a causal LM projects (PEFT-wrapped or not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder()


def logit_head_of(model: Any) -> LogitHead:
    """The ``LogitHead`` a transformers causal LM's forward applies, read from its output layer and config.

    The config names the post-processing (transformers' ``CohereForCausalLM``, ``GraniteForCausalLM``,
    ``HyperCLOVAXForCausalLM``, ``Gemma2ForCausalLM``/``Gemma3ForCausalLM``); ``check_own_logits`` proves the
    reading on the model itself, so a family that reads the same name another way is refused, not approximated.

    Example:
        >>> head = logit_head_of(model)  # doctest: +SKIP
        >>> head.softcap  # a Gemma 2 model  # doctest: +SKIP
        30.0
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    output = base.get_output_embeddings()
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere, Cohere 2: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        # Granite divides by it; HyperCLOVA X multiplies (its muP reading of the same name)
        multiplies = str(getattr(config, "model_type", "")).startswith("hyperclovax")
        scale = scale * float(config.logits_scaling) if multiplies else scale / float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitHead(weight=output.weight, bias=getattr(output, "bias", None), scale=scale,
                     softcap=float(softcap) if softcap is not None else None)


# How far past its soft cap (or the plain head's natural range) the amplified probe pushes the logits: far enough
# that a missing cap or scale moves them by most of their size, whatever the precision.
_PROBE_LOGIT_MAGNITUDE = 120.0
_FP32_TOLERANCE = 1e-5
_BF16_TOLERANCE = 2e-2


def check_own_logits(model: Any, head: LogitHead, hidden_states: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Refuse a model whose logits ``head`` does not reproduce; returns the largest relative difference found.

    On a short probe of token ids, the model's own ``model(...).logits`` must equal ``head`` applied to the
    decoder output the model fed its own head (captured by a forward hook), and ``hidden_states`` (what training
    calls) must equal that decoder output. Then the same forward runs with those hidden rows amplified (the hook
    replaces the decoder's output) so the raw logits reach about ±120: a soft cap, a scale or any other
    post-processing ``head`` lacks now changes the logits by most of their size. The difference is measured
    relative to the largest logit, within 1e-5 in fp32 (2e-2 when the model computes in bf16).

    Raises:
        UnsupportedArchitecture: ``unsupported_architecture``, naming the model type and the difference.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = decoder_of(model)
    device = head.weight.device
    ids = (torch.arange(12, device=device) * 7919 + 3) % head.vocab_size
    captured: dict[str, torch.Tensor] = {}
    replacement: dict[str, torch.Tensor] = {}

    def hook(_module, _inputs, output):
        captured["hidden"] = output.last_hidden_state.detach()
        if "hidden" in replacement:
            output.last_hidden_state = replacement["hidden"]
        return output

    model_type = getattr(base.config, "model_type", type(base).__name__)
    tolerance = _FP32_TOLERANCE if head.weight.dtype == torch.float32 else _BF16_TOLERANCE
    handle = decoder.register_forward_hook(hook)
    try:
        with torch.no_grad():
            own = base(input_ids=ids[None], use_cache=False).logits[0].float()
            natural = captured["hidden"][0]
            ours_hidden = hidden_states(ids)
            if ours_hidden.shape != natural.shape or not torch.allclose(ours_hidden.float(), natural.float(),
                                                                         rtol=tolerance, atol=tolerance):
                raise UnsupportedArchitecture(
                    "unsupported_architecture",
                    f"model type {model_type!r}: the decoder's hidden states kiln-flows computes differ from those "
                    f"the model's own forward feeds its LM head; its logits cannot be reproduced row by row")
            worst = _relative_difference(head.logits(natural), own)
            raw_peak = float((natural.float() @ head.weight.float().T).abs().max()) or 1.0
            replacement["hidden"] = (natural * (_PROBE_LOGIT_MAGNITUDE / raw_peak))[None]
            amplified_own = base(input_ids=ids[None], use_cache=False).logits[0].float()
            worst = max(worst, _relative_difference(head.logits(replacement["hidden"][0]), amplified_own))
    finally:
        handle.remove()
    if not worst <= tolerance:
        applied = [f"scale {head.scale:g}" if head.scale != 1.0 else None,
                   f"soft cap {head.softcap:g}" if head.softcap is not None else None]
        described = ", ".join(part for part in applied if part) or "no post-processing"
        raise UnsupportedArchitecture(
            "unsupported_architecture",
            f"model type {model_type!r}: its own logits differ from the LM head's output with {described} by "
            f"{worst:.3g} (relative; at most {tolerance:g} allowed): the model post-processes its logits in a way "
            "kiln-flows does not reproduce, so it cannot be trained or evaluated here")
    return worst


def _relative_difference(ours: torch.Tensor, own: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest logit (at least 1)."""
    return float((ours - own).abs().max()) / max(1.0, float(own.abs().max()))
