"""A Kiln recipe file: ``{name, description?, steps[]}``, each step tagged by ``kind``, and its two step shapes
that kiln-flows owns (``opd`` and ``post_eval``).

Source: Kiln's ``crates/kiln-server/src/api/recipes.rs`` (``Recipe``, ``RecipeStep``, ``PromptsSource``).
The step kinds:

* ``opd {name, teacher, prompts_from: {dataset} | {prompts}, config}``. For kiln-flows ``dataset`` is a
  teacher-scored Kiln corpus (a path relative to the recipe file, trained off-policy) and inline ``prompts``
  are Kiln ``OpdPrompt`` objects trained on-policy (Kiln's default mode) with a registered local teacher.
  Kiln itself refuses ``dataset`` in a recipe step ("requires server-side dataset resolution").
* ``distill_self``, ``distill_merge``, ``distill_pump``: the body of the route's request, less ``post_eval``
  (Kiln's step fields, plus the fields kiln-flows needs to run them, e.g. distill_self ``prompts``,
  ``ground_truth``, ``documents``; distill_pump ``prompt_bank``). Their models belong to their recipes
  (``kiln_core.contracts.distill_*``); this module keeps them as mappings.
* ``post_eval {suite, adapter, require_min_score}``: the gate of the training step right before it.
* ``sft`` and ``distill_refresh`` parse in Kiln but are refused here (``recipe_step_unsupported``).

Every step's ``config`` is Kiln's ``OpdConfig`` with its plain serde default, so ``training_mode`` is
``on_policy`` unless the file says otherwise — for every kind, distill_self and distill_merge included
(whose own routes default to off_policy). The file is read with ``yaml.safe_load`` after the same depth
check as a pipeline spec.

Example:
    >>> document = parse_recipe({"name": "demo", "steps": [{"kind": "post_eval", "suite": "s",
    ...     "adapter": "a", "require_min_score": 0.5}]})
    >>> document.steps[0]["kind"]
    'post_eval'
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.contracts.opd_prompt import OpdPrompt
from kiln_core.errors import Rejection

__all__ = ["RecipeDocument", "OpdStep", "PostEvalStep", "TRAINING_STEP_KINDS", "REFUSED_STEP_KINDS",
           "STEP_KINDS", "parse_recipe", "load_recipe", "recipe_value"]

TRAINING_STEP_KINDS = ("opd", "distill_self", "distill_merge", "distill_pump")
"""Step kinds that train an adapter (named by the step's ``name``)."""
REFUSED_STEP_KINDS = {
    "sft": "kiln-flows trains with OPD only; there is no SFT trainer. Replace the sft step with an opd step "
           "on a teacher-scored corpus (prompts_from: {dataset: corpus.jsonl}, config.training_mode: off_policy)",
    "distill_refresh": "Kiln refuses distill_refresh too (training_backend_unsupported: its SFT and OPD phases "
                       "cannot be pinned as one unit). Run an opd or distill_pump step on the new data with the "
                       "previous adapter's registered LoRA teacher instead",
}
"""Kiln step kinds kiln-flows parses but does not run, each with what to do instead."""
STEP_KINDS = (*TRAINING_STEP_KINDS, "post_eval")


class RecipeDocument(BaseModel):
    """Kiln's ``Recipe``: a name, an optional description and the steps, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    """The recipe's name (it names the recipe's run record under the storage root, so the adapter-name rule applies)."""
    description: str | None = None
    """What the recipe does and what it needs (shown by ``kiln-flows recipe list``)."""
    steps: list[dict[str, Any]] = Field(min_length=1)
    """The steps, each a mapping tagged by ``kind``; run in order."""


class OpdStep(BaseModel):
    """Kiln's ``RecipeStep::Opd``: one OPD run whose output adapter is ``name``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    """The output adapter's name."""
    teacher: str
    """A registered local teacher alias, or a file whose first line is the teacher's manifest (relative to the recipe file)."""
    dataset: str | None = None
    """``prompts_from.dataset``: a teacher-scored Kiln corpus (off-policy), relative to the recipe file."""
    prompts: list[OpdPrompt] = Field(default_factory=list)
    """``prompts_from.prompts``: inline Kiln ``OpdPrompt`` objects (on-policy)."""
    config: OpdConfig = Field(default_factory=OpdConfig)
    """Kiln's ``OpdConfig``; its default ``training_mode`` is on_policy, as in Kiln's recipe steps."""


class PostEvalStep(BaseModel):
    """Kiln's ``RecipeStep::PostEval``: the gate of the training step right before it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: str = "post_eval"
    suite: str
    """An eval suite registered under the storage root (``kiln-flows eval suites add``)."""
    adapter: str
    """The preceding training step's output adapter (Kiln refuses any other name)."""
    require_min_score: float
    """The gate's accuracy floor in [0, 1]: becomes that step's ``post_eval.min_accuracy``."""


def _error_field(error: ValidationError, prefix: str) -> tuple[str, str]:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return (f"{prefix}.{where}" if prefix and where else where or prefix), first["msg"]


def parse_recipe(value: Any, *, file: str | None = None) -> RecipeDocument:
    """Validate a decoded recipe's outline: its name, description and a non-empty list of mappings.

    The steps themselves are checked by ``kiln_core.recipes.recipe_plan.plan_recipe`` (each kind by its own rules).

    Raises:
        Rejection: ``invalid_recipe`` naming the field.

    Example:
        >>> parse_recipe({"name": "r", "steps": []})
        Traceback (most recent call last):
        ...
        kiln_core.errors.Rejection: [invalid_recipe] field steps: recipe steps: List should have at least 1 item after validation, not 0
    """
    if not isinstance(value, dict):
        raise Rejection("invalid_recipe", "a recipe must be a mapping with `name` and `steps`", file=file)
    try:
        return RecipeDocument.model_validate(value)
    except ValidationError as error:
        field, message = _error_field(error, "")
        raise Rejection("invalid_recipe", f"recipe {field}: {message}", field=field or None, file=file) from None


def load_recipe(path: str) -> RecipeDocument:
    """Read a recipe YAML (or JSON) file safely and validate its outline.

    Raises:
        Rejection: ``invalid_recipe`` (unreadable, not YAML, not a recipe), ``nesting_too_deep``.

    Example:
        >>> load_recipe("kiln_core/recipes/bundled/corpus-then-polish.yaml").name  # doctest: +SKIP
        'corpus-then-polish'
    """
    return parse_recipe(recipe_value(path), file=path)


def recipe_value(path: str) -> Any:
    """The decoded YAML of a recipe file (``yaml.safe_load`` after the pipeline spec's depth check).

    Raises:
        Rejection: ``invalid_recipe`` (unreadable or not YAML), ``nesting_too_deep``.

    Example:
        >>> recipe_value("kiln_core/recipes/bundled/distill-and-gate.yaml")["steps"][1]["kind"]  # doctest: +SKIP
        'post_eval'
    """
    import yaml

    from kiln_core.contracts.spec_file import check_yaml_depth
    from kiln_core.storage import resolve

    try:
        text = resolve(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else "not UTF-8 text"
        raise Rejection("invalid_recipe", f"cannot read recipe {path}: {reason}", file=path) from None
    try:
        check_yaml_depth(text, path, where="the recipe")
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise Rejection("invalid_recipe", f"recipe {path} is not valid YAML: {error}", file=path) from None
