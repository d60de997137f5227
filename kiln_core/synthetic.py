"""Synthetic scored corpora: valid by construction, for tests, benches and examples.

Rows carry random but well-formed top-K candidates (unique ids below the student's vocab size,
non-increasing logprobs whose probabilities sum below one) and declare the ``token_id`` of every
target, so a corpus built here is admitted unless a test breaks it on purpose. For real teacher
scores use ``kiln_core.scoring``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from kiln_core.contracts.identity import (
    IDENTITY_SCHEMA,
    KILN_VLLM_PROTOCOL,
    TeacherIdentity,
    build_manifest_line,
)
from kiln_core.tokenization import Conversation, Segment, encode_conversations, load_student_tokenizer

_WORDS = (
    "the quick brown fox jumps over lazy dog file src main list answer two plus four "
    "hello world python json directory recursive true false read write error ok done"
).split()


def synthetic_identity(student_dir: str | Path, *, max_top_k: int = 32, served_model_id: str = "synthetic-teacher") -> TeacherIdentity:
    """A valid teacher identity bound to the student's vocabulary (digests of a pretend teacher)."""
    student = load_student_tokenizer(student_dir)
    identity = student.identity()
    return TeacherIdentity(
        schema=IDENTITY_SCHEMA,
        protocol=KILN_VLLM_PROTOCOL,
        served_model_id=served_model_id,
        base_model_sha256="1" * 64,
        tokenizer_vocab_sha256=identity["tokenizer_vocab_sha256"],
        tokenizer_config_sha256=identity["tokenizer_config_sha256"],
        adapter=None,
        vocab_size=student.vocab_size,
        max_top_k=max(max_top_k, 1),
        max_model_len=32768,
        max_prompt_logprob_candidates=1_000_000,
        logprobs_mode="raw_logprobs",
        implementation="vllm:0.20.1",
        inference_config_sha256="2" * 64,
    )


def synthetic_example(rng: random.Random, *, words: int = 8, trajectory: bool = False, index: int = 0) -> dict[str, Any]:
    """An unscored example record (messages, teacher_response, optional trajectory)."""
    question = " ".join(rng.choice(_WORDS) for _ in range(words))
    answer = " ".join(rng.choice(_WORDS) for _ in range(words))
    record: dict[str, Any] = {
        "id": f"example-{index:05d}",
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}],
        "teacher_response": answer,
    }
    if trajectory:
        record["trajectory"] = [
            {"role": "assistant", "content": answer, "kind": "action", "tool_call_id": "call-1"},
            {"role": "tool", "content": "warning: " + question, "kind": "observation", "tool_call_id": "call-1",
             "warning_prefix_len": 9},
            {"role": "assistant", "content": "done " + answer, "kind": "action"},
        ]
    return record


def score_synthetically(record: dict[str, Any], targets: np.ndarray, *, top_k: int, vocab_size: int, rng: np.random.Generator) -> dict[str, Any]:
    """Attach random valid ``teacher_tokens`` for the given target ids."""
    tokens = []
    for target in targets.tolist():
        others = rng.choice(vocab_size - 1, size=top_k - 1, replace=False)
        others = others + (others >= target)  # skip the target itself
        ids = [int(target)] + [int(x) for x in others]
        logits = np.sort(rng.normal(0.0, 2.0, size=top_k))[::-1]
        logprobs = logits - np.log(np.exp(logits).sum()) - float(rng.uniform(0.01, 1.0))
        candidates = [{"token_id": i, "logprob": float(np.float32(lp))} for i, lp in zip(ids, logprobs)]
        tokens.append({"token_id": int(target), "logprob": candidates[0]["logprob"], "top_logprobs": candidates})
    return {**record, "teacher_tokens": tokens}


def synthesize_corpus(
    student_dir: str | Path,
    path: str | Path,
    *,
    n_examples: int = 8,
    top_k: int = 32,
    seed: int = 0,
    manifest_line: str | None = "auto",
    trajectory_every: int = 0,
    words: int = 8,
    target_bytes: int | None = None,
) -> Path:
    """Write a valid scored corpus for ``student_dir``.

    Args:
        student_dir: The student the corpus is admitted for.
        path: Output JSONL path.
        n_examples: Number of examples (ignored when ``target_bytes`` is set).
        top_k: Candidates per teacher token.
        seed: Seed for the text and the scores.
        manifest_line: ``"auto"`` for a synthetic identity's manifest, a manifest line, or None.
        trajectory_every: Every n-th example uses a trajectory with action and observation segments.
        words: Words per question and answer.
        target_bytes: Keep adding examples until the file reaches this size.

    Returns:
        The output path.
    """
    student = load_student_tokenizer(student_dir)
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    if manifest_line == "auto":
        manifest_line = build_manifest_line(synthetic_identity(student_dir, max_top_k=max(top_k, 32)))
    out = Path(path)
    size = 0
    with out.open("w", encoding="utf-8") as handle:
        if manifest_line is not None:
            handle.write(manifest_line + "\n")
            size += len(manifest_line) + 1
        index = 0
        batch = 64
        while (target_bytes is None and index < n_examples) or (target_bytes is not None and size < target_bytes):
            count = batch if target_bytes is not None else min(batch, n_examples - index)
            records = [
                synthetic_example(rng, words=words, index=index + j,
                                  trajectory=bool(trajectory_every) and (index + j) % trajectory_every == 0)
                for j in range(count)
            ]
            encoded = encode_conversations(student, [_conversation(r) for r in records])
            for record, enc in zip(records, encoded):
                scored = score_synthetically(
                    record, enc.input_ids[enc.action_positions], top_k=top_k, vocab_size=student.vocab_size, rng=np_rng
                )
                line = json.dumps(scored, ensure_ascii=False, separators=(",", ":"))
                handle.write(line + "\n")
                size += len(line.encode("utf-8")) + 1
                if target_bytes is not None and size >= target_bytes:
                    break
            index += count
    return out


def _conversation(record: dict[str, Any]) -> Conversation:
    trajectory = record.get("trajectory")
    segments = None
    if trajectory:
        segments = [
            Segment(s["role"], s["content"], s.get("kind", "context"), s.get("tool_call_id"), s.get("warning_prefix_len", 0))
            for s in trajectory
        ]
    return Conversation(messages=record["messages"], teacher_response=record["teacher_response"], trajectory=segments)
