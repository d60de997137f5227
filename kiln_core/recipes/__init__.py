"""Kiln's distillation recipes (``distill self``, ``distill merge``, ``distill pump``), one module each.

Every recipe module offers ``check_<kind>_request`` (Kiln's submit-time rules: no file read, no model
loaded) and ``prepare_<kind>`` (the checks that need files, the teacher work, and the ``PipelineSpec``
that trains the result, its ``recipe`` record set). Training then always goes through
``kiln_core.engine.pipeline.run_pipeline``, from the CLI (``kiln-flows distill <recipe>``) and from the
flows alike.
"""
