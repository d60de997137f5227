"""The suite registry: ``<eval_root>/suites/<name>/suite.json`` (+ optional ``examples.jsonl``).

Source: crates/kiln-server/src/eval/registry.rs · SuiteRegistry (layout, load order, "skip malformed
suites when listing", save without ``force`` refuses an existing name) and eval/util.rs ·
is_valid_segment_name. Kiln's ``eval_root`` defaults to ``<adapter_dir>/.eval``; kiln-flows keeps
it beside the runs, at ``<storage root>/.eval``. Everything goes through ``kiln_core.storage``, so the
registry may live on local disk or behind any fsspec URI.
"""

from __future__ import annotations

import json
import logging
import posixpath
from typing import Any

from kiln_core.contracts.post_eval.errors import PostEvalRejection
from kiln_core.contracts.post_eval.suite import EvalSuite, load_suite
from kiln_core.storage import Location, list_children, remove_tree, resolve, write_bytes_atomic

__all__ = ["SuiteRegistry", "is_valid_segment_name"]

log = logging.getLogger(__name__)
HEADER_FILE = "suite.json"
EXAMPLES_FILE = "examples.jsonl"


def is_valid_segment_name(name: str) -> bool:
    """Non-empty, not ``.``/``..``, no ``/``, ``\\`` or ``..``, not absolute."""
    return bool(name) and name not in (".", "..") and not any(part in name for part in ("/", "\\", "..")) \
        and not posixpath.isabs(name)


class SuiteRegistry:
    """Named eval suites under one eval root.

    Example:
        >>> registry = SuiteRegistry.for_storage_root("memory://kiln-data")
        >>> registry.names()
        []
    """

    def __init__(self, eval_root: str | Location, storage_options: dict[str, Any] | None = None) -> None:
        self.root = eval_root if isinstance(eval_root, Location) else resolve(eval_root, storage_options)
        self.suites = self.root.child("suites")

    @classmethod
    def for_storage_root(cls, storage_root: str, storage_options: dict[str, Any] | None = None) -> "SuiteRegistry":
        """The registry at ``<storage_root>/.eval``."""
        return cls(resolve(storage_root, storage_options).child(".eval"))

    def _dir(self, name: str) -> Location:
        if not is_valid_segment_name(name):
            raise PostEvalRejection("eval_suite_name_invalid", f"invalid suite name: {name}", field="suite")
        return self.suites.child(name)

    def load(self, name: str) -> EvalSuite:
        """Load and validate one suite: ``suite.json`` alone, or with ``examples.jsonl`` beside it.

        Raises:
            PostEvalRejection: ``eval_suite_name_invalid``, ``eval_suite_not_found`` or the suite's
                own rejection.
        """
        directory = self._dir(name)
        header = directory.child(HEADER_FILE)
        if not header.exists():
            missing = name if not directory.exists() else f"{name}/{HEADER_FILE}"
            raise PostEvalRejection("eval_suite_not_found", f"suite not found: {missing}", field="suite")
        examples = directory.child(EXAMPLES_FILE)
        examples_bytes = examples.read_bytes() if examples.exists() else None
        return load_suite(header.read_bytes(), examples_bytes, header_file=header.uri,
                          examples_file=examples.uri if examples_bytes is not None else None)

    def is_installed(self, name: str) -> bool:
        """Whether ``load(name)`` succeeds."""
        try:
            self.load(name)
        except PostEvalRejection:
            return False
        return True

    def names(self) -> list[str]:
        """Names of the loadable suites, sorted; hidden directories and broken suites are skipped."""
        found = []
        for name in list_children(self.suites):
            if name.startswith(".") or not is_valid_segment_name(name):
                continue
            try:
                self.load(name)
            except PostEvalRejection as error:
                log.warning("skipping malformed eval suite %s: %s", name, error)
                continue
            found.append(name)
        return found

    def save(self, suite: EvalSuite, *, force: bool = False) -> Location:
        """Validate ``suite`` and store it under its name (inline examples); returns ``suite.json``.

        Raises:
            PostEvalRejection: ``eval_suite_exists`` without ``force``, or the suite's own rejection.
        """
        suite.validate_rules()
        directory = self._dir(suite.name)
        header = directory.child(HEADER_FILE)
        if directory.exists() and not force:
            raise PostEvalRejection("eval_suite_exists", f"suite already exists: {suite.name}", field="suite")
        document = suite.model_dump(mode="json", exclude_unset=True)  # "unset" keeps inherit-vs-null budgets
        write_bytes_atomic(header, (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
        examples = directory.child(EXAMPLES_FILE)
        if examples.exists():  # the header now carries the examples; a sidecar would be concatenated
            examples.fs.rm(examples.path)
            examples.refresh()
        return header

    def register(self, source: str, examples: str | None = None, *, force: bool = False,
                 storage_options: dict[str, Any] | None = None) -> EvalSuite:
        """Read a suite file (and optional JSONL examples), validate it and save it under its name.

        Example:
            ``registry.register("math.json")`` or ``registry.register("header.json", "examples.jsonl")``
        """
        header = resolve(source, storage_options)
        lines = resolve(examples, storage_options) if examples is not None else None
        for location in (header, lines):
            if location is not None and not location.exists():
                raise PostEvalRejection("eval_suite_unreadable", "file not found", file=location.uri)
        suite = load_suite(header.read_bytes(), lines.read_bytes() if lines is not None else None,
                           header_file=header.uri, examples_file=lines.uri if lines is not None else None)
        self.save(suite, force=force)
        return suite

    def delete(self, name: str) -> None:
        """Remove a registered suite."""
        directory = self._dir(name)
        if not directory.exists():
            raise PostEvalRejection("eval_suite_not_found", f"suite not found: {name}", field="suite")
        remove_tree(directory)
