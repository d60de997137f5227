"""``distill merge``: several LoRAs, each the teacher of the prompts it was trained on, distilled into one student.

Kiln's ``POST /v1/adapters/distill_merge`` (``crates/kiln-server/src/api/training.rs`` ·
``validate_distill_merge_at_submit``; ``training_queue.rs`` · ``derive_source_prompts``), as one off-policy corpus and the one engine
path. ``prepare_distill_merge`` does, in order, what Kiln's admission and runner do:

1. **Sources.** Each ``sources[i].adapter`` is a published adapter: ``<out_root>/runs/<adapter>/latest.json``
   names its directory. Its ``replay.jsonl`` (written beside every published adapter) holds the prompts it
   trained on, read with Kiln's rules (``read_replay_prompts``: a regular UTF-8 file of at most 64 MiB, every
   non-blank line JSON; each line's ``request_body`` or the line itself, its ``examples`` and ``prompts``
   arrays, each element's ``messages`` that parse as chat messages).
2. **Admission** (``kiln_core.recipes.merge_admission``). At most 100,000 prompts and 64 MiB of serialized prompts over all sources; each prompt keyed
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
import os
import tempfile
from pathlib import Path
from typing import Any

from kiln_core.contracts.distill_merge import BASE_STUDENT, DistillMergeRequest, check_distill_merge_request
from kiln_core.contracts.pipeline import PipelineSpec
from kiln_core.recipes.merge_admission import (MergeRejection, PinnedSource, check_ownership, check_prompt_limits,
                                               check_unchanged, pin_source, plan_rows, resolve_source_adapter,
                                               write_examples)
from kiln_core.teachers.replay import REPLAY_FILE, read_replay_prompts

__all__ = ["check_distill_merge_request", "prepare_distill_merge"]  # the recipe runner's pair (recipe_plan)

WORK_DIR = ("recipes", "distill_merge")
CORPUS_FILE = "corpus.jsonl"
CORPUS_KEY_SCHEMA = "kiln-flows.distill-merge-corpus.v1"


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
    sources = [PinnedSource(index, source.adapter, source.weight, resolve_source_adapter(source.adapter, out_root,
                                                                                        index=index))
               for index, source in enumerate(request.sources)]
    for source in sources:
        source.prompts = read_replay_prompts(str(source.adapter_dir), source=source.adapter)
        source.replay_sha256 = hashlib.sha256((source.adapter_dir / REPLAY_FILE).read_bytes()).hexdigest()
    check_prompt_limits(sources)
    for source in sources:
        pin_source(source)
    base_identity = _base_identity(student_dir, top_k, device)

    with tempfile.TemporaryDirectory(prefix="kiln-merge-") as scratch:
        examples = [write_examples(source, Path(scratch)) for source in sources]
        check_ownership(sources, examples, student_dir, base_identity.max_model_len)
        draws, sampling = plan_rows(request, sources)
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


def _source_identity(base_identity, source: PinnedSource):
    """Kiln's identity of a LoRA teacher: the base identity with ``adapter = {name, weights, config}``."""
    from kiln_core.contracts.identity import TeacherAdapter

    adapter = TeacherAdapter(name=source.adapter, weights_sha256=source.weights_sha256,
                             config_sha256=source.config_sha256)
    return base_identity.model_copy(update={"adapter": adapter})


def _merge_manifest_line(base_identity, name: str) -> str:
    """The corpus's one manifest: the base model's identity, served as ``merge-multi-<name>``."""
    from kiln_core.contracts.identity import build_manifest_line

    return build_manifest_line(base_identity.model_copy(update={"served_model_id": f"merge-multi-{name}"}))


def _corpus_key(request: DistillMergeRequest, sources: list[PinnedSource], base_identity, top_k: int,
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


def _score_source(source: PinnedSource, examples: Path, scratch: Path, student_dir: str, top_k: int, device: str | None,
                  batch_size: int, *, needed: int) -> Path:
    """Score the source's first ``needed`` prompts with the student base wearing the source's pinned LoRA."""
    import shutil

    from kiln_core.identity.hashing import adapter_weights_file
    from kiln_core.scoring import score_examples

    scored = scratch / f"scored-{source.index}.jsonl"
    if needed <= 0:
        scored.write_text("", encoding="utf-8")
        return scored
    check_unchanged(source, source.adapter_dir)
    # The scorer loads an adapter directory on the base its adapter_config.json names; a copy that names the
    # student makes that the student whatever path the source recorded (a run's own student path may be gone).
    teacher = scratch / f"teacher-{source.index}" / source.adapter
    teacher.mkdir(parents=True)
    weights = adapter_weights_file(source.adapter_dir)
    shutil.copyfile(weights, teacher / weights.name)
    config = json.loads((source.adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = os.path.abspath(student_dir)
    (teacher / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    check_unchanged(source, teacher)  # the copy is the pinned weights, not a file rewritten meanwhile
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
