"""The student's logits are the model's own: ``LogitHead`` against naive references and transformers' forward.

Tolerances (fp32): values 1e-5 relative; gradients normwise relative error ≤ 1e-5. The references
(``naive_losses.softcapped_scaled_logits``, ``reverse_kl_from_logits``) build whole ``[T, V]`` logits from the
definitions; the self-check's tests compare with transformers' own ``model(...).logits``.
"""

from __future__ import annotations

import pytest
import torch

from kiln_core.logit_head import LogitHead, UnsupportedArchitecture, check_own_logits, decoder_of, logit_head_of
from kiln_core.loss import echo_env_cross_entropy, topk_reverse_kl, topk_tail_reverse_kl
from naive_losses import normalize, reverse_kl_from_logits, softcapped_scaled_logits

T, H, V, K = 23, 12, 97, 16
POST_PROCESSING = [(1.0, None), (0.0625, None), (0.125, None), (1.0, 30.0), (1.0, 2.0), (0.5, 3.0)]


def inputs(seed: int = 0, bias: bool = True):
    torch.manual_seed(seed)
    hidden = (torch.randn(T, H) * 2.0).requires_grad_(True)  # large enough that a soft cap of 2-3 bites
    weight = torch.randn(V, H)
    head_bias = torch.randn(V).requires_grad_(True) if bias else None
    ids = torch.rand(T, V).argsort(dim=-1)[:, :K]
    logprobs = torch.log_softmax(torch.randn(T, V) * 2, dim=-1).gather(1, ids).sort(dim=-1, descending=True)
    return hidden, weight, head_bias, ids.gather(1, logprobs.indices), logprobs.values


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("scale, softcap", POST_PROCESSING)
def test_gathered_logsumexp_logits_and_argmax_are_the_post_processed_logits(scale, softcap):
    hidden, weight, bias, ids, _ = inputs()
    head = LogitHead(weight, bias, scale=scale, softcap=softcap)
    reference = softcapped_scaled_logits(hidden, weight, bias, scale=scale, softcap=softcap)  # [T, V]
    torch.testing.assert_close(head.logits(hidden), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.gathered(hidden, ids, chunk_rows=5), reference.gather(1, ids), rtol=1e-5, atol=1e-5)
    ours = head.logsumexp(hidden, chunk_rows=4, chunk_vocab=10)  # tiles that divide nothing
    torch.testing.assert_close(ours, reference.logsumexp(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(head.argmax(hidden, chunk_rows=6), reference.argmax(-1))
    # the gradient of the full-vocabulary logsumexp goes through the cap and the scale
    ours_grads = torch.autograd.grad(ours.sum(), [hidden, bias])
    reference_grads = torch.autograd.grad(reference.logsumexp(-1).sum(), [hidden, bias])
    assert all(normwise(a, b) <= 1e-5 for a, b in zip(ours_grads, reference_grads))


@pytest.mark.parametrize("scale, softcap", POST_PROCESSING)
def test_the_losses_train_the_post_processed_objective(scale, softcap):
    hidden, weight, bias, ids, logprobs = inputs(seed=1)
    head = LogitHead(weight, bias, scale=scale, softcap=softcap)

    def reference_logits():
        return softcapped_scaled_logits(hidden, weight, bias, scale=scale, softcap=softcap)

    cases = [
        (lambda: topk_reverse_kl(hidden, head, ids, logprobs, chunk_rows=7),
         lambda: reverse_kl_from_logits(reference_logits(), ids, logprobs)),
        (lambda: echo_env_cross_entropy(hidden, head, ids[:, 0], T + 3, chunk_rows=7, chunk_vocab=20),
         lambda: -torch.log(normalize(reference_logits()).gather(1, ids[:, :1])).sum() / (T + 3)),
    ]
    for ours_fn, reference_fn in cases:
        ours, reference = ours_fn(), reference_fn()
        assert float(ours.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)
        ours_grads = torch.autograd.grad(ours, [hidden, bias])
        reference_grads = torch.autograd.grad(reference, [hidden, bias])
        assert all(normwise(a, b) <= 1e-5 for a, b in zip(ours_grads, reference_grads))


def test_a_soft_cap_changes_the_loss_the_plain_head_would_train():
    """The bug this module exists for: the plain projection of a soft-capped model trains another objective."""
    hidden, weight, bias, ids, logprobs = inputs(seed=2)
    capped = topk_reverse_kl(hidden, LogitHead(weight, bias, softcap=2.0), ids, logprobs)
    plain = topk_reverse_kl(hidden, LogitHead(weight, bias), ids, logprobs)
    assert abs(float(capped.detach()) - float(plain.detach())) > 0.1
    tail = topk_tail_reverse_kl(hidden, LogitHead(weight, bias, softcap=2.0), ids, logprobs, chunk_vocab=16)
    assert torch.isfinite(tail)


# ------------------------------------------------------------------------------------------------ the self-check


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from kiln_core.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gemma2") / "model", architecture="gemma2", seed=5)


def load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def decoder_rows(model):
    return lambda ids: decoder_of(model)(input_ids=ids[None], use_cache=False).last_hidden_state[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_self_check_accepts_the_models_own_head_and_refuses_a_plain_projection(gemma2, dtype):
    model = load(gemma2, dtype)
    head = logit_head_of(model)
    assert head.softcap == 5.0
    assert check_own_logits(model, head, decoder_rows(model)) <= (1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(UnsupportedArchitecture) as refused:
        check_own_logits(model, LogitHead(head.weight, head.bias), decoder_rows(model))
    assert refused.value.code == "unsupported_architecture"
    assert "'gemma2'" in refused.value.message and "no post-processing" in refused.value.message


def test_the_self_check_refuses_hidden_states_that_are_not_what_the_head_sees(gemma2):
    model = load(gemma2)
    with pytest.raises(UnsupportedArchitecture) as refused:
        check_own_logits(model, logit_head_of(model), lambda ids: decoder_rows(model)(ids) * 1.01)
    assert "hidden states" in refused.value.message


def test_a_model_with_nothing_for_lora_to_adapt_is_refused():
    from kiln_core.training.lora_targets import lora_targets_of

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Conv1d(4, 4, 1)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"model_type": "convnet"})()
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.lm_head = torch.nn.Linear(4, 10)  # outside the layers: never a target

    with pytest.raises(UnsupportedArchitecture) as refused:
        lora_targets_of(Decoder())
    assert refused.value.code == "unsupported_architecture"
    assert "'convnet'" in refused.value.message and "no linear projection" in refused.value.message


def test_a_student_whose_config_names_no_causal_lm_is_refused_by_name(tmp_path):
    import json

    from kiln_core.errors import Rejection
    from kiln_core.training.lora_targets import resolve_lora_targets

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitecture) as refused:
        resolve_lora_targets(tmp_path)
    assert refused.value.code == "unsupported_architecture" and str(tmp_path) in refused.value.message
    (tmp_path / "config.json").unlink()
    with pytest.raises(Rejection) as missing:
        resolve_lora_targets(tmp_path)
    assert missing.value.code == "invalid_student" and "config.json" in missing.value.message
