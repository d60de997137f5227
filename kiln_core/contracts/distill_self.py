"""``DistillSelfRequest``: the body of Kiln's ``POST /v1/distill/self``, and its submit-time rules.

Self-distillation with privileged information: the teacher is the student's own base model, shown a
system message the student never sees (the correct answer, a conciseness instruction, or a retrieved
document); its top-K at the assistant tokens becomes the student's target on the unprivileged prompt.

Fields, defaults and messages follow Kiln (``crates/kiln-train/src/opd.rs`` · ``DistillSelfRequest``,
``SelfDistillMode``, ``deserialize_off_policy_opd_config``; ``crates/kiln-server/src/api/training.rs`` ·
``validate_distill_self_at_submit``, ``validate_opd_prompts_at_submit``,
``validate_self_distill_context_at_submit``). ``check_distill_self_request`` applies
them in Kiln's order, reading no file and loading no model; every refusal is one ``Rejection`` naming
the field by its dotted path (``prompts[2].messages``, ``ground_truth[1]``, ``config.training_mode``).

Where kiln-flows is stricter than Kiln's serde (docs/kiln-compatibility.md, "distill self"): an unknown
key anywhere but inside a prompt is refused (``invalid_request``, naming the closest field), as
``kiln-flows train`` refuses one in an ``OpdRequest``; and a prompt must end with the assistant turn
it teaches (``prompt_not_trainable``), because a corpus row holds the action as its
``teacher_response``.

Example:
    >>> request = check_distill_self_request({"name": "terse", "mode": "conciseness", "prompts": [
    ...     {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}]})
    >>> request.config.training_mode, mode_variant(request.mode)
    ('off_policy', 'Conciseness')
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln_core.contracts.names import is_valid_name, NAME_RULE
from kiln_core.contracts.opd_config import KILN_IGNORED_ON_INPUT, ConfigError, OpdConfig, parse_opd_config, resolve_top_k
from kiln_core.contracts.opd_prompt import OpdPrompt, kiln_prompt_value
from kiln_core.contracts.opd_submit import validate_config_rules
from kiln_core.contracts.post_eval.config import PostEvalConfig, parse_post_eval_config, validate_post_eval_config
from kiln_core.contracts.unknown_keys import find_unknown_keys
from kiln_core.errors import Rejection
from kiln_core.serde_json import serde_json_text

__all__ = ["DistillSelfRequest", "SelfDistillMode", "check_distill_self_request", "mode_variant",
           "request_warnings", "self_teacher_id"]

SURFACE = "distill/self"
"""How Kiln's messages name this route."""

SelfDistillMode = Literal["ground_truth_conditioning", "conciseness", "document_as_pi", "reverse_teacher"]

MODE_VARIANTS = {
    "ground_truth_conditioning": "GroundTruthConditioning",
    "conciseness": "Conciseness",
    "document_as_pi": "DocumentAsPi",
    "reverse_teacher": "ReverseTeacher",
}
"""Kiln's Rust variant names: the ``<Mode>`` of the teacher id ``self-<name>:<Mode>``."""

# Kiln's admission limits (api/training.rs · prepare_training_entry_admission), the same for every
# prompt-carrying route.
MAX_PROMPTS = 100_000
MAX_PROMPT_BYTES = 64 * 1024 * 1024


def _off_policy_config() -> OpdConfig:
    return OpdConfig(training_mode="off_policy")


class DistillSelfRequest(BaseModel):
    """Kiln's ``DistillSelfRequest``: one privileged-information self-distillation job.

    The model ignores unknown fields (Kiln's serde does); ``check_distill_self_request`` refuses them.
    """

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    name: str
    """The adapter the job publishes (Kiln's output name); adapter-name rules."""
    mode: SelfDistillMode
    """What the teacher alone sees: the answer (``ground_truth_conditioning``), a conciseness instruction
    (``conciseness``) or a retrieved document (``document_as_pi``); ``reverse_teacher`` is refused."""
    prompts: list[OpdPrompt] | None = None
    """Kiln's ``OpdPrompt`` list, each with the assistant action to score; required (null is refused)."""
    ground_truth: list[str] | None = None
    """ground_truth_conditioning: one non-blank answer per prompt."""
    documents: list[str] | None = None
    """document_as_pi: one non-blank document per prompt."""
    config: OpdConfig = Field(default_factory=_off_policy_config)
    """Kiln's ``OpdConfig``; ``training_mode`` defaults to off_policy (also inside a config object that
    omits it), and only off_policy runs."""
    post_eval: PostEvalConfig | None = None
    """Kiln's post-training eval gate (docs/post-eval.md)."""


def mode_variant(mode: str) -> str:
    """Kiln's Rust variant name of a mode (``conciseness`` → ``Conciseness``).

    Example:
        >>> mode_variant("document_as_pi")
        'DocumentAsPi'
    """
    return MODE_VARIANTS[mode]


def self_teacher_id(request: DistillSelfRequest) -> str:
    """Kiln's teacher id for the job, ``self-<name>:<Mode>`` (its ``TeacherDescriptor`` alias and model id).

    Example:
        >>> self_teacher_id(DistillSelfRequest(name="terse", mode="conciseness"))
        'self-terse:Conciseness'
    """
    return f"self-{request.name}:{mode_variant(request.mode)}"


def check_distill_self_request(value: Any, *, file: str | None = None) -> DistillSelfRequest:
    """Parse a decoded ``DistillSelfRequest`` and apply Kiln's submit-time rules, in Kiln's order.

    Reads no file and loads no model. The order: the body parses (unknown keys refused; ``config`` must be
    an object, off_policy inserted when it omits ``training_mode``; ``post_eval`` parses), ``post_eval``'s
    own rules (its suite is checked where the eval registry is read, in ``prepare_distill_self``), the
    name, ``reverse_teacher``, Kiln's OpdConfig rules and top-K (the cap is the requested K), off_policy,
    the LoRA scale, the prompts (present, non-empty, each with messages and a non-blank assistant action),
    the per-mode ``ground_truth``/``documents``, Kiln's prompt-count and size limits, and last kiln-flows'
    own rule that each prompt ends with the assistant turn it teaches.

    Args:
        value: The decoded JSON body.
        file: The request file, named by every rejection (None for a flow parameter).

    Returns:
        The parsed request.

    Raises:
        Rejection: the first rule broken, with Kiln's message where Kiln has one, a stable code and the
            dotted field path.

    Example:
        >>> check_distill_self_request({"name": "x", "mode": "reverse_teacher"})
        Traceback (most recent call last):
        ...
        kiln_core.errors.Rejection: [reverse_teacher_unsupported] field mode: distill/self: reverse_teacher requires a distinct reverse objective
    """
    try:
        request = _parse(value)
        _check_rules(request)
    except Rejection as error:
        if file is not None and error.file is None:
            error.file = file
            error.args = (error.describe(),)
        raise
    return request


def request_warnings(request: DistillSelfRequest) -> list[str]:
    """What Kiln would tell the submitter without refusing: a learning rate far from the default, and a
    requested top-K resolved to a smaller supported one (Kiln's response-message suffix).

    Example:
        >>> request_warnings(DistillSelfRequest(name="x", mode="conciseness", config={"top_k": 20}))
        ['Requested top_k 20 was resolved to effective top_k 16 for the teacher and active OPD kernel.']
    """
    warnings = validate_config_rules(request.config)
    effective = resolve_top_k(request.config.top_k)
    if effective != request.config.top_k:
        warnings.append(f"Requested top_k {request.config.top_k} was resolved to effective top_k {effective} for "
                        "the teacher and active OPD kernel.")
    return warnings


# ---------------------------------------------------------------------------------------------- parsing


def _parse(value: Any) -> DistillSelfRequest:
    """The body as Kiln's serde reads it, plus kiln-flows' unknown-key refusal."""
    if not isinstance(value, dict):
        raise Rejection("invalid_request", f"invalid {SURFACE} request JSON: the body must be a JSON object")
    owners = {DistillSelfRequest: "Kiln's DistillSelfRequest", OpdConfig: "Kiln's OpdConfig"}
    for unknown in find_unknown_keys(value, DistillSelfRequest, owners=owners, tolerated=KILN_IGNORED_ON_INPUT):
        raise Rejection("invalid_request", f"invalid {SURFACE} request: {unknown.describe()}", field=unknown.path)
    fields = dict(value)
    if "config" in fields:
        fields["config"] = _off_policy_by_default(fields["config"])
    if "post_eval" in fields:
        fields["post_eval"] = parse_post_eval_config(fields["post_eval"])  # post_eval_invalid_config
    try:
        return DistillSelfRequest.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = _dotted(first["loc"])
        raise Rejection("invalid_request", f"invalid {SURFACE} request JSON: `{where}`: {first['msg']}",
                        field=where or None) from None


def _off_policy_by_default(config: Any) -> OpdConfig:
    """Kiln's ``deserialize_off_policy_opd_config``: an object, ``training_mode`` off_policy unless given."""
    if not isinstance(config, dict):
        raise Rejection("invalid_request", "OPD config must be a JSON object", field="config")
    return parse_opd_config({"training_mode": "off_policy", **config})


def _dotted(location: tuple) -> str:
    """``("prompts", 2, "messages")`` → ``prompts[2].messages``."""
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not str(part).startswith("function-"):
            text += f".{part}" if text else str(part)
    return text


# ---------------------------------------------------------------------------------------------- rules


def _check_rules(request: DistillSelfRequest) -> None:
    validate_post_eval_config(request.post_eval, None)
    if not request.name.strip():
        raise Rejection("invalid_adapter_name", f"{SURFACE}: name must be non-empty", field="name")
    if not is_valid_name(request.name):
        raise Rejection("invalid_adapter_name", f"name {request.name!r} must be {NAME_RULE}", field="name")
    if request.mode == "reverse_teacher":
        raise Rejection("reverse_teacher_unsupported",
                        f"{SURFACE}: reverse_teacher requires a distinct reverse objective", field="mode")
    try:
        validate_config_rules(request.config)  # Kiln's OpdConfig rules, the LoRA scale and top-K (cap = K)
    except ConfigError as error:
        raise Rejection(error.code, error.message, field=error.field) from None
    if request.config.training_mode != "off_policy":
        raise Rejection("invalid_config", f"{SURFACE} materializes teacher logits for fixed action sequences and "
                        'requires config.training_mode="off_policy"', field="config.training_mode")
    prompts = _check_prompts(request.prompts)
    _check_context(request, len(prompts))
    _check_limits(prompts)
    for index, prompt in enumerate(prompts):
        _check_trainable(index, prompt)


def _check_prompts(prompts: list[OpdPrompt] | None) -> list[OpdPrompt]:
    """Kiln's ``validate_opd_prompts_at_submit("distill/self", prompts, require_action=true)``."""
    if prompts is None:
        raise Rejection("prompts_missing", f"{SURFACE} requires explicit off-policy prompts with assistant actions",
                        field="prompts")
    if not prompts:
        raise Rejection("no_prompts", f"{SURFACE} requires at least one prompt", field="prompts")
    for index, prompt in enumerate(prompts):
        if not prompt.messages:
            raise Rejection("prompt_no_messages", f"{SURFACE} prompt {index} has no messages",
                            field=f"prompts[{index}].messages")
        if not _has_action(prompt):
            raise Rejection("prompt_no_action", f"{SURFACE} prompt {index} requires a non-empty assistant action for "
                            "off-policy scoring", field=f"prompts[{index}]")
    return prompts


def _has_action(prompt: OpdPrompt) -> bool:
    """Kiln's ``opd_prompt_has_action``: a non-blank assistant message or action segment."""
    value = kiln_prompt_value(prompt)
    return any(m["role"] == "assistant" and m["content"].strip() for m in value["messages"]) or any(
        s["kind"] == "action" and s["content"].strip() for s in value.get("trajectory", []))


def _check_context(request: DistillSelfRequest, prompt_count: int) -> None:
    """Kiln's ``validate_self_distill_context_at_submit``: one non-blank answer or document per prompt."""
    if request.mode == "ground_truth_conditioning":
        _check_one_per_prompt(request.ground_truth, "ground_truth", "answer", "answers", prompt_count,
                              missing=f"{SURFACE}: ground_truth_conditioning requires `ground_truth`")
    elif request.mode == "document_as_pi":
        _check_one_per_prompt(request.documents, "documents", "context", "documents", prompt_count,
                              missing=f"{SURFACE}: document_as_pi requires `documents`")


def _check_one_per_prompt(values: list[str] | None, field: str, noun: str, plural: str, prompt_count: int, *,
                          missing: str) -> None:
    if values is None:
        raise Rejection(f"{field}_missing", missing, field=field)
    blank = next((i for i, text in enumerate(values) if not text.strip()), None)
    if len(values) != prompt_count or blank is not None:
        message = (f"{SURFACE}: {field} must contain one non-empty {noun} per prompt ({prompt_count} prompts, "
                   f"{len(values)} {plural})")
        where = field if len(values) != prompt_count else f"{field}[{blank}]"
        raise Rejection(f"{field}_mismatch", message, field=where)


def _check_limits(prompts: list[OpdPrompt]) -> None:
    """Kiln's admission limits: at most 100,000 prompts and 64 MiB of serialized prompts."""
    if len(prompts) > MAX_PROMPTS:
        raise Rejection("too_many_prompts", f"{SURFACE} resolved to {len(prompts)} prompts; maximum is {MAX_PROMPTS}",
                        field="prompts")
    total = 0
    for prompt in prompts:
        total += len(serde_json_text(kiln_prompt_value(prompt)).encode("utf-8"))
        if total > MAX_PROMPT_BYTES:
            raise Rejection("prompts_too_large", f"{SURFACE} materializes to more than {MAX_PROMPT_BYTES} bytes; split "
                            "it into smaller jobs", field="prompts")


def _check_trainable(index: int, prompt: OpdPrompt) -> None:
    """kiln-flows' rule: the action is the prompt's last message, an assistant turn with text only.

    A corpus row is ``messages`` + ``teacher_response``, so the last assistant message becomes the response
    (earlier assistant turns stay in ``messages`` and are targets too, as Kiln's tokenization marks every
    assistant turn). Kiln scores ``messages`` whole; a prompt that ends elsewhere, or whose action lives only
    in a trajectory segment (which Kiln's self-distillation ignores, then fails on), cannot be one row."""
    last = kiln_prompt_value(prompt)["messages"][-1]
    where = f"prompts[{index}].messages"
    if last["role"] != "assistant":
        has_assistant = any(m.role == "assistant" for m in prompt.messages)
        reason = ("its last message is not an assistant turn; kiln-flows trains the prompt as one corpus row whose "
                  "teacher_response is the final assistant message, so end the prompt with the action it teaches"
                  if has_assistant else
                  "it has no assistant message: distill/self scores the assistant messages (trajectory action "
                  "segments are not read), so add the action as a final assistant message")
        raise Rejection("prompt_not_trainable", f"{SURFACE} prompt {index}: {reason}", field=where)
    if not last["content"].strip():
        raise Rejection("prompt_not_trainable", f"{SURFACE} prompt {index}: its final assistant message is blank; "
                        "it would be the corpus row's (empty) teacher_response", field=where)
    if last.get("tool_calls"):
        raise Rejection("prompt_not_trainable", f"{SURFACE} prompt {index}: its final assistant message carries "
                        "tool_calls, which a corpus row's teacher_response (text) cannot hold", field=where)
