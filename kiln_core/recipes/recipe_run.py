"""What a recipe run remembers between attempts, and how a step ends a recipe early.

A retried recipe resumes at its first unfinished step. The record of finished steps lives at
``<root>/recipes/runs/<recipe name>/<digest>.json``, where the digest covers the recipe document and the student,
so another recipe, an edited one or another student starts its own record. It is rewritten atomically after each
finished step. A step counts as finished on a retry only while ``runs/<adapter>/latest.json`` still points at the
run the record names: an adapter published again since (by hand, or by another recipe) makes the step run again.

Recipes are fail-fast (Kiln queues every step and never stops later ones): a step that fails ends the recipe
with ``RecipeStepFailed`` (exit 3), one whose gate holds its adapter back with ``RecipeHeldBack`` (exit 4).

Example:
    >>> len(recipe_digest({"name": "r", "steps": []}, "./student"))
    64
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.errors import EXIT_HELD_BACK, KilnFlowsError

__all__ = ["StepRecord", "RecipeRunRecord", "RecipeStepFailed", "RecipeHeldBack", "recipe_digest",
           "record_location", "read_run_record", "write_run_record", "finished_run"]

RECIPE_RUNS_DIR = ("recipes", "runs")
RECORD_SCHEMA = "kiln-flows.recipe-run.v1"


class RecipeStepFailed(KilnFlowsError):
    """A recipe step failed (training failed, its input was refused, storage failed): the recipe stops, exit 3."""

    status = "failed"
    retryable = False


class RecipeHeldBack(KilnFlowsError):
    """A recipe step trained, but its ``post_eval`` gate held the adapter back: the recipe stops, exit 4."""

    status = "held_back"
    exit_code = EXIT_HELD_BACK
    retryable = False


class StepRecord(BaseModel):
    """One finished step: the run that published its adapter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    """The step's position in the recipe file."""
    name: str
    """The adapter it published."""
    run: str
    """The run directory ``latest.json`` pointed at when the step finished."""
    receipt: str
    """The run's ``train_receipt.json``."""
    gate_outcome: str | None = None
    """``promoted`` or ``kept`` when a post_eval step gated it; None without a gate."""
    finished_at: str
    """When the step finished (RFC 3339, UTC)."""


class RecipeRunRecord(BaseModel):
    """``<root>/recipes/runs/<recipe>/<digest>.json``: the finished steps of one recipe for one student."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: str = Field(default=RECORD_SCHEMA, alias="schema")
    recipe: str
    digest: str
    student: str
    steps: list[StepRecord] = Field(default_factory=list)

    def with_step(self, step: StepRecord) -> "RecipeRunRecord":
        """This record with ``step`` recorded (replacing an earlier record of the same index)."""
        kept = [done for done in self.steps if done.index != step.index]
        return self.model_copy(update={"steps": sorted([*kept, step], key=lambda done: done.index)})

    def step(self, index: int) -> StepRecord | None:
        return next((done for done in self.steps if done.index == index), None)


def recipe_digest(document: Any, student: str) -> str:
    """SHA-256 (hex) of the recipe document and the student, in canonical JSON (sorted keys).

    Example:
        >>> recipe_digest({"a": 1}, "s") == recipe_digest({"a": 1}, "s")
        True
    """
    text = json.dumps({"recipe": document, "student": student}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def record_location(storage_root: str, recipe: str, digest: str):
    """The record's ``Location`` under the storage root.

    Example:
        >>> record_location("/data", "demo", "ab" * 32).uri
        '/data/recipes/runs/demo/abababababababababababababababababababababababababababababababab.json'
    """
    from kiln_core.storage import resolve

    return resolve(storage_root).child(*RECIPE_RUNS_DIR, recipe, f"{digest}.json")


def read_run_record(storage_root: str, recipe: str, digest: str, student: str) -> RecipeRunRecord:
    """The record of earlier attempts, or a fresh one when there is none (or it cannot be read as one).

    Example:
        >>> read_run_record("/tmp/nowhere", "r", "0" * 64, "./student").steps
        []
    """
    from pydantic import ValidationError

    location = record_location(storage_root, recipe, digest)
    fresh = RecipeRunRecord(recipe=recipe, digest=digest, student=student)
    if not location.exists():
        return fresh
    try:
        return RecipeRunRecord.model_validate_json(location.read_bytes())
    except ValidationError:  # a record from another version: run the steps again rather than trust it
        return fresh


def write_run_record(storage_root: str, record: RecipeRunRecord) -> str:
    """Write the record atomically (``write_bytes_atomic``: a reader sees the old record or the new one); returns its URI.

    Example:
        >>> write_run_record("./kiln-data", record.with_step(done))  # doctest: +SKIP
        '/abs/kiln-data/recipes/runs/demo/3f0c….json'
    """
    from kiln_core.storage import write_bytes_atomic

    location = record_location(storage_root, record.recipe, record.digest)
    write_bytes_atomic(location, record.model_dump_json(by_alias=True, indent=2).encode("utf-8"))
    return location.uri


def finished_run(record: RecipeRunRecord, index: int, name: str, storage_root: str) -> StepRecord | None:
    """The step's record when it finished in an earlier attempt and its adapter's ``latest.json`` still points at
    that run; None when the step must run (again).

    Example:
        >>> finished_run(RecipeRunRecord(recipe="r", digest="d", student="s"), 0, "a", "/tmp/nowhere") is None
        True
    """
    from kiln_core.contracts.latest import LATEST_FILE, decode_latest
    from kiln_core.storage import resolve

    done = record.step(index)
    if done is None or done.name != name:
        return None
    latest = resolve(storage_root).child("runs", name, LATEST_FILE)
    if not latest.exists():
        return None
    try:
        pointer = decode_latest(latest.read_bytes())
    except ValueError:
        return None
    return done if pointer.run == done.run else None


def step_record(index: int, name: str, summary: dict[str, Any]) -> StepRecord:
    """A finished step's record, from its run summary (``PipelineResult.summary()``).

    Example:
        >>> step_record(0, "a", {"run": "/r/runs/a/k", "receipt": "/r/runs/a/k/train_receipt.json"}).gate_outcome is None
        True
    """
    gate = summary.get("gate") or {}
    return StepRecord(index=index, name=name, run=summary["run"], receipt=summary["receipt"],
                      gate_outcome=gate.get("outcome"),
                      finished_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
