"""The recipes ``kiln-flows recipe list`` shows: those bundled with kiln-flows, and Kiln's built-in ones.

Bundled recipes (``kiln_core/recipes/bundled/*.yaml``, package data) can actually run; each says in its
description what it needs (a corpus in the working directory, an installed eval suite). A bundled recipe is run
by name (``kiln-flows recipe run distill-and-gate``); its relative paths are taken relative to the working
directory. Kiln's ten built-in recipes (``crates/kiln-server/src/api/recipes/*.yaml``) are
listed with ``--all``, each marked not runnable with the reason: none of them can run here as written.

Example:
    >>> sorted(entry.name for entry in bundled_recipes())
    ['distill-and-gate', 'general-then-domain']
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["CatalogEntry", "bundled_recipes", "bundled_recipe_path", "kiln_builtin_recipes", "BUNDLED_DIR"]

BUNDLED_DIR = Path(__file__).with_name("bundled")

_REFRESH = "distill_refresh is refused (Kiln refuses it too: training_backend_unsupported)"
_DOMAIN = ("distill_pump domain mode without a prompt bank: Kiln's seed bank is 3-4 user-only prompts (and "
           "{domain!r} is not even one of its domains); kiln-flows needs the pump's prompt_bank")
_MERGE = ("distill_merge step without training_mode: off_policy (a recipe step defaults to on_policy, which merge "
          "refuses), and its rollout_budget and weights must match the sources' replay rows (Kiln's contract)")

# (name, steps as Kiln's YAML has them, why it cannot run here) — crates/kiln-server/src/api/recipes/*.yaml.
_KILN_BUILTINS = (
    ("recover-instruction-following", "distill_refresh company-assistant@refresh", _REFRESH),
    ("update-with-new-docs", "distill_refresh company-assistant@v18", _REFRESH),
    ("recover-tool-following", "distill_refresh pi-coder-tool-recovered", _REFRESH),
    ("frontier-pump", "distill_pump math-frontier-lora (domain math_reasoning)",
     "distill_pump domain mode without a prompt bank: Kiln's math_reasoning seed bank is 4 user-only prompts; "
     "kiln-flows needs the pump's prompt_bank"),
    ("pi-share-then-pump", "distill_pump rust-agentic-lora (domain pi_share_rust)", _DOMAIN.format(domain="pi_share_rust")),
    ("make-a-judge-lora-from-my-picks", "distill_pump judge-lora (domain judge_traces)",
     _DOMAIN.format(domain="judge_traces")),
    ("merge-my-loras", "distill_merge unified-assistant <- rust-helper, python-helper, sql-helper", _MERGE),
    ("merge-my-agent-loras", "distill_merge unified-agent <- rust-coder, bash-ops, repo-navigator", _MERGE),
    ("coding-assistant-from-repo", "sft repo-cold-start -> opd repo-assistant",
     "sft steps are refused (kiln-flows has no SFT trainer), and `dataset: repo-synthesis-prompts` names a Kiln "
     "server dataset"),
    ("learn-from-my-pi-history", "opd pi-coder-refresh (prompts agent_traces:user-pi)",
     "agent_traces: selectors need Kiln's agent-trace index, which kiln-flows does not have"),
)


@dataclass(frozen=True)
class CatalogEntry:
    """One recipe in the list.

    Attributes:
        name: The recipe's name (a bundled one runs by this name).
        description: What it does and what it needs.
        steps: Its steps, ``kind name`` each.
        source: ``bundled`` (ships with kiln-flows) or ``kiln`` (Kiln's built-in, listed for reference).
        runnable: Whether kiln-flows can run it as written.
        reason: Why not, when it cannot.
    """

    name: str
    description: str
    steps: tuple[str, ...]
    source: str
    runnable: bool
    reason: str | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description, "steps": list(self.steps),
                "source": self.source, "runnable": self.runnable, "reason": self.reason}


def bundled_recipe_path(name: str) -> Path | None:
    """The bundled recipe file called ``name`` (``<name>.yaml``), or None.

    Example:
        >>> bundled_recipe_path("distill-and-gate").name
        'distill-and-gate.yaml'
    """
    path = BUNDLED_DIR / f"{name}.yaml"
    return path if "/" not in name and path.is_file() else None


def bundled_recipes() -> list[CatalogEntry]:
    """The bundled recipes, each checked with ``plan_recipe`` (no storage root: suites are checked at run time).

    A bundled recipe this build cannot plan (a step kind it does not ship) is listed as not runnable, with why.

    Example:
        >>> all(entry.runnable for entry in bundled_recipes())
        True
    """
    from kiln_core.contracts.recipe import load_recipe, recipe_value
    from kiln_core.errors import Rejection
    from kiln_core.recipes.recipe_plan import plan_recipe

    entries = []
    for path in sorted(BUNDLED_DIR.glob("*.yaml")):
        document = load_recipe(str(path))
        steps = tuple(f"post_eval {step.get('suite')} on {step.get('adapter')}" if step.get("kind") == "post_eval"
                      else f"{step.get('kind')} {step.get('name')}" for step in document.steps)
        try:
            plan_recipe(recipe_value(str(path)))
            runnable, reason = True, None
        except Rejection as error:
            runnable, reason = False, error.describe()
        entries.append(CatalogEntry(document.name, " ".join((document.description or "").split()), steps, "bundled",
                                    runnable, reason))
    return entries


def kiln_builtin_recipes() -> list[CatalogEntry]:
    """Kiln's built-in recipes, none runnable here, each with the reason.

    Example:
        >>> [entry.runnable for entry in kiln_builtin_recipes()].count(False)
        10
    """
    return [CatalogEntry(name, "Kiln built-in recipe", (steps,), "kiln", False, reason)
            for name, steps, reason in _KILN_BUILTINS]
