"""``distill merge``: several LoRAs, each the teacher of the prompts it was trained on, distilled into one student.

Kiln's ``POST /v1/adapters/distill_merge`` (``crates/kiln-server/src/api/training.rs`` ·
``validate_distill_merge_at_submit``; ``training_queue.rs`` · ``derive_source_prompts``), as one off-policy corpus and the one engine
path. ``prepare_distill_merge`` does, in order, what Kiln's admission and runner do:

1. **Sources.** Each ``sources[i].adapter`` is a published adapter: ``<out_root>/runs/<adapter>/latest.json``
   names its directory. Its ``replay.jsonl`` (written beside every published adapter) holds the prompts it
   trained on, read with Kiln's rules (``read_replay_prompts``: a regular UTF-8 file of at most 64 MiB, every
   non-blank line JSON; each line's ``request_body`` or the line itself, its ``examples`` and ``prompts``
   arrays, each element's ``messages`` that parse as chat messages).
2. **Admission.** At most 100,000 prompts and 64 MiB of serialized prompts over all sources; each prompt keyed
   by SHA-256 over u64-BE(token count) ‖ u32-BE tokens of its training tokenization (the student's chat
   template), and a key owned by two different sources refused with Kiln's text; each source's LoRA pinned
   by ``weights_sha256`` and ``config_sha256``; Kiln's sampling contract (``rollout_budget == prompts ×
   epochs``, every weight share equal to the source's row share within 1e-12) — or, with the request's
   ``weighted_sampling`` (a kiln-flows extension), a seeded draw of ``rollout_budget`` rows in proportion to
   the weights instead.
3. **Scoring.** Each source's prompts are scored by that source alone: the ``--student`` base model wearing
   the source's LoRA (loaded from a copy of the pinned weights whose ``adapter_config.json`` names the
   student as its base, whatever base path the adapter recorded). The digests are checked again right before
   each source is scored; a changed source is refused (``merge_source_changed``).
4. **Corpus.** One teacher-scored Kiln corpus, in source order then file order (weighted: in draw order),
   behind one manifest line: the base model's identity with ``served_model_id`` ``merge-multi-<name>``. The
   true teachers (base + each LoRA) are in the receipt's ``recipe.sources``. The corpus is content-addressed
   under ``<out_root>/recipes/distill_merge/<key>/corpus.jsonl`` (the key covers the sources' digests and
   replay logs, the student, top-K and the sampling), so a retry reuses it instead of scoring again.
5. **Spec.** Off-policy training of ``request.name`` on that corpus; ``config.base_adapter = student`` unless
   ``student == "base"``; ``spec.recipe`` names the recipe, Kiln's ``merge-multi:<name>`` teacher and the
   pinned sources.

Example:
    >>> from kiln_core.contracts.distill_merge import check_distill_merge_request
    >>> request = check_distill_merge_request(json.load(open("merge.json")))  # doctest: +SKIP
    >>> spec = prepare_distill_merge(request, student_dir="./student", out_root="./kiln-data")  # doctest: +SKIP
    >>> spec.recipe.teacher.alias  # doctest: +SKIP
    'merge-multi:unified'
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln_core.contracts.distill_merge import BASE_STUDENT, SURFACE, DistillMergeRequest, check_distill_merge_request  # noqa: F401 - re-exported
from kiln_core.contracts.pipeline import PipelineSpec
from kiln_core.errors import Rejection
from kiln_core.teachers.replay import MAX_REPLAY_BYTES, REPLAY_FILE, read_replay_prompts  # noqa: F401 - re-exported

__all__ = [
    "MERGE_CODES",
    "MergeRejection",
    "draw_weighted_rows",
    "prepare_distill_merge",
    "prompt_sequence_sha256",
    "read_replay_prompts",
]

MAX_PROMPTS = 100_000  # Kiln's admission limits (api/training.rs · prepare_training_entry_admission)
MAX_PROMPT_BYTES = 64 * 1024 * 1024
SHARE_TOLERANCE = 1e-12
WORK_DIR = ("recipes", "distill_merge")
CORPUS_FILE = "corpus.jsonl"
CORPUS_KEY_SCHEMA = "kiln-flows.distill-merge-corpus.v1"

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
class _Source:
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
        raise MergeRejection("merge_source_not_found", f"{SURFACE}: source adapter {_quoted(adapter)} not found at "
                             f"{runs.uri} (no readable {LATEST_FILE}: train and publish it first)", field=where) from None
    if not is_local_uri(pointer.adapter):
        raise MergeRejection("merge_source_not_found", f"{SURFACE}: source adapter {_quoted(adapter)} not found at "
                             f"{pointer.adapter} (source adapters must be on this machine's file system)", field=where)
    directory = Path(pointer.adapter.removeprefix("file://"))
    if not (directory / "adapter_config.json").is_file():
        raise MergeRejection("merge_source_not_found", f"{SURFACE}: source adapter {_quoted(adapter)} not found at "
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
        raise MergeRejection("prompt_not_trainable", f"{SURFACE}: source adapter {_quoted(source)} replay prompt "
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


def check_prompt_limits(sources: list[_Source]) -> None:
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


# ---------------------------------------------------------------------------------------------------- the recipe


def prepare_distill_merge(request: DistillMergeRequest, *, student_dir: str, out_root: str,
                          base_adapter: str | None = None, recipe: str | None = None, step: int | None = None,
                          device: str | None = None, batch_size: int = 8) -> PipelineSpec:
    """Admit the sources, score each source's prompts with that source's LoRA into one corpus, and return the
    spec that trains ``request.name`` on it.

    Args:
        request: A request ``check_distill_merge_request`` accepted.
        student_dir: The student base model directory (the base every source LoRA is loaded on).
        out_root: The storage root: sources are looked up under ``runs/``, the corpus goes under
            ``recipes/distill_merge/``, the run under ``runs/<name>/``.
        base_adapter: A recipe chain's warm start; ``request.student`` (when not ``"base"``) wins, as in Kiln.
        recipe, step: The recipe file's name and the step's index when this runs as a recipe step.
        device: Scoring device (``cpu``/``cuda``; default CUDA when available).
        batch_size: Prompts per teacher forward pass.

    Returns:
        The ``PipelineSpec`` (off-policy, ``adapter = request.name``, ``recipe`` set).

    Raises:
        MergeRejection: a source not found, a replay log missing or invalid, a prompt not trainable, the
            admission limits, a prompt owned by two sources, the sampling contract, a source changed.
        ScoringError: the scorer refused a source (e.g. a LoRA that does not fit the student).
    """
    from kiln_core.contracts.recipe_record import RecipeRecord, RecipeSource, TeacherDescriptor
    from kiln_core.contracts.opd_config import resolve_top_k
    from kiln_core.storage import resolve

    top_k = resolve_top_k(request.config.top_k)
    sources = [_Source(index, source.adapter, source.weight, resolve_source_adapter(source.adapter, out_root,
                                                                                        index=index))
               for index, source in enumerate(request.sources)]
    for source in sources:
        source.prompts = read_replay_prompts(str(source.adapter_dir), source=source.adapter)
        source.replay_sha256 = hashlib.sha256((source.adapter_dir / REPLAY_FILE).read_bytes()).hexdigest()
    check_prompt_limits(sources)
    for source in sources:
        _pin(source)
    base_identity = _base_identity(student_dir, top_k, device)

    with tempfile.TemporaryDirectory(prefix="kiln-merge-") as scratch:
        examples = [_write_examples(source, Path(scratch)) for source in sources]
        _check_ownership(sources, examples, student_dir, base_identity.max_model_len)
        draws, sampling = _plan_rows(request, sources)
        corpus = resolve(out_root).child(*WORK_DIR, _corpus_key(request, sources, base_identity, top_k, sampling),
                                         CORPUS_FILE)
        if not corpus.exists():  # content-addressed: a retry with the same inputs reuses the scored corpus
            scored = [_score_source(source, path, Path(scratch), student_dir, top_k, device, batch_size,
                                    needed=max((row for s, row in draws if s == source.index), default=-1) + 1)
                      for source, path in zip(sources, examples)]
            _write_corpus(corpus.uri, _merge_manifest_line(base_identity, request.name), scored, draws)

    record = RecipeRecord(
        kind="distill_merge", name=request.name,
        teacher=TeacherDescriptor(alias=f"merge-multi:{request.name}", model_id=f"merge-multi:{request.name}"),
        sources=[RecipeSource(adapter=s.adapter, weight=s.weight, weights_sha256=s.weights_sha256,
                              config_sha256=s.config_sha256, prompts=len(s.prompts), rows=s.rows,
                              identity_revision=_source_identity(base_identity, s).identity_revision())
                 for s in sources],
        request=request.model_dump(mode="json", by_alias=True), sampling=sampling, recipe=recipe, step=step)
    return _spec(request, corpus.uri, student_dir, out_root, base_adapter, record)


def _pin(source: _Source) -> None:
    """Fingerprint the source's LoRA (Kiln's ``LoraSourceIdentity``), pinned for the rest of the run."""
    from kiln_core.identity.hashing import IdentityHashError, adapter_config_sha256, adapter_weights_sha256

    try:
        source.weights_sha256 = adapter_weights_sha256(source.adapter_dir)
        source.config_sha256 = adapter_config_sha256(source.adapter_dir)
    except IdentityHashError as error:
        raise MergeRejection("merge_source_not_found", f"{SURFACE}: source adapter {_quoted(source.adapter)} at "
                             f"{source.adapter_dir} is not a usable PEFT adapter: {error.message}",
                             field=f"sources[{source.index}].adapter") from None


def _check_unchanged(source: _Source, directory: Path) -> None:
    """The source's files are still the pinned ones (checked right before it scores)."""
    from kiln_core.identity.hashing import IdentityHashError, adapter_config_sha256, adapter_weights_sha256

    try:
        now = (adapter_weights_sha256(directory),
               adapter_config_sha256(source.adapter_dir) if directory == source.adapter_dir else source.config_sha256)
    except IdentityHashError:
        now = ("", "")
    if now != (source.weights_sha256, source.config_sha256):
        raise MergeRejection("merge_source_changed", f"{SURFACE}: source adapter {_quoted(source.adapter)} changed "
                             f"after admission: {source.adapter_dir} no longer holds the pinned weights "
                             f"{source.weights_sha256} and config {source.config_sha256}; submit the merge again",
                             field=f"sources[{source.index}].adapter", file=str(source.adapter_dir))


def _base_identity(student_dir: str, top_k: int, device: str | None):
    """The student base model's identity as the scorer computes it for a teacher (same options)."""
    from kiln_core.identity.hashing import IdentityHashError, model_vocab_size
    from kiln_core.identity.local_teacher import DEFAULT_MAX_TOP_K, local_teacher_identity

    try:
        max_top_k = min(max(top_k, DEFAULT_MAX_TOP_K), model_vocab_size(student_dir))
        return local_teacher_identity(student_dir, max_top_k=max_top_k, device_kind=device)
    except IdentityHashError as error:
        raise MergeRejection("merge_source_not_found", f"student {student_dir}: {error.message}",
                             field="student") from None


def _source_identity(base_identity, source: _Source):
    """Kiln's identity of a LoRA teacher: the base identity with ``adapter = {name, weights, config}``."""
    from kiln_core.contracts.identity import TeacherAdapter

    adapter = TeacherAdapter(name=source.adapter, weights_sha256=source.weights_sha256,
                             config_sha256=source.config_sha256)
    return base_identity.model_copy(update={"adapter": adapter})


def _merge_manifest_line(base_identity, name: str) -> str:
    """The corpus's one manifest: the base model's identity, served as ``merge-multi-<name>``."""
    from kiln_core.contracts.identity import build_manifest_line

    return build_manifest_line(base_identity.model_copy(update={"served_model_id": f"merge-multi-{name}"}))


def _write_examples(source: _Source, scratch: Path) -> Path:
    """The source's replay prompts as an examples file (one row per prompt, replay order)."""
    path = scratch / f"examples-{source.index}.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for index, messages in enumerate(source.prompts):
            row = prompt_example(messages, source=source.adapter, index=index)
            handle.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    return path


def _check_ownership(sources: list[_Source], examples: list[Path], student_dir: str, max_model_len: int) -> None:
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
                raise MergeRejection("prompt_not_trainable", f"{SURFACE}: source adapter {_quoted(source.adapter)} "
                                     f"replay prompt {index} failed canonical training tokenization: {error.message}",
                                     field=f"prompts[{index}].messages") from None
            for request in requests:
                key = prompt_sequence_sha256(request.input_ids)
                first = owner.setdefault(key, source.adapter)
                if first != source.adapter:
                    raise MergeRejection(
                        "merge_shared_prompt",
                        f"{SURFACE}: source adapters {_quoted(first)} and {_quoted(source.adapter)} contain the same "
                        "tokenized prompt; shared prompts require weighted multi-teacher aggregation, which is not "
                        "implemented, so deduplicate or pre-sample the replay logs before submitting",
                        field=f"sources[{source.index}].adapter")


def _plan_rows(request: DistillMergeRequest, sources: list[_Source]) -> tuple[list[tuple[int, int]], dict[str, Any]]:
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


def _corpus_key(request: DistillMergeRequest, sources: list[_Source], base_identity, top_k: int,
                sampling: dict[str, Any]) -> str:
    """What decides the corpus's bytes: the merge's name (its manifest), the student, top-K, each source's
    pinned LoRA and replay log, and how rows are sampled."""
    from kiln_core.canonical import kiln_compact_json, sha256_hex

    value = {
        "schema": CORPUS_KEY_SCHEMA,
        "name": request.name,
        "student": base_identity.identity_revision(),
        "top_k": top_k,
        "sources": [{"adapter": s.adapter, "weight": s.weight, "weights_sha256": s.weights_sha256,
                     "config_sha256": s.config_sha256, "replay_sha256": s.replay_sha256} for s in sources],
        "sampling": sampling,
    }
    return f"{request.name}-{sha256_hex(kiln_compact_json(value).encode('utf-8'))[:24]}"


def _score_source(source: _Source, examples: Path, scratch: Path, student_dir: str, top_k: int, device: str | None,
                  batch_size: int, *, needed: int) -> Path:
    """Score the source's first ``needed`` prompts with the student base wearing the source's pinned LoRA."""
    import shutil

    from kiln_core.identity.hashing import adapter_weights_file
    from kiln_core.scoring import score_examples

    scored = scratch / f"scored-{source.index}.jsonl"
    if needed <= 0:
        scored.write_text("", encoding="utf-8")
        return scored
    _check_unchanged(source, source.adapter_dir)
    # The scorer loads an adapter directory on the base its adapter_config.json names; a copy that names the
    # student makes that the student whatever path the source recorded (a run's own student path may be gone).
    teacher = scratch / f"teacher-{source.index}" / source.adapter
    teacher.mkdir(parents=True)
    weights = adapter_weights_file(source.adapter_dir)
    shutil.copyfile(weights, teacher / weights.name)
    config = json.loads((source.adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = os.path.abspath(student_dir)
    (teacher / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    _check_unchanged(source, teacher)  # the copy is the pinned weights, not a file rewritten meanwhile
    subset = scratch / f"examples-{source.index}-scored.jsonl"
    with examples.open("rb") as reader, subset.open("wb") as writer:
        for _ in range(min(needed, len(source.prompts))):
            writer.write(reader.readline())
    score_examples(str(subset), teacher_dir=str(teacher), student_dir=student_dir, top_k=top_k, out_uri=str(scored),
                   device=device, batch_size=batch_size)
    return scored


def _write_corpus(uri: str, manifest_line: str, scored: list[Path], draws: list[tuple[int, int]]) -> None:
    """Write the manifest, then each drawn row from its source's scored file, and publish atomically."""
    from kiln_core.scoring.writer import CorpusWriter

    offsets = [_row_offsets(path) for path in scored]
    handles = [path.open("rb") for path in scored]
    try:
        with CorpusWriter(uri) as writer:
            writer.write_line(manifest_line)
            for source, row in draws:
                start, end = offsets[source][row]
                handles[source].seek(start)
                writer.write_line(handles[source].read(end - start).decode("utf-8").rstrip("\n"))
            writer.commit()
    finally:
        for handle in handles:
            handle.close()


def _row_offsets(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of a scored file's rows (its manifest line skipped)."""
    ranges, position = [], 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle):
            if number > 0 and line.strip():
                ranges.append((position, position + len(line)))
            position += len(line)
    return ranges


def _spec(request: DistillMergeRequest, corpus: str, student_dir: str, out_root: str, base_adapter: str | None,
          record) -> PipelineSpec:
    """Off-policy training of the merged student on the corpus, warm-started as Kiln's runner does."""
    from kiln_core.contracts.pipeline import parse_spec

    warm = request.student if request.student != BASE_STUDENT else (base_adapter or request.config.base_adapter)
    config = request.config.model_copy(update={"output_name": request.name, "auto_load": False, "base_adapter": warm})
    spec = parse_spec({
        "teacher": {"kind": "manifest_file", "path": corpus},
        "corpus": corpus,
        "student": student_dir,
        "storage_root": out_root,
        "adapter": request.name,
        "config": config.model_dump(mode="json", by_alias=True, exclude={"preset"}),
        "post_eval": request.post_eval.model_dump(mode="json") if request.post_eval is not None else None,
    })
    return spec.model_copy(update={"recipe": record})


def _quoted(text: str) -> str:
    """Rust's ``{:?}`` of a string, as Kiln's messages print adapter names."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
