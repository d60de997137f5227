"""``kiln.teacher-identity.v1`` and ``kiln.off-policy-distillation-manifest.v1``.

Both are compared byte for byte in Kiln's compact, declaration-order JSON, so the field order of these
models is part of the contract (Kiln's crates/kiln-train/src/opd.rs, teacher_identity.rs). Parsing is strict: unknown
fields are refused, integers must be JSON integers, digests are raw lowercase hex, and JSON nested as
deep as serde_json's recursion limit is refused before anything else (``nesting_too_deep``).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln_core.canonical import kiln_compact_json, sha256_hex
from kiln_core.errors import Rejection
from kiln_core.strict_json import NestingTooDeep, check_nesting, loads_nesting_limited

MANIFEST_SCHEMA = "kiln.off-policy-distillation-manifest.v1"
IDENTITY_SCHEMA = "kiln.teacher-identity.v1"
KILN_VLLM_PROTOCOL = "vllm.prompt-logprobs.numeric-token-ids.causal.v1"
KILN_FLOWS_PROTOCOL = "kiln-flows.hf-eager.prompt-logprobs.numeric-token-ids.causal.v1"
ACCEPTED_PROTOCOLS = (KILN_VLLM_PROTOCOL, KILN_FLOWS_PROTOCOL)
LOGPROBS_MODE = "raw_logprobs"
MAX_CANONICAL_IDENTITY_BYTES = 4096
MAX_TEXT_BYTES = 256
U32_MAX = 2**32 - 1

_LOWER_SHA256 = re.compile(r"[0-9a-f]{64}")
# Rust's char::is_control: the C0 and C1 control ranges.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _raw_sha256(value: str) -> str:
    if not _LOWER_SHA256.fullmatch(value):
        raise ValueError("must be exactly 64 lowercase hex characters with no 'sha256:' prefix")
    return value


def _identity_text(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    if len(value.encode("utf-8")) > MAX_TEXT_BYTES:
        raise ValueError(f"must be at most {MAX_TEXT_BYTES} bytes")
    if value != value.strip():
        raise ValueError("must not have leading or trailing whitespace")
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters")
    return value


RawSha256 = Annotated[str, AfterValidator(_raw_sha256)]
IdentityText = Annotated[str, AfterValidator(_identity_text)]


class _StrictContract(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class TeacherAdapter(_StrictContract):
    """The LoRA adapter a teacher serves on top of its base weights."""

    name: IdentityText
    """Adapter name; same text rules as ``served_model_id``."""
    weights_sha256: RawSha256
    """Domain-separated digest of the adapter weights file (``scripts/vllm_teacher.py``)."""
    config_sha256: RawSha256
    """SHA-256 of the raw ``adapter_config.json`` bytes."""


class TeacherIdentity(_StrictContract):
    """``kiln.teacher-identity.v1``: everything that decides what a teacher's logprobs mean.

    Field order is normative: it is the order of Kiln's struct and of the canonical JSON.
    """

    schema_: Literal["kiln.teacher-identity.v1"] = Field(alias="schema")
    """Schema tag, exactly ``kiln.teacher-identity.v1``."""
    protocol: str
    """Scoring protocol. Kiln accepts only ``vllm.prompt-logprobs.numeric-token-ids.causal.v1``;
    kiln-flows also accepts its own ``kiln-flows.hf-eager.prompt-logprobs.numeric-token-ids.causal.v1``."""
    served_model_id: IdentityText
    """API model name every scoring request and response carries (≤ 256 bytes, trimmed, no controls)."""
    base_model_sha256: RawSha256
    """Domain-separated digest of the base weight shards (raw hex)."""
    tokenizer_vocab_sha256: RawSha256
    """Domain-separated digest of the numeric vocabulary (raw hex)."""
    tokenizer_config_sha256: RawSha256
    """SHA-256 of the fast tokenizer's backend JSON string (raw hex)."""
    adapter: TeacherAdapter | None
    """``null`` for a base teacher, else the served adapter."""
    vocab_size: int = Field(ge=1, le=16_777_216)
    """The model's logit width (not the tokenizer's entry count)."""
    max_top_k: int = Field(ge=1, le=65_536)
    """Most top-K candidates the teacher returns; also ≤ ``vocab_size``."""
    max_model_len: int = Field(ge=1, le=16_777_216)
    """Context cap in tokens."""
    max_prompt_logprob_candidates: int = Field(ge=1, le=1_000_000)
    """Ceiling on candidates in one response; must fit one maximum-K row."""
    logprobs_mode: Literal["raw_logprobs"]
    """Always ``raw_logprobs``: full-vocabulary log-softmax values, no temperature."""
    implementation: IdentityText
    """Free text naming the scoring implementation (≤ 256 bytes)."""
    inference_config_sha256: RawSha256
    """Digest of the canonical inference configuration (raw hex)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _cross_field_bounds(self) -> "TeacherIdentity":
        if self.max_top_k > self.vocab_size:
            raise ValueError("`max_top_k` must be ≤ `vocab_size`")
        if self.max_prompt_logprob_candidates < min(self.max_top_k + 1, self.vocab_size):
            raise ValueError("`max_prompt_logprob_candidates` must fit one maximum-K row (≥ min(max_top_k+1, vocab_size))")
        if len(self.canonical_json().encode("utf-8")) > MAX_CANONICAL_IDENTITY_BYTES:
            raise ValueError(f"canonical identity JSON exceeds {MAX_CANONICAL_IDENTITY_BYTES} bytes")
        return self

    def as_ordered_dict(self) -> dict[str, Any]:
        """The identity as a dict in declaration order, ready for ``kiln_compact_json``."""
        return self.model_dump(mode="json", by_alias=True)

    def canonical_json(self) -> str:
        """Kiln's canonical compact JSON of this identity."""
        return kiln_compact_json(self.as_ordered_dict())

    def content_revision(self) -> str:
        """Lowercase hex SHA-256 of the canonical identity bytes (Kiln's ``content_revision()``)."""
        return sha256_hex(self.canonical_json().encode("utf-8"))

    def identity_revision(self) -> str:
        """``sha256:`` + ``content_revision()``, as in ``TeacherEntry.identity_revision``."""
        return "sha256:" + self.content_revision()


class OffPolicyManifest(_StrictContract):
    """``kiln.off-policy-distillation-manifest.v1``: the first record of a scored corpus."""

    schema_: Literal["kiln.off-policy-distillation-manifest.v1"] = Field(alias="schema")
    """Schema tag, exactly ``kiln.off-policy-distillation-manifest.v1``."""
    teacher_identity: TeacherIdentity
    """The complete identity of the teacher that scored every row."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    def canonical_json(self) -> str:
        """The exact line Kiln serves as ``off_policy_manifest`` (no trailing newline)."""
        return kiln_compact_json(
            {"schema": MANIFEST_SCHEMA, "teacher_identity": self.teacher_identity.as_ordered_dict()}
        )


MANIFEST_ERROR_CODES = {
    "invalid": "manifest_invalid",
    "not_canonical": "manifest_not_canonical",
    "nesting_too_deep": "nesting_too_deep",
}


class ManifestError(Rejection, ValueError):
    """A manifest or identity that does not satisfy the contract.

    Attributes:
        kind: ``invalid``, ``not_canonical`` or ``nesting_too_deep``.
        code: The stable rejection code of ``kind`` (``manifest_invalid``, ``manifest_not_canonical``,
            ``nesting_too_deep``).
        message: What is wrong (``str(error)`` is the message alone, as before).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(MANIFEST_ERROR_CODES[kind], message)
        self.kind = kind

    def __str__(self) -> str:
        return self.message


def check_protocol(identity: TeacherIdentity, *, kiln_strict: bool = False) -> None:
    """Raise ``ManifestError`` unless the identity's protocol is one we accept."""
    accepted = (KILN_VLLM_PROTOCOL,) if kiln_strict else ACCEPTED_PROTOCOLS
    if identity.protocol not in accepted:
        raise ManifestError("invalid", f"teacher identity protocol {identity.protocol!r} is not one of {list(accepted)}")


def parse_manifest_object(value: Any, *, kiln_strict: bool = False) -> OffPolicyManifest:
    """Validate an already-decoded manifest object strictly (unknown fields, bounds, protocol).

    Raises:
        ManifestError: ``kind="invalid"`` with the pydantic field path in the message.
    """
    try:
        check_nesting(value, where="the manifest")
        manifest = OffPolicyManifest.model_validate(value)
    except NestingTooDeep as error:
        raise ManifestError("nesting_too_deep", error.message) from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "manifest"
        raise ManifestError("invalid", f"manifest field `{where}`: {first['msg']}") from None
    check_protocol(manifest.teacher_identity, kiln_strict=kiln_strict)
    return manifest


def parse_manifest_line(line: str, *, kiln_strict: bool = False) -> OffPolicyManifest:
    """Parse one manifest line and require it to be Kiln's canonical compact JSON byte for byte.

    Args:
        line: The raw line, without its line terminator. It is not trimmed: leading or trailing
            whitespace makes it non-canonical.
        kiln_strict: Accept only Kiln's vLLM protocol.

    Returns:
        The parsed manifest.

    Raises:
        ManifestError: ``invalid`` for bad JSON or contract violations, ``not_canonical`` when the
            line is valid but not byte-identical to its canonical form.

    Example:
        >>> m = parse_manifest_line(line)  # doctest: +SKIP
        >>> m.canonical_json() == line  # doctest: +SKIP
        True
    """
    value = _loads(line, "the manifest")
    manifest = parse_manifest_object(value, kiln_strict=kiln_strict)
    if manifest.canonical_json() != line:
        raise ManifestError("not_canonical", "manifest is not canonical compact JSON")
    return manifest


def parse_identity_json(text: str) -> TeacherIdentity:
    """Parse a canonical identity JSON string, requiring byte equality with its re-serialization."""
    value = _loads(text, "the teacher identity")
    try:
        identity = TeacherIdentity.model_validate(value)
    except ValidationError as error:
        raise ManifestError("invalid", f"teacher identity is invalid: {error}") from None
    if identity.canonical_json() != text:
        raise ManifestError("not_canonical", "teacher identity JSON is not the canonical compact encoding")
    return identity


def _loads(text: str, where: str) -> Any:
    """Decode JSON as serde_json would: a document nested too deep is refused, not parsed."""
    try:
        return loads_nesting_limited(text, where=where)
    except NestingTooDeep as error:
        raise ManifestError("nesting_too_deep", error.message) from None
    except json.JSONDecodeError as error:
        raise ManifestError("invalid", f"{where} is not valid JSON: {error.msg}") from None


def build_manifest_line(identity: TeacherIdentity) -> str:
    """The canonical ``off_policy_manifest`` line for ``identity``."""
    return OffPolicyManifest(schema=MANIFEST_SCHEMA, teacher_identity=identity).canonical_json()
