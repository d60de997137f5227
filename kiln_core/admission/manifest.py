"""The manifest record rules, applied at the manifest's own line as Kiln reads the file.

Kiln's line loop (opd.rs ``parse_off_policy_distillation_dataset_str``) checks a manifest record
the moment it reads it: it must come before every example and be the only one
(``manifest_not_first``), deserialize strictly (``manifest_invalid``) and re-serialize to the exact
raw line (``manifest_not_canonical``). So a misplaced manifest is reported at its line even when a
later line is also bad, and a bad example line before it is reported first.
"""

from __future__ import annotations

from typing import Any

from kiln_core.contracts.identity import ManifestError, OffPolicyManifest, parse_manifest_object
from kiln_core.errors import AdmissionError


def check_manifest_record(
    number: int, raw: str, value: Any, *, seen_example: bool, seen_manifest: bool, kiln_strict: bool
) -> OffPolicyManifest:
    """Apply the manifest rules to the record on line ``number``.

    Args:
        number: 1-based physical line.
        raw: The raw line without its terminator (not trimmed).
        value: The decoded record.
        seen_example: Whether an example came before it.
        seen_manifest: Whether a manifest came before it.
        kiln_strict: Accept only Kiln's vLLM protocol.

    Raises:
        AdmissionError: ``manifest_not_first``, ``manifest_invalid`` or ``manifest_not_canonical``.
    """
    if seen_example or seen_manifest:
        raise AdmissionError(
            "manifest_not_first", number, "off-policy distillation manifest must be the first non-empty JSONL record"
        )
    repeated = _repeated_key(value)
    if repeated:
        raise AdmissionError("manifest_invalid", number, f"manifest field `{repeated}` is given more than once")
    try:
        manifest = parse_manifest_object(value, kiln_strict=kiln_strict)
    except ManifestError as error:
        raise AdmissionError("manifest_invalid", number, error.message) from None
    if manifest.canonical_json() != raw:
        raise AdmissionError(
            "manifest_not_canonical", number, f"off-policy distillation manifest on line {number} is not canonical compact JSON"
        )
    return manifest


def check_manifest_records(records: list[tuple[int, str, Any]], first_example_line: int | None, *, kiln_strict: bool) -> OffPolicyManifest | None:
    """The manifest rules over records collected by a parser that found no other error."""
    manifest = None
    for number, raw, value in records:
        manifest = check_manifest_record(
            number, raw, value, kiln_strict=kiln_strict, seen_manifest=manifest is not None,
            seen_example=first_example_line is not None and first_example_line < number,
        )
    return manifest


def _repeated_key(value: Any) -> str | None:
    """The first key given twice anywhere in a decoded manifest (serde denies duplicate fields)."""
    if isinstance(value, dict):
        duplicates = sorted(getattr(value, "duplicates", ()))
        if duplicates:
            return duplicates[0]
        for child in value.values():
            found = _repeated_key(child)
            if found:
                return found
    return None
