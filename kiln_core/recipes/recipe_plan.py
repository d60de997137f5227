"""A recipe file checked whole before its first step runs, and each step turned into the spec that trains it.

Kiln's recipe runner (``crates/kiln-server/src/api/recipes.rs``) validates the structure and
the adapter names, then maps every step to a training job. ``plan_recipe`` does the same, in this order, and
refuses the first problem with a code and the field (``steps[2].adapter``):

1. the outline (``invalid_recipe``): a mapping with ``name`` (the adapter-name rule: it names the recipe's run
   record), optional ``description``, and at least one step;
2. every step's ``kind``: ``sft`` and ``distill_refresh`` are refused (``recipe_step_unsupported``, saying why and
   what to use instead), anything else unknown is ``recipe_step_unknown_kind``; training steps' ``name`` follows the
   adapter-name rule (``invalid_adapter_name``) and is unique (``recipe_duplicate_step_name``);
3. each ``post_eval`` step follows a training step (``recipe_post_eval_misplaced``) and names that step's output
   (``recipe_post_eval_adapter_mismatch``, Kiln's text); its suite is installed and ``require_min_score`` is in
   [0, 1] (the ``post_eval`` codes); it becomes that step's gate ``{suite, min_accuracy: require_min_score}``;
4. a training step may not carry its own ``post_eval`` (its gate is the ``post_eval`` step after it), and no cycle
   of names (``recipe_name_cycle``): its ``config.base_adapter`` (or a merge's ``sources[].adapter`` or
   ``student``) may not name its own output or the output of a later step;
5. each training step's own submit rules (its kind's ``check_*``, the field prefixed with ``steps[i].``), with
   Kiln's plain ``OpdConfig`` default (``training_mode: on_policy`` unless the file says otherwise).

Chaining as Kiln chains: an ``opd``, ``distill_pump`` or ``distill_self`` step whose config names no
``base_adapter`` warm-starts from the previous training step's output; ``distill_merge`` does not chain.

Each training kind maps to its ``check_<kind>_request`` / ``prepare_<kind>`` pair, imported by module path when a
step needs it (``STEP_ENGINES``), so a build without one of the distill recipes refuses that step kind by name.

Example:
    >>> plan = plan_recipe({"name": "two", "steps": [
    ...     {"kind": "opd", "name": "a", "teacher": "t.jsonl", "prompts_from": {"dataset": "c.jsonl"},
    ...      "config": {"training_mode": "off_policy"}},
    ...     {"kind": "opd", "name": "b", "teacher": "t.jsonl", "prompts_from": {"dataset": "c.jsonl"},
    ...      "config": {"training_mode": "off_policy"}}]})
    >>> [(step.name, step.base_adapter) for step in plan.steps]
    [('a', None), ('b', 'a')]
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from kiln_core.contracts.names import check_name
from kiln_core.contracts.recipe import REFUSED_STEP_KINDS, STEP_KINDS, TRAINING_STEP_KINDS, PostEvalStep, parse_recipe
from kiln_core.errors import Rejection

__all__ = ["PlannedStep", "RecipePlan", "STEP_ENGINES", "CHAINED_KINDS", "plan_recipe", "check_step_inputs",
           "step_functions", "prepare_step"]

STEP_ENGINES: dict[str, tuple[str, str, str]] = {
    "opd": ("kiln_core.recipes.opd", "check_opd_request", "prepare_opd"),
    "distill_self": ("kiln_core.recipes.distill_self", "check_distill_self_request", "prepare_distill_self"),
    "distill_merge": ("kiln_core.recipes.distill_merge", "check_distill_merge_request", "prepare_distill_merge"),
    "distill_pump": ("kiln_core.recipes.distill_pump", "check_distill_pump_request", "prepare_distill_pump"),
}
"""Each training step kind: (module, check function, prepare function)."""
STEP_OPTIONS: dict[str, tuple[str, ...]] = {
    "distill_pump": ("prompt_bank",),
    "distill_self": ("teacher",),
}
"""Keys of a step that are not fields of Kiln's request body but options of its recipe (the command's flags):
distill_pump's ``prompt_bank`` (a path, relative to the recipe file), distill_self's ``teacher`` (a registered
alias scoring with the privileged context instead of the bare base model)."""
PATH_OPTIONS = ("prompt_bank",)
CHAINED_KINDS = ("opd", "distill_self", "distill_pump")
"""Kinds whose ``base_adapter`` defaults to the previous training step's output (Kiln: sft too; merge never)."""


@dataclass(frozen=True)
class PlannedStep:
    """One training step of a checked recipe.

    Attributes:
        index: The step's 0-based position in the recipe file (``steps[index]``).
        kind: ``opd``, ``distill_self``, ``distill_merge`` or ``distill_pump``.
        name: The adapter the step publishes.
        body: The step less ``kind``, with Kiln's default config filled in: what its ``check_*`` validated.
        base_adapter: The warm start chained from the previous training step (None: the step's own config
            decides, or the kind does not chain, or it is the first training step).
        gate: The ``post_eval`` block from the ``post_eval`` step right after it (``PostEvalConfig`` fields), or None.
        gate_step: That ``post_eval`` step's index, or None.
    """

    index: int
    kind: str
    name: str
    body: dict[str, Any]
    base_adapter: str | None = None
    gate: dict[str, Any] | None = None
    gate_step: int | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The step's recipe options (``STEP_OPTIONS``), kept out of the request body its ``check_*`` validates."""

    @property
    def label(self) -> str:
        """``steps[2] opd 'polished'``: how messages name the step."""
        return f"steps[{self.index}] {self.kind} {self.name!r}"


@dataclass(frozen=True)
class RecipePlan:
    """A recipe checked whole: its name, description and training steps in order (gates folded into them)."""

    name: str
    description: str | None
    steps: tuple[PlannedStep, ...]
    file: str | None = None


def step_functions(kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The ``(check_<kind>_request, prepare_<kind>)`` pair of a training step kind, imported now.

    Raises:
        Rejection: ``recipe_step_unsupported`` when this build does not ship the kind's module.

    Example:
        >>> check, prepare = step_functions("opd")
        >>> check.__name__, prepare.__name__
        ('check_opd_request', 'prepare_opd')
    """
    module_name, check_name_, prepare_name = STEP_ENGINES[kind]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise Rejection("recipe_step_unsupported", f"{kind} steps need {module_name}, which this kiln-flows build "
                        "does not ship; upgrade kiln-flows or remove the step", field="kind") from None
    return getattr(module, check_name_), getattr(module, prepare_name)


def plan_recipe(value: Any, *, file: str | None = None, suites: Any = None) -> RecipePlan:
    """Check a decoded recipe whole (the rules in the module docstring) and plan its training steps.

    Args:
        value: The decoded recipe (``kiln_core.contracts.recipe.recipe_value``) or a mapping.
        file: The recipe file, named in rejections and passed to each step's ``check_*``.
        suites: The installed eval suites (``kiln_core.post_eval.registry.SuiteRegistry`` of the storage root, which
            the caller opens: a recipe does not reach into the gate's stage); None skips the installed-suite check.

    Returns:
        The plan: training steps in order, each with its chained warm start and its gate.

    Raises:
        Rejection: the first rule broken, naming ``steps[i].<field>``.

    Example:
        >>> plan_recipe({"name": "r", "steps": [{"kind": "sft", "name": "a"}]})
        Traceback (most recent call last):
        ...
        kiln_core.errors.Rejection: [recipe_step_unsupported] field steps[0].kind: sft steps are not supported: kiln-flows trains with OPD only; there is no SFT trainer. Replace the sft step with an opd step on a teacher-scored corpus (prompts_from: {dataset: corpus.jsonl}, config.training_mode: off_policy)
    """
    document = parse_recipe(value, file=file)
    check_name(document.name, field="name", code="invalid_recipe")
    names = _training_names(document.steps, file)
    planned: list[PlannedStep] = []
    previous: PlannedStep | None = None
    for index, step in enumerate(document.steps):
        if step["kind"] == "post_eval":
            gate = _gate(index, step, document.steps, document.name, file, suites)
            planned[-1] = dataclasses.replace(planned[-1], gate=gate, gate_step=index)
            continue
        option_keys = STEP_OPTIONS.get(step["kind"], ())
        options = {key: step[key] for key in option_keys if key in step}
        for key, option in options.items():
            if not isinstance(option, str) or not option.strip():
                raise Rejection("invalid_recipe", f"`{key}` must be a non-empty string", field=f"steps[{index}].{key}",
                                file=file)
        body = _with_kiln_default_config({key: item for key, item in step.items()
                                          if key != "kind" and key not in option_keys})
        if "post_eval" in body:
            raise Rejection("invalid_recipe", "a recipe step's gate is the post_eval step right after it, not a "
                            "`post_eval` field of the step", field=f"steps[{index}].post_eval", file=file)
        _check_no_cycle(index, step["kind"], body, names, file)
        check, _ = _step_functions_at(index, step["kind"], file)
        try:
            check(body, file=file)
        except Rejection as error:
            raise _at_step(error, index, file) from None
        chained = None
        if step["kind"] in CHAINED_KINDS and previous is not None and not _named_base_adapter(body):
            chained = previous.name
        previous = PlannedStep(index=index, kind=step["kind"], name=body["name"], body=body, base_adapter=chained,
                               options=options)
        planned.append(previous)
    return RecipePlan(name=document.name, description=document.description, steps=tuple(planned), file=file)


def check_step_inputs(plan: RecipePlan, recipe_file: str | None = None) -> None:
    """Refuse a recipe whose steps name input files that are not there, before the first step runs: an opd step's
    ``prompts_from.dataset`` and a step's path options (``prompt_bank``), taken relative to ``recipe_file`` (the
    working directory without one), as ``prepare_step`` takes them.

    Raises:
        Rejection: ``file_not_found``, naming the step's field (``steps[0].prompts_from.dataset``).
    """
    import os

    from kiln_core.storage import anchored_path, resolve

    anchor = recipe_file or os.path.join(os.getcwd(), "recipe.yaml")
    for step in plan.steps:
        named = [(key, value) for key, value in step.options.items() if key in PATH_OPTIONS]
        source = step.body.get("prompts_from") if step.kind == "opd" else None
        if isinstance(source, dict) and isinstance(source.get("dataset"), str):
            named.append(("prompts_from.dataset", source["dataset"]))
        for field, value in named:
            path = anchored_path(value, anchor)
            if not resolve(path).exists():
                raise Rejection("file_not_found", f"{path} does not exist", field=f"steps[{step.index}].{field}",
                                file=recipe_file)


def prepare_step(step: PlannedStep, *, recipe: str, student_dir: str, storage_root: str,
                 recipe_file: str | None = None):
    """The ``PipelineSpec`` that trains one planned step: its ``check_*`` again, its ``prepare_*`` (the teacher
    work), and its gate.

    Relative paths in the step (an opd ``teacher`` or ``dataset``) are taken relative to ``recipe_file``.

    Raises:
        Rejection: what the step's ``prepare_*`` refuses (a missing corpus, an unregistered teacher, …).

    Example:
        >>> spec = prepare_step(plan.steps[0], recipe=plan.name, student_dir="./student",
        ...                     storage_root="./kiln-data", recipe_file="recipe.yaml")  # doctest: +SKIP
        >>> spec.recipe.step  # doctest: +SKIP
        0
    """
    from kiln_core.contracts.post_eval.config import PostEvalConfig

    from kiln_core.storage import anchored_path

    check, prepare = step_functions(step.kind)
    request = check(step.body, file=recipe_file)
    options = {key: anchored_path(value, recipe_file) if key in PATH_OPTIONS and recipe_file else value
               for key, value in step.options.items()}
    if step.kind == "opd":  # its teacher and dataset are paths, taken relative to the recipe file
        options["request_file"] = recipe_file
    spec = prepare(request, student_dir=student_dir, out_root=storage_root, base_adapter=step.base_adapter,
                   recipe=recipe, step=step.index, **options)
    if step.gate is not None:
        spec = spec.model_copy(update={"post_eval": PostEvalConfig.model_validate(step.gate)})
    return spec


def _training_names(steps: list[dict[str, Any]], file: str | None) -> list[str | None]:
    """Every step's kind checked, and each training step's output name (None for a post_eval step)."""
    names: list[str | None] = []
    for index, step in enumerate(steps):
        kind = step.get("kind")
        if kind in REFUSED_STEP_KINDS:
            raise Rejection("recipe_step_unsupported", f"{kind} steps are not supported: {REFUSED_STEP_KINDS[kind]}",
                            field=f"steps[{index}].kind", file=file)
        if kind not in STEP_KINDS:
            raise Rejection("recipe_step_unknown_kind", f"unknown step kind {kind!r}; a step's kind is one of "
                            f"{', '.join(STEP_KINDS)} (sft and distill_refresh are refused)",
                            field=f"steps[{index}].kind", file=file)
        if kind == "post_eval":
            names.append(None)
            continue
        name = check_name(step.get("name"), field=f"steps[{index}].name")
        if name in names:
            raise Rejection("recipe_duplicate_step_name", f"step name {name!r} is already the output of "
                            f"steps[{names.index(name)}]; each training step publishes its own adapter",
                            field=f"steps[{index}].name", file=file)
        names.append(name)
    return names


def _gate(index: int, step: dict[str, Any], steps: list[dict[str, Any]], recipe: str, file: str | None,
          suites: Any) -> dict[str, Any]:
    """Kiln's post_eval step rules, and the gate it becomes (``PostEvalConfig`` fields)."""
    from pydantic import ValidationError

    from kiln_core.contracts.post_eval.config import parse_post_eval_config, validate_post_eval_config
    from kiln_core.contracts.post_eval.errors import PostEvalRejection

    try:
        parsed = PostEvalStep.model_validate(step)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise Rejection("invalid_recipe", f"post_eval step: `{where}`: {first['msg']}",
                        field=f"steps[{index}].{where}", file=file) from None
    check_name(parsed.adapter, field=f"steps[{index}].adapter")
    before = steps[index - 1] if index > 0 else None
    if before is None or before.get("kind") not in TRAINING_STEP_KINDS:
        raise Rejection("recipe_post_eval_misplaced", f"recipe {recipe} step {index}: PostEval must follow a "
                        "training step (it gates the adapter that step trains)", field=f"steps[{index}]", file=file)
    if parsed.adapter != before.get("name"):
        raise Rejection("recipe_post_eval_adapter_mismatch", f"recipe {recipe} step {index}: PostEval adapter "
                        f"'{parsed.adapter}' does not match the preceding step's output adapter '{before.get('name')}'",
                        field=f"steps[{index}].adapter", file=file)
    renamed = {"post_eval.suite": "suite", "post_eval.min_accuracy": "require_min_score"}
    try:
        gate = parse_post_eval_config({"suite": parsed.suite, "min_accuracy": parsed.require_min_score})
        validate_post_eval_config(gate, suites)
    except PostEvalRejection as error:
        field = renamed.get(error.field or "", "suite")
        raise Rejection(error.code, error.message, field=f"steps[{index}].{field}", file=file) from None
    return gate.model_dump(mode="json", exclude_defaults=True)


def _with_kiln_default_config(body: dict[str, Any]) -> dict[str, Any]:
    """Kiln's recipe steps take ``OpdConfig``'s plain serde default: ``training_mode`` is on_policy unless the step
    says otherwise, for every kind (a distill_self or distill_merge route would default to off_policy instead)."""
    config = body.get("config", {})
    if isinstance(config, dict) and "training_mode" not in config:
        return {**body, "config": {"training_mode": "on_policy", **config}}
    return body


def _named_base_adapter(body: dict[str, Any]) -> str | None:
    config = body.get("config")
    value = config.get("base_adapter") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def _check_no_cycle(index: int, kind: str, body: dict[str, Any], names: list[str | None], file: str | None) -> None:
    """A step may warm-start from, or merge, only adapters that exist before it runs."""
    references: list[tuple[str, str]] = []
    if _named_base_adapter(body):
        references.append(("config.base_adapter", _named_base_adapter(body) or ""))
    if kind == "distill_merge":
        for position, source in enumerate(body.get("sources") or []):
            if isinstance(source, dict) and isinstance(source.get("adapter"), str):
                references.append((f"sources[{position}].adapter", source["adapter"]))
        student = body.get("student")
        if isinstance(student, str) and student != "base":
            references.append(("student", student))
    for field, named in references:
        if named == names[index]:
            raise Rejection("recipe_name_cycle", f"{field} {named!r} is this step's own output: a step cannot start "
                            "from, or learn from, the adapter it is training", field=f"steps[{index}].{field}", file=file)
        later = [position for position in range(index + 1, len(names)) if names[position] == named]
        if later:
            raise Rejection("recipe_name_cycle", f"{field} {named!r} is the output of the later step "
                            f"steps[{later[0]}], which has not run yet when this step starts; reorder the steps",
                            field=f"steps[{index}].{field}", file=file)


def _step_functions_at(index: int, kind: str, file: str | None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        return step_functions(kind)
    except Rejection as error:
        raise _at_step(error, index, file) from None


def _at_step(error: Rejection, index: int, file: str | None) -> Rejection:
    """The step's rejection with its field as the recipe names it (``config.top_k`` → ``steps[1].config.top_k``)."""
    field = f"steps[{index}].{error.field}" if error.field else f"steps[{index}]"
    return Rejection(error.code, error.message, field=field, line=error.line, file=error.file or file)
