"""The training package's shape: small files, no import circle, and imports that only point down.

Read from the source with ``ast`` (every import, including those inside functions, since a deferred
import still closes a circle at run time); nothing is imported. Run as a script to print the table:

    python tests/test_training_layout.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ROOT / "kiln_core" / "training"
MAX_LINES = 400

# Lowest tier first. A module imports only modules of its own tier or below; a new module must be
# placed here before it can be imported by anything.
TIERS: list[tuple[str, set[str]]] = [
    ("parts", {
        "kiln_core.training", "kiln_core.training.loss", "kiln_core.training.objectives", "kiln_core.training.student",
        "kiln_core.training.optim", "kiln_core.training.data_identity", "kiln_core.training.run_identity",
        "kiln_core.training.receipt_model", "kiln_core.training.receipt", "kiln_core.training.eval_curve",
        "kiln_core.training.checkpoint", "kiln_core.training.checkpoint.format",
        "kiln_core.training.checkpoint.names", "kiln_core.training.checkpoint.rules",
        "kiln_core.training.checkpoint.contract", "kiln_core.training.checkpoint.rng",
        "kiln_core.training.checkpoint.write", "kiln_core.training.checkpoint.load",
        "kiln_core.training.distributed", "kiln_core.training.distributed.world", "kiln_core.training.base_adapter",
        "kiln_core.training.interrupt",
    }),
    ("loop pieces", {"kiln_core.training.plan", "kiln_core.training.progress", "kiln_core.training.step",
                     "kiln_core.training.finish", "kiln_core.training.lifecycle", "kiln_core.training.on_policy_plan",
                     "kiln_core.training.watch"}),
    ("loop", {"kiln_core.training.trainer", "kiln_core.training.on_policy_trainer"}),
    ("launcher", {"kiln_core.training.distributed.launcher"}),
    ("entries", {"kiln_core.training.run_request", "kiln_core.training.distributed.worker"}),
]
TIER_OF = {module: rank for rank, (_, modules) in enumerate(TIERS) for module in modules}


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


def test_every_training_module_has_a_tier_and_imports_point_down():
    graph = import_graph()
    assert set(graph) - set(TIER_OF) == set(), "place new modules in TIERS"
    upward = sorted((a, b) for a, targets in graph.items() for b in targets if TIER_OF[b] > TIER_OF[a])
    assert upward == []


def test_the_launcher_never_imports_the_worker():
    graph = import_graph()
    assert "kiln_core.training.distributed.worker" not in reachable(graph, "kiln_core.training.distributed.launcher")
    # ...while the worker may prepare the request itself.
    assert "kiln_core.training.run_request" in graph["kiln_core.training.distributed.worker"]


def test_the_loop_does_not_import_the_entry_points():
    graph = import_graph()
    below_entries = reachable(graph, "kiln_core.training.trainer")
    assert {"kiln_core.training.run_request", "kiln_core.training.distributed.launcher",
            "kiln_core.training.distributed.worker"} & below_entries == set()


def test_the_training_package_has_no_test_hooks():
    source = "\n".join(path.read_text() for path in training_files().values())
    assert "fail_at_step" not in source and "KILN_FLOWS_FAIL_AT_STEP" not in source
    loss_functions = [node.name for node in ast.walk(ast.parse((TRAINING / "loss.py").read_text()))
                      if isinstance(node, ast.FunctionDef)]
    assert [name for name in loss_functions if "naive" in name or "reference" in name] == []


@pytest.mark.parametrize("layer", ["admission", "contracts", "identity", "scoring", "teachers", "oracle", "schemas",
                                   "on_policy"])
def test_packages_below_training_do_not_import_it(layer):
    files = {module_name(p) for p in TRAINING.rglob("*.py")}
    offenders = {module_name(p): sorted(imported_modules(p, files))
                 for p in (ROOT / "kiln_core" / layer).rglob("*.py") if imported_modules(p, files)}
    assert offenders == {}


def test_modules_below_training_do_not_import_it():
    files = {module_name(p) for p in TRAINING.rglob("*.py")}
    lower = ["corpus", "canonical", "errors", "storage", "tokenization", "materialize", "kiln_prompts",
             "strict_json", "synthetic", "tiny_models"]
    offenders = {name: sorted(imported_modules(ROOT / "kiln_core" / f"{name}.py", files)) for name in lower}
    assert {name: found for name, found in offenders.items() if found} == {}


if __name__ == "__main__":
    graph = import_graph()
    for name, path in sorted(training_files().items(), key=lambda item: -len(item[1].read_text().splitlines())):
        short = name.removeprefix("kiln_core.training.") if name != "kiln_core.training" else "(package)"
        tier = TIERS[TIER_OF[name]][0] if name in TIER_OF else "?"
        print(f"{len(path.read_text().splitlines()):4d}  {tier:<11}  {short}")
    print("import circle:", find_cycle(graph))
    print("launcher reaches worker:",
          "kiln_core.training.distributed.worker" in reachable(graph, "kiln_core.training.distributed.launcher"))
    sys.exit(0)
