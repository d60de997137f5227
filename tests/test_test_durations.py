"""tools/test_durations.py: the per-file seconds that order a parallel run (longest file first)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_tool():
    spec = importlib.util.spec_from_file_location("test_durations_tool", REPO / "tools" / "test_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seconds_are_summed_per_file_and_a_test_class_counts_for_its_file(tmp_path):
    report = tmp_path / "run.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_fast_tier" name="a" time="1.25"/>'
        '<testcase classname="tests.test_fast_tier" name="b" time="0.75"/>'
        '<testcase classname="tests.fault_drills.test_drills.SomeClass" name="c" time="3.5"/>'
        '<testcase classname="elsewhere.test_gone" name="d" time="9"/>'
        '</testsuite></testsuites>', encoding="utf-8")
    assert load_tool().file_seconds(report) == {"tests/test_fast_tier.py": 2.0, "tests/fault_drills/test_drills.py": 3.5}


def test_the_committed_record_names_test_files_with_seconds():
    record = json.loads((REPO / "tests" / "test_durations.json").read_text(encoding="utf-8"))
    assert record and all(name.startswith("tests/") and name.endswith(".py") and seconds >= 0
                          for name, seconds in record.items())
    assert list(record.values()) == sorted(record.values(), reverse=True)  # longest first, as the tool writes it
