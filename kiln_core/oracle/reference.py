"""The independent reference: tokenizer re-checks and one eager Hugging Face forward pass.

This is Kiln's ``scripts/qualification/qwen35_hf_logits.py`` without the ROCm/Qwen3.5 pins: any local causal LM that
``AutoModelForCausalLM`` loads, on CUDA when available and otherwise on CPU.

* **Tokenizer re-check** — re-rendering ``messages`` with ``add_generation_prompt=True,
  enable_thinking=False`` must give ``prompt.token_ids`` (``prompt_render_mismatch``); every prefix
  and candidate id decoded alone must give its recorded text (``token_text_mismatch``); every id
  must be below the model's vocabulary size (``token_id_out_of_range``).
* **Forward** — ``attn_implementation="eager"``, ``use_cache=False``, one pass over the whole
  ``[1, N]`` int64 input under ``torch.inference_mode()``; the last position's logits cast to
  float32. No sampling, no KV cache, no incremental decode.
* **Determinism** — ``manual_seed(20260715)``, deterministic algorithms, TF32 off, matmul precision
  ``highest`` and, on CUDA, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS refuses deterministic mode
  without it). These are process-global torch settings, so they are restored on exit.

Failures of loading or running the model raise ``OracleRunError`` (the CLI's exit 3); contract
failures raise ``OracleRejection`` (exit 2). torch and transformers are imported inside functions.

Example:
    >>> out = run_reference("./student", loaded.request, dtype="fp32")  # doctest: +SKIP
    >>> out.logits.shape  # doctest: +SKIP
    torch.Size([400])
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from kiln_core.contracts.oracle_request import HfNextTokenRequest
from kiln_core.oracle.errors import OracleRejection, OracleRunError

SEED = 20260715
ATTENTION_IMPLEMENTATION = "eager"
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
Dtype = Literal["bf16", "fp32"]


@dataclass(frozen=True)
class ReferenceOutput:
    """What the forward pass produced and where it ran.

    Attributes:
        logits: float32 CPU tensor ``[V]``: the distribution after the last forced token.
        input_ids: The ids fed to the model, ``N`` of them.
        device: ``cuda`` or ``cpu``.
        device_name: GPU name or ``cpu``; diagnostic only.
        dtype: ``bf16`` or ``fp32``: the dtype the model ran in.
        torch_version: ``torch.__version__``.
        transformers_version: ``transformers.__version__``.
    """

    logits: Any
    input_ids: list[int]
    device: str
    device_name: str
    dtype: str
    torch_version: str
    transformers_version: str


# ------------------------------------------------------------------------------------------ tokenizer


def load_tokenizer(model_dir: str | Path):
    """``AutoTokenizer`` from the local directory only (no hub access)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - a tokenizer that does not load is a failed run
        raise OracleRunError(f"cannot load the tokenizer: {type(error).__name__}: {error}") from error


def render_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Render and tokenize the prompt exactly as the serving engines did (thinking off).

    Example:
        >>> render_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])  # doctest: +SKIP
        [1, 87, 85, 201, 72, 73, 2, 201, 1, 67, 85, 85, 295, 275, 86, 201]
    """
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, enable_thinking=False
    )
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    if ids and isinstance(ids[0], list):  # batched output: un-nest one level
        ids = ids[0]
    return [int(token) for token in ids]


def decode_one(tokenizer, token_id: int) -> str:
    """Decode one id alone, special tokens kept, no clean-up (the text a request records)."""
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_token_range(request: HfNextTokenRequest, vocab_size: int) -> None:
    """Every input, prefix and candidate id must index the model's logits.

    Raises:
        OracleRejection: ``token_id_out_of_range`` naming the field.
    """
    places = [(f"input_token_ids[{i}]", token) for i, token in enumerate(request.input_token_ids)]
    places += [(f"candidates[{i}].token_id", item.token_id) for i, item in enumerate(request.candidates)]
    for where, token in places:
        if token >= vocab_size:
            raise OracleRejection("token_id_out_of_range", f"{where} = {token} is not below the model vocab_size {vocab_size}")


def check_tokenization(tokenizer, request: HfNextTokenRequest) -> None:
    """Re-render the prompt and re-decode each prefix and candidate id (the tokenizer re-check of Kiln's
    ``scripts/qualification/qwen35_hf_logits.py``).

    Raises:
        OracleRejection: ``prompt_render_mismatch`` or ``token_text_mismatch``.
    """
    messages = [message.model_dump() for message in request.prompt.messages]
    rendered = render_prompt_ids(tokenizer, messages)
    expected = list(request.prompt.token_ids)
    if rendered != expected:
        first = next((i for i, (a, b) in enumerate(zip(rendered, expected)) if a != b), min(len(rendered), len(expected)))
        raise OracleRejection(
            "prompt_render_mismatch",
            f"the chat template renders {len(rendered)} ids, prompt.token_ids has {len(expected)}; first difference at index {first}",
        )
    tokens = [(f"continuation_prefix[{i}]", item.token_id, item.text) for i, item in enumerate(request.continuation_prefix)]
    tokens += [(f"candidates[{i}]", item.token_id, item.text) for i, item in enumerate(request.candidates)]
    for where, token_id, text in tokens:
        decoded = decode_one(tokenizer, token_id)
        if decoded != text:
            raise OracleRejection("token_text_mismatch", f"{where}: id {token_id} decodes to {decoded!r}, request says {text!r}")


def check_model_inputs(model_dir: str | Path, request: HfNextTokenRequest, tokenizer=None) -> None:
    """Id range against the model's vocab, then the tokenizer re-check; no weights are loaded.

    Raises:
        OracleRejection: ``token_id_out_of_range``, ``prompt_render_mismatch``, ``token_text_mismatch``.
        OracleRunError: ``config.json`` cannot be loaded.
    """
    check_token_range(request, model_vocab_size(model_dir))
    check_tokenization(load_tokenizer(model_dir) if tokenizer is None else tokenizer, request)


def model_vocab_size(model_dir: str | Path) -> int:
    """The logit width from ``config.json`` (text config for multimodal wrappers)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any load failure is a failed run, reported verbatim
        raise OracleRunError(f"cannot load config.json: {error}") from error
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.vocab_size)


# ------------------------------------------------------------------------------------------ forward


def select_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def deterministic_torch(device: str) -> Iterator[None]:
    """Apply the oracle's determinism settings for the duration of the block, then restore them."""
    if device.startswith("cuda"):
        # Read by cuBLAS when its first handle is created, so it must be set before any CUDA work.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    import torch

    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    rng_devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=rng_devices):
        try:
            torch.manual_seed(SEED)
            torch.use_deterministic_algorithms(True)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
            yield
        finally:
            torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
            torch.backends.cuda.matmul.allow_tf32 = saved[2]
            torch.backends.cudnn.allow_tf32 = saved[3]
            torch.set_float32_matmul_precision(saved[4])


def forward_last_logits(model_dir: str | Path, input_ids: list[int], *, dtype: Dtype, device: str):
    """Load the model eagerly and return the float32 logits of the last position, on CPU.

    Raises:
        OracleRunError: The model failed to load or run, or produced non-finite logits.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch_dtype, local_files_only=True, attn_implementation=ATTENTION_IMPLEMENTATION
        )
        model.eval().to(device)
        ids = torch.tensor([input_ids], dtype=torch.int64, device=device)  # [1, N]
        with torch.inference_mode():
            output = model(input_ids=ids, use_cache=False)
        logits = output.logits[0, -1].float().cpu().contiguous()  # [V]
    except Exception as error:  # noqa: BLE001 - every model failure is exit 3 with its message
        raise OracleRunError(f"reference forward pass failed: {type(error).__name__}: {error}") from error
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if logits.dim() != 1 or not bool(torch.isfinite(logits).all()):
        raise OracleRunError(f"reference logits must be a finite vector, got shape {tuple(logits.shape)}")
    return logits


def run_reference(
    model_dir: str | Path,
    request: HfNextTokenRequest,
    *,
    dtype: Dtype = "bf16",
    device: str | None = None,
    tokenizer=None,
    inputs_checked: bool = False,
) -> ReferenceOutput:
    """Re-check the tokenization, then run the one eager forward pass.

    Args:
        model_dir: The model directory whose identity already matched the request.
        request: The validated request.
        dtype: ``bf16`` (Kiln's setting) or ``fp32``.
        device: ``cuda``/``cpu``; ``None`` picks CUDA when available.
        tokenizer: An already loaded tokenizer of ``model_dir``; loaded here when ``None``.
        inputs_checked: ``check_model_inputs`` already passed for this request; skip repeating it.

    Returns:
        The last-position logits and the runtime description.

    Raises:
        OracleRejection: ``token_id_out_of_range``, ``prompt_render_mismatch``, ``token_text_mismatch``.
        OracleRunError: The forward pass failed.
    """
    if device is None or device.startswith("cuda"):
        # Before torch touches CUDA at all: cuBLAS reads it when its first handle is created.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    import torch
    import transformers

    device = device or select_device()
    vocab_size = model_vocab_size(model_dir)
    if not inputs_checked:
        check_model_inputs(model_dir, request, tokenizer)
    input_ids = list(request.input_token_ids)
    with deterministic_torch(device):
        logits = forward_last_logits(model_dir, input_ids, dtype=dtype, device=device)
    if logits.numel() != vocab_size:
        raise OracleRunError(f"reference logits have {logits.numel()} entries, config vocab_size is {vocab_size}")
    device_name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return ReferenceOutput(
        logits=logits,
        input_ids=input_ids,
        device=device,
        device_name=device_name,
        dtype=dtype,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
    )
