"""Shared by the gate and watch tests: a tiny training corpus, a disjoint held-out corpus, the manifest.

Both corpora are synthesized for the tiny student by the same synthetic teacher, so they carry the
same manifest line (the held-out rules accept them) and share no prompt (different seeds).
"""

from __future__ import annotations

from pathlib import Path

from kiln_core.synthetic import synthesize_corpus


def training_and_held_out(student, directory: Path) -> Path:
    """``corpus.jsonl`` (4 examples), ``heldout.jsonl`` (3) and ``manifest.jsonl`` in ``directory``."""
    synthesize_corpus(student, directory / "corpus.jsonl", n_examples=4, top_k=16, seed=0)
    synthesize_corpus(student, directory / "heldout.jsonl", n_examples=3, top_k=16, seed=11)
    manifest = (directory / "corpus.jsonl").read_text().splitlines()[0]
    assert (directory / "heldout.jsonl").read_text().splitlines()[0] == manifest
    (directory / "manifest.jsonl").write_text(manifest + "\n")
    return directory
