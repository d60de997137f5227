"""``DistillPumpRequest``: the body of Kiln's ``POST /v1/distill/pump``, and its submit-time rules.

Field names, defaults and messages follow Kiln's ``crates/kiln-train/src/opd.rs`` (``DistillPumpRequest``,
``DistillPumpMode``) and ``crates/kiln-server/src/api/training.rs`` (``validate_distill_pump_at_submit``,
``submit_distill_pump``, ``validate_opd_prompts_at_submit``).

``mode`` is serde's untagged enum: ``{"domain": "math"}``, ``{"examples": [OpdPrompt, ...]}`` or
``{"wide": bool}`` (``{"wide": false}`` still selects wide: the bool is never read). Kiln's serde ignores
unknown keys; kiln-flows refuses them (``invalid_request``, naming the key and the closest field), as it
does for an ``OpdRequest`` (``kiln_core.contracts.opd_config.parse_opd_request``), and it refuses a
``mode`` that names two variants instead of silently taking serde's first match.

``check_distill_pump_request`` applies every rule that needs no file and no model, in Kiln's order:
``post_eval`` (the installed-suite check needs the storage root: ``prepare_distill_pump``), a non-blank
``name`` and ``teacher``, the adapter-name rule, the OpdConfig rules (with ``rank`` in place of
``config.lora_rank``, as Kiln's LoRA-scale check does), then the mode rules. Off-policy ``examples``
are also checked against the one kiln-flows rule Kiln lacks: each prompt must end with its assistant
action (``prompt_not_trainable``), because it becomes a scored row ``messages[:-1]`` + that action.

Example:
    >>> request = check_distill_pump_request({"name": "math-pump", "teacher": "big",
    ...     "mode": {"domain": "math"}})
    >>> request.mode_name, request.rollout_budget, request.config.training_mode
    ('domain', 50000, 'on_policy')
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln_core.contracts.opd_config import KILN_IGNORED_ON_INPUT, ConfigError, OpdConfig
from kiln_core.contracts.opd_prompt import OpdPrompt, kiln_prompt_value
from kiln_core.contracts.unknown_keys import closest_name, find_unknown_keys
from kiln_core.errors import Rejection

__all__ = ["DistillPumpRequest", "PumpDomain", "PumpExamples", "PumpWide", "SURFACE", "check_distill_pump_request",
           "check_off_policy_examples", "effective_pump_config", "prompt_has_action"]

SURFACE = "distill/pump"
"""How Kiln's messages name this route."""
DEFAULT_ROLLOUT_BUDGET = 50_000
SEED_MODES_NEED_ON_POLICY = ("distill/pump domain and wide seed modes require on_policy training; off_policy "
                             "requires explicit examples with assistant actions")
MODE_KEYS = ("domain", "examples", "wide")


class PumpDomain(BaseModel):
    """``{"domain": "<name>"}``: Kiln pumps its built-in seed bank for the domain; kiln-flows pumps the
    user's prompt bank (``--prompt-bank``) and records the domain name."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    domain: str


class PumpExamples(BaseModel):
    """``{"examples": [OpdPrompt, ...]}``: the user's own prompts (on-policy) or examples (off-policy)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    examples: list[OpdPrompt]


class PumpWide(BaseModel):
    """``{"wide": bool}``: Kiln's wide-coverage seed bank; the bool is never read (false still selects it)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    wide: bool


class DistillPumpRequest(BaseModel):
    """Kiln's ``DistillPumpRequest``: distil a (large) registered teacher into the student.

    Example:
        >>> DistillPumpRequest.model_validate({"name": "p", "teacher": "t", "mode": {"wide": True}}).use_cache
        True
    """

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    name: str
    """The adapter the run publishes (Kiln's output adapter name for this route)."""
    teacher: str
    """A registered teacher alias (``kiln-flows teachers register``), pinned when the run is prepared."""
    mode: PumpDomain | PumpExamples | PumpWide
    """``{"domain": str}`` | ``{"examples": [OpdPrompt]}`` | ``{"wide": bool}`` (serde untagged)."""
    rank: int | None = Field(default=None, ge=0)
    """When set, replaces ``config.lora_rank`` for the LoRA-scale check and for training. Kiln default: empty."""
    rollout_budget: int = Field(default=DEFAULT_ROLLOUT_BUDGET, ge=0)
    """Logged only: Kiln never passes it to the trainer. Kiln default: 50000."""
    use_cache: bool = True
    """Kiln wraps a remote teacher in its logit cache; kiln-flows has no logit cache (logged). Kiln default: true."""
    config: OpdConfig = Field(default_factory=OpdConfig)
    """Kiln's OpdConfig; ``training_mode`` defaults to on_policy here (the plain OpdConfig default)."""
    post_eval: dict[str, Any] | None = None
    """Kiln's PostEvalConfig, checked with ``kiln_core.contracts.post_eval.config``."""

    @property
    def mode_name(self) -> str:
        """``domain``, ``examples`` or ``wide``."""
        return next(key for key in MODE_KEYS if key in type(self.mode).model_fields)

    def kiln_value(self) -> dict[str, Any]:
        """The whole request as JSON, defaults included (Kiln's receipt ``hyperparameters``); examples as
        Kiln re-serializes a prompt (``kiln_prompt_value``)."""
        value = self.model_dump(mode="json", by_alias=True)
        if isinstance(self.mode, PumpExamples):
            value["mode"] = {"examples": [kiln_prompt_value(prompt) for prompt in self.mode.examples]}
        return value


def _invalid(message: str, field: str | None, file: str | None) -> Rejection:
    return Rejection("invalid_request", message, field=field, file=file)


def _parse_mode(value: Any, file: str | None) -> dict[str, Any]:
    """``mode`` must name exactly one known variant; its other keys are unknown keys."""
    if not isinstance(value, dict):
        raise _invalid(f"invalid {SURFACE} request: `mode` must be one of {{\"domain\": string}}, "
                       "{\"examples\": [prompt, ...]} or {\"wide\": bool}", "mode", file)
    named = [key for key in MODE_KEYS if key in value]
    if len(named) != 1:
        detail = f"names {' and '.join(f'`{key}`' for key in named)}" if named else "names none of them"
        raise _invalid(f"invalid {SURFACE} request: `mode` must name exactly one of `domain`, `examples` or `wide`; "
                       f"it {detail}", "mode", file)
    for key in value:
        if key not in MODE_KEYS:
            hint = closest_name(str(key), MODE_KEYS)
            raise _invalid(f"invalid {SURFACE} request: `mode.{key}`: unknown key (not a field of Kiln's "
                           f"DistillPumpMode){f'; did you mean `{hint}`?' if hint else ''}", f"mode.{key}", file)
    return value


def _parse(value: Any, file: str | None) -> DistillPumpRequest:
    if not isinstance(value, dict):
        raise _invalid(f"invalid {SURFACE} request: the body must be a JSON object", None, file)
    unknown = find_unknown_keys(value, DistillPumpRequest, owners={DistillPumpRequest: "Kiln's DistillPumpRequest",
                                                                   OpdConfig: "Kiln's OpdConfig"},
                                tolerated=KILN_IGNORED_ON_INPUT)
    if unknown:
        raise _invalid(f"invalid {SURFACE} request: {unknown[0].describe()}", unknown[0].path, file)
    if "mode" in value:
        _parse_mode(value["mode"], file)
    try:
        return DistillPumpRequest.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        # A union member's label (`PumpExamples`) is not a field the user wrote.
        parts = [str(part) for part in first["loc"] if not str(part).startswith(("Pump", "function-"))]
        where = ".".join(parts) or None
        raise _invalid(f"invalid {SURFACE} request: `{where or 'request'}`: {first['msg']}", where, file) from None


def effective_pump_config(request: DistillPumpRequest) -> OpdConfig:
    """The config that trains: ``rank``, when set, replaces ``config.lora_rank`` (Kiln's pump arm).

    Raises:
        ConfigError: ``invalid_config`` naming ``rank`` when it is not a LoRA rank (0).

    Example:
        >>> effective_pump_config(check_distill_pump_request({"name": "p", "teacher": "t",
        ...     "mode": {"wide": True}, "rank": 64})).lora_rank
        64
    """
    if request.rank is None:
        return request.config
    try:  # validated, not model_copy: the rank must satisfy the config's own bounds
        return OpdConfig.model_validate({**request.config.model_dump(by_alias=True), "lora_rank": request.rank})
    except ValidationError as error:
        raise ConfigError(f"{SURFACE} rank {request.rank}: {error.errors()[0]['msg']}", "rank") from None


def prompt_has_action(prompt: OpdPrompt) -> bool:
    """Kiln's ``opd_prompt_has_action``: a non-blank assistant message or action segment.

    Example:
        >>> prompt_has_action(OpdPrompt.model_validate({"messages": [{"role": "user", "content": "q"}]}))
        False
    """
    value = kiln_prompt_value(prompt)
    return any(m["role"] == "assistant" and m["content"].strip() for m in value["messages"]) or any(
        s["kind"] == "action" and s["content"].strip() for s in value.get("trajectory", []))


def check_off_policy_examples(examples: list[OpdPrompt], *, file: str | None = None) -> None:
    """Off-policy ``examples``: Kiln's action rule, then the rule that makes each one a scored row.

    A prompt becomes the example ``messages[:-1]`` with ``teacher_response`` = its last message, so that
    message must be the non-blank assistant action, and nothing the scored row cannot carry may ride
    along: no ``trajectory`` (replay segments) and no ``teacher_extra_messages`` (a scored corpus has no
    teacher-only context; the teacher would be scored on what the student sees).

    Raises:
        Rejection: ``prompt_no_action`` (Kiln's text) or ``prompt_not_trainable``, naming the prompt.
    """
    for index, prompt in enumerate(examples):
        field = f"mode.examples[{index}]"
        if not prompt_has_action(prompt):
            raise Rejection("prompt_no_action", f"{SURFACE} prompt {index} requires a non-empty assistant action for "
                            "off-policy scoring", field=field, file=file)
        last = kiln_prompt_value(prompt)["messages"][-1]
        if last["role"] != "assistant" or not last["content"].strip():
            raise Rejection("prompt_not_trainable", f"{SURFACE} prompt {index} has an assistant turn but does not end "
                            "with one; off-policy, a prompt's last message is the action the teacher scores (the "
                            "earlier messages are its context): end it with the assistant answer",
                            field=f"{field}.messages", file=file)
        for extra, why in (("trajectory", "replay segments"), ("teacher_extra_messages", "teacher-only context")):
            if getattr(prompt, extra):
                raise Rejection("prompt_not_trainable", f"{SURFACE} prompt {index} has {why} (`{extra}`), which an "
                                "off-policy scored row cannot carry; drop it, or train on_policy",
                                field=f"{field}.{extra}", file=file)


def check_distill_pump_request(value: Any, *, file: str | None = None) -> DistillPumpRequest:
    """Kiln's submit-time rules for ``/v1/distill/pump``, reading no file and loading no model.

    Args:
        value: The decoded request body.
        file: The request file, named in every rejection.

    Returns:
        The parsed request (``config`` as sent; ``effective_pump_config`` applies ``rank``).

    Raises:
        Rejection: ``invalid_request`` (not an object, an unknown key, a wrong type, a blank name or
            teacher), ``post_eval_invalid_config``, ``invalid_adapter_name``, the OpdConfig rules
            (``invalid_config``, ``unsafe_lora_scale``, …), ``seed_mode_requires_on_policy``,
            ``no_prompts``, ``prompt_no_messages``, ``prompt_no_action``, ``prompt_not_trainable``; each
            with ``field`` the dotted path (``mode.examples[2].messages``, ``config.training_mode``).

    Example:
        >>> check_distill_pump_request({"name": "p", "teacher": "t", "mode": {"wide": False},
        ...     "config": {"training_mode": "off_policy"}})
        Traceback (most recent call last):
        kiln_core.errors.Rejection: [seed_mode_requires_on_policy] field config.training_mode: distill/pump domain and wide seed modes require on_policy training; off_policy requires explicit examples with assistant actions
    """
    from kiln_core.contracts.names import check_name
    from kiln_core.contracts.opd_submit import validate_config_rules
    from kiln_core.contracts.post_eval.config import parse_post_eval_config, validate_post_eval_config

    request = _parse(value, file)
    validate_post_eval_config(parse_post_eval_config(request.post_eval), None)
    if not request.name.strip() or not request.teacher.strip():
        raise _invalid(f"{SURFACE} requires non-empty name and teacher",
                       "name" if not request.name.strip() else "teacher", file)
    check_name(request.name, field="name")
    validate_config_rules(effective_pump_config(request), pre_scored=False)
    off_policy = request.config.training_mode == "off_policy"
    if not isinstance(request.mode, PumpExamples):
        if off_policy:
            raise Rejection("seed_mode_requires_on_policy", SEED_MODES_NEED_ON_POLICY, field="config.training_mode",
                            file=file)
        return request
    examples = request.mode.examples
    if not examples:
        raise Rejection("no_prompts", f"{SURFACE} requires at least one prompt", field="mode.examples", file=file)
    for index, prompt in enumerate(examples):
        if not prompt.messages:
            raise Rejection("prompt_no_messages", f"{SURFACE} prompt {index} has no messages",
                            field=f"mode.examples[{index}].messages", file=file)
    if off_policy:
        check_off_policy_examples(examples, file=file)
    return request
