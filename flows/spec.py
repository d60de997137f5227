"""The pipeline spec, under the name the flows and the CLI use (``from flows.spec import PipelineSpec``).

The contract itself lives below the Prefect layer, in ``kiln_core.contracts.pipeline``, so that the
engine and the tasks can use it without importing ``flows``.
"""

from kiln_core.contracts.pipeline import (
    DistributedOptions,
    PipelineSpec,
    RunOptions,
    SpecError,
    TeacherSource,
    TrainingData,
    parse_spec,
)
from kiln_core.contracts.spec_file import load_spec

__all__ = ["DistributedOptions", "PipelineSpec", "RunOptions", "SpecError", "TeacherSource", "TrainingData",
           "load_spec", "parse_spec"]
