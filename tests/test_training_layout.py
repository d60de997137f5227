"""The training package's shape: small files, no import circle, and the entry points kept out of the loop.

Read from the source with ``ast`` (every import, including those inside functions, since a deferred
import still closes a circle at run time); nothing is imported. Which packages training may import,
and which may import it, is ``tools/import_graph.py``'s layer table (``tests/test_import_graph.py``).
Run as a script to print the table:

    python tests/test_training_layout.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ROOT / "kiln_core" / "training"
MAX_LINES = 400
sys.path.insert(0, str(ROOT / "tools"))

import import_graph as layers  # noqa: E402


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def training_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(TRAINING.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Every ``known`` module that importing or running ``path`` can import, with their parent packages."""
    tree = ast.parse(path.read_text(), filename=str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name:  # importing a.b.c runs a, a.b and a.b.c
                if name in known:
                    found.add(name)
                name = name.rpartition(".")[0]
    # A module's own packages are already importing when it runs (the usual package/submodule pattern).
    return {name for name in found if not (this == name or this.startswith(name + "."))}


def import_graph() -> dict[str, set[str]]:
    files = training_files()
    return {name: imported_modules(path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_training_file_exceeds_the_size_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in training_files().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_there_is_no_import_circle_in_training():
    assert find_cycle(import_graph()) is None


def test_the_launcher_never_imports_the_worker_and_the_worker_never_reaches_the_engine():
    # The launcher only names the torchrun worker (it runs in each rank). The worker takes a job and never a
    # request: the engine's one door (spec_from_request, then prepare) makes every job, so nothing in training
    # reaches up into the engine, not even through a string import (the Ray worker used to).
    graph = layers.graph(ROOT)[0]
    worker = "kiln_core.training.distributed.worker"
    assert worker not in reachable(graph, "kiln_core.training.distributed.launcher")
    assert worker in graph["kiln_core.training.distributed.ray_worker"]
    for entry in (worker, "kiln_core.training.distributed.ray_worker"):
        assert not {name for name in reachable(graph, entry) if name.startswith("kiln_core.engine")}, entry


def test_the_loop_does_not_import_the_launcher():
    assert "kiln_core.training.distributed.launcher" not in reachable(import_graph(), "kiln_core.training.trainer")


def test_the_training_package_has_no_test_hooks():
    source = "\n".join(path.read_text() for path in training_files().values())
    assert "fail_at_step" not in source and "KILN_FLOWS_FAIL_AT_STEP" not in source
    loss_functions = [node.name for node in ast.walk(ast.parse((ROOT / "kiln_core" / "loss.py").read_text()))
                      if isinstance(node, ast.FunctionDef)]
    assert [name for name in loss_functions if "naive" in name or "reference" in name] == []


if __name__ == "__main__":
    graph = import_graph()
    for name, path in sorted(training_files().items(), key=lambda item: -len(item[1].read_text().splitlines())):
        short = name.removeprefix("kiln_core.training.") if name != "kiln_core.training" else "(package)"
        print(f"{len(path.read_text().splitlines()):4d}  {short}")
    print("import circle:", find_cycle(graph))
    sys.exit(0)
