"""``shard_student`` on its own, in one process (a one-rank gloo group): what it wraps and what it leaves whole.

What a user of ``strategy: fsdp`` depends on, checked without launching ranks (tests/test_fsdp.py launches
two): every decoder layer's frozen base weights become FSDP shards, the LoRA parameters and the LM head stay
plain tensors (so the gradient all-reduce, the optimizer, checkpoints and PEFT saving see what they see
under ddp), the report counts them, and the sharded student computes exactly the hidden states of the
whole one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_shard_student_shards_the_base_layers_and_keeps_lora_and_head_whole(tiny_student, one_rank_group):
    from torch.distributed.tensor import DTensor

    from kiln_core.training.distributed.fsdp import shard_student
    from kiln_core.training.distributed.world import World
    from kiln_core.training.student import load_student

    whole = load_student(tiny_student, rank=4, alpha=8.0, seed=3, device="cpu")
    sharded = load_student(tiny_student, rank=4, alpha=8.0, seed=3, device="cpu")
    report = shard_student(sharded, World(rank=0, size=1, backend="gloo", strategy="fsdp"))

    layers = sharded.model.get_base_model().model.layers
    assert report.sharded_modules == len(layers) + 1  # every decoder layer, then the decoder as the root
    for name, param in sharded.model.named_parameters():
        if "lora_" in name:
            assert not isinstance(param, DTensor) and param.requires_grad, name
        elif ".layers." in name:
            assert isinstance(param, DTensor), name
    assert all(not isinstance(param, DTensor) for param in sharded.lora_parameters.values())
    assert not isinstance(sharded.head.weight, DTensor)

    lora = sum(param.numel() for param in sharded.lora_parameters.values())
    total = sum(param.numel() for param in whole.model.parameters())
    assert report.sharded_parameters + report.replicated_parameters == total
    assert report.local_parameters == report.sharded_parameters  # one rank holds all of every shard
    assert report.replicated_parameters >= lora + sharded.head.weight.numel()

    tokens = torch.tensor([1, 5, 9, 2])
    with torch.no_grad():
        assert torch.equal(sharded.hidden_states(tokens), whole.hidden_states(tokens))
