"""Admission's modules import each other in one direction only (issue 10, admission part).

``admit`` → ``materialize`` → ``corpus`` and ``records`` → ``columnar`` → ``parsed``: what two modules
both need lives in a module below them, and no import inside a function hides a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kiln_core"
WATCHED = ["kiln_core.materialize", "kiln_core.corpus", "kiln_core.tokenization", "kiln_core.chat_template",
           "kiln_core.assistant_mask", "kiln_core.trajectory_mask", "kiln_core.strict_json"]
WATCHED += [f"kiln_core.admission.{p.stem}" for p in (PACKAGE / "admission").glob("*.py") if p.stem != "__init__"]


def module_path(name: str) -> Path:
    return PACKAGE.parent / (name.replace(".", "/") + ".py")


def imports_of(name: str) -> set[str]:
    """Every kiln_core module ``name`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(module_path(name).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln_core"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("kiln_core"))
    return {module for module in found if module in WATCHED}


def test_no_import_cycle_among_admission_modules():
    graph = {name: imports_of(name) for name in WATCHED}
    visiting, done = [], set()

    def visit(name):
        assert name not in visiting, " -> ".join(visiting[visiting.index(name):] + [name])
        if name in done:
            return
        visiting.append(name)
        for target in graph[name]:
            visit(target)
        visiting.pop()
        done.add(name)

    for name in WATCHED:
        visit(name)
    assert "kiln_core.materialize" in graph["kiln_core.admission.admit"]
    assert "kiln_core.admission.columnar" in graph["kiln_core.admission.records"]
