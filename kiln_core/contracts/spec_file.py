"""A pipeline spec as a file: YAML read under Kiln's nesting limit, and the local inputs it names checked.

``kiln-flows run pipeline.yaml`` and ``kiln-flows serve --spec`` read a spec with ``load_spec``; the spec
itself, and every rule about its fields, is ``kiln_core.contracts.pipeline``. ``check_local_inputs`` moves the
refusal of a missing local corpus, teacher or student before any work (the flow's first task runs it).
A recipe file is read under the same nesting limit (``check_yaml_depth``).
"""

from __future__ import annotations

from kiln_core.contracts.pipeline import PipelineSpec, SpecError, parse_spec

__all__ = ["check_local_inputs", "check_yaml_depth", "load_spec"]


def load_spec(path: str) -> PipelineSpec:
    """Load a ``PipelineSpec`` from a YAML (or JSON) file; relative paths stay relative to the CWD.

    Raises:
        SpecError: unreadable file (``invalid_spec``), not YAML, not a mapping, an invalid field;
            ``NestingTooDeep`` (``nesting_too_deep``) for nesting beyond Kiln's parser limit.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise SpecError(f"cannot read pipeline spec {path}: {reason}", file=path) from None
    try:
        check_yaml_depth(text, path)
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SpecError(f"pipeline spec {path} is not valid YAML: {error}", file=path) from None
    if not isinstance(value, dict):
        raise SpecError(f"pipeline spec {path} must be a mapping", file=path)
    return parse_spec(value, file=path)


def check_yaml_depth(text: str, path: str, *, where: str = "the pipeline spec") -> None:
    """Refuse what serde_json's depth limit refuses (``kiln_core.strict_json``), counted on the parser's
    event stream, before PyYAML's recursive composer would hit Python's recursion limit. ``where`` names
    the document in the message (a pipeline spec, a recipe file).

    Raises:
        NestingTooDeep: ``nesting_too_deep``, with the line where the limit was reached.

    Example:
        >>> check_yaml_depth("a: [1, 2]", "spec.yaml")
    """
    import yaml

    from kiln_core.strict_json import SERDE_JSON_RECURSION_LIMIT, too_deep

    level = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            level += 1
            if level >= SERDE_JSON_RECURSION_LIMIT:
                raise too_deep(level, where=where, file=path,
                               line=event.start_mark.line + 1 if event.start_mark else None)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            level -= 1


def _local_path(uri: str) -> str | None:
    """The filesystem path of a local location (a plain path or ``file://``), else None."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    return None if "://" in uri else uri


def check_local_inputs(spec: PipelineSpec) -> None:
    """Refuse a spec whose local inputs are not there, naming the field (remote URIs are left to the
    stages that read them).

    Raises:
        SpecError: ``student`` is not a directory, or ``corpus``/``examples``/``teacher.path`` does not exist.

    Example:
        >>> check_local_inputs(PipelineSpec(corpus="missing.jsonl", student=".", adapter="a",
        ...     teacher={"kind": "manifest_file", "path": "."}))
        Traceback (most recent call last):
        SpecError: invalid pipeline spec: `corpus`: missing.jsonl does not exist
    """
    import os

    # The codes are the ones the stages reading these inputs use (never renamed): the check only moves
    # the refusal before any work.
    checks = [("student", spec.student, os.path.isdir, "is not a directory", "invalid_student"),
              ("corpus", spec.corpus, os.path.exists, "does not exist", "file_not_found"),
              ("examples", spec.examples, os.path.exists, "does not exist", "file_not_found")]
    if spec.teacher.kind in ("local_dir", "manifest_file"):
        checks.append(("teacher.path", spec.teacher.path, os.path.exists, "does not exist", "file_not_found"))
    for field, uri, present, problem, code in checks:
        path = _local_path(uri) if uri else None
        if path is not None and not present(path):
            raise SpecError(f"invalid pipeline spec: `{field}`: {uri} {problem}", field, code=code)
