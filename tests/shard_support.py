"""Writing a set of shards cut from one corpus file, for the tests of sets (test_corpus_set, test_shard_training)."""

from __future__ import annotations

from pathlib import Path


def write_file(path: Path, lines: list[str]) -> Path:
    """``lines`` as a JSONL file, each ending in a newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_set(directory: Path, corpus_lines: list[str], cuts: tuple[int, ...]) -> Path:
    """Shards ``part-00.jsonl``, ``part-01.jsonl``, … of ``cuts[i]`` examples each, in file order, each
    starting with the corpus's manifest line (its first line)."""
    manifest, examples = corpus_lines[0], corpus_lines[1:]
    start = 0
    for number, count in enumerate(cuts):
        write_file(directory / f"part-{number:02d}.jsonl", [manifest, *examples[start:start + count]])
        start += count
    return directory
