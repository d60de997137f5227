"""Data shipped with kiln-flows.

``prompts.jsonl`` — 282 short instructions written for this project (facts, arithmetic, word tasks,
short writing, how-to), one JSON object a line: ``id``, ``split`` (``train`` or ``heldout``: every fifth
prompt is held out, fixed) and ``prompt``. The real demo and ``bench/distill_quality.py`` have the
teacher answer them, score the answers and distill on the ``train`` split.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["SPLITS", "load_prompts"]

SPLITS = ("train", "heldout")


def load_prompts(split: str | None = None) -> list[dict[str, Any]]:
    """The shipped prompts (``{"id", "split", "prompt"}``), all or one split, in file order.

    Raises:
        ValueError: ``split`` is not one of ``SPLITS`` (a misspelt split would otherwise select nothing).

    Example:
        >>> len(load_prompts("heldout")), len(load_prompts("train"))
        (56, 226)
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown prompt split {split!r}: the shipped prompts have the splits {', '.join(SPLITS)}")
    text = resources.files(__name__).joinpath("prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [row for row in rows if split is None or row["split"] == split]
