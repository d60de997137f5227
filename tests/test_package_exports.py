"""``import kiln_core`` is cheap, and every name its front door lists resolves on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kiln_core


@pytest.mark.parametrize("name", sorted(set(kiln_core.__all__) - {"__version__"}))
def test_every_exported_name_resolves(name):
    value = getattr(kiln_core, name)
    assert getattr(value, "__name__", name) == name or not callable(value)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'admit_corpora'"):
        kiln_core.admit_corpora  # noqa: B018


def test_importing_the_package_loads_neither_torch_nor_prefect():
    code = "import sys, kiln_core; kiln_core.OpdConfig; print(sorted({'torch', 'prefect'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
