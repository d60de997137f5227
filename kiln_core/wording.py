"""Small wording helpers for what kiln-flows prints and logs.

Example:
    >>> counted(1, "prompt"), counted(3, "prompt")
    ('1 prompt', '3 prompts')
"""

from __future__ import annotations

__all__ = ["counted"]


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, the noun in the plural unless the count is one (``1 prompt``, ``0 shards``)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
