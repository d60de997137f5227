"""Which layers of a student its LoRA adapts: every linear projection of attention and MLP, read from the model.

A fixed list of names adapts only the layers a family happens to name that way: Phi-3 fuses its attention into
``qkv_proj`` and its MLP's gate and up projections into ``gate_up_proj``, so a ``q_proj``…``down_proj`` list would
train ``o_proj`` and ``down_proj`` alone, silently. So the targets are resolved from the model itself:

* **modules** — the name (last path component) of every ``nn.Linear`` (or GPT-2-style ``Conv1D``) inside the
  decoder's layers, fused projections included; never the embeddings or the LM head, which sit outside the layers
  and stay frozen. A mixture-of-experts router (a linear map to one score per expert, or to a single gate value)
  is not a projection and is left out.
* **parameters** — a mixture-of-experts block that keeps its experts' projections as one 3-D tensor
  (``Qwen3MoeExperts.gate_up_proj`` ``[experts, 2·intermediate, hidden]``) is no linear module; PEFT adapts such
  tensors through ``target_parameters``, named by their path inside a decoder layer (``mlp.experts.down_proj``).

For the Llama and Qwen families the result is exactly Kiln's seven projections (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``), so their adapters, checkpoints and tensor names are what they
were when the list was fixed. The targets are read from ``config.json`` alone (the model is built on PyTorch's
``meta`` device: no weights are read), so a run knows them before any data stage, records them in its checkpoints
when they differ from Kiln's seven, and refuses a model where nothing matches.
"""

from __future__ import annotations

import os
import re
from typing import Any

from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.logit_head import UnsupportedArchitecture

__all__ = ["lora_targets_of", "resolve_lora_targets"]

_LAYER_PATH = re.compile(r"(?:^|\.)\d+\.(.+)$")  # inside the first numbered block: a decoder layer


def lora_targets_of(model: Any) -> LoraTargets:
    """The LoRA targets of a transformers causal LM (any device, ``meta`` included).

    Raises:
        UnsupportedArchitecture: ``unsupported_architecture`` — no linear projection found in the decoder layers.
    """
    import torch
    from transformers.pytorch_utils import Conv1D

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    modules: set[str] = set()
    parameters: set[str] = set()
    for name, module in base.named_modules():
        inside = _LAYER_PATH.search(name)
        if inside is None:  # embeddings, the final norm, the LM head: outside the decoder layers
            continue
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            width = module.out_features if isinstance(module, torch.nn.Linear) else module.nf
            if width == 1 or (experts and width == int(experts)):  # a router or a gate value, not a projection
                continue
            modules.add(name.rsplit(".", 1)[-1])
        else:
            for param_name, param in module.named_parameters(recurse=False):
                if param.dim() == 3 and param_name.endswith("_proj"):  # experts kept as one [E, out, in] tensor
                    parameters.add(f"{inside.group(1)}.{param_name}")
    if not modules and not parameters:
        raise UnsupportedArchitecture(
            "unsupported_architecture",
            f"model type {getattr(config, 'model_type', type(base).__name__)!r}: no linear projection in its decoder "
            "layers for LoRA to adapt")
    return LoraTargets(modules=tuple(sorted(modules)), parameters=tuple(sorted(parameters)))


def resolve_lora_targets(student_dir: str | os.PathLike[str]) -> LoraTargets:
    """``lora_targets_of`` the student in ``student_dir``, built from its ``config.json`` on the ``meta`` device.

    Example:
        >>> resolve_lora_targets("./kiln-data/demo-models/student").modules  # doctest: +SKIP
        ('down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj')
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln_core.errors import Rejection
    from kiln_core.identity.hashing import IdentityHashError, read_model_config

    try:  # names the file, and the snapshot to give when a Hugging Face cache folder was given instead
        read_model_config(student_dir)
    except IdentityHashError as error:
        raise Rejection("invalid_student", error.message, field="student") from None
    try:
        config = AutoConfig.from_pretrained(str(student_dir), local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as error:  # a model type this transformers does not know as a causal LM
        raise UnsupportedArchitecture("unsupported_architecture", f"{student_dir}: transformers cannot build a causal "
                                      f"LM from its config.json: {str(error).splitlines()[0]}") from None
    return lora_targets_of(skeleton)
