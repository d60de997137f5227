"""Rebuild ``tests/test_durations.json``: how long each test file takes, so parallel runs start the long ones.

``python -m pytest`` runs on 2 workers and hands out whole files (``--dist loadfile``). When a long file
(Ray worker groups, SIGKILL drills, the real model) starts last, the run ends with one worker busy and the
other idle for minutes. ``tests/conftest.py`` therefore orders files longest first by the seconds recorded
here (a file missing from the record is placed by its count of slow tests). The record only orders the
run: a stale one costs minutes, never a wrong result.

    $ python -m pytest --junitxml=run.xml       # a full run (pytest's own per-test times: setup+call+teardown)
    $ python tools/test_durations.py run.xml    # writes tests/test_durations.json

Rebuild it after adding or slowing down a long test file.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "test_durations.json"


def file_seconds(junit_xml: Path) -> dict[str, float]:
    """Seconds per test file (``tests/...py``) summed over its test cases in a pytest JUnit XML report."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        classname = case.get("classname", "")  # "tests.fault_drills.test_drills" (+ ".Class" for methods)
        parts = classname.split(".")
        while parts and not (REPO / Path(*parts)).with_suffix(".py").is_file():
            parts.pop()  # drop a test class name
        if parts:
            seconds[Path(*parts).with_suffix(".py").as_posix()] += float(case.get("time") or 0.0)
    return dict(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_xml", type=Path, help="a full run's report: python -m pytest --junitxml=FILE")
    args = parser.parse_args(argv)
    seconds = file_seconds(args.junit_xml)
    if not seconds:
        parser.error(f"{args.junit_xml} holds no test cases of this repository")
    ordered = dict(sorted(((name, round(value, 1)) for name, value in seconds.items()), key=lambda kv: (-kv[1], kv[0])))
    RECORD.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")
    print(f"{len(ordered)} files, {sum(ordered.values()):.0f} s in all, written to {RECORD.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
