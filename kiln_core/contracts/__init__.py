"""Pydantic models, one module per wire format Kiln and kiln-flows exchange."""
