"""The import graph (``tools/import_graph.py``): layers point one way, and no circles.

The tool is checked on a small synthetic tree first (it finds a planted circle, a lazy one, and an
upward import), then run on this checkout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import import_graph  # noqa: E402

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


def test_no_upward_imports_and_no_prefect_in_the_engine():
    report = import_graph.report(REPO)
    assert report["upward_imports"] == []
    assert report["engine_imports_prefect"] == []


def test_no_import_circles():
    # Not even a lazy one (an import inside a function): the torchrun worker reaches the engine through
    # the request preparation, the engine reaches the launcher, and the launcher never the worker.
    circles = [c["modules"] for c in import_graph.report(REPO)["circles"]]
    assert circles == [], circles


def test_the_command_line_report():
    done = subprocess.run([sys.executable, str(REPO / "tools" / "import_graph.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout
    assert "circles: 0" in done.stdout and "upward imports: 0" in done.stdout, done.stdout
    assert "kiln_core importing prefect: 0" in done.stdout, done.stdout
