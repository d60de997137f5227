"""``strategy: fsdp``: the student's frozen base weights sharded across the ranks with FSDP2.

A data-parallel (``ddp``) run keeps a whole copy of the student on every rank. For a student that does
not fit one GPU, ``shard_student`` applies ``torch.distributed.fsdp.fully_shard`` (FSDP2) after the
LoRA wrap:

* **Every decoder layer is one FSDP unit, the inner decoder the root unit** (the embeddings and the
  final norm). ``Student.hidden_states`` calls the inner decoder, so its forward is what unshards the
  root unit; each layer's weights are all-gathered just before the layer runs and freed after it (and
  gathered again in backward, which needs them for the gradient flowing to the LoRA of earlier layers).
  Each rank holds ``1 / world size`` of every sharded weight, as a ``DTensor`` shard (``Shard(0)``).
* **Replicated, as under ddp**: the LoRA parameters (``ignored_params``: plain tensors, so the
  hand-made gradient all-reduce, the optimizer, the checkpoint files and PEFT's adapter saving stay
  exactly as they are) and the LM head (the loss projects only the rows it needs through
  ``Student.logit_head`` outside any module's forward, so no FSDP hook would gather it; with tied
  embeddings the input embedding is that same tensor and stays replicated with it).
* **Same values, same kernels**: an all-gather reassembles the exact fp32/bf16 weights, so on CPU the
  fsdp adapter equals the ddp adapter of the same world size byte for byte.
* **Every forward is collective**: all ranks must run the student together. Every rank trains its
  block of every step, and a rank without a candidate in the short last group runs a forward and
  backward whose gradients it discards (``step.train_step_distributed``). What would run the student on
  some ranks only is refused with several ranks whatever the strategy: the held-out watch
  (``eval_watch_distributed``) and on-policy sampling (one process only). Rank 0 alone saves the PEFT
  adapter, which reads only the replicated LoRA tensors (no collective).

On CUDA the mesh is ``cuda`` (each rank on ``cuda:<local_rank>``, nccl); on CPU ``cpu`` with gloo —
the device type is the only difference. CPU runs are refused at the front (``check_strategy``: the
point is GPU memory); they remain reachable below it so the code path is tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln_core.training.distributed.world import World
    from kiln_core.training.student import Student

__all__ = ["ShardingReport", "shard_student"]


@dataclass(frozen=True)
class ShardingReport:
    """What ``shard_student`` did, seen from this rank (rank 0's goes into the receipt).

    Attributes:
        sharded_modules: FSDP units (decoder layers + the root decoder).
        sharded_parameters: Base parameter elements sharded across the ranks (whole-model count).
        local_parameters: Of those, the elements this rank holds.
        replicated_parameters: Elements every rank holds whole (LoRA, LM head).
    """

    sharded_modules: int
    sharded_parameters: int
    local_parameters: int
    replicated_parameters: int

    def receipt_fields(self) -> dict[str, int]:
        return {"sharded_modules": self.sharded_modules, "sharded_parameters": self.sharded_parameters,
                "sharded_parameters_on_rank_0": self.local_parameters,
                "replicated_parameters": self.replicated_parameters}


def shard_student(student: "Student", world: "World") -> ShardingReport:
    """Shard the frozen base weights of ``student`` across ``world`` (in place); every rank calls it.

    Args:
        student: The loaded student, LoRA already wrapped (``load_student``) and on its device.
        world: The initialized process group (two or more ranks).

    Returns:
        ``ShardingReport`` of this rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from kiln_core.logit_head import decoder_of

    mesh = init_device_mesh(student.device.type, (world.size,))
    replicated = {*student.lora_parameters.values(), *student.head.parameters()}
    decoder = decoder_of(student.model)
    layers = list(decoder.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=replicated)
    fully_shard(decoder, mesh=mesh, ignored_params=replicated)

    sharded = local = whole = 0
    for param in student.model.parameters():
        if isinstance(param, DTensor):
            sharded += param.numel()
            local += param.to_local().numel()
        else:
            whole += param.numel()
    return ShardingReport(sharded_modules=len(layers) + 1, sharded_parameters=sharded, local_parameters=local,
                          replicated_parameters=whole)

