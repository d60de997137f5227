"""What a gate outcome does to the adapter on storage, and the receipt's ``post_eval`` block.

Kiln [crates/kiln-server/src/eval/worker.rs · apply_post_eval_gate]: only ``promoted`` makes the
adapter active; ``demoted`` renames ``<adapter_dir>/<name>`` to ``<name>.failed`` (``<name>.failed-<unix
ms>`` when that exists); every other outcome leaves the adapter where it is, not promoted.

kiln-flows' equivalents:

* the active-adapter pointer is ``runs/<adapter>/latest.json``; only ``promoted`` writes it, with the
  very writer publication uses (``kiln_core.engine.publish.write_latest``), so the document is the
  same whether publishing or the gate wrote it;
* a trained adapter lives in its run directory ``runs/<adapter>/<run key>/`` (adapter, receipt,
  checkpoints; ``kiln_core.engine.runs``), so a losing adapter's run directory is renamed to
  ``runs/<adapter>/<adapter>.failed`` — still on storage, visible, with its receipt, beside the runs
  that ``latest.json`` may still point at — and training the same inputs again starts afresh;
* which outcomes lose is ``losing_outcomes``. Default: ``demoted`` *and* ``regression`` — both are
  conclusive evidence against the adapter (its accuracy is below the floor, or it is significantly
  worse than what was serving). ``inconclusive``, ``kept`` and ``error`` are not conclusive and leave
  it in place. Pass ``KILN_RENAMED_OUTCOMES`` for Kiln's exact behaviour (``demoted`` only).

Storage failures raise ``EnvironmentFailure`` (retried by the flow). Every step is safe to repeat:
rewriting ``latest.json`` writes the same bytes, and a rename happens only while the run directory
still exists. Object stores rename by copy-then-delete; a failure in between leaves both prefixes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kiln_core.contracts.latest import LatestPointer
from kiln_core.contracts.outcomes import PostEvalRecord
from kiln_core.contracts.post_eval.errors import PostEvalRejection
from kiln_core.errors import EnvironmentFailure
from kiln_core.post_eval.gate import GATE_OUTCOMES, PostEvalGateEvidence
from kiln_core.storage import Location, move_aside, resolve

__all__ = ["LOSING_OUTCOMES", "KILN_RENAMED_OUTCOMES", "GateFate", "latest_pointer", "apply_gate_outcome",
           "post_eval_receipt_block"]

LOSING_OUTCOMES = frozenset({"demoted", "regression"})
KILN_RENAMED_OUTCOMES = frozenset({"demoted"})


@dataclass(frozen=True)
class GateFate:
    """What happened on storage. ``run_uri`` is where the run directory is now."""

    outcome: str
    verdict: str | None
    evidence: dict[str, Any] | None
    run_uri: str
    latest_uri: str | None = None
    renamed_to: str | None = None


def latest_pointer(run_dir: str | Location) -> LatestPointer:
    """The ``latest.json`` document for the adapter in ``run_dir``, exactly as publication writes it
    (``kiln_core.engine.publish.latest_pointer``).

    Raises:
        PostEvalRejection: ``adapter_receipt_mismatch`` when the adapter bytes differ from the receipt.
        ReceiptError: the run has no valid ``train_receipt.json``.
    """
    from kiln_core.engine.publish import AdapterMismatch
    from kiln_core.engine.publish import latest_pointer as published_pointer

    try:
        return published_pointer(run_dir)
    except AdapterMismatch as error:
        raise PostEvalRejection("adapter_receipt_mismatch", error.message, file=error.file) from None


def apply_gate_outcome(run_dir: str | Location, adapter: str, outcome: str, evidence: Any = None, *,
                       verdict: str | None = None, pointer: LatestPointer | None = None,
                       losing_outcomes: frozenset[str] = LOSING_OUTCOMES, now_ms: int | None = None) -> GateFate:
    """Act on a gate outcome: promote (write ``latest.json``), rename a loser, or leave the adapter.

    Args:
        run_dir: The run directory ``<root>/runs/<adapter>/<run key>`` (path or fsspec URI).
        adapter: The adapter name.
        outcome: One of ``GATE_OUTCOMES`` (``PostEvalResult.outcome``).
        evidence: ``PostEvalGateEvidence`` (or its dict) to stamp with the outcome; may be None.
        verdict: ``PostEvalResult.verdict``; a rename is appended to it.
        pointer: The ``latest.json`` document; default ``latest_pointer(run_dir)``.
        losing_outcomes: Outcomes whose run directory is renamed ``<adapter>.failed``.
        now_ms: Unix milliseconds for the ``.failed-<ms>`` name (default: now).

    Returns:
        ``GateFate``.

    Raises:
        EnvironmentFailure: ``storage_failed`` — storage refused a write or rename (retry).

    Example:
        >>> fate = apply_gate_outcome(published.run, "demo", result.outcome, result.evidence,
        ...                           verdict=result.verdict)  # doctest: +SKIP
        >>> fate.latest_uri  # doctest: +SKIP
        '/abs/kiln-data/runs/demo/latest.json'
    """
    if outcome not in GATE_OUTCOMES:
        raise ValueError(f"unknown gate outcome {outcome!r}; expected one of {GATE_OUTCOMES}")
    run = resolve(run_dir) if isinstance(run_dir, str) else run_dir
    stamped = _stamp(evidence, outcome)
    try:
        if outcome == "promoted":
            from kiln_core.engine.publish import write_latest

            latest = write_latest(run, pointer if pointer is not None else latest_pointer(run))
            return GateFate(outcome, verdict, stamped, run.uri, latest_uri=latest.uri)
        if outcome in losing_outcomes and run.exists():
            name = f"{adapter}.failed"
            if _sibling(run, name).exists():
                name = f"{adapter}.failed-{now_ms if now_ms is not None else int(time.time() * 1000)}"
            moved = move_aside(run, name)
            note = f"renamed to `{name}`"
            if verdict is not None:
                verdict = f"{verdict}, {note}" if outcome == "demoted" else f"{verdict}; {note}"
            return GateFate(outcome, verdict, stamped, moved.uri, renamed_to=moved.uri)
    except OSError as error:
        raise EnvironmentFailure("storage_failed", f"could not apply gate outcome {outcome!r} to {run.uri}: {error}",
                                 file=run.uri) from error
    return GateFate(outcome, verdict, stamped, run.uri)


def _sibling(location: Location, name: str) -> Location:
    parent_uri, _, _ = location.uri.rstrip("/").rpartition("/")
    parent_path, _, _ = location.path.rstrip("/").rpartition("/")
    return Location(location.fs, f"{parent_path}/{name}", f"{parent_uri}/{name}")


def _stamp(evidence: Any, outcome: str) -> dict[str, Any] | None:
    if evidence is None:
        return None
    data = evidence.model_dump() if isinstance(evidence, PostEvalGateEvidence) else dict(evidence)
    data["outcome"] = outcome
    return data


def post_eval_receipt_block(result: Any, fate: GateFate | None = None) -> PostEvalRecord:
    """The ``post_eval`` block for ``train_receipt.json`` (Kiln's training-job field names).

    Kiln keeps ``gate_outcome``, ``post_eval_verdict`` and ``post_eval_gate_evidence[]`` on the
    training job (its receipt has no gate fields); kiln-flows records them in the receipt.

    Args:
        result: The ``PostEvalResult``.
        fate: What ``apply_gate_outcome`` did (None for an ungated eval).
    """
    evidence = fate.evidence if fate is not None else _stamp(result.evidence, result.outcome or "")
    metrics = {name: run.metrics for name, run in
               (("candidate", result.candidate), ("baseline", result.baseline), ("base_model", result.base_model))
               if run is not None}
    return PostEvalRecord(
        suite=result.suite, data_scope=result.data_scope, min_accuracy=result.min_accuracy, gated=result.gated,
        eval_job_id=result.eval_job_id, effective_seed=str(result.effective_seed),
        suite_hash=result.candidate.suite_hash if result.candidate else None,
        gate_outcome=fate.outcome if fate is not None else result.outcome,
        post_eval_verdict=fate.verdict if fate is not None else result.verdict,
        post_eval_gate_evidence=[evidence] if evidence is not None else [], metrics=metrics,
        adapter_location=fate.run_uri if fate is not None else None,
        latest=fate.latest_uri if fate is not None else None, error=result.error, warnings=list(result.warnings))
