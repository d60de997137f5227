"""Reading a request file (an OPD request, a distill/self, distill/pump or distill_merge request): one reader,
one wording of its two failures, before any rule of the request itself is checked.

Example:
    >>> value = read_request_json("merge.json", "distill_merge")  # doctest: +SKIP
"""

from __future__ import annotations

import json
from typing import Any

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.storage import resolve
from kiln_core.strict_json import loads_nesting_limited

__all__ = ["read_request_json"]


def read_request_json(path: str, surface: str) -> Any:
    """The decoded JSON of the request file ``path`` (any storage URI), for the route named ``surface``.

    Raises:
        ConfigError: ``invalid_request`` — the file cannot be read or is not JSON, naming the file.
        NestingTooDeep: ``nesting_too_deep`` — deeper than Kiln's parser (serde_json) accepts.
    """
    try:
        text = resolve(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {surface} request {path}: {error}", None, code="invalid_request") from None
    try:
        return loads_nesting_limited(text, where=f"the {surface} request", file=path)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{surface} request {path} is not valid JSON: {error}", None, code="invalid_request") from None
