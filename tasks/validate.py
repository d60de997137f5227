"""Stage 0, ``validate``: the spec a run was given, checked before any work, in one readable line.

The UI's form already enforces what a JSON schema can carry (types, ranges, enums, the adapter-name
pattern). The rest — exactly one of corpus or examples, Kiln's submit-time config rules, a student
directory that is not there — is checked here, in a task that takes milliseconds, and fails the run
with one line naming the field from the flow parameter down (``spec.adapter: …``). A rejection is
never retried.
"""

from __future__ import annotations

import re
from typing import Any

from prefect import task

from kiln_core.contracts.pipeline import PipelineSpec, SpecError, parse_spec
from kiln_core.contracts.spec_file import check_local_inputs


# The run form shows the training data under `source` (Training data → Corpus); a spec that came from
# the form is told about `spec.source.corpus`, the field its user can see, not the bound `spec.corpus`.
_FORM_FIELDS = {"corpus": "source.corpus", "examples": "source.examples", "prompts": "source.prompts"}


def _from_parameter(error: SpecError, from_form: bool) -> SpecError:
    """``invalid pipeline spec: `adapter`: must be …`` → field ``spec.adapter``, message ``must be …``."""
    field = error.field
    if from_form and field in _FORM_FIELDS:
        field = _FORM_FIELDS[field]
    field = f"spec.{field}" if field else "spec"
    detail = re.sub(r"^invalid pipeline spec: `[^`]*`:? ", "", error.message)
    return SpecError(detail, field, code=error.code, file=error.file)


@task(name="validate", task_run_name="validate-spec", retries=0)
def validate_spec(spec: Any) -> PipelineSpec:
    """Parse the flow's ``spec`` parameter and check its local inputs exist.

    Raises:
        SpecError: field ``spec.<field>`` (as the form names it), message the rule (code ``invalid_spec``
            unless the rule has its own).

    Example:
        ```python
        spec = validate_spec({"corpus": "./c.jsonl", "student": "./student", "adapter": "demo"})
        ```
    """
    from_form = isinstance(spec, dict) and spec.get("source") is not None
    try:
        parsed = parse_spec(spec)
        check_local_inputs(parsed)
    except SpecError as error:
        raise _from_parameter(error, from_form) from None
    return parsed
