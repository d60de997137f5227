"""``DistillMergeRequest``: Kiln's ``POST /v1/adapters/distill_merge`` body and its submit-time rules.

Field names, defaults and rejection texts follow Kiln's ``crates/kiln-train/src/opd.rs``
(``DistillMergeRequest``, ``DistillMergeSource``, ``deserialize_off_policy_opd_config``) and
``crates/kiln-server/src/api/training.rs`` (``validate_distill_merge_at_submit``), in Kiln's order:
``post_eval`` first, then the name, the sources list, ``rollout_budget``, the OpdConfig rules, the
off-policy rule, and each source (adapter name, duplicate, weight). Everything here reads no file and
loads no model; the rules that need files (the source adapter exists, its replay log, prompt ownership,
the sampling contract) are ``kiln_core.recipes.distill_merge``'s.

An unknown key is refused (``invalid_request``, naming the key and the closest field), as
``parse_opd_request`` refuses one in an OPD request: Kiln would drop it silently and train something else.

Extension (off by default, docs/recipes.md): ``weighted_sampling: true`` replaces Kiln's sampling contract
(``rollout_budget`` must equal prompt-epochs and each weight its source's row share) with a real weighted
draw of ``rollout_budget`` training rows from the sources.

Example:
    >>> request = check_distill_merge_request({"name": "unified", "sources": [{"adapter": "rust-helper"}]})
    >>> request.config.training_mode, request.sources[0].weight, request.rollout_budget
    ('off_policy', 1.0, 5000)
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln_core.contracts.names import check_name
from kiln_core.contracts.opd_config import (
    KILN_IGNORED_ON_INPUT,
    ConfigError,
    OpdConfig,
    parse_opd_config,
)
from kiln_core.contracts.post_eval.config import PostEvalConfig, parse_post_eval_config, validate_post_eval_config
from kiln_core.contracts.unknown_keys import find_unknown_keys

__all__ = ["MERGE_REQUEST_CODES", "DistillMergeRequest", "MergeSource", "check_distill_merge_request"]

SURFACE = "distill_merge"
DEFAULT_ROLLOUT_BUDGET = 5000
BASE_STUDENT = "base"

MERGE_REQUEST_CODES = (
    "invalid_request",  # not an object, an unknown key, a field of the wrong type
    "merge_name_missing",
    "merge_sources_empty",
    "merge_rollout_budget",
    "merge_off_policy_required",
    "merge_duplicate_source",
    "merge_source_weight",
)
"""The codes of the submit-time rules (besides ``invalid_adapter_name``, the OpdConfig and post_eval codes)."""


class MergeSource(BaseModel):
    """Kiln's ``DistillMergeSource``: one LoRA that teaches the prompts it was trained on."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    adapter: str
    """A published adapter name (``<root>/runs/<adapter>/latest.json``)."""
    weight: float = 1.0
    """Kiln: checked against the source's share of replay rows, never used in the loss. Default 1.0.
    With ``weighted_sampling``: the source's probability of being drawn (proportional)."""


class DistillMergeRequest(BaseModel):
    """Kiln's ``DistillMergeRequest``: several LoRAs, each scoring its own replay prompts, into one student."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    name: str
    """The merged adapter's name (the output adapter)."""
    sources: list[MergeSource]
    """The source adapters, in order (their prompts train in this order, then file order)."""
    student: str = BASE_STUDENT
    """``"base"`` (default) trains a fresh LoRA; any other value is the published adapter the student warm-starts
    from (``config.base_adapter``). Not checked at submit, as in Kiln."""
    rollout_budget: int = Field(default=DEFAULT_ROLLOUT_BUDGET)
    """Kiln: must equal prompts × epochs (the steps the run makes). With ``weighted_sampling``: training rows
    drawn. Default 5000."""
    config: OpdConfig = Field(default_factory=lambda: OpdConfig(training_mode="off_policy"))
    """Kiln's OpdConfig; ``training_mode`` defaults to off_policy (the only mode merge runs)."""
    post_eval: PostEvalConfig | None = None
    """Kiln's post-training eval gate (``crates/kiln-eval/src/suite.rs`` · ``PostEvalConfig``)."""
    weighted_sampling: bool = False
    """kiln-flows extension: draw ``rollout_budget`` rows from the sources in proportion to their weights instead
    of Kiln's sampling contract. Default false (Kiln's contract)."""


def _invalid(message: str, field: str | None, code: str = "invalid_request") -> ConfigError:
    return ConfigError(message, field, code=code)


def _pydantic_error(error: ValidationError, prefix: str = "") -> ConfigError:
    first = error.errors()[0]
    path = ".".join(str(part) for part in first["loc"])
    where = f"{prefix}{path}" if path else prefix.rstrip(".") or None
    return _invalid(f"invalid {SURFACE} request: `{where or 'request'}`: {first['msg']}", where)


def _unknown_keys(value: dict[str, Any]) -> None:
    """Refuse the first key Kiln's structs do not know (Kiln would ignore it), naming it and the closest field."""
    found = find_unknown_keys(value, DistillMergeRequest,
                              owners={DistillMergeRequest: "Kiln's DistillMergeRequest", OpdConfig: "Kiln's OpdConfig"},
                              tolerated=KILN_IGNORED_ON_INPUT)
    sources = value.get("sources")
    if isinstance(sources, list):
        for index, source in enumerate(sources):
            found += find_unknown_keys(source, MergeSource, prefix=f"sources[{index}].",
                                       owners={MergeSource: "Kiln's DistillMergeSource"})
    if found:
        first = found[0]
        raise _invalid(f"invalid {SURFACE} request: {first.describe()}", first.path)


def _config(value: Any) -> OpdConfig:
    """Kiln's ``deserialize_off_policy_opd_config``: off_policy unless the object says otherwise."""
    if value is None:
        return OpdConfig(training_mode="off_policy")
    if not isinstance(value, dict):
        raise _invalid("OPD config must be a JSON object", "config")
    return parse_opd_config({"training_mode": "off_policy", **value})


def check_distill_merge_request(value: Any, *, file: str | None = None) -> DistillMergeRequest:
    """Kiln's submit-time rules for ``distill_merge``, reading no file and loading no model.

    Args:
        value: The decoded request body (a dict).
        file: The request file, named in the rejection.

    Returns:
        The parsed request, Kiln's defaults filled in.

    Raises:
        ConfigError: a ``Rejection`` (exit 2) with Kiln's message, a code of ``MERGE_REQUEST_CODES`` (or
            ``invalid_adapter_name``, an OpdConfig code) and ``field`` the dotted path (``sources[1].weight``);
        PostEvalRejection: a ``post_eval`` rule.

    Example:
        >>> check_distill_merge_request({"name": "m", "sources": []})
        Traceback (most recent call last):
        ...
        kiln_core.contracts.opd_config.ConfigError: distill_merge: sources must be non-empty
    """
    try:
        return _check(value)
    except ConfigError as error:
        if file is not None and error.file is None:
            error.file = file
        raise


def _check(value: Any) -> DistillMergeRequest:
    from kiln_core.contracts.opd_submit import validate_config_rules

    if not isinstance(value, dict):
        raise _invalid(f"invalid {SURFACE} request JSON: expected an object, got {type(value).__name__}", None)
    _unknown_keys(value)
    # Kiln's order: post_eval (admission step 4) before the recipe's own rules (step 5).
    post_eval = parse_post_eval_config(value.get("post_eval"))
    validate_post_eval_config(post_eval, None)  # the installed-suite check needs storage: the engine's gate
    fields = {key: value[key] for key in ("name", "student", "rollout_budget", "weighted_sampling") if key in value}
    if "sources" not in value:
        raise _invalid(f"invalid {SURFACE} request: `sources`: Field required", "sources")
    raw_sources = value["sources"]
    if not isinstance(raw_sources, list):
        raise _invalid(f"invalid {SURFACE} request: `sources`: Input should be a valid list", "sources")
    try:
        sources = [MergeSource.model_validate(source) for source in raw_sources]
    except ValidationError as error:
        index = next(i for i, source in enumerate(raw_sources) if not _valid_source(source))
        raise _pydantic_error(error, f"sources[{index}].") from None
    try:
        # config and post_eval are parsed on their own (Kiln's config default, the post_eval codes)
        request = DistillMergeRequest.model_validate({**fields, "sources": sources})
    except ValidationError as error:
        raise _pydantic_error(error) from None
    config = _config(value.get("config"))
    request = request.model_copy(update={"config": config, "post_eval": post_eval})

    if not request.name.strip():
        raise _invalid(f"{SURFACE}: name must be non-empty", "name", "merge_name_missing")
    check_name(request.name, field="name")
    if not request.sources:
        raise _invalid(f"{SURFACE}: sources must be non-empty", "sources", "merge_sources_empty")
    if request.rollout_budget <= 0:  # usize in Kiln: a negative number does not even parse there
        raise _invalid(f"{SURFACE}: rollout_budget must be greater than zero", "rollout_budget", "merge_rollout_budget")
    validate_config_rules(config)  # also the LoRA-scale rule Kiln checks next
    if config.training_mode != "off_policy":
        raise _invalid(f'{SURFACE} materializes teacher logits for fixed action sequences and requires '
                       'config.training_mode="off_policy"', "config.training_mode", "merge_off_policy_required")
    seen: set[str] = set()
    for index, source in enumerate(request.sources):
        check_name(source.adapter, field=f"sources[{index}].adapter")
        if source.adapter in seen:
            raise _invalid(f"{SURFACE}: duplicate source adapter {rust_quoted(source.adapter)}",
                           f"sources[{index}].adapter", "merge_duplicate_source")
        seen.add(source.adapter)
        if not math.isfinite(source.weight) or source.weight <= 0.0:
            raise _invalid(f"{SURFACE}: source adapter {rust_quoted(source.adapter)} weight must be finite and greater "
                           "than zero", f"sources[{index}].weight", "merge_source_weight")
    return request


def _valid_source(source: Any) -> bool:
    try:
        MergeSource.model_validate(source)
    except ValidationError:
        return False
    return True


def rust_quoted(text: str) -> str:
    """Rust's ``{:?}`` of a string as Kiln's messages print it: double quotes, ``\\`` and ``"`` escaped."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
