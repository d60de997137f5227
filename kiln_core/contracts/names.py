"""Names that become paths: adapter names (run directories, checkpoint prefixes) and local teacher
aliases. One rule for all of them, checked with ``fullmatch`` (``re.match`` with ``$`` would accept
a trailing newline).

Example:
    >>> check_name("offline-distilled.v2")
    'offline-distilled.v2'
"""

from __future__ import annotations

import re

from kiln_core.contracts.opd_config import ConfigError

# The whole rule as one regular expression. It stays out of every message (users read NAME_RULE) and
# out of the run form's schema, whose validators would quote it back ("does not match '^(?!…'").
NAME_PATTERN = r"^(?!.*\.\.)(?!.*\.kiln-checkpoint$)[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NAME = re.compile(NAME_PATTERN)
NAME_RULE = ("1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit, "
             "without '..' and not ending in '.kiln-checkpoint'")


def is_valid_name(name: object) -> bool:
    """Whether ``name`` is one safe path component under the rule above."""
    return isinstance(name, str) and "\n" not in name and _NAME.fullmatch(name) is not None


def check_name(name: object, *, field: str = "adapter", code: str = "invalid_adapter_name") -> str:
    """Return ``name`` when it follows the rule, else raise a ``ConfigError`` naming ``field``.

    Raises:
        ConfigError: ``code`` (default ``invalid_adapter_name``).
    """
    if not is_valid_name(name):
        raise ConfigError(f"{field} {name!r} must be {NAME_RULE}", field, code=code)
    return name  # type: ignore[return-value]
