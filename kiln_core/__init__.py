"""kiln_core: the engine behind kiln-flows.

Kiln-compatible contracts, canonical hashing, tokenization and masks, corpus admission and
materialization, teacher identity and scoring, training, checkpoints, receipts and the Hugging Face
next-token oracle. Nothing in this package imports Prefect; heavy libraries (torch, transformers) are
imported inside the functions that need them so that importing a contract stays cheap.
"""

__version__ = "0.1.0"
