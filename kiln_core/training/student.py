"""The student: a Hugging Face causal LM with a seeded LoRA adapter, and the hidden rows the loss needs.

Choices, and why:

* **LoRA targets every linear projection of attention and MLP** (``q_proj``, ``k_proj``, ``v_proj``,
  ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``). Kiln picks its set inside
  ``TrainableLoraParams`` and the public sources do not say which (``crates/kiln-train/src/opd.rs``;
  unconfirmed); the all-linear set is the common choice for distillation students and the superset of the alternatives.
  Embeddings and the LM head stay frozen, so the loss never allocates a ``[V, H]`` gradient.
* **Seeded init independent of the device and of global RNG state**: ``lora_A`` gets PEFT's own
  Kaiming-uniform init drawn from a CPU ``torch.Generator`` seeded with the run's seed, in sorted
  parameter-name order; ``lora_B`` starts at zero. Same seed → identical adapter at step 0 on any
  device, and loading the model never perturbs the RNG streams a checkpoint restores.
* **No dropout**: every dropout probability is forced to 0 so a step is a pure function of the
  weights and the candidate (Kiln's OPD step has no dropout either); exact resume needs no RNG.
* **Precision**: ``fp32`` = fp32 weights and activations (CPU default, bit-exact resume);
  ``bf16`` = bf16 base weights and bf16 autocast, with fp32 LoRA parameters, gradients and
  optimizer state (CUDA default). The loss always upcasts to fp32.
* **No logits**: ``hidden_states`` calls the inner decoder (``get_base_model().model``), whose
  ``last_hidden_state`` is already post-final-norm for Qwen3 (``Qwen3Model.forward`` applies
  ``self.norm``), and the loss projects only the rows and ids it needs through the LM head.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kiln_core.canonical import sha256_hex

__all__ = ["LORA_TARGET_MODULES", "Student", "load_student", "student_identity", "kiln_parameter_key", "resolve_device"]

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_NAME = "default"  # PEFT's adapter slot; part of the stable parameter names


def resolve_device(device: str | None = None) -> torch.device:
    """``cuda`` when available (or requested), else ``cpu``."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def resolve_precision(device: torch.device, precision: str | None = None) -> str:
    """``bf16`` on CUDA and ``fp32`` on CPU unless asked otherwise."""
    precision = precision or ("bf16" if device.type == "cuda" else "fp32")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16'; got {precision!r}")
    return precision


def kiln_parameter_key(name: str) -> str:
    """Kiln's checkpoint key of a LoRA parameter: PEFT's name without the adapter slot.

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` becomes
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, the form Kiln's
    ``trainer/lora_parameters.rs`` ``checkpoint_parameter_key`` writes.
    """
    return name.replace(f".lora_A.{ADAPTER_NAME}.", ".lora_A.").replace(f".lora_B.{ADAPTER_NAME}.", ".lora_B.")


def lora_module(name: str) -> str:
    """The projection a LoRA parameter adapts (``q_proj``, ``down_proj``, ...)."""
    return name.split(".lora_")[0].rsplit(".", 1)[-1]


@dataclass
class Student:
    """A loaded student with its trainable LoRA parameters.

    Attributes:
        model: The ``peft.PeftModel``.
        device: Where it runs.
        precision: ``fp32`` or ``bf16``.
        lora_parameters: Trainable parameters by stable name, in sorted name order.
        sharding: With ``strategy: fsdp``, this rank's view of the sharded base weights
            (``distributed.fsdp.ShardingReport.receipt_fields``); None when the student is whole.
    """

    model: Any
    device: torch.device
    precision: str
    lora_parameters: dict[str, torch.nn.Parameter]
    sharding: dict[str, int] | None = None

    @property
    def head(self) -> torch.nn.Module:
        return self.model.get_base_model().get_output_embeddings()

    @property
    def head_weight(self) -> torch.Tensor:
        """LM head weight ``[V, H]`` (frozen)."""
        return self.head.weight

    @property
    def head_bias(self) -> torch.Tensor | None:
        return getattr(self.head, "bias", None)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states of one unpadded sequence: ``[L] -> [L, H]``."""
        decoder = self.model.get_base_model().model
        with self.autocast():
            out = decoder(input_ids=input_ids[None], use_cache=False)
        return out.last_hidden_state[0]

    def packed_hidden_states(self, sequences: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``hidden_states`` of several unpadded sequences in one forward pass: ``[L_i] -> [L_i, H]`` each.

        The sequences are laid end to end with positions restarting at 0 for each. transformers reads restarting
        positions (with no attention mask) as packed sequences and masks attention block-diagonally, so each token
        sees only its own sequence and every row equals its sequence's own forward up to float rounding
        (``check_packing`` verifies this for the student's architecture).
        """
        decoder = self.model.get_base_model().model
        ids = torch.cat(list(sequences))[None]
        positions = torch.cat([torch.arange(int(s.shape[0]), device=ids.device) for s in sequences])[None]
        with self.autocast():
            out = decoder(input_ids=ids, position_ids=positions, use_cache=False)
        return list(out.last_hidden_state[0].split([int(s.shape[0]) for s in sequences]))

    def check_packing(self) -> None:
        """Refuse ``pack_sequences`` for an architecture whose attention does not keep packed sequences apart.

        Two short sequences go through the model packed and alone. The first cannot see the second (causal), so
        its difference measures the precision's own rounding of another shape (about 1e-6 in fp32, 3e-2 in bf16);
        the second's may exceed that only if it sees the first.

        Raises:
            ConfigError: ``unsupported`` on ``config.pack_sequences``, when the second sequence's hidden states
                move further than rounding explains.
        """
        from kiln_core.contracts.opd_config import ConfigError

        vocab = int(self.head_weight.shape[0])
        sequences = [torch.arange(5, device=self.device) % vocab, (torch.arange(7, device=self.device) * 3 + 1) % vocab]
        with torch.no_grad():
            packed = self.packed_hidden_states(sequences)
            alone = [self.hidden_states(ids) for ids in sequences]
        moved = [float(((p.float() - a.float()).norm(dim=-1) / a.float().norm(dim=-1).clamp_min(1e-12)).max())
                 for p, a in zip(packed, alone)]
        rounding = max(1e-4, 4 * moved[0])
        if moved[1] > rounding:
            raise ConfigError(f"pack_sequences: this student's architecture ({type(self.model.get_base_model()).__name__}) "
                              f"lets packed sequences see each other (a packed sequence's hidden states moved by "
                              f"{moved[1]:.2g}, rounding explains {rounding:.2g}); train them one after another",
                              "config.pack_sequences", code="unsupported")

    def checkpoint_keys(self) -> dict[str, torch.nn.Parameter]:
        """The LoRA parameters under Kiln's checkpoint keys, in sorted order."""
        return {kiln_parameter_key(name): p for name, p in self.lora_parameters.items()}

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """CPU copies of the LoRA parameters under Kiln's keys (``adapter.safetensors``)."""
        return {key: p.detach().to("cpu", copy=True).contiguous() for key, p in self.checkpoint_keys().items()}

    def load_adapter_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the LoRA parameters with checkpointed values (exact names, shapes and dtypes).

        Raises:
            ResumeError: ``resume_adapter_tensors`` (Kiln: "checkpoint adapter parameter set mismatch").
        """
        from kiln_core.contracts.checkpoint import ResumeError

        keys = self.checkpoint_keys()
        if set(tensors) != set(keys):
            missing, extra = sorted(set(keys) - set(tensors))[:3], sorted(set(tensors) - set(keys))[:3]
            raise ResumeError("resume_adapter_tensors", f"checkpoint adapter parameter set mismatch (missing {missing}, "
                              f"unexpected {extra})", file="adapter.safetensors")
        for key, param in keys.items():
            value = tensors[key]
            if tuple(value.shape) != tuple(param.shape) or value.dtype != param.dtype:
                raise ResumeError("resume_adapter_tensors", f"checkpoint adapter tensor {key} is {value.dtype} "
                                  f"{tuple(value.shape)}, expected {param.dtype} {tuple(param.shape)}", file="adapter.safetensors")
        with torch.no_grad():
            for key, param in keys.items():
                param.copy_(tensors[key].to(device=param.device))

    def peft_adapter_files(self) -> dict[str, bytes]:
        """``adapter_model.safetensors`` and ``adapter_config.json`` as PEFT writes them.

        PEFT's own ``save_pretrained`` is used so the directory loads with
        ``PeftModel.from_pretrained``; ``target_modules`` is re-sorted because PEFT keeps it as a set
        and would otherwise write it in a hash-seed-dependent order.
        """
        with tempfile.TemporaryDirectory(prefix="kiln-adapter-") as tmp:
            self.model.save_pretrained(tmp, safe_serialization=True)
            weights = Path(tmp, "adapter_model.safetensors").read_bytes()
            config = json.loads(Path(tmp, "adapter_config.json").read_text(encoding="utf-8"))
        if isinstance(config.get("target_modules"), list):
            config["target_modules"] = sorted(config["target_modules"])
        config_bytes = json.dumps(config, indent=2, sort_keys=True).encode("utf-8")
        return {"adapter_model.safetensors": weights, "adapter_config.json": config_bytes}


def load_student(
    student_dir: str | os.PathLike[str],
    *,
    rank: int,
    alpha: float,
    seed: int,
    device: str | None = None,
    precision: str | None = None,
    gradient_checkpointing: bool = False,
) -> Student:
    """Load the student model and wrap it with a freshly, deterministically initialized LoRA adapter.

    Args:
        student_dir: Local Hugging Face model directory.
        rank: LoRA rank r.
        alpha: LoRA alpha (scale = alpha / r).
        seed: Seed of the LoRA init (the run's effective seed).
        device: ``cpu``/``cuda``; default CUDA when available.
        precision: ``fp32``/``bf16``; default bf16 on CUDA, fp32 on CPU.
        gradient_checkpointing: Recompute decoder layers in backward (less memory, same math).

    Returns:
        The ``Student``.

    Example:
        >>> student = load_student("./student", rank=16, alpha=32.0, seed=7)  # doctest: +SKIP
        >>> student.hidden_states(torch.tensor([1, 2, 3])).shape  # doctest: +SKIP
        torch.Size([3, 64])
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kiln_core.identity.model_files import check_model_files

    check_model_files(student_dir, role="student")  # refused naming the file, not deep inside transformers
    device_ = resolve_device(device)
    precision_ = resolve_precision(device_, precision)
    dtype = torch.bfloat16 if precision_ == "bf16" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=dtype, local_files_only=True)
    base.requires_grad_(False)
    _disable_dropout(base)
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(LORA_TARGET_MODULES),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora, adapter_name=ADAPTER_NAME)
    params = {name: p for name, p in sorted(model.named_parameters()) if p.requires_grad}
    for name, p in params.items():
        if p.dtype != torch.float32:  # LoRA master weights are always fp32
            p.data = p.data.float()
    _seeded_lora_init(params, seed)
    model.to(device_)
    if gradient_checkpointing:
        base_model = model.get_base_model()
        kwargs = {"use_reentrant": False}  # non-reentrant: works although the inputs need no grad
        if hasattr(base_model, "activation_checkpointing_enable"):  # transformers >= 5 name
            base_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # train() only so that gradient checkpointing is active; dropout is already 0 everywhere.
    model.train()
    return Student(model=model, device=device_, precision=precision_, lora_parameters=params)


def _disable_dropout(model: torch.nn.Module) -> None:
    """Force every dropout probability to 0 (a step must not depend on RNG state)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if hasattr(model.config, "attention_dropout"):
        model.config.attention_dropout = 0.0


def _seeded_lora_init(params: dict[str, torch.nn.Parameter], seed: int) -> None:
    """PEFT's default LoRA init (Kaiming-uniform A, zero B), drawn from a private CPU generator."""
    generator = torch.Generator(device="cpu").manual_seed(int(seed) % 2**64)
    with torch.no_grad():
        for name, param in params.items():  # sorted name order: part of the init's definition
            if ".lora_A." in name:
                value = torch.empty(param.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
                param.copy_(value)
            elif ".lora_B." in name:
                param.zero_()


def student_identity(student_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Digests that pin the student's config and tokenizer (raw hex), for checkpoints and receipts.

    ``model_config_sha256`` hashes the exact ``config.json`` bytes; the tokenizer digests follow
    ``StudentTokenizer.identity`` (backend JSON, chat template text). The base weights are pinned
    separately, shard by shard (``run_identity.base_weight_shard_manifest``).
    """
    from kiln_core.tokenization import load_student_tokenizer

    tokenizer = load_student_tokenizer(student_dir).identity()
    return {
        "model_config_sha256": sha256_hex(Path(student_dir, "config.json").read_bytes()),
        "tokenizer_config_sha256": tokenizer["tokenizer_config_sha256"],
        "tokenizer_vocab_sha256": tokenizer["tokenizer_vocab_sha256"],
        "chat_template_sha256": tokenizer["chat_template_sha256"],
    }
