"""How ``kiln-flows score --shard-size`` splits examples into shards (``kiln_core.scoring.shards`` scores them).

Before the teacher runs, every example is tokenized (the admission mask builder, as when scoring) and
given an *upper bound* on the bytes of its scored row: everything in the row is known exactly from the input and the student's tokenizer — the copied fields, each target's
token text and id — except the logprobs, each counted at ``MAX_LOGPROB_CHARS`` (the longest ``repr``
of an f32 held in a Python float) and each candidate id at the digits of ``vocab_size - 1``. Shards
are filled greedily in example order: an example goes into the current shard unless the shard's
manifest line plus its examples' bounds would pass ``shard_size``; then the shard is closed and the
next begins. The split therefore follows from the examples, the student, the teacher's manifest, K and
the size alone (a rerun makes the same split before scoring anything), and no shard can exceed the
size whatever the teacher answers. The price: shards come out some 10-15 % under the size, since real
logprobs print shorter than the bound. An example whose bound alone does not fit is refused
(``row_exceeds_shard_size``, naming its line).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from kiln_core.contracts.corpus_shards import DIRECTORY_INDEX
from kiln_core.scoring.examples import ScoringError, batched, iter_examples
from kiln_core.scoring.requests import encode_requests, sequence_key

__all__ = ["INDEX_NAME", "KILN_MAX_SHARD_BYTES", "MAX_LOGPROB_CHARS", "PLAN_FORMAT", "STATE_DIR", "ShardPlan", "SetPlan",
           "check_existing_set", "file_sha256", "parse_shard_size", "plan_set", "row_size_bound", "shard_dependencies"]

KILN_MAX_SHARD_BYTES = 64 * 1024 * 1024
"""Kiln admits corpora of at most 64 MiB (Kiln's docs/OPD_TEACHER_JSONL.md); every shard must be one."""
MAX_LOGPROB_CHARS = 24
"""Characters ``repr(float(np.float32(x)))`` can take: sign, 17 significant digits, point, ``e-45``."""
PLAN_FORMAT = "kiln-flows.scored-set-plan.v1"
STATE_DIR = ".kiln-flows-score"
INDEX_NAME = DIRECTORY_INDEX  # the name a directory of shards is read through (admission)
_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
_SIZE_TEXT = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_shard_size(value: int | str) -> int:
    """Bytes from ``64MiB``, ``500KiB``, ``1GiB``, ``4096`` (units binary, case ignored); at most 64 MiB.

    Raises:
        ScoringError: ``invalid_option`` for text that is no size, a size of zero, or one above 64 MiB.

    Example:
        >>> parse_shard_size("64MiB"), parse_shard_size("500KiB"), parse_shard_size(4096)
        (67108864, 512000, 4096)
    """
    if isinstance(value, bool):
        raise ScoringError("invalid_option", f"--shard-size must be a size such as 64MiB, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_TEXT.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ScoringError("invalid_option", f"--shard-size {value!r} is not a size: give bytes or a number with "
                                                 f"KiB, MiB or GiB (e.g. 64MiB)")
        size = int(match.group(1)) * _UNITS[unit]
    if size < 1:
        raise ScoringError("invalid_option", f"--shard-size must be positive, got {value!r}")
    if size > KILN_MAX_SHARD_BYTES:
        raise ScoringError("invalid_option", f"--shard-size {value!r} ({size} bytes) is above 64 MiB: each shard "
                                             f"must be a file Kiln admits on its own (at most 64 MiB)")
    return size


# --- the split ------------------------------------------------------------------------------------------


def row_size_bound(head: str, target_texts: list[str], target_ids: list[int], top_k: int, vocab_size: int) -> int:
    """An upper bound on the bytes of one scored row, newline included (``writer.teacher_tokens_json``'s layout).

    Args:
        head: ``writer.row_head(record)``, exact.
        target_texts: Each target's ``token`` as JSON text (``json.dumps(text, ensure_ascii=False)``), exact.
        target_ids: Each target's token id, exact.
        top_k: Candidates per target.
        vocab_size: The logit width; candidate ids have at most the digits of ``vocab_size - 1``.

    Example:
        >>> row_size_bound('{"teacher_tokens":', ['"a"'], [5], 1, 10) >= len(
        ...     '{"teacher_tokens":[{"token":"a","token_id":5,"logprob":-0.5,"top_logprobs":'
        ...     '[{"token_id":5,"logprob":-0.5}]}]}\\n')
        True
    """
    id_chars = len(str(max(vocab_size - 1, 0)))
    candidate = len('{"token_id":') + id_chars + len(',"logprob":') + MAX_LOGPROB_CHARS + len("}")
    candidates = top_k * candidate + max(top_k - 1, 0)
    fixed = (len('{"token":') + len(',"token_id":') + len(',"logprob":') + MAX_LOGPROB_CHARS
             + len(',"top_logprobs":[') + candidates + len("]}"))
    targets = sum(len(text.encode("utf-8")) + len(str(i)) + fixed for text, i in zip(target_texts, target_ids))
    array = len("[]") + max(len(target_ids) - 1, 0) + targets
    return len(head.encode("utf-8")) + array + len("}\n")


@dataclass(frozen=True)
class ShardPlan:
    """One shard of the split: which examples it holds and what it is called."""

    number: int
    name: str
    first: int
    """Index of its first example in the whole set (0-based)."""
    count: int
    first_line: int
    last_line: int
    action_tokens: int

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "first_line": self.first_line, "last_line": self.last_line,
                "examples": self.count, "action_tokens": self.action_tokens}


@dataclass(frozen=True)
class SetPlan:
    """The whole split, and ``plan.json``'s bytes (the inputs and the shards) that a rerun must match."""

    shards: list[ShardPlan]
    keys: list[bytes]
    """Each example's sequence key, in set order (duplicates share one)."""
    first_shard: dict[bytes, int]
    """The shard each sequence key first appears in."""
    plan_json: bytes
    plan_sha256: str


def plan_set(examples_uri, student, binding, top_k, shard_size, inputs, batch_size, storage_options) -> SetPlan:
    """Tokenize every example, bound its row and split the set (see the module docstring).

    Args:
        examples_uri: The examples file (already validated by ``count_examples``).
        student: The student's ``StudentTokenizer``.
        binding: The teacher's binding (its manifest line starts every shard; its ``max_model_len`` applies).
        top_k: Candidates per target.
        shard_size: Bytes a shard may take, manifest line included.
        inputs: What decided the scored bytes, recorded in ``plan.json``.
        batch_size: Examples tokenized at once.
        storage_options: fsspec options for the examples.

    Raises:
        ScoringError: ``row_exceeds_shard_size`` naming the line, ``invalid_option`` for a size smaller than
            the manifest line, or any refusal of the mask builder.
    """
    from kiln_core.scoring.writer import TokenTexts, row_head

    token_text = TokenTexts(student.tokenizer)
    manifest_bytes = len(binding.manifest_line.encode("utf-8")) + 1
    capacity = shard_size - manifest_bytes
    if capacity <= 0:
        raise ScoringError("invalid_option", f"--shard-size {shard_size} cannot hold even the manifest line "
                                             f"({manifest_bytes} bytes) that starts every shard")
    shards: list[ShardPlan] = []
    keys: list[bytes] = []
    first_shard: dict[bytes, int] = {}
    current: list[tuple[int, int, int]] = []  # (set index, line, action tokens) of the open shard's examples
    used = 0

    def close() -> None:
        number = len(shards)
        shards.append(ShardPlan(number, f"shard-{number:05d}.jsonl", current[0][0], len(current), current[0][1],
                                 current[-1][1], sum(tokens for _, _, tokens in current)))

    for batch in batched(iter_examples(examples_uri, storage_options), batch_size):
        requests = encode_requests(student, batch, binding.identity.max_model_len)
        for example, request in zip(batch, requests):
            targets = request.input_ids[request.positions].tolist()
            texts = [json.dumps(token_text(t), ensure_ascii=False) for t in targets]
            bound = row_size_bound(row_head(example.record), texts, targets, top_k, student.vocab_size)
            if bound > capacity:
                raise ScoringError(
                    "row_exceeds_shard_size",
                    f"its scored row may take up to {bound} bytes; with the {manifest_bytes}-byte manifest line "
                    f"it does not fit a shard of {shard_size} bytes (raise --shard-size, at most 64MiB)",
                    line=example.line,
                )
            if current and used + bound > capacity:
                close()
                current, used = [], 0
            key = sequence_key(request)
            first_shard.setdefault(key, len(shards))
            current.append((len(keys), example.line, int(request.positions.shape[0])))
            keys.append(key)
            used += bound
    if current:
        close()
    plan_json = json.dumps({"format": PLAN_FORMAT, "inputs": inputs, "shards": [s.as_json() for s in shards]},
                           indent=1, sort_keys=True).encode("utf-8") + b"\n"
    return SetPlan(shards, keys, first_shard, plan_json, "sha256:" + hashlib.sha256(plan_json).hexdigest())


def shard_dependencies(plan: SetPlan, shard: ShardPlan) -> set[int]:
    """The earlier shards whose ``teacher_tokens`` this shard copies (sequences they scored first): they
    must be committed before it is scored elsewhere."""
    keys = plan.keys[shard.first : shard.first + shard.count]
    return {plan.first_shard[key] for key in keys if plan.first_shard[key] < shard.number}


def check_existing_set(out, plan: SetPlan, inputs: dict[str, Any]) -> None:
    """Refuse a directory holding another run's set, or ``*.jsonl`` files of its own (``scored_set_mismatch``)."""
    plan_location = out.child(STATE_DIR, "plan.json")
    if plan_location.exists():
        try:
            previous = json.loads(plan_location.read_bytes())
        except ValueError:
            previous = {}
        if not isinstance(previous, dict) or previous.get("format") != PLAN_FORMAT:
            raise ScoringError("scored_set_mismatch", f"{plan_location.uri} is not a scoring plan; give an empty "
                                                      f"or new --out directory")
        before = previous.get("inputs") or {}
        differing = sorted(name for name in inputs if before.get(name) != inputs[name])
        if differing or previous.get("shards") != json.loads(plan.plan_json)["shards"]:
            raise ScoringError(
                "scored_set_mismatch",
                f"{out.uri} holds a set scored from other inputs (differing: {', '.join(differing) or 'the split'}); "
                f"its shards would not be this run's. Score into a new --out directory, or remove that one",
            )
        return
    if out.exists():
        from kiln_core.storage import list_children

        foreign = sorted(name for name in list_children(out) if name.endswith(".jsonl") or name == INDEX_NAME)
        if foreign:
            raise ScoringError("scored_set_mismatch", f"{out.uri} already holds {', '.join(foreign[:3])} but no "
                                                      f"scoring plan; shards written beside them would be admitted "
                                                      f"together. Give an empty or new --out directory")


def file_sha256(uri: str, storage_options) -> str:
    """``sha256:<hex>`` of a file at ``uri``, read in 8 MiB chunks."""
    from kiln_core.storage import resolve

    location = resolve(uri, storage_options)
    digest = hashlib.sha256()
    with location.fs.open(location.path, "rb") as handle:
        while chunk := handle.read(8 * 1024 * 1024):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()
