"""The fast tier (``python -m pytest -m fast``) keeps every product module in it.

``tests/conftest.py`` decides which tests are fast; ``tests/fast_tier_map.json`` (rebuilt with coverage by
``tools/fast_tier_map.py``) records, per module of ``kiln_core``, ``tasks``, ``flows`` and ``drills``, fast
test files that run code inside its functions. Checked here without coverage: every module is in the map,
every file the map names still holds fast tests, and a module listed with no file has no function to
run. A new module, a test moved out of the tier or a test file deleted fails this test until the map is
rebuilt, so the tier cannot lose a module without anyone noticing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import fast_tier_map  # noqa: E402

RECORDED = json.loads((REPO / "tests" / "fast_tier_map.json").read_text(encoding="utf-8"))
REBUILD = "rebuild it: python tools/fast_tier_map.py (needs coverage)"


def fast_tests() -> set[str]:
    """The node ids ``-m fast`` selects, from pytest's own collection (the documented command)."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "fast", "-p", "no:cacheprovider", "-n", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    return {line for line in listed.stdout.splitlines() if "::" in line}


# Modules no fast test reaches yet (none today). The list may only shrink: a module added to it is a module
# the tier lost.
KNOWN_GAPS: frozenset[str] = frozenset()  # every product module is exercised by the fast tier


def test_every_product_module_is_in_the_map():
    modules = fast_tier_map.product_modules()
    unmapped = set(modules) - set(RECORDED)
    assert sorted(unmapped - KNOWN_GAPS) == [], f"modules no fast test exercises (or new ones); {REBUILD}"
    assert sorted(KNOWN_GAPS - unmapped) == [], "a known gap is now covered: take it off KNOWN_GAPS"
    assert sorted(set(RECORDED) - set(modules)) == [], f"tests/fast_tier_map.json names modules that are gone; {REBUILD}"
    with_functions_but_no_test = [name for name, files in RECORDED.items()
                                  if not files and fast_tier_map.function_body_lines(modules[name])]
    assert with_functions_but_no_test == [], f"no fast test exercises these modules; {REBUILD}"


def test_every_file_in_the_map_holds_fast_tests_and_every_representative_exists():
    from conftest import FAST_REPRESENTATIVES, NOT_FAST

    fast = fast_tests()
    files = {node.split("::")[0] for node in fast}
    assert "tests/test_fast_tier.py" in files  # this check runs in the tier it guards
    named = {file for files in RECORDED.values() for file in files}
    assert sorted(named - files) == [], f"tests/fast_tier_map.json names files without fast tests; {REBUILD}"
    bases = fast | {node.split("[", 1)[0] for node in fast}
    assert sorted(FAST_REPRESENTATIVES - bases) == [], "conftest.FAST_REPRESENTATIVES names tests that do not exist"
    if NOT_FAST:  # names of tests kept out of the tier must name tests that exist
        listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0",
                                 *sorted(NOT_FAST)], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert listed.returncode == 0, f"conftest.NOT_FAST names tests that do not exist:\n{listed.stdout[-3000:]}"
