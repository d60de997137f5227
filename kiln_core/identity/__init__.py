"""Teacher identity: the content digests of Kiln's teacher identity (``scripts/vllm_teacher.py``,
``docs/VLLM_TEACHER_IDENTITY.md``) and the full identity of a local HF teacher.

Importing this package is cheap: transformers and torch load only when a tokenizer or the library
versions are actually needed.
"""

from kiln_core.identity.hashing import (
    IdentityHashError,
    adapter_config_sha256,
    adapter_weights_sha256,
    base_model_digest,
    base_model_sha256,
    model_vocab_size,
    select_weight_shards,
    sha256_file,
    tokenizer_config_sha256,
    tokenizer_vocab_sha256,
    vocab_digest,
)
from kiln_core.identity.local_teacher import (
    INFERENCE_CONFIG_SCHEMA,
    build_inference_config,
    implementation_string,
    local_teacher_identity,
    served_model_id_for,
    with_adapter,
)

__all__ = [
    "INFERENCE_CONFIG_SCHEMA",
    "IdentityHashError",
    "adapter_config_sha256",
    "adapter_weights_sha256",
    "base_model_digest",
    "base_model_sha256",
    "build_inference_config",
    "implementation_string",
    "local_teacher_identity",
    "model_vocab_size",
    "select_weight_shards",
    "served_model_id_for",
    "sha256_file",
    "tokenizer_config_sha256",
    "tokenizer_vocab_sha256",
    "vocab_digest",
    "with_adapter",
]
