"""Short task-run names: the stage, then a digest prefix or a file name.

A task run is named after what it works on, and the UI shows that name in the run graph, the task list
and every log line. A full ``sha256:<64 hex>`` digest or an absolute path (``/home/me/data/…``) crowds
out everything else there; the first 12 hex digits and the last path component identify the input just
as well (the receipt and the artifacts keep the full values).

Example:
    >>> short("sha256:" + "ab" * 32)
    'abababababab'
    >>> short("s3://bucket/data/teacher-scored.jsonl")
    'teacher-scored.jsonl'
"""

from __future__ import annotations

import re
from typing import Any, Callable

_DIGEST = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")


def short(value: Any) -> str:
    """A digest's first 12 hex digits, a path's or URI's last component, anything else as text."""
    text = str(value)
    digest = _DIGEST.match(text)
    if digest:
        return digest.group(1)[:12]
    name = text.rstrip("/").rsplit("/", 1)[-1]
    return name or text


def run_name(stage: str, parameter: str, attribute: str | None = None) -> Callable[..., str]:
    """A ``task_run_name`` callable: ``<stage>-<short(parameters[parameter].attribute)>``."""

    def name(parameters: dict[str, Any]) -> str:
        value = parameters.get(parameter)
        if attribute is not None:
            value = getattr(value, attribute, None) if not isinstance(value, dict) else value.get(attribute)
        return f"{stage}-{short(value)}" if value is not None else stage

    return name
