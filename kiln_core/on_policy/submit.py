"""Submit-time checks of an on-policy ``OpdRequest``: Kiln's rules, before any model loads.

Kiln runs these when a request is submitted (``crates/kiln-server/src/api/training.rs`` ·
``submit_opd``, ``validate_opd_request_at_submit``, ``validate_opd_prompts_at_submit``,
``validate_opd_config_at_submit``, ``require_remote_teacher_off_policy``,
``registered_teacher_top_k_limit``, ``resolve_opd_top_k_at_submit``, ``measure_materialized_opd_prompts``,
``exact_opd_admission_max_seq_len``). In order:

1. ``check_request``: exactly one of non-empty ``prompts`` or ``dataset_path``; a teacher alias; a
   plain-file ``dataset_path`` needs ``off_policy``; every prompt has messages (off-policy: an
   assistant action too); the config rules; at most 100,000 prompts and 64 MiB of serialized prompts.
2. ``check_teacher``: the alias is registered; a remote teacher cannot run on-policy; the teacher's
   vocabulary is the student's (width and token table); ``top_k`` resolves to 16 or 32 under the
   teacher's ``max_top_k``.
3. ``check_prompts_fit``: every prompt renders and encodes; the longest plus ``max_tokens`` fits.
   Kiln sizes this against free accelerator memory (``training_will_not_fit``); kiln-flows refuses
   with the same code when it exceeds the student's context (``max_position_embeddings``) or the
   teacher's ``max_model_len``.

``plan_on_policy`` runs all three and loads only the student's tokenizer. Every refusal is a
``Rejection`` whose code is stable (the config rules keep ``kiln_core.contracts.opd_config``'s codes).
kiln-flows does not run Kiln's ``agent_traces:`` selectors nor off-policy inline prompts; both are
refused as ``unsupported`` after Kiln's own rules pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Sequence

from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.contracts.opd_config import (ConfigError, OpdConfig, OpdRequest, effective_samples_per_prompt,
                                            resolve_top_k)
from kiln_core.contracts.opd_submit import validate_config_rules
from kiln_core.serde_json import serde_json_text
from kiln_core.contracts.opd_prompt import OpdPrompt, kiln_prompt_value, prompts_content_sha256
from kiln_core.errors import Rejection
from kiln_core.on_policy.render import (RenderError, encode_text, render_for_generation, teacher_messages,
                                        teacher_prompt_refused)

__all__ = ["OnPolicyPlan", "StudentFacts", "TeacherBinding", "bind_teacher", "check_prompts_fit", "check_request",
           "check_teacher", "teacher_top_k_cap", "plan_on_policy", "student_facts"]

MAX_PROMPTS = 100_000
MAX_PROMPT_BYTES = 64 * 1024 * 1024
AGENT_TRACES_PREFIX = "agent_traces:"


@dataclass(frozen=True)
class TeacherBinding:
    """A registered teacher as the submit checks see it.

    Attributes:
        alias: The request's ``teacher``.
        kind: ``local`` (a registered local model kiln-flows runs) or ``remote`` (only a pinned manifest).
        identity: The pinned ``kiln.teacher-identity.v1``.
        teacher_dir: The local model directory (None for a remote teacher).
    """

    alias: str
    kind: Literal["local", "remote"]
    identity: TeacherIdentity
    teacher_dir: str | None = None


@dataclass(frozen=True)
class StudentFacts:
    """What the checks need from the student, read without loading weights."""

    vocab_size: int
    context_length: int | None
    tokenizer_vocab_sha256: str


@dataclass(frozen=True)
class OnPolicyPlan:
    """An accepted on-policy request, resolved.

    Attributes:
        samples_per_prompt: Effective S (auto-scaled from the request's prompt count).
        top_k: Effective K (16 or 32).
        content_sha256: Kiln's digest of the prompt list (hex, no prefix).
        longest_prompt_tokens: The longest rendered prompt.
        warnings: Messages that do not block the run.
    """

    samples_per_prompt: int
    top_k: int
    content_sha256: str
    longest_prompt_tokens: int
    warnings: tuple[str, ...]


def _config_rejection(error: ConfigError) -> Rejection:
    return error if isinstance(error, Rejection) else Rejection(error.code, error.message, field=error.field)


def check_request(request: OpdRequest) -> list[str]:
    """Kiln's pure-input rules for a request with ``prompts`` (see the module docstring, step 1).

    Returns:
        Warnings that do not block the run.

    Raises:
        Rejection: the first rule broken.
        ValueError: an off-policy ``dataset_path`` request (it belongs to the corpus path).

    Example:
        >>> from kiln_core.contracts.opd_config import parse_opd_request
        >>> check_request(parse_opd_request({"teacher": "t", "prompts": [{"messages": [
        ...     {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}]}))
        []
    """
    config = request.config
    if bool(request.prompts) == (request.dataset_path is not None):
        raise Rejection("source_not_exactly_one",
                        "OPD request must use exactly one of non-empty prompts or dataset_path", field="prompts")
    if not request.teacher.strip():
        raise Rejection("teacher_missing", "OPD request must specify a teacher alias", field="teacher")
    if request.dataset_path is not None:
        if request.dataset_path.startswith(AGENT_TRACES_PREFIX):
            raise Rejection("unsupported", "agent_traces: selectors need Kiln's agent-trace index, which kiln-flows "
                            "does not have; send the prompts inline or as a prompt file", field="dataset_path")
        if config.training_mode != "off_policy":
            raise Rejection("invalid_config", 'OPD teacher-logprob JSONL requires config.training_mode="off_policy"; '
                            "for on-policy training send prompts", field="config.training_mode")
        raise ValueError("an off-policy dataset_path request is trained from its corpus, not from prompts")
    off_policy = config.training_mode == "off_policy"
    for index, prompt in enumerate(request.prompts):
        if not prompt.messages:
            raise Rejection("prompt_no_messages", f"OPD prompt {index} has no messages",
                            field=f"prompts[{index}].messages")
        if off_policy and not _has_action(prompt):
            raise Rejection("prompt_no_action", f"OPD prompt {index} requires a non-empty assistant action for "
                            "off-policy scoring", field=f"prompts[{index}]")
    try:
        warnings = validate_config_rules(config, pre_scored=False)
    except ConfigError as error:
        raise _config_rejection(error) from None
    if off_policy:
        raise Rejection("unsupported", "off-policy training on inline prompts is not supported by kiln-flows; "
                        "score them into a corpus (kiln-flows score) and send it as dataset_path",
                        field="config.training_mode")
    _check_limits(request.prompts)
    return warnings


def _has_action(prompt: OpdPrompt) -> bool:
    """Kiln's ``opd_prompt_has_action``: a non-blank assistant message or action segment."""
    value = kiln_prompt_value(prompt)
    return any(m["role"] == "assistant" and m["content"].strip() for m in value["messages"]) or any(
        s["kind"] == "action" and s["content"].strip() for s in value.get("trajectory", []))


def _check_limits(prompts: Sequence[OpdPrompt]) -> None:
    if len(prompts) > MAX_PROMPTS:
        raise Rejection("too_many_prompts", f"OPD resolved to {len(prompts)} prompts; maximum is {MAX_PROMPTS}",
                        field="prompts")
    total = 0
    for prompt in prompts:
        total += len(serde_json_text(kiln_prompt_value(prompt)).encode("utf-8"))
        if total > MAX_PROMPT_BYTES:
            raise Rejection("prompts_too_large", f"OPD materializes to more than {MAX_PROMPT_BYTES} bytes; split it "
                            "into smaller jobs", field="prompts")


def check_teacher(request: OpdRequest, teacher: TeacherBinding | None, student: StudentFacts, *,
                  top_k: int | None = None) -> tuple[int, list[str]]:
    """Step 2: the teacher binding; returns the effective top-K and its warning, if any. ``top_k`` is the run's
    effective top-K when the engine already resolved it under this teacher's cap (``ResolvedSettings``); None
    resolves it here.

    Raises:
        Rejection: ``teacher_not_registered``, ``remote_teacher_on_policy``, ``teacher_vocab_mismatch``,
            ``top_k_unsupported``.
    """
    if teacher is None:
        raise Rejection("teacher_not_registered", f"OPD teacher alias '{request.teacher}' is not registered",
                        field="teacher")
    if teacher.kind == "remote" and request.config.training_mode == "on_policy":
        raise Rejection("remote_teacher_on_policy", 'OPD cannot use a remote teacher with training_mode="on_policy": '
                        "remote logits must be prefetched before GPU coordination; use "
                        'training_mode="off_policy" with fixed assistant actions', field="teacher")
    identity = teacher.identity
    if identity.vocab_size != student.vocab_size:
        raise Rejection("teacher_vocab_mismatch", f"teacher '{teacher.alias}' has vocab_size {identity.vocab_size} "
                        f"but the student's is {student.vocab_size}: on-policy scoring needs one vocabulary",
                        field="teacher")
    if identity.tokenizer_vocab_sha256 != student.tokenizer_vocab_sha256:
        raise Rejection("teacher_vocab_mismatch", f"teacher '{teacher.alias}' tokenizes with another vocabulary "
                        f"(tokenizer_vocab_sha256 {identity.tokenizer_vocab_sha256[:12]}… vs the student's "
                        f"{student.tokenizer_vocab_sha256[:12]}…): it cannot score the student's tokens",
                        field="teacher")
    requested = request.config.top_k
    effective = resolve_top_k(requested, source_cap=teacher_top_k_cap(identity)) if top_k is None else top_k
    warnings = [] if effective == requested else [f"Requested top_k {requested} was resolved to effective top_k "
                                                  f"{effective} for the teacher and active OPD kernel."]
    return effective, warnings


def teacher_top_k_cap(identity: TeacherIdentity) -> int:
    """What a pinned teacher can serve: Kiln's source cap ``min(max_top_k, vocab_size)`` for
    ``resolve_top_k``."""
    return min(identity.max_top_k, identity.vocab_size)


def check_prompts_fit(prompts: Sequence[OpdPrompt], config: OpdConfig, chat_template: str, tokenizer, *,
                      context_length: int | None, teacher_max_model_len: int | None = None) -> int:
    """Step 3: every prompt renders and encodes, and prompt + ``max_tokens`` fits; returns the longest.

    Raises:
        Rejection: ``prompt_render_failed``, ``prompt_tokenization_failed``, ``teacher_prompt_render_failed``
            (the asymmetric teacher's prompt, checked here when the teacher's length is), ``training_will_not_fit``.
    """
    longest = 0
    for index, prompt in enumerate(prompts):
        value = kiln_prompt_value(prompt)
        tokens = _rendered_length(chat_template, tokenizer, value["messages"], index)
        longest = max(longest, tokens)
        _check_fits(index, tokens, config.max_tokens, context_length, "the student's context (max_position_embeddings)")
        if teacher_max_model_len is not None:
            teacher_tokens = tokens
            if value.get("teacher_extra_messages"):
                merged = teacher_messages(value["messages"], value["teacher_extra_messages"])
                try:
                    teacher_tokens = int(encode_text(tokenizer, render_for_generation(chat_template, merged)).shape[0])
                except RenderError as error:  # the prompt itself rendered: the teacher's system turn is refused
                    raise teacher_prompt_refused(index, error) from None
            _check_fits(index, teacher_tokens, config.max_tokens, teacher_max_model_len, "the teacher's max_model_len")
    return longest


def _rendered_length(chat_template: str, tokenizer, messages, index: int) -> int:
    try:
        text = render_for_generation(chat_template, messages)
    except RenderError as error:
        raise Rejection("prompt_render_failed", f"OPD prompt {index} failed chat-template rendering during admission: "
                        f"{error}", field=f"prompts[{index}]") from None
    try:
        return int(encode_text(tokenizer, text).shape[0])
    except RenderError as error:
        raise Rejection("prompt_tokenization_failed", f"OPD prompt {index} failed tokenization during admission: "
                        f"{error}", field=f"prompts[{index}]") from None


def _check_fits(index: int, tokens: int, max_tokens: int, limit: int | None, what: str) -> None:
    if limit is not None and tokens + max_tokens > limit:
        raise Rejection("training_will_not_fit", f"OPD prompt {index} renders to {tokens} tokens; with max_tokens "
                        f"{max_tokens} a rollout needs {tokens + max_tokens} positions, more than {what} of {limit}; "
                        "shorten the prompt or lower config.max_tokens", field="config.max_tokens")


def student_facts(student_dir: str) -> tuple[StudentFacts, object]:
    """The student's vocabulary, context and tokenizer, read from its directory (no weights).

    Raises:
        Rejection: ``student_invalid`` when the directory has no usable config or fast tokenizer.
    """
    from kiln_core.identity.hashing import IdentityHashError, config_value, read_model_config, tokenizer_vocab_sha256
    from kiln_core.tokenization import TokenizationError, load_student_tokenizer

    try:
        student = load_student_tokenizer(student_dir)
        _, config = read_model_config(student_dir)
        context = config_value(config, "max_position_embeddings")
    except (TokenizationError, IdentityHashError) as error:
        raise Rejection("student_invalid", str(error), field="student") from None
    return StudentFacts(student.vocab_size, context, tokenizer_vocab_sha256(student.tokenizer)), student


def bind_teacher(registry_root: str, teacher: str) -> TeacherBinding | None:
    """Resolve ``teacher``: a registered local alias, else an existing manifest file (a remote teacher).

    Returns:
        The binding, or None when ``teacher`` is neither.
    """
    from kiln_core.contracts.identity import parse_manifest_line
    from kiln_core.teachers.local_registry import LocalRegistryError, get_local_teacher, read_manifest_file

    try:
        entry = get_local_teacher(registry_root, teacher)
        return TeacherBinding(teacher, "local", TeacherIdentity.model_validate(entry.identity), entry.teacher_dir)
    except LocalRegistryError as error:
        if error.code != "unknown_alias":
            raise Rejection(error.code, error.message, field="teacher") from None
    if os.path.isfile(teacher):
        try:
            manifest = parse_manifest_line(read_manifest_file(teacher))
        except LocalRegistryError as error:
            raise Rejection(error.code, error.message, field="teacher") from None
        return TeacherBinding(teacher, "remote", manifest.teacher_identity)
    return None


def plan_on_policy(request: OpdRequest, *, teacher: TeacherBinding | None, student_dir: str,
                   top_k: int | None = None, samples_per_prompt: int | None = None) -> OnPolicyPlan:
    """All submit checks of an on-policy request, cheapest first; loads the student's tokenizer only. ``top_k``
    and ``samples_per_prompt`` are the run's effective ones when the engine already resolved them
    (``ResolvedSettings``); None resolves them here.

    Example:
        >>> plan = plan_on_policy(request, teacher=bind_teacher("./kiln-data", request.teacher),
        ...                       student_dir="./student")  # doctest: +SKIP
        >>> plan.samples_per_prompt, plan.top_k  # doctest: +SKIP
        (64, 32)
    """
    warnings = check_request(request)
    facts, student = student_facts(student_dir)
    top_k, top_k_warnings = check_teacher(request, teacher, facts, top_k=top_k)
    longest = check_prompts_fit(request.prompts, request.config, student.chat_template, student.tokenizer,
                                context_length=facts.context_length,
                                teacher_max_model_len=teacher.identity.max_model_len if teacher else None)
    return OnPolicyPlan(
        samples_per_prompt=(samples_per_prompt if samples_per_prompt is not None
                            else effective_samples_per_prompt(request.config, len(request.prompts))),
        top_k=top_k,
        content_sha256=prompts_content_sha256(request.prompts),
        longest_prompt_tokens=longest,
        warnings=tuple(warnings + top_k_warnings),
    )
