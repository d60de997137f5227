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

from kiln_core.contracts.pipeline import PipelineSpec, SpecError, check_local_inputs, parse_spec


def _from_parameter(error: SpecError) -> SpecError:
    """``invalid pipeline spec: `adapter`: must be …`` → ``spec.adapter: must be …``."""
    field = f"spec.{error.field}" if error.field else "spec"
    detail = re.sub(r"^invalid pipeline spec: `[^`]*`:? ", "", error.message)
    return SpecError(f"{field}: {detail}", field, code=error.code, file=error.file)


@task(name="validate", task_run_name="validate-spec", retries=0)
def validate_spec(spec: Any) -> PipelineSpec:
    """Parse the flow's ``spec`` parameter and check its local inputs exist.

    Raises:
        SpecError: ``spec.<field>: <rule>`` (code ``invalid_spec``).

    Example:
        ```python
        spec = validate_spec({"corpus": "./c.jsonl", "student": "./student", "adapter": "demo"})
        ```
    """
    try:
        parsed = parse_spec(spec)
        check_local_inputs(parsed)
    except SpecError as error:
        raise _from_parameter(error) from None
    return parsed
