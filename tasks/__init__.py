"""Thin Prefect ``@task`` wrappers over ``kiln_core``, one module per pipeline stage.

Tasks take and return small pydantic refs (URIs, ``sha256:`` digests, counts); tables, tensors and
checkpoints never travel as Prefect results.
"""
