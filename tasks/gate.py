"""The gate stage as a task: evaluate the adapter, tell automations, show base vs distilled.

``kiln_core.engine.gate.run_gate`` decides and acts on storage; this task adds what Prefect users
route and read:

* an event per decision — ``kiln-flows.adapter.promoted``, ``kiln-flows.adapter.rejected``
  (``regression``, ``demoted``, ``inconclusive``, ``error``) or ``kiln-flows.adapter.kept`` (passed,
  ``auto_load`` off) — on the resource ``kiln-flows.adapter.<adapter>.run.<run key>``, with the
  outcome, the verdict and the evidence as payload, so an automation can deploy a promoted adapter or
  page someone about a rejected one;
* a table artifact ``before-after-<adapter>``: base student vs distilled adapter on every metric the
  gate measured, with the thresholds.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from kiln_core.contracts.pipeline import PipelineSpec
from kiln_core.contracts.stage_refs import CorpusRef, GateRef, HeldOutRef, TrainRef
from tasks.artifacts import artifact_key
from tasks.retry import retry_unless_rejected

EVENT_PREFIX = "kiln-flows.adapter"


def gate_event_name(outcome: str | None) -> str | None:
    """The event for an outcome (None: an informational eval decides nothing, so nothing is emitted).

    Example:
        >>> gate_event_name("demoted")
        'kiln-flows.adapter.rejected'
    """
    if outcome is None:
        return None
    if outcome in ("promoted", "kept"):
        return f"{EVENT_PREFIX}.{outcome}"
    return f"{EVENT_PREFIX}.rejected"


def gate_event(gate: GateRef, adapter: str) -> dict[str, Any] | None:
    """The event's name, resource and payload (``emit_event``'s keywords), or None."""
    name = gate_event_name(gate.outcome)
    if name is None:
        return None
    run_key = gate.run_uri.rstrip("/").rsplit("/", 1)[-1]
    summary = gate.summary()  # the blocks as JSON
    evidence = ((summary["post_eval"] or {}).get("post_eval_gate_evidence") or [None])[0]
    quality = summary["quality_gate"]
    return {
        "event": name,
        "resource": {"prefect.resource.id": f"{EVENT_PREFIX}.{adapter}.run.{run_key}",
                     "prefect.resource.name": adapter, "kiln-flows.run": gate.run_uri},
        "payload": {"outcome": gate.outcome, "verdict": gate.verdict, "adapter": adapter, "run": gate.run_uri,
                    "receipt": gate.receipt_uri, "evidence": evidence,
                    "quality": {key: quality[key] for key in ("thresholds", "base", "distilled", "failures")}
                    if quality else None},
    }


def before_after_artifact(gate: GateRef, adapter: str) -> None:
    """The base-vs-distilled table (one row per metric the gate measured)."""
    from prefect.artifacts import create_table_artifact

    from kiln_core.engine.gate import before_after_rows

    rows = before_after_rows(gate.summary())
    if rows:
        create_table_artifact(rows, key=artifact_key("before-after", adapter),
                              description=f"{adapter}: base student vs distilled adapter — gate {gate.outcome}")


@task(name="gate", task_run_name="gate-{spec.adapter}", retries=2, retry_delay_seconds=[2, 10],
      retry_condition_fn=retry_unless_rejected)
def gate_task(trained: TrainRef, spec: PipelineSpec, manifest: Any, student_dir: str, seed: int | None,
              training: CorpusRef, device: str | None = None, gate_corpus: HeldOutRef | None = None) -> GateRef:
    """Evaluate the trained adapter (``post_eval``, ``quality_gate``), emit the decision, show the table.

    Example:
        ```python
        gate = gate_task(train_ref, spec, manifest_ref, "./student", seed=7, training=corpus_ref)
        print(gate.outcome)
        ```
    """
    from prefect import get_run_logger
    from prefect.events import emit_event

    from kiln_core.engine.gate import run_gate

    gate = run_gate(trained, spec, manifest, student_dir, seed=seed, training=training, device=device,
                    gate_corpus=gate_corpus)
    get_run_logger().info("gate %s: %s", gate.outcome or "informational", gate.verdict or "")
    event = gate_event(gate, spec.adapter)
    if event is not None:
        emit_event(**event)
    before_after_artifact(gate, spec.adapter)
    return gate
