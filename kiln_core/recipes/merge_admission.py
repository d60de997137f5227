"""``distill merge``'s sources and admission: the rules Kiln checks before anything is scored.

Kiln's admission of a ``POST /v1/adapters/distill_merge`` (``crates/kiln-server/src/api/training.rs`` ·
``prepare_training_entry_admission`` (DistillMerge arm), ``distill_merge_prompt_sequence_sha256``,
``validate_distill_merge_sampling_contract``; ``training_queue.rs`` · ``derive_source_prompts``): each source
resolved to a published adapter and its ``replay.jsonl`` read, at most 100,000 prompts and 64 MiB over all
sources, each source's LoRA pinned by its digests, a tokenized prompt owned by one source only, and the
sampling contract (or kiln-flows' seeded weighted draw). ``kiln_core.recipes.distill_merge`` scores and
writes the corpus from what this module admitted.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln_core.contracts.distill_merge import SURFACE, DistillMergeRequest, rust_quoted
from kiln_core.errors import Rejection

__all__ = ["MERGE_CODES", "MergeRejection", "PinnedSource", "check_ownership", "check_prompt_limits",
           "check_sampling_contract", "check_unchanged", "draw_weighted_rows", "pin_source", "plan_rows",
           "prompt_example", "prompt_sequence_sha256", "resolve_source_adapter", "sampling_seed", "write_examples"]

MAX_PROMPTS = 100_000  # Kiln's admission limits (api/training.rs · prepare_training_entry_admission)
MAX_PROMPT_BYTES = 64 * 1024 * 1024
SHARE_TOLERANCE = 1e-12

MERGE_CODES = (
    "merge_source_not_found",
    "replay_log_missing",
    "replay_log_invalid",
    "prompt_not_trainable",
    "merge_prompt_limit",
    "merge_shared_prompt",
    "merge_sampling_contract",
    "merge_source_changed",
)
"""The codes of the rules that need files (the request's own are ``MERGE_REQUEST_CODES``)."""


class MergeRejection(Rejection):
    """A merge whose sources break one of Kiln's admission rules (exit 2); ``code`` is one of ``MERGE_CODES``."""


@dataclass
class PinnedSource:
    """One source adapter as admission pins it."""

    index: int
    adapter: str
    weight: float
    adapter_dir: Path
    replay_sha256: str = ""
    prompts: list[list[dict[str, Any]]] = field(default_factory=list)
    weights_sha256: str = ""
    config_sha256: str = ""
    rows: int = 0  # training rows taken from this source


# ---------------------------------------------------------------------------------------------------- sources


def resolve_source_adapter(adapter: str, out_root: str, *, index: int) -> Path:
    """The local directory of a published source adapter (``runs/<adapter>/latest.json`` → its ``adapter``).

    Raises:
        MergeRejection: ``merge_source_not_found`` with Kiln's text, when nothing is published under the name
            or the directory it names is gone (or is not on this machine's file system: the scorer loads it).
    """
    from kiln_core.contracts.latest import LATEST_FILE, decode_latest
    from kiln_core.storage import is_local_uri, resolve

    runs = resolve(out_root).child("runs", adapter)
    latest = runs.child(LATEST_FILE)
    where = f"sources[{index}].adapter"
    try:
        pointer = decode_latest(latest.read_bytes())
    except (OSError, ValueError):  # missing, unreadable or not a latest.json: nothing published there
        raise MergeRejection("merge_source_not_found", f"{SURFACE}: source adapter {rust_quoted(adapter)} not found at "
                             f"{runs.uri} (no readable {LATEST_FILE}: train and publish it first)", field=where) from None
    if not is_local_uri(pointer.adapter):
        raise MergeRejection("merge_source_not_found", f"{SURFACE}: source adapter {rust_quoted(adapter)} not found at "
                             f"{pointer.adapter} (source adapters must be on this machine's file system)", field=where)
    directory = Path(pointer.adapter.removeprefix("file://"))
    if not (directory / "adapter_config.json").is_file():
        raise MergeRejection("merge_source_not_found", f"{SURFACE}: source adapter {rust_quoted(adapter)} not found at "
                             f"{directory}", field=where)
    return directory


def prompt_example(messages: list[dict[str, Any]], *, source: str, index: int) -> dict[str, Any]:
    """A replay prompt as an example row: ``messages[:-1]`` and the last (assistant) message's text as the
    ``teacher_response`` the source scores.

    Raises:
        MergeRejection: ``prompt_not_trainable`` when the prompt does not end with an assistant answer.
    """
    from kiln_core.contracts.example import normalize_content

    last = messages[-1]
    answer = normalize_content(last.get("content")) if last.get("role") == "assistant" else ""
    if last.get("role") != "assistant" or not answer.strip():
        earlier = any(message.get("role") == "assistant" for message in messages[:-1])
        why = ("its last message is not an assistant answer (kiln-flows trains the final assistant turn only; "
               "an earlier assistant turn cannot be scored alone)" if earlier
               else "it has no non-empty assistant answer to score")
        raise MergeRejection("prompt_not_trainable", f"{SURFACE}: source adapter {rust_quoted(source)} replay prompt "
                             f"{index} is not trainable: {why}", field=f"prompts[{index}].messages")
    return {"messages": messages[:-1], "teacher_response": answer}


def prompt_sequence_sha256(input_ids: Any) -> bytes:
    """Kiln's ownership key of a prompt: SHA-256 over u64-BE(token count) ‖ each token id as u32-BE.

    Example:
        >>> prompt_sequence_sha256([1, 2]).hex()[:8]
        '6e40293f'
    """
    tokens = [int(token) for token in input_ids]
    digest = hashlib.sha256(struct.pack(">Q", len(tokens)))
    digest.update(struct.pack(f">{len(tokens)}I", *tokens))
    return digest.digest()


# ---------------------------------------------------------------------------------------------------- admission


def check_prompt_limits(sources: list[PinnedSource]) -> None:
    """Kiln's admission limits over all sources: at least one prompt, at most 100,000 and 64 MiB serialized."""
    total = sum(len(source.prompts) for source in sources)
    if total == 0:
        raise MergeRejection("merge_prompt_limit", f"{SURFACE} resolved to zero prompts", field="sources")
    if total > MAX_PROMPTS:
        raise MergeRejection("merge_prompt_limit", f"{SURFACE} resolved to {total} prompts; maximum is {MAX_PROMPTS}",
                             field="sources")
    size = sum(len(json.dumps({"messages": prompt}, separators=(",", ":")).encode("utf-8"))
               for source in sources for prompt in source.prompts)
    if size > MAX_PROMPT_BYTES:
        raise MergeRejection("merge_prompt_limit", f"{SURFACE} materializes to more than {MAX_PROMPT_BYTES} bytes; "
                             "split it into smaller jobs", field="sources")


def check_sampling_contract(request: DistillMergeRequest, counts: list[int]) -> int:
    """Kiln's ``validate_distill_merge_sampling_contract``: the run executes every replay prompt once per epoch,
    so ``rollout_budget`` must be prompts × epochs and each weight share its source's row share.

    Returns:
        The prompt-epochs the run executes.

    Raises:
        MergeRejection: ``merge_sampling_contract`` with Kiln's text.

    Example:
        >>> check_sampling_contract(request, [3, 1])  # doctest: +SKIP
        4
    """
    prompts = sum(counts)
    expected = prompts * request.config.epochs
    weight_sum = sum(source.weight for source in request.sources)
    shares_match = math.isfinite(weight_sum) and weight_sum > 0 and all(
        abs(source.weight / weight_sum - count / prompts) <= SHARE_TOLERANCE
        for source, count in zip(request.sources, counts))
    if request.rollout_budget != expected or not shares_match:
        raise MergeRejection(
            "merge_sampling_contract",
            f"{SURFACE} cannot silently approximate weighted sampling: this materialized corpus executes {expected} "
            "prompt-epochs and source shares proportional to replay row counts; set "
            f"rollout_budget={expected} and each source weight proportional to its replay row count, or "
            "pre-sample the replay logs accordingly", field="rollout_budget")
    return expected


def draw_weighted_rows(weights: list[float], counts: list[int], budget: int, seed: int) -> list[tuple[int, int]]:
    """kiln-flows' weighted sampling: ``budget`` draws of a source in proportion to its weight; the n-th draw of
    a source takes its row n (file order), cycling when the source has fewer rows.

    Returns:
        ``(source index, row index)`` per draw, in draw order (the training order).

    Example:
        >>> draw_weighted_rows([1.0, 3.0], [2, 2], 4, seed=0)
        [(1, 0), (1, 1), (1, 0), (1, 1)]
    """
    rng = random.Random(seed)
    taken = [0] * len(weights)
    draws = []
    for source in rng.choices(range(len(weights)), weights=weights, k=budget):
        draws.append((source, taken[source] % counts[source]))
        taken[source] += 1
    return draws


def sampling_seed(request: DistillMergeRequest) -> int:
    """The weighted draw's seed: ``config.seed``, else one derived from the request (same request, same rows)."""
    if request.config.seed is not None:
        return int(request.config.seed)
    text = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def pin_source(source: PinnedSource) -> None:
    """Fingerprint the source's LoRA (Kiln's ``LoraSourceIdentity``), pinned for the rest of the run."""
    from kiln_core.identity.hashing import IdentityHashError, adapter_config_sha256, adapter_weights_sha256

    try:
        source.weights_sha256 = adapter_weights_sha256(source.adapter_dir)
        source.config_sha256 = adapter_config_sha256(source.adapter_dir)
    except IdentityHashError as error:
        raise MergeRejection("merge_source_not_found", f"{SURFACE}: source adapter {rust_quoted(source.adapter)} at "
                             f"{source.adapter_dir} is not a usable PEFT adapter: {error.message}",
                             field=f"sources[{source.index}].adapter") from None


def check_unchanged(source: PinnedSource, directory: Path) -> None:
    """The source's files are still the pinned ones (checked right before it scores)."""
    from kiln_core.identity.hashing import IdentityHashError, adapter_config_sha256, adapter_weights_sha256

    try:
        now = (adapter_weights_sha256(directory),
               adapter_config_sha256(source.adapter_dir) if directory == source.adapter_dir else source.config_sha256)
    except IdentityHashError:
        now = ("", "")
    if now != (source.weights_sha256, source.config_sha256):
        raise MergeRejection("merge_source_changed", f"{SURFACE}: source adapter {rust_quoted(source.adapter)} changed "
                             f"after admission: {source.adapter_dir} no longer holds the pinned weights "
                             f"{source.weights_sha256} and config {source.config_sha256}; submit the merge again",
                             field=f"sources[{source.index}].adapter", file=str(source.adapter_dir))


def write_examples(source: PinnedSource, scratch: Path) -> Path:
    """The source's replay prompts as an examples file (one row per prompt, replay order)."""
    path = scratch / f"examples-{source.index}.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for index, messages in enumerate(source.prompts):
            row = prompt_example(messages, source=source.adapter, index=index)
            handle.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    return path


def check_ownership(sources: list[PinnedSource], examples: list[Path], student_dir: str, max_model_len: int) -> None:
    """Tokenize every prompt as training does; a tokenized prompt in two different sources is refused."""
    from kiln_core.scoring.examples import ScoringError, batched, iter_examples
    from kiln_core.scoring.requests import encode_requests
    from kiln_core.tokenization import TokenizationError, load_student_tokenizer

    try:
        student = load_student_tokenizer(student_dir)
    except TokenizationError as error:
        raise MergeRejection("merge_source_not_found", f"student {student_dir}: {error}", field="student") from None
    owner: dict[bytes, str] = {}
    for source, path in zip(sources, examples):
        for batch in batched(iter_examples(str(path)), 64):
            try:
                requests = encode_requests(student, batch, max_model_len)
            except ScoringError as error:
                index = (error.line or 1) - 1
                raise MergeRejection("prompt_not_trainable", f"{SURFACE}: source adapter {rust_quoted(source.adapter)} "
                                     f"replay prompt {index} failed canonical training tokenization: {error.message}",
                                     field=f"prompts[{index}].messages") from None
            for request in requests:
                key = prompt_sequence_sha256(request.input_ids)
                first = owner.setdefault(key, source.adapter)
                if first != source.adapter:
                    raise MergeRejection(
                        "merge_shared_prompt",
                        f"{SURFACE}: source adapters {rust_quoted(first)} and {rust_quoted(source.adapter)} contain the same "
                        "tokenized prompt; shared prompts require weighted multi-teacher aggregation, which is not "
                        "implemented, so deduplicate or pre-sample the replay logs before submitting",
                        field=f"sources[{source.index}].adapter")


def plan_rows(request: DistillMergeRequest, sources: list[PinnedSource]) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """The training rows, ``(source, row)`` in training order, and the receipt's ``sampling`` block."""
    counts = [len(source.prompts) for source in sources]
    if not request.weighted_sampling:
        check_sampling_contract(request, counts)
        draws = [(source.index, row) for source in sources for row in range(len(source.prompts))]
        sampling: dict[str, Any] = {"method": "kiln_contract", "rollout_budget": request.rollout_budget}
    else:
        seed = sampling_seed(request)
        draws = draw_weighted_rows([s.weight for s in sources], counts, request.rollout_budget, seed)
        sampling = {"method": "weighted", "rollout_budget": request.rollout_budget, "seed": seed}
    for source in sources:
        source.rows = sum(1 for s, _ in draws if s == source.index)
    return draws, sampling
