"""Where teacher manifests come from: a Kiln server's registry, or our local ``teachers.json``."""

from kiln_core.contracts.teachers import LocalTeacherEntry
from kiln_core.teachers.kiln_client import (
    DEFAULT_KILN_URL,
    TeacherRegistryError,
    fetch_off_policy_manifest,
    fetch_teachers,
    select_manifest,
)
from kiln_core.teachers.local_registry import (
    LocalRegistryError,
    get_local_teacher,
    list_local_teachers,
    register_local_teacher,
    resolve_pinned_manifest,
)

__all__ = [
    "DEFAULT_KILN_URL",
    "LocalRegistryError",
    "LocalTeacherEntry",
    "TeacherRegistryError",
    "fetch_off_policy_manifest",
    "fetch_teachers",
    "get_local_teacher",
    "list_local_teachers",
    "register_local_teacher",
    "resolve_pinned_manifest",
    "select_manifest",
]
