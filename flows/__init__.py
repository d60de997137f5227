"""Prefect flows of kiln-flows.

Flows are imported lazily so that ``flows.cli`` and ``kiln-flows <command> --help`` never pay for
importing Prefect or torch. Import a flow from its module (``from flows.opd_distill import opd_distill``,
the form deployments use): ``from flows import opd_distill`` gives the flow only until the module of the
same name is imported, after which Python binds that name to the module.

Flow modules avoid ``from __future__ import annotations``: Prefect builds each flow's parameter
schema from the real annotations, also in the child processes that ``serve`` and workers start.
"""

from __future__ import annotations

import importlib
from typing import Any

_FLOW_MODULES = {
    "opd_distill": "flows.opd_distill",
    "score_corpus": "flows.score_corpus",
    "validate_corpus": "flows.validate_corpus",
    "hf_next_token_oracle": "flows.oracle",
    "demo": "flows.demo",
    "distill_merge": "flows.distill_merge",
    "train_stage": "flows.train_stage",
    "distill_pump": "flows.distill_pump",
    "run_recipe": "flows.recipe",
    "distill_self": "flows.distill_self",
}

__all__ = sorted(_FLOW_MODULES)


def __getattr__(name: str) -> Any:
    if name in _FLOW_MODULES:
        return getattr(importlib.import_module(_FLOW_MODULES[name]), name)
    raise AttributeError(f"module 'flows' has no attribute {name!r}")
