"""``<run>/adapter/replay.jsonl``: the prompts an adapter trained on, beside it, in the form Kiln's merge reads.

Kiln's ``distill_merge`` learns a source LoRA's prompts from ``replay.jsonl`` in that adapter's directory
(``training_queue.rs`` · ``derive_source_prompts``: each line's ``request_body`` or the whole line, then its arrays ``examples`` and
``prompts``, each element's ``messages``). ``run_pipeline`` writes one for every run that trained successfully,
right after training and before the gate, so every published adapter can be a merge source
(``kiln_core.teachers.replay.read_replay_prompts`` reads it back).

One line per training example, in training-file order (a set of shards: every shard in set order)::

    {"prompts":[{"messages":[...]}]}

* an off-policy corpus row: its ``messages`` plus its ``teacher_response`` as the final assistant message
  (the assistant turn the student trained on); the manifest line and blank lines are not examples;
* an on-policy prompt: its ``messages`` (teacher-only context and trajectories are not the student's prompt).

Messages are written as Kiln re-serializes them (``role``, ``content`` as text, the optional ``tool_calls`` /
``name`` / ``tool_call_id``; ``kiln_core.contracts.opd_prompt.kiln_prompt_value``), each line compact JSON
with keys sorted as serde_json writes a ``Value`` (``serde_json_text``), UTF-8, ``\\n`` after every line.

The data is read from what the run trained on: the corpus bytes admission digested (checked against the run's
``dataset_sha256`` while they stream, so a corpus rewritten since is refused, not half-described) or the
prompt file (checked against its prompt-list digest). The log is written streaming into a temp file and
published atomically (``AtomicFile``): a reader sees the whole log or none.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

from kiln_core.admission.parsed import RUST_WHITESPACE
from kiln_core.contracts.stage_refs import CorpusRef, TrainRef
from kiln_core.errors import EnvironmentFailure
from kiln_core.serde_json import serde_json_text
from kiln_core.storage import AtomicFile, Location, resolve

__all__ = ["REPLAY_FILE", "corpus_row_messages", "replay_line", "write_replay_log"]

REPLAY_FILE = "replay.jsonl"
_READ_BYTES = 1024 * 1024


def replay_line(messages: list[dict[str, Any]]) -> bytes:
    """One ``replay.jsonl`` line for one prompt's messages, ``\\n`` included.

    Example:
        >>> replay_line([{"role": "user", "content": "hi"}])
        b'{"prompts":[{"messages":[{"content":"hi","role":"user"}]}]}\\n'
    """
    return (serde_json_text({"prompts": [{"messages": messages}]}) + "\n").encode("utf-8")


def _kiln_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as Kiln re-serializes them; what does not parse as a chat message is kept as given (Kiln's
    reader then drops it), which admission makes rare."""
    from pydantic import ValidationError

    from kiln_core.contracts.opd_prompt import OpdPrompt, kiln_prompt_value

    try:
        return kiln_prompt_value(OpdPrompt.model_validate({"messages": messages}))["messages"]
    except (ValidationError, ValueError):
        return list(messages) if isinstance(messages, list) else []


def corpus_row_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompt a corpus row trained on: its ``messages`` plus ``teacher_response`` as the assistant's turn.

    Example:
        >>> corpus_row_messages({"messages": [{"role": "user", "content": "2+2?"}], "teacher_response": "4"})
        [{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4'}]
    """
    return _kiln_messages(record.get("messages")) + [{"role": "assistant", "content": record.get("teacher_response")}]


def _corpus_lines(location: Location, expected_sha256: str) -> Iterator[bytes]:
    """Replay lines of one admitted corpus file, streamed; refuses bytes that are not the admitted ones."""
    from kiln_core.contracts.identity import MANIFEST_SCHEMA

    digest = hashlib.sha256()
    pending = b""
    with location.fs.open(location.path, "rb") as handle:
        while True:
            block = handle.read(_READ_BYTES)
            digest.update(block)
            lines = (pending + block).split(b"\n")
            pending = lines.pop() if block else b""
            for raw in lines:
                text = raw.decode("utf-8").strip(RUST_WHITESPACE)  # blank: admission's rule
                if not text:
                    continue
                record = json.loads(text)
                if isinstance(record, dict) and record.get("schema") != MANIFEST_SCHEMA:
                    yield replay_line(corpus_row_messages(record))
            if not block:
                break
    if "sha256:" + digest.hexdigest() != expected_sha256:
        raise EnvironmentFailure("corpus_changed", f"{location.uri} is no longer the corpus the run trained on "
                                 f"({expected_sha256}); its replay log was not written", file=location.uri)


def _training_lines(corpus: CorpusRef) -> Iterator[bytes]:
    """Every replay line of the run's training data, in training order."""
    if corpus.kind == "prompts":
        from kiln_core.contracts.opd_prompt import kiln_prompt_value, prompts_content_sha256
        from kiln_core.on_policy.prompt_file import read_prompt_file

        prompts = read_prompt_file(corpus.uri).prompts
        if "sha256:" + prompts_content_sha256(prompts) != corpus.dataset_sha256:
            raise EnvironmentFailure("corpus_changed", f"{corpus.uri} no longer holds the prompts the run trained on "
                                     f"({corpus.dataset_sha256}); its replay log was not written", file=corpus.uri)
        for prompt in prompts:
            yield replay_line(kiln_prompt_value(prompt)["messages"])
        return
    if corpus.kind == "shard_set":
        from kiln_core.admission.shard_sources import training_files
        from kiln_core.corpus_set import ShardedCorpus

        digests = [shard.dataset_sha256 for shard in ShardedCorpus.open(corpus.uri).record.shards]
        files = [uri for uri, _ in training_files(corpus.source_uri)]
        if len(files) != len(digests):
            raise EnvironmentFailure("corpus_changed", f"{corpus.source_uri} holds {len(files)} shards, the run trained "
                                     f"on {len(digests)}; its replay log was not written", file=corpus.source_uri)
        for uri, digest in zip(files, digests):
            yield from _corpus_lines(resolve(uri), digest)
        return
    yield from _corpus_lines(resolve(corpus.source_uri), corpus.dataset_sha256)


def write_replay_log(trained: TrainRef, corpus: CorpusRef) -> str | None:
    """Write ``replay.jsonl`` into a successful run's adapter directory; returns its URI (None: nothing to do).

    A run found finished (``trained.reused``) keeps the log it has; one whose log is missing (an attempt that
    stopped between training and this write) gets it now.

    Args:
        trained: The training stage's result (``adapter_uri`` is the adapter directory).
        corpus: What the run trained on (``CorpusRef``: a corpus, a set of shards, or a prompt file).

    Raises:
        EnvironmentFailure: ``corpus_changed`` when the training data is no longer the bytes the run trained
            on (nothing is written).

    Example:
        >>> write_replay_log(trained, ready.corpus)  # doctest: +SKIP
        '/abs/kiln-data/runs/demo/3f2a9c0d1e2b4a5c/adapter/replay.jsonl'
    """
    if trained.status != "success" or trained.adapter_uri is None:
        return None
    adapter = resolve(trained.adapter_uri)
    target = adapter.child(REPLAY_FILE)
    if trained.reused and (target.exists() or not adapter.child("adapter_model.safetensors").exists()):
        return None
    with AtomicFile(target) as out:
        for line in _training_lines(corpus):
            out.handle.write(line)
        return out.commit()
