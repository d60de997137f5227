"""The import graph (``tools/import_graph.py``): kiln_core's package layers, no circles, layers point one way.

The tool is checked on small synthetic trees first (it finds a planted module circle, a lazy one, a
package cycle, an upward arrow, an unplaced package, a second orchestrator and an upward import hidden in
a string, and its command line fails on them), then run on this checkout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import import_graph  # noqa: E402


@pytest.fixture(scope="module")
def repo_report() -> dict:
    return import_graph.report(REPO)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_tool_finds_circles_and_upward_imports(tmp_path):
    _write(tmp_path, {
        "kiln_core/__init__.py": "",
        "kiln_core/a.py": "from kiln_core import b\n",
        "kiln_core/b.py": "def f():\n    from kiln_core.a import x\n",  # lazy: still a circle
        "kiln_core/c.py": "import prefect\nfrom tasks.t import y\n",  # upward, and Prefect in the engine
        "tasks/__init__.py": "", "tasks/t.py": "from kiln_core.c import z\n",
        "flows/__init__.py": "", "flows/commands/drill.py": "import drills\n",  # the drill command may
        "drills/__init__.py": "",
    })
    report = import_graph.report(tmp_path)
    circles = {tuple(c["modules"]): c["import_time"] for c in report["circles"]}
    assert circles == {("kiln_core.a", "kiln_core.b"): False, ("kiln_core.c", "tasks.t"): True}
    assert report["upward_imports"] == [{"from": "kiln_core.c", "to": "tasks.t"}]
    assert report["engine_imports_prefect"] == [{"from": "kiln_core.c", "to": "prefect"}]


# A tree with the real layer table's package names: contracts (low) and engine (top) import each other
# (the contracts side inside a function), the root package imports the floor, a new top-level module has
# no layer, and post_eval imports two pipeline stages.
PLANTED = {
    "kiln_core/__init__.py": "from kiln_core.errors import Rejection\n",
    "kiln_core/errors.py": "class Rejection(Exception):\n    pass\n",
    "kiln_core/storage.py": "from kiln_core.errors import Rejection\n",
    "kiln_core/contracts/__init__.py": "",
    "kiln_core/contracts/spec.py": "def check():\n    from kiln_core.engine.run import go\n",
    "kiln_core/engine/__init__.py": "", "kiln_core/engine/run.py": "from kiln_core.contracts.spec import check\n",
    "kiln_core/admission/__init__.py": "", "kiln_core/training/__init__.py": "from kiln_core import storage\n",
    "kiln_core/post_eval/__init__.py": "from kiln_core import admission\nfrom kiln_core import training\n",
    "kiln_core/newthing.py": "from kiln_core.storage import resolve\n",
    "tasks/__init__.py": "", "flows/__init__.py": "", "drills/__init__.py": "",
}


def test_the_package_check_finds_a_planted_cycle_upward_arrows_and_an_unplaced_package(tmp_path):
    _write(tmp_path, PLANTED)
    packages = import_graph.report(tmp_path)["packages"]
    assert packages["package_cycles"] == [["contracts", "engine"]]
    arrows = {(arrow["from"], arrow["to"]): arrow["imports"] for arrow in packages["upward_arrows"]}
    assert arrows == {
        ("contracts", "engine"): [
            {"from": "kiln_core.contracts.spec", "to": "kiln_core.engine.run", "in_function": True}],
        ("kiln_core", "errors"): [{"from": "kiln_core", "to": "kiln_core.errors", "in_function": False}],
    }
    assert packages["unplaced_packages"] == ["newthing"]
    assert packages["orchestrators"] == [{"package": "post_eval", "stages": ["admission", "training"]}]
    assert "engine" not in packages["missing_packages"] and "scoring" in packages["missing_packages"]


def test_the_command_line_fails_on_a_planted_upward_arrow(tmp_path):
    _write(tmp_path, PLANTED)
    done = subprocess.run([sys.executable, str(REPO / "tools" / "import_graph.py"), "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout
    assert "package cycles: 1" in done.stdout and "upward arrows: 2" in done.stdout, done.stdout
    assert "    kiln_core.contracts.spec -> kiln_core.engine.run (in a function)" in done.stdout, done.stdout
    assert "unplaced packages: 1 (add them to KILN_CORE_LAYERS): newthing" in done.stdout, done.stdout


# A training module reaches the engine through string imports only: a literal inside a function, and a
# constant imported from a sibling module at module level; a name chosen at run time cannot be followed.
# The engine's worker imports the training module back.
HIDDEN = {
    "kiln_core/__init__.py": "", "kiln_core/errors.py": "",
    "kiln_core/engine/__init__.py": "", "kiln_core/engine/worker.py": "from kiln_core.training import ray\n",
    "kiln_core/training/__init__.py": "",
    "kiln_core/training/names.py": 'WORKER = "kiln_core.engine.worker"\n',
    "kiln_core/training/ray.py": (
        "import importlib\nfrom kiln_core.training.names import WORKER\n"
        "RUN = importlib.import_module(WORKER)\n"
        "def run(name):\n    importlib.import_module('kiln_core.engine')\n    return importlib.import_module(name)\n"),
    "tasks/__init__.py": "", "flows/__init__.py": "", "drills/__init__.py": "",
}


def test_string_imports_are_followed_counted_and_checked_like_any_import(tmp_path):
    _write(tmp_path, HIDDEN)
    report = import_graph.report(tmp_path)
    assert report["string_imports"] == {
        "followed": [{"from": "kiln_core.training.ray", "to": "kiln_core.engine.worker", "line": 3, "in_function": False},
                     {"from": "kiln_core.training.ray", "to": "kiln_core.engine", "line": 5, "in_function": True}],
        "not_followed": [{"from": "kiln_core.training.ray", "line": 6, "argument": "name"}],
    }
    arrows = {(arrow["from"], arrow["to"]): arrow["imports"] for arrow in report["packages"]["upward_arrows"]}
    assert arrows == {("training", "engine"): [
        {"from": "kiln_core.training.ray", "to": "kiln_core.engine", "in_function": True},
        {"from": "kiln_core.training.ray", "to": "kiln_core.engine.worker", "in_function": False}]}
    # the engine's worker imports that module back: a circle closed at import time by a string
    assert report["circles"] == [{"modules": ["kiln_core.engine.worker", "kiln_core.training.ray"], "import_time": True}]
    done = subprocess.run([sys.executable, str(REPO / "tools" / "import_graph.py"), "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout
    assert "2 followed" in done.stdout and "kiln_core.training.ray:3 -> kiln_core.engine.worker" in done.stdout
    assert "kiln_core.training.ray:6 -> import_module(name) (not followed)" in done.stdout, done.stdout


def test_the_layer_table_places_each_package_once_with_a_reason():
    placed = [package for _, packages, _ in import_graph.KILN_CORE_LAYERS for package in packages]
    assert len(placed) == len(set(placed))
    assert all(why.strip() and "\n" not in why for _, _, why in import_graph.KILN_CORE_LAYERS)
    # The orchestrator is alone at the top, and the root package (a lazy export table) at the bottom.
    assert import_graph.KILN_CORE_LAYERS[-1][1] == (import_graph.ORCHESTRATOR,)
    assert import_graph.KILN_CORE_LAYERS[0][1] == ("kiln_core",)


def test_kiln_core_packages_follow_their_layers(repo_report):
    packages = repo_report["packages"]
    assert packages["package_cycles"] == []
    assert packages["upward_arrows"] == []
    assert packages["unplaced_packages"] == [] and packages["missing_packages"] == []
    assert packages["orchestrators"] == []


def test_no_upward_imports_and_no_prefect_in_the_engine(repo_report):
    assert repo_report["upward_imports"] == []
    assert repo_report["engine_imports_prefect"] == []


def test_no_import_circles(repo_report):
    # Not even a lazy one (an import inside a function) or one through a string import: the engine reaches
    # the launchers, the Ray worker imports the torchrun worker, and neither worker ever reaches the engine.
    circles = [c["modules"] for c in repo_report["circles"]]
    assert circles == [], circles


def test_the_command_line_report():
    done = subprocess.run([sys.executable, str(REPO / "tools" / "import_graph.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout
    assert "package cycles: 0" in done.stdout and "upward arrows: 0" in done.stdout, done.stdout
    assert "circles: 0" in done.stdout and "upward imports: 0" in done.stdout, done.stdout
    assert "kiln_core importing prefect: 0" in done.stdout, done.stdout
    assert "in-function imports in kiln_core:" in done.stdout, done.stdout
    assert "string imports (importlib.import_module, import_module, __import__):" in done.stdout, done.stdout


def test_every_string_import_of_the_checkout_is_counted_and_none_reaches_up(repo_report):
    # The one the Ray worker had (kiln_core.engine.worker through importlib) is gone: it calls the torchrun
    # worker of its own package. What remains picks a module from a table at run time (lazy exports, the CLI's
    # commands, the drills, a recipe's step kinds): listed, not followed.
    strings = repo_report["string_imports"]
    assert strings["followed"] == []
    assert {call["from"] for call in strings["not_followed"]} == {
        "kiln_core", "kiln_core.recipes.recipe_plan", "flows", "flows.cli", "flows.commands.distill", "drills"}
