"""docs/errors.md is the user's reference for codes: every stable code a rejection can carry is in it."""

from __future__ import annotations

from pathlib import Path

from kiln_core.errors import ADMISSION_CODES, MODEL_FILE_CODES, SHARD_SET_CODES
from kiln_core.oracle.errors import ALL_RULES

REPO = Path(__file__).resolve().parent.parent


def test_errors_page_lists_every_admission_shard_set_model_file_and_oracle_code():
    page = (REPO / "docs" / "errors.md").read_text(encoding="utf-8")
    section = page[page.index("## Rejection codes"):]
    missing = [code for code in (*ADMISSION_CODES, *SHARD_SET_CODES, *MODEL_FILE_CODES, *ALL_RULES) if f"`{code}`" not in section]
    assert not missing, missing


def test_compatibility_table_keeps_a_section_for_checkpoints():
    text = (REPO / "docs" / "kiln-compatibility.md").read_text(encoding="utf-8")
    assert "## Checkpoints and receipts" in text and "--kiln-strict" in text
