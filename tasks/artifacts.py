"""Artifact helpers: keys Prefect accepts, and the training progress artifact with throttled updates."""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

_NOT_KEY = re.compile(r"[^a-z0-9-]+")


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (``^[a-z0-9-]*$``) built from free text.

    Example:
        >>> artifact_key("train", "My_Adapter.v2")
        'train-my-adapter-v2'
    """
    text = "-".join(parts).lower()
    return _NOT_KEY.sub("-", text).strip("-")[:100] or "kiln-flows"


# Set by the interactive CLI commands (`run`, `demo`) unless --quiet/--json: a console progress bar
# next to the artifact. Workers leave it unset, so their logs stay free of bar redraws.
CONSOLE_PROGRESS_ENV = "KILN_FLOWS_PROGRESS"


class ProgressReporter:
    """A progress artifact created once and updated at most every ``every_seconds``.

    Every update is an API call, so a training loop calls ``update`` each step and the reporter decides
    whether to send it. When ``KILN_FLOWS_PROGRESS=1`` a tqdm bar on stderr follows every step too.
    """

    def __init__(self, key: str, description: str, every_seconds: float = 5.0) -> None:
        from prefect.artifacts import create_progress_artifact

        self.every_seconds = every_seconds
        self._last = 0.0
        self._rollout_text = ""
        self.artifact_id = create_progress_artifact(progress=0.0, key=key, description=description)
        self._bar = None
        if os.environ.get(CONSOLE_PROGRESS_ENV) == "1":
            from tqdm import tqdm

            self._bar = tqdm(desc=description, unit="step", file=sys.stderr, leave=True)

    def update(self, step: int, total: int, loss: float | None = None, *, force: bool = False, rollout=None) -> None:
        """``rollout``: an on-policy run's ``OnPolicyProgress`` (``step`` then counts consumed candidates);
        its rollouts/s and teacher tokens scored join the description."""
        from prefect.artifacts import update_progress_artifact

        if rollout is not None:  # kept for the final (forced) update, which carries no rollout figures
            self._rollout_text = (f", {rollout.rollouts_per_second:.2f} rollouts/s, "
                                  f"{rollout.teacher_tokens_scored} teacher tokens scored")
        rollout_text = self._rollout_text
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = step
            if loss is not None:
                self._bar.set_postfix_str(f"loss={loss:.4f}{rollout_text}", refresh=False)
            self._bar.refresh()
            if force:
                self._bar.close()
        now = time.monotonic()
        if not force and now - self._last < self.every_seconds:
            return
        self._last = now
        percent = 100.0 * step / total if total else 100.0
        description = f"step {step}/{total}" + (f", loss {loss:.4f}" if loss is not None else "") + rollout_text
        update_progress_artifact(self.artifact_id, progress=percent, description=description)


def markdown_links(title: str, links: dict[str, str | None]) -> str:
    """A small markdown document listing output locations."""
    lines = [f"# {title}", ""]
    for name, uri in links.items():
        if uri:
            lines.append(f"- **{name}**: `{uri}`")
    return "\n".join(lines) + "\n"


def table_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A two-column table (field, value) from a flat mapping."""
    return [{"field": key, "value": "" if value is None else str(value)} for key, value in record.items()]
