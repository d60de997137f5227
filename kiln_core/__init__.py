"""kiln_core: the engine behind kiln-flows.

Kiln-compatible contracts, canonical hashing, tokenization and masks, corpus admission and
materialization, teacher identity and scoring, training, checkpoints, receipts and the Hugging Face
next-token oracle. Nothing in this package imports Prefect; heavy libraries (torch, transformers) are
imported inside the functions that need them, and the names below are loaded on first use, so
``import kiln_core`` stays cheap.

Example:
    >>> from kiln_core import admit_corpus, AdmissionError  # doctest: +SKIP
    >>> admit_corpus("teacher-data.jsonl", "./student", out_root="./kiln-data").examples  # doctest: +SKIP
    128
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "admit_corpus": "kiln_core.admission",
    "AdmissionResult": "kiln_core.admission",
    "AdmissionError": "kiln_core.errors",
    "ADMISSION_CODES": "kiln_core.errors",
    "read_materialization": "kiln_core.materialize",
    "canonical_sha256": "kiln_core.canonical",
    "kiln_compact_json": "kiln_core.canonical",
    "TeacherIdentity": "kiln_core.contracts.identity",
    "OffPolicyManifest": "kiln_core.contracts.identity",
    "parse_manifest_line": "kiln_core.contracts.identity",
    "OpdConfig": "kiln_core.contracts.opd_config",
    "OpdRequest": "kiln_core.contracts.opd_config",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kiln_core' has no attribute {name!r}")
