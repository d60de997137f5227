"""How the run form shows a choice, and how it keeps the numbers typed into it.

* A tagged choice (the optimizer, Stable-OPD) is one object of fields: Prefect's default UI (V1) renders
  a JSON-schema ``oneOf`` as a raw JSON editor; both of its UIs render a plain object with a dropdown as
  fields. ``flat_choice_schema`` shapes it, ``normalize_flat_choice`` reads the form's value back into
  the branch's own keys.
* Numbers Kiln requires above zero are ``exclusiveMinimum: 0`` (``mark_positive``), so a form refuses 0.
* Every number field of the spec's form is ``required`` (``require_numbers``). A form leaves out a number
  it cannot read: V1's number boxes refuse the letter e, so ``1e-5`` typed there becomes "1-5" and is
  dropped, and a cleared box is dropped in both UIs. Left optional, the run would train with the
  default in its place and say nothing; required, the form refuses it under the field, and so does the
  server for a run started through the API (``null`` still means Kiln's default where a field has one).

Parsing a Kiln request never goes through these: only the form's schema and a pipeline spec do.
"""

from __future__ import annotations

from typing import Any, Callable, get_args

from pydantic import BaseModel

__all__ = ["POSITIVE_FIELDS", "flat_choice_schema", "normalize_flat_choice", "mark_positive", "config_from_form",
           "spec_form_schema", "require_numbers", "complete_for_form"]

# Numbers Kiln's submit rules require to be above zero (kiln_core.contracts.opd_submit): the form's
# schema says so too (`exclusiveMinimum: 0`), so a Prefect UI refuses 0 or a negative value under the field.
POSITIVE_FIELDS = ("top_k", "samples_per_prompt", "learning_rate", "lora_alpha", "checkpoint_interval",
                   "sampler_segments")

# Numbers whose absence means something else than null (Kiln's eval generation: an absent thinking budget
# is the server's default, null is unlimited): a form may leave them out.
ABSENT_IS_NOT_NULL = frozenset({"thinking_budget_tokens", "thinking_budget_ms"})


def mark_positive(prop: dict[str, Any]) -> None:
    """Mark a number property (or the number branch of a nullable one) ``exclusiveMinimum: 0``."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("number", "integer"):
            branch.pop("minimum", None)
            branch["exclusiveMinimum"] = 0


def _is_number(prop: dict[str, Any]) -> bool:
    return any(branch.get("type") in ("number", "integer") for branch in prop.get("anyOf", [prop]))


def require_numbers(schema: dict[str, Any], resolve: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Make every number field of ``schema`` and of the objects it holds ``required`` (in place).

    A nullable number without a default gets ``default: null``, so a form opens it empty and sends null
    for it; the deployment's default parameters must name every required field (``form_defaults``).

    Args:
        schema: An object schema (a model's, or a flat choice's).
        resolve: Turns a ``{"$ref": ...}`` into the definition it names (the JSON-schema handler's
            ``resolve_ref_schema``), so that nested models are reached.
    """
    seen: set[int] = set()

    def visit(node: dict[str, Any]) -> None:
        if "$ref" in node:
            node = resolve(node)
        if id(node) in seen:
            return
        seen.add(id(node))
        properties = node.get("properties", {})
        required = node.setdefault("required", []) if properties else []
        for name, prop in properties.items():
            if _is_number(prop) and name not in ABSENT_IS_NOT_NULL:
                if name not in required:
                    required.append(name)
                if "anyOf" in prop and "default" not in prop and {"type": "null"} in prop["anyOf"]:
                    prop["default"] = None
            for branch in prop.get("anyOf", [prop]):
                if "$ref" in branch or "properties" in branch:
                    visit(branch)
        if properties and not required:
            node.pop("required")

    visit(schema)


def complete_for_form(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` (a spec as JSON) with every required field the form schema names and the value leaves out
    filled in: the schema's default, else null where the field takes null (a field with neither is left out). A deployment's default
    parameters are what the form opens with and what a Quick run sends; the server checks them against
    the same ``required`` lists.

    Args:
        value: The JSON value of one schema node (an object is walked field by field).
        schema: The node's schema; ``$ref``s are resolved against ``schema["$defs"]`` of the root given to
            the first call.

    Example:
        >>> schema = {"type": "object", "required": ["lr"], "properties": {"lr": {"anyOf": [
        ...     {"type": "number"}, {"type": "null"}], "default": None}}}
        >>> complete_for_form({}, schema)
        {'lr': None}
    """
    definitions = schema.get("$defs", {})

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        return definitions[node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node

    def walk(item: Any, node: dict[str, Any]) -> Any:
        node = resolve(node)
        if not isinstance(item, dict):
            return item
        objects = [resolve(branch) for branch in node.get("anyOf", [node]) if "properties" in resolve(branch)]
        if not objects:
            return item
        node = objects[0]
        filled = dict(item)
        for name, prop in node["properties"].items():
            if name in filled:
                filled[name] = walk(filled[name], prop)
            elif name in node.get("required", []):
                if "default" in prop:
                    filled[name] = prop["default"]
                elif {"type": "null"} in prop.get("anyOf", []):
                    filled[name] = None
        return filled

    return walk(value, schema)


def _tag_of(model: type[BaseModel], tag: str) -> str:
    """The one value a branch's ``Literal`` tag field takes."""
    return get_args(model.model_fields[tag].annotation)[0]


def flat_choice_schema(tag: str, branches: tuple[type[BaseModel], ...], *, title: str, description: str) -> dict[str, Any]:
    """The JSON schema of a tagged choice (``{"kind": "adam_w", "beta1": 0.9}``) as ONE object: a ``tag``
    dropdown plus every branch's settings, each nullable and null by default, its description prefixed by
    the branches it belongs to. Prefect's default UI (V1) renders a ``oneOf`` as a raw JSON editor; both
    of its UIs render this as fields. ``normalize_flat_choice`` reads such a value back.

    Example:
        >>> from kiln_core.contracts.opd_blocks import MuonOptimizer, SgdOptimizer
        >>> flat_choice_schema("kind", (MuonOptimizer, SgdOptimizer), title="Optimizer", description="d")[
        ...     "properties"]["kind"]["enum"]
        ['muon', 'sgd']
    """
    tags = [_tag_of(model, tag) for model in branches]
    properties: dict[str, Any] = {tag: {"type": "string", "enum": tags, "default": tags[0], "title": tag.title(),
                                        "description": f"One of {', '.join(tags)}. Default: {tags[0]}.",
                                        "position": 0}}
    owners: dict[str, list[str]] = {}
    for value, model in zip(tags, branches):
        for name, prop in model.model_json_schema(by_alias=True).get("properties", {}).items():
            if name == tag:
                continue
            owners.setdefault(name, []).append(value)
            if name not in properties:
                # Nullable, null FIRST: a form opens an unset setting on its first choice, and a switch
                # (Muon's nesterov) opened on "bool" would send false for every optimizer; on "None" it sends
                # nothing. A value the defaults give (adam_w's beta1) opens on its type.
                setting = {key: item for key, item in prop.items() if key not in ("default", "title", "description")}
                properties[name] = {"anyOf": [{"type": "null"}, setting], "default": None,
                                    "title": prop.get("title", name), "description": prop.get("description", "")}
    for name, kinds in owners.items():
        properties[name]["description"] = f"{' and '.join(kinds)} only: {properties[name].get('description', '')}"
    return {"type": "object", "title": title, "description": description, "properties": properties}


def normalize_flat_choice(value: Any, tag: str, branches: tuple[type[BaseModel], ...], *, where: str,
                          default: str | None = None) -> Any:
    """A tagged-choice value as a form sends it (every field it shows, empty ones as null) → the branch's
    own keys. Raises ``ValueError`` ("`<where>.<key>`: ...") for a setting of another branch.

    Example:
        >>> from kiln_core.contracts.opd_blocks import MuonOptimizer, SgdOptimizer
        >>> normalize_flat_choice({"kind": "sgd", "beta1": None}, "kind", (MuonOptimizer, SgdOptimizer), where="o")
        {'kind': 'sgd'}
    """
    if not isinstance(value, dict):
        return value
    value = {key: item for key, item in value.items() if item is not None}
    chosen = value.get(tag, default)
    model = next((model for model in branches if _tag_of(model, tag) == chosen), None)
    if model is None:  # an unknown tag: the model's own error names the choices
        return value
    own = {field.alias or name for name, field in model.model_fields.items()}
    others = {field.alias or name for other in branches if other is not model for name, field in other.model_fields.items()}
    for key in value:
        if key not in own and key in others:
            raise ValueError(f"`{where}.{key}`: a setting of another {tag} than {chosen}; clear it, or choose the "
                             f"{tag} it belongs to")
    return value


def config_from_form(config: Any) -> Any:
    """A ``config`` mapping whose ``optimizer`` / ``stable_opd`` came from the form's flat objects
    (``flat_choice_schema``) → the chosen branch's own keys; another branch's setting is refused, naming it."""
    if not isinstance(config, dict):
        return config
    from kiln_core.contracts.opd_blocks import (AdamWOptimizer, MuonOptimizer, SgdOptimizer, StableOpdAuto,
                                                StableOpdManual, StableOpdOff)

    config = dict(config)
    if isinstance(config.get("optimizer"), dict):
        config["optimizer"] = normalize_flat_choice(config["optimizer"], "kind", (MuonOptimizer, AdamWOptimizer,
                                                    SgdOptimizer), where="config.optimizer", default="muon")
    if isinstance(config.get("stable_opd"), dict):
        config["stable_opd"] = normalize_flat_choice(config["stable_opd"], "mode", (StableOpdOff, StableOpdAuto,
                                                     StableOpdManual), where="config.stable_opd", default="off")
    return config


def spec_form_schema(schema: dict[str, Any]) -> None:
    """The pipeline spec's form: the training data is asked for, and every group has its title in V1 too."""
    # The form asks for the training data; a YAML spec may still name `corpus:` or `examples:` instead.
    schema.setdefault("required", []).append("source")
    schema["properties"]["source"].pop("default", None)
    # pydantic drops a $ref property's title (it equals the model's), and Prefect's V1 UI then labels the
    # group with the bare property name ("Source", "Config"); V2 reads the model's title. Say it once here.
    for name, title in (("teacher", "Teacher"), ("source", "Training data"), ("config", "Training config (Kiln OpdConfig)"),
                        ("options", "Run options")):
        schema["properties"][name].setdefault("title", title)
