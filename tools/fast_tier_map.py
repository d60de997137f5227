"""Rebuild ``tests/fast_tier_map.json``: for every product module, fast test files that exercise it.

The fast tier (``python -m pytest -m fast``, chosen by ``tests/conftest.py``) must exercise every module
of ``kiln_core``, ``tasks``, ``flows`` and ``drills``: run some code inside one of its functions, not just
import it. This tool measures that with coverage.py (a developer tool, not a project dependency:
``pip install coverage``) and records, per module, up to three test files that exercise it most;
``tests/test_fast_tier.py`` then checks, without coverage, that every module is listed and that every
listed file still holds fast tests. A module with no function at all (a package ``__init__`` of imports
and constants) has nothing to exercise; it is recorded with an empty list.

    $ python tools/fast_tier_map.py            # runs the fast tier under coverage (minutes), then writes the map
    $ python tools/fast_tier_map.py --data .coverage [--data more.coverage]   # from existing data files
      (recorded with ``dynamic_context = test_function`` and ``source_pkgs = kiln_core, tasks, flows, drills``)

Exits 1, naming them, when some module is exercised by no fast test (the map is still written, without it).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kiln_core", "tasks", "flows", "drills")
MAP_PATH = REPO / "tests" / "fast_tier_map.json"
FILES_PER_MODULE = 3


def product_modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of the product packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def function_body_lines(path: Path) -> set[int]:
    """Lines inside function bodies: running one of them is exercising the module, importing it is not."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.update(range(node.body[0].lineno, (node.end_lineno or node.body[-1].lineno) + 1))
    return lines


def test_of(context: str, test_files: dict[str, str]) -> str | None:
    """``test_function`` context (``test_x.test_name``, ``fault_drills.test_x.Class.test_name``) -> the
    test's node id without parameters (``tests/test_x.py::test_name``); None for other code."""
    parts = context.split(".")
    for index, part in enumerate(parts):
        if part in test_files:
            return "::".join([test_files[part], *parts[index + 1:]])
    return None


def not_fast() -> frozenset[str]:
    """``NOT_FAST`` of ``tests/conftest.py``: tests left out of the tier after the data was recorded."""
    tree = ast.parse((REPO / "tests" / "conftest.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(target, ast.Name) and target.id == "NOT_FAST" for target in targets):
                return frozenset(value.value for value in ast.walk(node.value) if isinstance(value, ast.Constant)
                                 and isinstance(value.value, str))
    return frozenset()


def run_fast_tier_under_coverage(data_file: Path) -> None:
    rcfile = data_file.with_suffix(".rc")
    rcfile.write_text("[run]\nsource_pkgs = " + ", ".join(PACKAGES) + "\ndynamic_context = test_function\n"
                      f"data_file = {data_file}\n")
    subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rcfile}", "-m", "pytest", "-n", "0", "-m", "fast", "-q",
                    "-p", "no:cacheprovider"], cwd=REPO, check=False)


def build_map(data_files: list[Path]) -> tuple[dict[str, list[str]], list[str]]:
    """(module -> up to three test files exercising it most, modules no fast test exercises)."""
    from coverage import CoverageData

    test_files = {path.stem: path.relative_to(REPO).as_posix() for path in (REPO / "tests").rglob("test_*.py")}
    modules = product_modules()
    by_source = {str(path.resolve()): name for name, path in modules.items()}
    left_out = not_fast()
    exercised: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # module -> test file -> lines
    for data_file in data_files:
        data = CoverageData(basename=str(data_file))
        data.read()
        for source in data.measured_files():
            name = by_source.get(str(Path(source).resolve()))
            if name is None:
                continue
            body = function_body_lines(modules[name])
            for line, contexts in data.contexts_by_lineno(source).items():
                if line not in body:
                    continue
                tests = {test_of(context, test_files) for context in contexts} - {None} - left_out
                for test_file in {test.split("::")[0] for test in tests}:
                    exercised[name][test_file] += 1
    mapping, missing = {}, []
    for name, path in modules.items():
        if not function_body_lines(path):
            mapping[name] = []  # no function to run: importing it is all there is (the check verifies this)
        elif exercised.get(name):
            ranked = exercised[name]
            mapping[name] = sorted(ranked, key=lambda file: (-ranked[file], file))[:FILES_PER_MODULE]
        else:
            missing.append(name)
    return mapping, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", action="append", type=Path, help="coverage data file(s) to read instead of running")
    args = parser.parse_args(argv)
    data_files = args.data
    if not data_files:
        data_file = Path(tempfile.mkdtemp(prefix="fast-tier-")) / ".coverage"
        run_fast_tier_under_coverage(data_file)
        data_files = [data_file]
    mapping, missing = build_map(data_files)
    MAP_PATH.write_text(json.dumps(mapping, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{MAP_PATH.relative_to(REPO)}: {len(mapping)} modules", file=sys.stderr)
    if missing:
        print("exercised by no fast test: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
