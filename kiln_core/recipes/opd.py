"""The ``opd`` step of a recipe file: Kiln's ``RecipeStep::Opd`` as an ``OpdRequest`` that trains one adapter.

``check_opd_request`` applies what Kiln checks on an OPD request at submit time (``OpdRequest`` parsing, the
config rules, the on-policy prompt rules), reading no file. ``prepare_opd`` resolves the teacher (a manifest
file next to the recipe, or a registered alias), writes inline prompts once under the storage root, and
returns the ``PipelineSpec`` (what ``kiln-flows train`` builds from a request: ``kiln_core.engine.request``) with its
``RecipeRecord``: kind ``opd``, the registered teacher's descriptor (alias, served model id,
``sha256:<identity revision>``, the whole identity) and the step as Kiln's ``hyperparameters``.

``prompts_from.dataset`` is a teacher-scored corpus, trained off-policy: like a Kiln request's ``dataset_path``
it needs ``config.training_mode: off_policy`` (the step's default is Kiln's on_policy; the message says so).
``prompts_from.prompts`` trains on-policy with a registered local teacher.

Example:
    >>> step = check_opd_request({"name": "a", "teacher": "t.jsonl", "prompts_from": {"dataset": "c.jsonl"},
    ...                           "config": {"training_mode": "off_policy"}})
    >>> step.dataset
    'c.jsonl'
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import ValidationError

from kiln_core.contracts.names import check_name
from kiln_core.contracts.opd_config import (
    KILN_IGNORED_ON_INPUT,
    OpdConfig,
    OpdRequest,
    parse_opd_request,
)
from kiln_core.contracts.pipeline import PipelineSpec
from kiln_core.contracts.recipe import OpdStep
from kiln_core.contracts.unknown_keys import closest_name, find_unknown_keys
from kiln_core.errors import Rejection
from kiln_core.on_policy.submit import AGENT_TRACES_PREFIX

__all__ = ["check_opd_request", "prepare_opd", "opd_request_of"]

STEP_FIELDS = ("name", "teacher", "prompts_from", "config")
SOURCE_FIELDS = ("dataset", "prompts")


def check_opd_request(value: Any, *, file: str | None = None) -> OpdStep:
    """Kiln's submit-time rules for an ``opd`` step (the step less its ``kind``), reading no file.

    Args:
        value: ``{name, teacher, prompts_from: {dataset} | {prompts}, config?}``.
        file: The recipe file, named in a rejection.

    Raises:
        Rejection: ``invalid_request`` (an unknown key, a bad ``prompts_from``), ``invalid_adapter_name``,
            or the OPD rule the step breaks (``invalid_config``, ``empty_prompt``, …), naming the field.

    Example:
        >>> check_opd_request({"name": "a", "teacher": "t", "prompts_from": {"prompts": []}})
        Traceback (most recent call last):
        ...
        kiln_core.errors.Rejection: [source_not_exactly_one] field prompts_from.prompts: OPD request must use exactly one of non-empty prompts or dataset_path
    """
    if not isinstance(value, dict):
        raise Rejection("invalid_request", "an opd step must be a mapping", file=file)
    for key in value:
        if key not in STEP_FIELDS:
            raise _unknown(str(key), STEP_FIELDS, "Kiln's opd step", file)
    for unknown in find_unknown_keys(value.get("config"), OpdConfig, prefix="config.",
                                     owners={OpdConfig: "Kiln's OpdConfig"}, tolerated=KILN_IGNORED_ON_INPUT):
        raise Rejection("invalid_request", f"invalid opd step: {unknown.describe()}", field=unknown.path, file=file)
    for required in ("name", "teacher", "prompts_from"):
        if required not in value:
            raise Rejection("invalid_request", f"an opd step needs `{required}`", field=required, file=file)
    check_name(value["name"], field="name")
    source = value["prompts_from"]
    if not isinstance(source, dict) or len(source) != 1 or next(iter(source)) not in SOURCE_FIELDS:
        raise Rejection("invalid_request", "prompts_from must be exactly one of {dataset: <teacher-scored corpus>} "
                        "or {prompts: [OpdPrompt, ...]}", field="prompts_from", file=file)
    request = {"teacher": value["teacher"], "config": value.get("config", {})}
    if "dataset" in source and isinstance(source["dataset"], str) and source["dataset"].startswith(AGENT_TRACES_PREFIX):
        raise Rejection("unsupported", "agent_traces: selectors need Kiln's agent-trace index, which kiln-flows does "
                        "not have; give a teacher-scored corpus or inline prompts", field="prompts_from.dataset",
                        file=file)
    if "dataset" in source:
        request["dataset_path"] = source["dataset"]
    else:
        request["prompts"] = source["prompts"]
    try:
        parsed = parse_opd_request(request)
        _check_submit_rules(parsed)
        return OpdStep(name=value["name"], teacher=parsed.teacher, dataset=parsed.dataset_path,
                       prompts=parsed.prompts, config=parsed.config)
    except Rejection as error:
        raise _in_step(error, file) from None
    except ValidationError as error:  # the parsed request always fits the step; a guard, not a rule
        raise Rejection("invalid_request", f"invalid opd step: {error.errors()[0]['msg']}", file=file) from None


def _check_submit_rules(request: OpdRequest) -> None:
    """What ``kiln-flows train`` checks on a request file (``kiln_core.engine.request.load_request``)."""
    from kiln_core.contracts.opd_submit import validate_request_for_offline_training

    if request.prompts or request.dataset_path is None:
        from kiln_core.on_policy.submit import check_request

        check_request(request)
    else:
        validate_request_for_offline_training(request)


def _unknown(key: str, known: tuple[str, ...], owner: str, file: str | None) -> Rejection:
    hint = closest_name(key, known)
    return Rejection("invalid_request", f"invalid opd step: `{key}`: unknown key (not a field of {owner})"
                     + (f"; did you mean `{hint}`?" if hint else ""), field=key, file=file)


def _in_step(error: Rejection, file: str | None) -> Rejection:
    """The request's field as the step names it (``dataset_path`` → ``prompts_from.dataset``)."""
    field = error.field
    if field == "dataset_path":
        field = "prompts_from.dataset"
    elif field is not None and field.startswith("prompts"):
        field = f"prompts_from.{field}"
    return Rejection(error.code, error.message, field=field, line=error.line, file=error.file or file)


def opd_request_of(step: OpdStep, base_adapter: str | None = None) -> OpdRequest:
    """The ``OpdRequest`` the step stands for, with ``config.base_adapter`` chained in when the step sets none.

    Example:
        >>> step = OpdStep(name="b", teacher="t", dataset="c.jsonl", config={"training_mode": "off_policy"})
        >>> opd_request_of(step, base_adapter="a").config.base_adapter
        'a'
    """
    config = step.config
    if base_adapter is not None and config.base_adapter is None:
        config = config.model_copy(update={"base_adapter": base_adapter})
    return OpdRequest(teacher=step.teacher, prompts=step.prompts, dataset_path=step.dataset, config=config)


def prepare_opd(request: OpdStep, *, student_dir: str, out_root: str, base_adapter: str | None = None,
                recipe: str | None = None, step: int | None = None, request_file: str | None = None,
                **_options: Any) -> PipelineSpec:
    """The spec that trains the step: the teacher resolved, inline prompts written, the recipe record set.

    Args:
        request: The checked step (``check_opd_request``).
        student_dir: The student model directory.
        out_root: The storage root (runs, the teacher registry, prompt files).
        base_adapter: The warm start the recipe chains in (the previous training step's adapter), used when the
            step's config names none.
        recipe, step: The recipe's name and the step's index, recorded in the receipt.
        request_file: The recipe file; relative ``teacher`` and ``dataset`` paths are taken relative to it
            (default: the working directory).

    Raises:
        Rejection: ``teacher_not_registered`` (neither a manifest file nor an alias),
            ``remote_teacher_on_policy`` (on-policy prompts with a manifest file for teacher), an invalid spec.

    Example:
        >>> spec = prepare_opd(check_opd_request(step_body), student_dir="./student", out_root="./kiln-data",
        ...                    base_adapter="warm", recipe="demo", step=1)  # doctest: +SKIP
        >>> spec.recipe.kind, spec.config.base_adapter  # doctest: +SKIP
        ('opd', 'warm')
    """
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.storage import anchored_path
    from kiln_core.teachers.local_registry import teacher_source

    anchor = request_file or os.path.join(os.getcwd(), "recipe.yaml")
    opd = opd_request_of(request, base_adapter)
    teacher = teacher_source(opd.teacher, anchor, out_root)
    spec: dict[str, Any] = {"teacher": teacher, "student": student_dir, "storage_root": out_root,
                            "adapter": request.name, "config": opd.config}
    if opd.prompts:
        from kiln_core.on_policy.prompt_file import write_prompt_file

        if teacher.kind != "local_registry":  # Kiln's require_remote_teacher_off_policy, as `kiln-flows train`
            raise Rejection("remote_teacher_on_policy", 'OPD cannot use a remote teacher with training_mode='
                            f'"on_policy": {opd.teacher!r} is a manifest file, not a registered local teacher '
                            "(`kiln-flows teachers register ALIAS DIR`)", field="teacher")
        spec["prompts"] = write_prompt_file(opd.prompts, out_root)
    else:
        spec["corpus"] = anchored_path(opd.dataset_path or "", anchor)
    built = parse_spec(spec, file=request_file)
    return built.model_copy(update={"recipe": _record(request, opd, teacher, out_root, recipe, step)})


def _record(step_: OpdStep, opd: OpdRequest, teacher: Any, out_root: str, recipe: str | None, step: int | None):
    """Kiln's receipt story for an opd step: the registered teacher's descriptor and the step as ``hyperparameters``."""
    from kiln_core.contracts.identity import parse_manifest_line
    from kiln_core.contracts.recipe_record import RecipeRecord, TeacherDescriptor
    from kiln_core.teachers.local_registry import resolve_pinned_manifest

    identity = parse_manifest_line(resolve_pinned_manifest(out_root, teacher.path or teacher.alias)).teacher_identity
    descriptor = TeacherDescriptor(alias=opd.teacher, model_id=identity.served_model_id,
                                   model_version_hash=identity.identity_revision(), identity=identity.as_ordered_dict())
    body = {"name": step_.name, "teacher": opd.teacher,
            "prompts_from": {"dataset": opd.dataset_path} if opd.dataset_path is not None
            else {"prompts": [prompt.model_dump(mode="json") for prompt in opd.prompts]},
            "config": opd.config.model_dump(mode="json")}
    return RecipeRecord(kind="opd", name=step_.name, teacher=descriptor,
                        teacher_identity_revision=identity.identity_revision(), request=body, recipe=recipe, step=step)
