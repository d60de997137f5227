"""The identity of a suite and of one run's generation settings, as Kiln hashes them.

Source: crates/kiln-eval/src/replay.rs · eval_suite_sha256, eval_effective_generation_sha256:

* ``suite_sha256`` = ``hash_json("kiln.eval-suite.v1\\0", suite)``;
* ``effective_generation_sha256`` = ``hash_json("kiln.eval-effective-generation.v1\\0", {seed_derivation,
  effective_seed (decimal string), suite_sha256, generation_override, resolved_thinking_budgets})``.

Two arms are comparable only when both digests match (``gate.paired_aggregate_flips``). Thinking
budgets are part of the generation identity; kiln-flows resolves them as a Kiln server without a
default would, but its runner does not enforce them (the records say ``applied: false``).
"""

from __future__ import annotations

from typing import Any

from kiln_core.post_eval.stats import SEED_DERIVATION_V1
from kiln_core.contracts.post_eval.suite import EvalGenerationParams, EvalSuite, effective_generation
from kiln_core.serde_json import hash_json

__all__ = ["suite_sha256", "effective_generation_sha256"]

SUITE_DOMAIN = b"kiln.eval-suite.v1\0"
EFFECTIVE_GENERATION_DOMAIN = b"kiln.eval-effective-generation.v1\0"


def suite_sha256(suite: EvalSuite) -> str:
    """Kiln's ``eval_suite_sha256``: ``hash_json("kiln.eval-suite.v1\\0", suite)``."""
    return hash_json(SUITE_DOMAIN, suite.wire())


def _budget_record(params: EvalGenerationParams, scope: str) -> dict[str, Any]:
    """``ThinkingBudgetRecord`` as Kiln resolves it with no server default; never applied here."""
    limits: dict[str, Any] = {}
    sources = []
    for field, key in (("thinking_budget_tokens", "max_tokens"), ("thinking_budget_ms", "max_time_ms")):
        value = params.budget(field)
        if value == "inherit":
            sources.append("unlimited")
        elif value is None:
            sources.append(f"{scope}_unlimited")
        else:
            limits[key] = value
            sources.append(scope)
    return {"configured": bool(limits), "applied": False, **limits, "tokens_source": sources[0],
            "time_source": sources[1], "triggered": False}


def effective_generation_sha256(suite: EvalSuite, override: EvalGenerationParams | None, effective_seed: int) -> str:
    """Kiln's ``eval_effective_generation_sha256`` for one run of ``suite``."""
    budgets = [_budget_record(*effective_generation(suite, example, override)) for example in suite.examples]
    identity = {
        "seed_derivation": SEED_DERIVATION_V1,
        "effective_seed": str(effective_seed),
        "suite_sha256": suite_sha256(suite),
        "generation_override": override.wire() if override is not None else None,
        "resolved_thinking_budgets": budgets,
    }
    return hash_json(EFFECTIVE_GENERATION_DOMAIN, identity)
