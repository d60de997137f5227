"""Kiln's identities of the teacher side of the training data: capabilities and content revision.

Recomputed on resume and compared, so they must be byte-for-byte what Kiln computes.
``fixture_content_revision`` is ``teacher_content_revision``: a pre-scored corpus is a
``FixtureLogitSource`` and its revision digests every scored row (``logit_source.rs``
``FixtureLogitSource::authoritative_content_revision``): declaration-order JSON of
``{schema, capabilities, top_k, rows}``, rows sorted by the exact token sequence then by logits row.

The prompt-list digest (``data.content_sha256``) is computed at admission: ``kiln_core.kiln_prompts``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from kiln_core.corpus import CorpusTables

__all__ = ["teacher_capabilities", "fixture_content_revision", "prepared_source_order_sha256"]

FIXTURE_SCHEMA = "kiln.fixture-logit-source.v1"


# ---------------------------------------------------------------------------------------------
# Teacher capabilities and content revision


def teacher_capabilities(teacher_alias: str, vocab_size: int, top_k: int, tokenizer_hash: str | None) -> dict[str, Any]:
    """``LogitSourceCaps`` of the fixture Kiln builds for a pre-scored corpus, in declaration order.

    Kiln's server passes the request's teacher alias, the student model's ``vocab_size`` and the
    effective top-K; binding a manifest identity sets ``tokenizer_hash`` to its raw
    ``tokenizer_vocab_sha256`` (``logit_source.rs`` ``with_authoritative_identity``).
    """
    return {"teacher_id": teacher_alias, "vocab_size": int(vocab_size), "max_top_k": int(top_k),
            "supports_full_vocab": False, "supports_batched": True, "tokenizer_hash": tokenizer_hash}


def corpus_content_revision(corpus: Any, capabilities: dict[str, Any]) -> str:
    """The teacher content revision of a corpus: ``fixture_content_revision`` of its tables, or for a set
    of shards (``kiln_core.corpus_set.ShardedCorpus``) each shard's, combined in set order (a set of one
    shard has that shard's revision). One shard is read at a time."""
    from kiln_core.corpus_set import ShardedCorpus, combined_revision

    if isinstance(corpus, ShardedCorpus):
        return combined_revision([fixture_content_revision(tables, capabilities) for tables in corpus.shards()])
    return fixture_content_revision(corpus, capabilities)


def fixture_content_revision(tables: CorpusTables, capabilities: dict[str, Any]) -> str:
    """``sha256:`` revision of every scored row of ``tables`` (Kiln's ``FixtureLogitSource``).

    Examples with the same token sequence share one entry, as in Kiln's map keyed by the sequence.
    """
    by_sequence: dict[tuple[int, ...], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for example in tables:
        rows = by_sequence.setdefault(tuple(int(t) for t in example.input_ids), {})
        bits = example.teacher_logprobs.astype(np.float32).view(np.uint32)
        for position, ids, row_bits in zip((example.action_positions - 1).tolist(), example.teacher_ids, bits):
            rows.setdefault(position, (ids, row_bits))
    digest = hashlib.sha256()
    top_k = int(tables.top_k)
    caps = json.dumps(capabilities, ensure_ascii=False, separators=(",", ":"))
    digest.update(f'{{"schema":"{FIXTURE_SCHEMA}","capabilities":{caps},"top_k":{top_k},"rows":['.encode())
    first = True
    for tokens in sorted(by_sequence):
        token_json = ("[" + ",".join(map(str, tokens)) + "]").encode()
        for position in sorted(by_sequence[tokens]):
            ids, bits = by_sequence[tokens][position]
            digest.update(b'{"tokens":' if first else b',{"tokens":')
            first = False
            digest.update(token_json)
            digest.update(f',"position":{position},"indices":[{",".join(map(str, ids.tolist()))}],'
                          f'"logprob_bits":[{",".join(map(str, bits.tolist()))}]}}'.encode())
    digest.update(b"]}")
    return "sha256:" + digest.hexdigest()


def prepared_source_order_sha256(indices: list[int]) -> str:
    """``sha256:`` of the compact JSON array of prepared source indices (``opd.rs``)."""
    return "sha256:" + hashlib.sha256(("[" + ",".join(map(str, indices)) + "]").encode()).hexdigest()
