"""``admission.json``: the commit record of an admitted corpus's materialization.

Written last into ``corpora/<sha256 of the JSONL bytes>/`` (or a ``variants/<key>/`` below it) by
``kiln_core.materialize``: what was admitted, for which student, and the size and SHA-256 of every
table file, which readers verify before use. kiln-flows' own format (Kiln keeps no admitted corpus).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["FORMAT_VERSION", "COMMIT_FILE", "FileDigest", "AdmissionRecord"]

# v2: Kiln's trajectory masks (byte search / prefix re-tokenization), |O| per example, env_tokens
# after the warning filter. A v1 materialization holds other masks and is never reused.
FORMAT_VERSION = "kiln-flows.admission.v2"
COMMIT_FILE = "admission.json"


class FileDigest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bytes: int
    sha256: str


class AdmissionRecord(BaseModel):
    """``admission.json``: what was admitted, for which student, and the files that hold it."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal["kiln-flows.admission.v2"] = FORMAT_VERSION
    dataset_sha256: str
    """``sha256:`` digest of the exact JSONL bytes."""
    source_uri: str
    """Where the corpus was read from when it was admitted."""
    student: dict[str, Any]
    """Student tokenizer identity: vocab/config/chat-template digests and ``vocab_size``."""
    requested_top_k: int
    effective_top_k: int
    examples: int
    action_tokens: int
    env_tokens: int
    """ECHO env targets after Kiln's default warning filter (Kiln's ``env_tokens`` with ``echo`` null)."""
    env_tokens_in_warning_prefix: int
    """Observation tokens the default warning filter leaves out."""
    observation_tokens: int
    """ECHO's |O|: observation span widths before warning trimming, summed over examples."""
    context_tokens: int
    """Tokens that are neither action nor active env targets (Kiln: seq_len − action − env)."""
    manifest_line_number: int | None
    manifest_line: str | None
    teacher_identity_revision: str | None
    pinned_identity_revision: str | None
    files: dict[str, FileDigest]
    kiln_prompts_sha256: str | None = None
    """Kiln's ``data.content_sha256`` of the corpus (raw hex); absent in materializations written before it."""
    created_at: str
    kiln_flows_version: str
