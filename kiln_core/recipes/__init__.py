"""Kiln's distillation recipes (``distill self``, ``distill merge``, ``distill pump``): one module per recipe, each
with ``check_<kind>_request`` (Kiln's submit-time rules, reading no file) and ``prepare_<kind>`` (the checks that
need files, the teacher work, and the ``PipelineSpec`` that trains it through the one engine path)."""
