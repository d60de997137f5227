"""Training: the student losses (``loss``), and later the train step, optimizer and checkpoint glue.

Submodules import torch; this package file imports nothing so that ``import kiln_core.training``
stays cheap for callers that only need a submodule name.
"""
