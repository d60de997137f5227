"""Kiln's distillation recipes (``distill self``, ``distill merge``, ``distill pump``), one module each.

Each module checks its request with Kiln's submit-time rules (``check_<kind>_request``: no file read, no
model loaded), then prepares the run (``prepare_<kind>``: the checks that need files, the teacher work,
and the ``PipelineSpec`` that trains it with ``spec.recipe`` set); training is always
``kiln_core.engine.pipeline.run_pipeline``.
"""
