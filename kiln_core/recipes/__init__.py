"""Kiln's distillation recipes, one module per recipe (``distill_self``, ``distill_merge``, ``distill_pump``, the
``opd`` step of a recipe file) with two functions each: ``check_<kind>_request`` (Kiln's submit-time rules, no file
read, no model loaded) and ``prepare_<kind>`` (the checks that need files, the teacher work, and the
``PipelineSpec`` that ``kiln_core.engine.pipeline.run_pipeline`` trains, carrying its ``RecipeRecord``); and the
recipe-file runner's plan (``recipe_plan``), run record (``recipe_run``) and catalogue (``catalog``).
"""
