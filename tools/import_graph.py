"""The import graph of kiln-flows' packages: circles and upward imports.

Every ``import``/``from … import`` statement in ``kiln_core``, ``tasks``, ``flows`` and ``drills`` —
at module level or inside a function — is an edge from its module to the module it names
(``from pkg import sub`` names the submodule when there is one). Printed:

* the longest modules (lines);
* every circle (a strongly connected component of two or more modules, or a self-import), marked
  ``import-time`` when it is made of module-level imports only;
* every upward import against the layering of DESIGN.md: ``kiln_core`` (the engine, never Prefect)
  < ``tasks`` < ``flows`` < ``drills``. ``flows.commands.drill`` — the ``kiln-flows drill`` command —
  is the one module of ``flows`` that imports ``drills``.

Usage:
    python tools/import_graph.py            # exit 1 when there is a circle or an upward import
    python tools/import_graph.py --json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kiln_core", "tasks", "flows", "drills")
LAYER = {"kiln_core": 0, "tasks": 1, "flows": 2, "drills": 3}
ALLOWED_UPWARD = {("flows.commands.drill", "drills")}
FORBIDDEN_IN_ENGINE = ("prefect",)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name → file for every module of the four packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import statement of one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            found.append((target, id(node) in top_level))
    return found


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]], list[tuple[str, str]]]:
    """All edges, module-level edges, and imports of third-party packages the engine must not use."""
    known = modules(root)
    every: dict[str, set[str]] = {name: set() for name in known}
    eager: dict[str, set[str]] = {name: set() for name in known}
    forbidden = []
    for name, path in known.items():
        for target, top in imports(path, name, known):
            if name.startswith("kiln_core") and target.split(".")[0] in FORBIDDEN_IN_ENGINE:
                forbidden.append((name, target))
            while target and target not in known:  # `import kiln_core.x.y` of an attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                every[name].add(target)
                if top:
                    eager[name].add(target)
    return every, eager, forbidden


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one (``kiln_core`` → ``tasks``, ``tasks`` → ``flows``, …)."""
    found = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if LAYER[source.split(".")[0]] < LAYER[target.split(".")[0]] and (source, target.split(".")[0]) not in ALLOWED_UPWARD:
                found.append((source, target))
    return found


def report(root: Path = ROOT) -> dict:
    every, eager, forbidden = graph(root)
    sizes = sorted(((len(path.read_text(encoding="utf-8").splitlines()), name) for name, path in modules(root).items()),
                   reverse=True)
    eager_circles = circles(eager)
    return {
        "modules": len(every),
        "edges": sum(len(targets) for targets in every.values()),
        "longest_modules": [{"module": name, "lines": lines} for lines, name in sizes[:5]],
        "circles": [{"modules": component, "import_time": component in eager_circles} for component in circles(every)],
        "upward_imports": [{"from": source, "to": target} for source, target in upward(every)],
        "engine_imports_prefect": [{"from": source, "to": target} for source, target in forbidden],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    result = report()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['modules']} modules, {result['edges']} import edges (kiln_core, tasks, flows, drills)")
        print("longest modules: " + ", ".join(f"{m['module']} {m['lines']}" for m in result["longest_modules"]))
        print(f"circles: {len(result['circles'])}")
        for circle in result["circles"]:
            print(f"  {'import-time ' if circle['import_time'] else ''}circle: {' <-> '.join(circle['modules'])}")
        print(f"upward imports: {len(result['upward_imports'])}")
        for edge in result["upward_imports"]:
            print(f"  {edge['from']} -> {edge['to']}")
        print(f"kiln_core importing prefect: {len(result['engine_imports_prefect'])}")
        for edge in result["engine_imports_prefect"]:
            print(f"  {edge['from']} -> {edge['to']}")
    clean = not (result["circles"] or result["upward_imports"] or result["engine_imports_prefect"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
