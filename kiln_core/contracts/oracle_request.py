"""``kiln.hf-next-token-request.v1``: the oracle request, as strict pydantic models.

Field names, bounds and patterns are those of Kiln's ``scripts/qualification/hf_next_token_contract.py``
and the JSON Schema kiln-flows ships beside ``kiln_core.oracle`` (``hf-next-token-request-v1.schema.json``).
Loading a request file, the schema check and the rules that span fields are
``kiln_core.oracle.request``; these models only type what passed them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["REQUEST_SCHEMA", "MAX_TOKEN_ID", "ReceiptReference", "Source", "WeightFile", "ModelIdentity", "Generator",
           "Message", "TemplateKwargs", "Prompt", "Token", "Candidate", "HfNextTokenRequest"]

REQUEST_SCHEMA = "kiln.hf-next-token-request.v1"
MAX_TOKEN_ID = 248_319  # the seed's Qwen3.5-4B vocabulary; the live model's bound is checked later

Sha256 = Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
NonEmpty = Annotated[str, Field(min_length=1)]


class _Closed(BaseModel):
    # strict: JSON booleans and floats are never accepted where the contract says integer.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)


class ReceiptReference(_Closed):
    """A repository-relative qualification receipt and the two digests that bind it."""

    path: NonEmpty
    """Normalized repository-relative POSIX path of the receipt."""
    file_sha256: Sha256
    """SHA-256 of the receipt file's exact bytes."""
    content_sha256: Sha256
    """Must equal the receipt's own ``receipt_sha256`` (its canonical self-hash)."""


class Source(_Closed):
    """The source revision and the two receipts that produced the disputed candidates."""

    source_commit: Annotated[str, Field(pattern=r"^[0-9a-f]{40}$")]
    kiln_receipt: ReceiptReference
    vllm_receipt: ReceiptReference


class WeightFile(_Closed):
    """One weight shard: path inside the model directory, exact size, SHA-256 of its bytes."""

    path: NonEmpty
    bytes: Annotated[int, Field(ge=1)]
    sha256: Sha256


class ModelIdentity(_Closed):
    """Content identity of the model directory (Kiln's ``scripts/qualification/model_fingerprint.py``);
    requests carry it without ``path``."""

    id: NonEmpty
    content_sha256: Sha256
    config_hash: Sha256
    tokenizer_hash: Sha256
    chat_template_hash: Sha256
    weight_files: Annotated[list[WeightFile], Field(min_length=1)]


class Generator(_Closed):
    """Coordinates of the serving-benchmark prompt generator (fixed to the first short request)."""

    run_id: NonEmpty
    phase: NonEmpty
    request_index: Literal[0]
    profile: Literal["short"]
    template_version: Literal["fixed-serving-profiles-v1"]


class Message(_Closed):
    """The single user message, before chat-template rendering."""

    role: Literal["user"]
    content: NonEmpty


class TemplateKwargs(_Closed):
    """Chat-template options; thinking is always off for this contract."""

    enable_thinking: Literal[False]


class Prompt(_Closed):
    """The prompt recipe and its exact rendered token ids (without the continuation prefix)."""

    generator: Generator
    messages: Annotated[list[Message], Field(min_length=1, max_length=1)]
    add_generation_prompt: Literal[True]
    template_kwargs: TemplateKwargs
    utf8_sha256: Sha256
    """SHA-256 of ``messages[0].content`` as UTF-8 (the raw user text, as Kiln's validator does)."""
    token_count: Annotated[int, Field(ge=1, le=4096)]
    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=4096)]


class Token(_Closed):
    """One forced continuation token and its decoded text."""

    token_id: TokenId
    text: str


class Candidate(_Closed):
    """One engine's disputed next-token prediction."""

    engine: Literal["kiln", "vllm"]
    token_id: TokenId
    text: str


class HfNextTokenRequest(_Closed):
    """``kiln.hf-next-token-request.v1``: one independent eager-HF next-token check."""

    schema_: Literal["kiln.hf-next-token-request.v1"] = Field(alias="schema")
    id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{2,127}$")]
    source: Source
    model_identity: ModelIdentity
    prompt: Prompt
    continuation_prefix: Annotated[list[Token], Field(min_length=1, max_length=64)]
    input_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=4096)]
    input_token_ids_sha256: Sha256
    candidates: Annotated[list[Candidate], Field(min_length=2, max_length=2)]

    def candidate(self, engine: str) -> Candidate:
        """The candidate of ``engine`` (``kiln`` or ``vllm``)."""
        return next(item for item in self.candidates if item.engine == engine)
