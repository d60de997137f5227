"""Artifact helpers, one module for every flow: keys Prefect accepts, the throttled training progress
artifact, a loss-curve chart the UI renders, the compact receipt table and the outputs list.

The builders (``loss_curve_svg``, ``loss_curve_markdown``, ``receipt_rows``, ``outputs_markdown``)
are pure functions returning text or rows; the ``record_*`` functions create the artifacts. Later
artifacts (evaluation, gates) reuse ``artifact_key``, ``table_rows``, ``loss_curve_svg`` and
``svg_image_markdown``.

Charts are SVG images embedded as ``data:image/svg+xml;base64`` URIs in a markdown artifact: the
Prefect UI's markdown renderer keeps ``data:image/`` sources on ``<img>`` (its sanitizer allows the
``data`` protocol for ``src``) and drops raw ``<svg>`` elements, so an image is what renders
(tests/integration/test_ui_form.py measures its size in Chromium).
"""

from __future__ import annotations

import base64
import os
import re
import sys
import time
from typing import Any, Sequence

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


# ---------------------------------------------------------------------------------------------
# Generic builders


def markdown_links(title: str, links: dict[str, str | None]) -> str:
    """A small markdown document listing output locations (entries without a location are left out)."""
    lines = [f"# {title}", ""]
    for name, uri in links.items():
        if uri:
            lines.append(f"- **{name}**: `{uri}`")
    return "\n".join(lines) + "\n"


def table_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A two-column table (field, value) from a flat mapping."""
    return [{"field": key, "value": "" if value is None else str(value)} for key, value in record.items()]


def svg_image_markdown(svg: str, alt: str) -> str:
    """Markdown that shows ``svg`` as an image in the Prefect UI (a base64 ``data:`` URI).

    Example:
        >>> svg_image_markdown("<svg xmlns='http://www.w3.org/2000/svg'/>", "empty")[:40]
        '![empty](data:image/svg+xml;base64,PHN2Z'
    """
    encoded = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return f"![{alt}](data:image/svg+xml;base64,{encoded})"


def _number(value: float) -> str:
    return f"{value:.4g}"


def loss_curve_svg(series: dict[str, Sequence[float]], *, width: int = 640, height: int = 260,
                   x_label: str = "optimizer step", y_label: str = "loss") -> str:
    """A line chart of one or more curves as a standalone SVG document (no scripts, no fonts to fetch).

    Each series is plotted against its 1-based index; non-finite points are skipped. The y axis spans
    the finite values (a flat curve gets a small band around it).

    Example:
        >>> svg = loss_curve_svg({"train loss": [2.0, 1.5, 1.2]})
        >>> svg.startswith("<svg") and "polyline" in svg
        True
    """
    colors = ("#2563eb", "#dc2626", "#16a34a", "#9333ea")
    finite = [v for values in series.values() for v in values if v == v and abs(v) != float("inf")]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if high - low < 1e-12:
        low, high = low - 0.5, high + 0.5
    steps = max((len(values) for values in series.values()), default=1)
    left, right, top, bottom = 64, 16, 16, 44
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(i: int) -> float:
        return left + (plot_w * (i - 1) / (steps - 1) if steps > 1 else plot_w / 2)

    def y(v: float) -> float:
        return top + plot_h * (high - v) / (high - low)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#9ca3af"/>']
    for fraction in (0.0, 0.5, 1.0):  # three y ticks: top, middle, bottom
        value = high - fraction * (high - low)
        ty = top + fraction * plot_h
        parts.append(f'<line x1="{left - 4}" y1="{ty:.1f}" x2="{left + plot_w}" y2="{ty:.1f}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="{left - 6}" y="{ty + 4:.1f}" text-anchor="end">{_number(value)}</text>')
    for step in sorted({1, steps}):
        parts.append(f'<text x="{x(step):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{step}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle">{x_label}</text>')
    parts.append(f'<text x="14" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {top + plot_h / 2:.1f})">{y_label}</text>')
    for index, (name, values) in enumerate(series.items()):
        color = colors[index % len(colors)]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values, start=1)
                          if v == v and abs(v) != float("inf"))
        if points:
            parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{left + 8}" y="{top + 16 + 16 * index}" fill="{color}">{_escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---------------------------------------------------------------------------------------------
# Training artifacts


def loss_curve_markdown(adapter: str, losses: Sequence[float]) -> str:
    """The loss-curve artifact: a chart, then the first, lowest and last loss in one line.

    Example:
        >>> text = loss_curve_markdown("demo", [2.0, 1.0, 1.5])
        >>> text.splitlines()[-1]
        'first 2.0000 · lowest 1.0000 (step 2) · last 1.5000 · 3 steps'
    """
    if not losses:
        return f"# Loss curve of {adapter}\n\nNo step was trained in this run.\n"
    lowest = min(range(len(losses)), key=lambda i: losses[i])
    return (f"# Loss curve of {adapter}\n\n{svg_image_markdown(loss_curve_svg({'train loss': losses}), 'loss curve')}\n\n"
            f"first {losses[0]:.4f} · lowest {losses[lowest]:.4f} (step {lowest + 1}) · last {losses[-1]:.4f} · "
            f"{len(losses)} steps")


def receipt_rows(receipt: Any, failure_reason: str | None = None) -> list[dict[str, str]]:
    """The receipt numbers a person checks first, as (field, value) rows (a typed ``TrainReceipt``).

    Digests are shortened to 16 hex digits; the full values stay in ``train_receipt.json``.

    Args:
        receipt: The run's ``TrainReceipt``.
        failure_reason: The run's own code for a failure (``TrainRef.failure_reason``), which the log and the
            run's final state name; the receipt file keeps Kiln's closed enum (``training_diverged`` is written
            as Kiln's ``training_error``), and the table names both then.
    """
    hyper = receipt.hyperparameters
    loss = receipt.opd.final_opd_loss
    reason = failure_reason or receipt.failure_reason
    if reason and receipt.failure_reason and reason != receipt.failure_reason:
        reason = f"{reason}; Kiln's failure_reason {receipt.failure_reason}"
    status = receipt.status + (f" ({reason})" if reason else "")
    return table_rows({
        "status": status,
        "steps": f"{receipt.data.examples_trained} of {receipt.data.total_steps}",
        "final loss": None if loss is None else f"{loss:.4f}",
        "learning rate": f"{hyper.learning_rate:g}",
        "epochs": hyper.epochs,
        "optimizer": hyper.optimizer,
        "LoRA rank / alpha": f"{hyper.rank} / {hyper.alpha:g}",
        "action tokens": receipt.token_counts.action_tokens,
        "corpus sha256": _short(receipt.training_data.sha256),
        "teacher revision": _short(receipt.opd.teacher_identity_revision or receipt.opd.teacher_content_revision),
    })


def _short(digest: str | None) -> str | None:
    if not digest:
        return digest
    prefix, _, hexdigits = digest.rpartition(":")
    return f"{prefix + ':' if prefix else ''}{hexdigits[:16]}…" if len(hexdigits) > 16 else digest


def outputs_markdown(adapter: str, status: str, *, adapter_uri: str | None, receipt_uri: str | None,
                     latest_uri: str | None, checkpoints: Sequence[str], run_uri: str | None) -> str:
    """The outputs artifact: adapter, receipt and ``latest.json`` first, then the newest checkpoint
    (the count of older ones in a word) and the run directory.

    Example:
        >>> text = outputs_markdown("demo", "success", adapter_uri="/r/adapter", receipt_uri="/r/receipt.json",
        ...                         latest_uri="/latest.json", checkpoints=["/r/c1", "/r/c2"], run_uri="/r")
        >>> text.splitlines()[2]
        '- **adapter**: `/r/adapter`'
    """
    links: dict[str, str | None] = {"adapter": adapter_uri, "receipt": receipt_uri, "latest.json": latest_uri}
    if checkpoints:
        older = len(checkpoints) - 1
        label = "newest checkpoint" + (f" (+{older} older in the run directory)" if older else "")
        links[label] = checkpoints[-1]
    links["run directory"] = run_uri
    return markdown_links(f"Outputs of {adapter} ({status})", links)
