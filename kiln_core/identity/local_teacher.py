"""The full ``kiln.teacher-identity.v1`` of a local Hugging Face teacher that kiln-flows scores itself.

docs/architecture.md, decision 6: the protocol is our own ``kiln-flows.hf-eager...`` string and the
implementation names kiln-flows, transformers and torch versions. ``inference_config_sha256`` hashes
our own canonical inference-config object (``kiln-flows.hf-inference-config.v1``): everything that
changes the logprobs our scorer would produce for the same weights and tokenizer.

A directory holding a PEFT adapter (``adapter_config.json`` naming a local base model directory) gets
the base model's digests plus an ``adapter`` object.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kiln_core.canonical import kiln_compact_json, sha256_hex
from kiln_core.contracts.identity import (
    IDENTITY_SCHEMA,
    KILN_FLOWS_PROTOCOL,
    LOGPROBS_MODE,
    MAX_TEXT_BYTES,
    TeacherIdentity,
)
from kiln_core.identity.hashing import (
    IdentityHashError,
    adapter_config_sha256,
    adapter_weights_sha256,
    base_model_sha256,
    config_value,
    load_fast_tokenizer,
    read_model_config,
    tokenizer_config_sha256,
    tokenizer_vocab_sha256,
)
from kiln_core.identity.model_files import check_model_files

INFERENCE_CONFIG_SCHEMA = "kiln-flows.hf-inference-config.v1"
MAX_PROMPT_LOGPROB_CANDIDATES = 1_000_000
DEFAULT_MAX_TOP_K = 32
DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
DEVICE_KINDS = ("cpu", "cuda")
_TOKENIZER_FILES = ("tokenizer.json",)
_SANITIZE = re.compile(r"[^A-Za-z0-9._/-]+")


def library_versions() -> dict[str, str]:
    """Versions of the libraries that decide our scorer's numerics, in a fixed key order."""
    import torch
    import transformers

    import kiln_core

    return {"kiln_flows": kiln_core.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def implementation_string(versions: dict[str, str] | None = None) -> str:
    """``kiln-flows/<version>/transformers-<version>/torch-<version>`` (checked ≤ 256 bytes).

    Example:
        >>> implementation_string({"kiln_flows": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0"})
        'kiln-flows/0.1.0/transformers-5.24.0/torch-2.13.0'
    """
    versions = versions or library_versions()
    text = f"kiln-flows/{versions['kiln_flows']}/transformers-{versions['transformers']}/torch-{versions['torch']}"
    if len(text.encode("utf-8")) > MAX_TEXT_BYTES:
        raise IdentityHashError("bad_implementation", f"implementation string exceeds {MAX_TEXT_BYTES} bytes: {text!r}")
    return text


def is_identity_text(value: str) -> bool:
    """Whether ``value`` satisfies the identity text rules (non-empty, ≤256 bytes, trimmed, no controls)."""
    from pydantic import TypeAdapter, ValidationError

    from kiln_core.contracts.identity import IdentityText

    try:
        TypeAdapter(IdentityText).validate_python(value)
    except ValidationError:
        return False
    return True


def served_model_id_for(alias: str | None, teacher_dir: str | Path) -> str:
    """The alias when it is valid identity text, else the directory name made safe.

    Example:
        >>> served_model_id_for(None, "/models/My Teacher (v2)")
        'My-Teacher-v2'
    """
    if alias is not None and is_identity_text(alias):
        return alias
    name = _SANITIZE.sub("-", Path(teacher_dir).resolve().name).strip("-._/")
    name = name.encode("utf-8")[:MAX_TEXT_BYTES].decode("utf-8", "ignore").rstrip("-._/")
    return name or "local-teacher"


def resolve_device_kind(device_kind: str | None) -> str:
    """``cuda`` when asked for or (if ``None``) when torch sees a GPU, else ``cpu``."""
    if device_kind is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_kind not in DEVICE_KINDS:
        raise IdentityHashError("bad_option", f"device_kind must be one of {list(DEVICE_KINDS)}, got {device_kind!r}")
    return device_kind


def build_inference_config(
    model_config_bytes: bytes,
    *,
    dtype: str,
    attn_implementation: str,
    device_kind: str,
    versions: dict[str, str],
    max_top_k: int,
    max_model_len: int,
) -> dict[str, Any]:
    """Our canonical inference-config object; key order is part of the digest.

    Example:
        >>> cfg = build_inference_config(b"{}", dtype="float32", attn_implementation="eager",
        ...     device_kind="cpu", versions={"kiln_flows": "0.1.0", "torch": "2", "transformers": "5"},
        ...     max_top_k=32, max_model_len=2048)
        >>> list(cfg)[:3]
        ['schema', 'model_config_sha256', 'dtype']
    """
    return {
        "schema": INFERENCE_CONFIG_SCHEMA,
        "model_config_sha256": sha256_hex(model_config_bytes),
        "dtype": dtype,
        "attn_implementation": attn_implementation,
        "device_kind": device_kind,
        "library_versions": {
            "kiln_flows": versions["kiln_flows"],
            "torch": versions["torch"],
            "transformers": versions["transformers"],
        },
        "max_top_k": max_top_k,
        "max_model_len": max_model_len,
    }


def _adapter_base_dir(teacher_dir: Path) -> Path | None:
    """The local base model directory of a PEFT adapter dir, or ``None`` for a plain model dir."""
    config_path = teacher_dir / "adapter_config.json"
    if not config_path.exists():
        return None
    try:
        base = json.loads(config_path.read_bytes()).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        raise IdentityHashError("bad_adapter", f"{config_path} is not a JSON object") from None
    if not isinstance(base, str) or not base:
        raise IdentityHashError("bad_adapter", f"{config_path} has no base_model_name_or_path")
    base_dir = Path(base) if Path(base).is_absolute() else (teacher_dir / base)
    if not base_dir.is_dir():
        base_dir = Path(base)
    if not base_dir.is_dir():
        raise IdentityHashError(
            "adapter_base_not_local",
            f"adapter base model {base!r} is not a local directory; hub ids are not supported for local teachers",
        )
    return base_dir.resolve()


def local_teacher_identity(
    teacher_dir: str | Path,
    *,
    served_model_id: str | None = None,
    max_top_k: int = DEFAULT_MAX_TOP_K,
    max_model_len: int | None = None,
    dtype: str | None = None,
    attn_implementation: str = "eager",
    device_kind: str | None = None,
    max_workers: int | None = None,
) -> TeacherIdentity:
    """Compute the complete identity of a local HF teacher directory.

    Args:
        teacher_dir: A model directory (safetensors + fast tokenizer + ``config.json``), or a PEFT
            adapter directory whose ``base_model_name_or_path`` is a local model directory.
        served_model_id: Name the scorer answers to; default: the directory name made safe.
        max_top_k: Most top-K candidates the scorer returns per position.
        max_model_len: Context cap; default ``max_position_embeddings`` from the config.
        dtype: ``float32`` / ``bfloat16`` / ``float16``; default ``float32`` on CPU, ``bfloat16`` on CUDA.
        attn_implementation: Attention kernel the scorer loads the model with.
        device_kind: ``cpu`` or ``cuda``; default: ``cuda`` if torch sees a GPU.
        max_workers: Weight shards hashed at once.

    Returns:
        A validated ``TeacherIdentity`` with our protocol and implementation strings.

    Raises:
        IdentityHashError: unhashable input, or options/bounds the identity contract refuses.

    Example:
        >>> identity = local_teacher_identity("teacher/", served_model_id="teacher-small")  # doctest: +SKIP
        >>> identity.protocol  # doctest: +SKIP
        'kiln-flows.hf-eager.prompt-logprobs.numeric-token-ids.causal.v1'
    """
    root = Path(teacher_dir)
    if not root.is_dir():
        raise IdentityHashError("missing_dir", f"teacher directory {root} does not exist or is not a directory")
    root = root.resolve()
    device_kind = resolve_device_kind(device_kind)
    dtype = dtype or ("bfloat16" if device_kind == "cuda" else "float32")
    if dtype not in DTYPES:
        raise IdentityHashError("bad_option", f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise IdentityHashError(
            "bad_option",
            f"attn_implementation must be one of {list(ATTN_IMPLEMENTATIONS)}, got {attn_implementation!r}",
        )
    served = served_model_id if served_model_id is not None else served_model_id_for(None, root)

    base_dir = _adapter_base_dir(root)
    model_dir = base_dir or root
    # The model's files must parse before anything is hashed; an adapter's weights are checked where the
    # teacher loads (``LocalTeacher.load``): its identity only hashes their bytes.
    check_model_files(model_dir, role="teacher")
    adapter = None
    if base_dir is not None:
        adapter = {
            "name": served,
            "weights_sha256": adapter_weights_sha256(root),
            "config_sha256": adapter_config_sha256(root),
        }
    # An adapter dir may ship its own tokenizer (added tokens); otherwise the base model's applies.
    tokenizer_dir = root if any((root / name).exists() for name in _TOKENIZER_FILES) else model_dir
    tokenizer = load_fast_tokenizer(tokenizer_dir)

    config_bytes, config = read_model_config(model_dir)
    vocab_size = config_value(config, "vocab_size")
    if vocab_size is None:
        raise IdentityHashError("bad_config", f"{model_dir / 'config.json'} has no vocab_size")
    if max_model_len is None:
        max_model_len = config_value(config, "max_position_embeddings")
        if max_model_len is None:
            raise IdentityHashError("bad_config", "config.json has no max_position_embeddings; pass max_model_len")
    versions = library_versions()
    inference_config = build_inference_config(
        config_bytes,
        dtype=dtype,
        attn_implementation=attn_implementation,
        device_kind=device_kind,
        versions=versions,
        max_top_k=max_top_k,
        max_model_len=max_model_len,
    )
    fields = {
        "schema": IDENTITY_SCHEMA,
        "protocol": KILN_FLOWS_PROTOCOL,
        "served_model_id": served,
        "base_model_sha256": base_model_sha256(model_dir, max_workers=max_workers),
        "tokenizer_vocab_sha256": tokenizer_vocab_sha256(tokenizer),
        "tokenizer_config_sha256": tokenizer_config_sha256(tokenizer),
        "adapter": adapter,
        "vocab_size": vocab_size,
        "max_top_k": max_top_k,
        "max_model_len": max_model_len,
        "max_prompt_logprob_candidates": MAX_PROMPT_LOGPROB_CANDIDATES,
        "logprobs_mode": LOGPROBS_MODE,
        "implementation": implementation_string(versions),
        "inference_config_sha256": sha256_hex(kiln_compact_json(inference_config).encode("utf-8")),
    }
    return _validated_identity(fields)


def with_adapter(identity: TeacherIdentity, *, name: str, adapter_dir: str | Path) -> TeacherIdentity:
    """The identity of ``identity``'s base model wearing the LoRA in ``adapter_dir`` (Kiln's ``with_static_adapter``).

    Kiln's rule for a local teacher with a LoRA: the bare base's identity with ``adapter = {name,
    weights_sha256, config_sha256}`` put in its place; every other field, ``served_model_id`` included,
    stays the base's.

    Args:
        identity: The bare base model's identity (its ``adapter`` must be null).
        name: The adapter's name, recorded as ``adapter.name``.
        adapter_dir: A local PEFT adapter directory (``adapter_config.json`` + the weights file).

    Raises:
        IdentityHashError: the base already wears an adapter (``bad_adapter``), or the adapter's files
            cannot be hashed (``missing_file``, ``adapter_weights``, ...).

    Example:
        >>> lora = with_adapter(base_identity, name="my-lora", adapter_dir="./my-lora")  # doctest: +SKIP
        >>> lora.adapter["name"], lora.served_model_id == base_identity.served_model_id  # doctest: +SKIP
        ('my-lora', True)
    """
    if identity.adapter is not None:
        raise IdentityHashError("bad_adapter", f"the base identity {identity.served_model_id!r} already names adapter "
                                f"{identity.adapter.name!r}; a LoRA teacher's base must be a bare model")
    fields = identity.as_ordered_dict()
    fields["adapter"] = {
        "name": name,
        "weights_sha256": adapter_weights_sha256(adapter_dir),
        "config_sha256": adapter_config_sha256(adapter_dir),
    }
    return _validated_identity(fields)


def _validated_identity(fields: dict[str, Any]) -> TeacherIdentity:
    from pydantic import ValidationError

    try:
        return TeacherIdentity.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "identity"
        raise IdentityHashError("invalid_identity", f"teacher identity field `{where}`: {first['msg']}") from None
