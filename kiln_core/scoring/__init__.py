"""Teacher scoring: unscored examples in, a Kiln-admissible teacher-scored corpus out.

``score_examples`` is the whole workflow, in this order (cheap checks before any expensive step):

1. Validate every input line (``examples.py``), so a bad line fails before a teacher is touched.
2. Load the student's tokenizer and bind the teacher: its ``tokenizer_vocab_sha256`` must equal the
   student's and its logit width the student's ``vocab_size`` *before* any weights load or any
   request is sent; then its identity (local directory → computed; registry alias → the pinned
   entry, re-verified against the directory; vLLM → the pinned manifest).
3. Stream the examples in batches: the admission mask builder (``encode_conversations``) finds the
   action targets, the teacher (``local.py`` or ``vllm.py``) scores them, and ``writer.py`` appends
   the rows to a temp file that is published atomically at the end.

What ``score`` writes, ``admit`` admits by construction: the same field rules parse the input, the
same mask builder picks the targets, and every row is checked against admission's row rules.
Examples whose token ids *and* targets are identical reuse the first one's rows byte for byte, because
admission refuses two bit-different scores for one exact token sequence, and batching may perturb
the last bits.

Example:
    >>> result = score_examples("examples.jsonl", teacher_dir="./teacher", student_dir="./student",
    ...                         top_k=32, out_uri="teacher-data.jsonl")  # doctest: +SKIP
    >>> result.examples, result.sha256[:7]  # doctest: +SKIP
    (128, 'sha256:')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from kiln_core.contracts.opd_config import SUPPORTED_TOP_K
from kiln_core.scoring.examples import ScoringError, batched, count_examples, iter_examples
from kiln_core.scoring.requests import encode_requests as _encode  # the mask builder per batch (tests use it too)
from kiln_core.scoring.requests import sequence_key as _sequence_key

__all__ = ["ScoreResult", "ScoringError", "score_examples"]

DEFAULT_REGISTRY_ROOT = "./kiln-data"
DTYPES = ("float32", "bfloat16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


class ScoreResult(BaseModel):
    """What a scoring run wrote."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out_uri: str
    """Where the corpus was published."""
    examples: int
    """Scored examples (the manifest line is not counted)."""
    action_tokens: int
    """Action targets over all examples (one ``teacher_tokens`` entry each)."""
    manifest_line: str
    """The corpus's first line: the teacher's canonical manifest."""
    identity_revision: str
    """``sha256:`` digest of the teacher's canonical identity."""
    sha256: str
    """``sha256:`` digest of the exact bytes written (the corpus's ``dataset_sha256``)."""
    size_bytes: int
    """Size of the written file."""
    reused_rows: int = 0
    """Examples whose rows were copied from an identical earlier example instead of re-scored."""


@dataclass(frozen=True)
class _Binding:
    identity: Any  # TeacherIdentity
    manifest_line: str
    teacher_dir: str | None
    adapter_dir: str | None = None  # a registered LoRA teacher's pinned adapter, applied to teacher_dir (the base)
    alias: str | None = None


def score_examples(
    examples_uri: str,
    *,
    teacher_dir: str | None = None,
    teacher_alias: str | None = None,
    registry_root: str | None = None,
    student_dir: str,
    top_k: int,
    out_uri: str,
    batch_size: int = 8,
    dtype: str | None = None,
    attn_implementation: str = "eager",
    vllm_url: str | None = None,
    served_model: str | None = None,
    pinned_manifest: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    device: str | None = None,
    storage_options: dict | None = None,
    shard_size: int | str | None = None,
    workers: int = 1,
) -> Any:
    """Score unscored examples with a teacher and publish a corpus Kiln's admission accepts.

    With ``shard_size`` the corpus is a resumable set of shards in the directory ``out_uri`` plus its
    index (``kiln_core.scoring.shards``), and the result a ``ScoreSetResult``; without it, one file and
    a ``ScoreResult``.

    Args:
        examples_uri: JSONL of examples (``messages``, ``teacher_response``, optional ``trajectory``,
            ``id``, ``metadata``); local path or fsspec URI.
        teacher_dir: A local Hugging Face teacher directory (its identity is computed).
        teacher_alias: A teacher registered in the local registry under ``registry_root``.
        registry_root: Storage root holding ``teachers.json`` (default ``./kiln-data``).
        student_dir: The student model directory: its tokenizer and chat template pick the targets.
        top_k: Candidates per target (≤ the teacher identity's ``max_top_k``; admission needs ≥ 16).
        out_uri: Where to publish the corpus (local path or fsspec URI); nothing appears on failure.
        batch_size: Examples per forward pass (local) or requests in flight (vLLM).
        dtype: Local teacher dtype, ``float32`` or ``bfloat16``; default fp32 on CPU, bf16 on CUDA.
        attn_implementation: Local teacher attention kernel, ``eager`` or ``sdpa``.
        vllm_url: Base URL of a vLLM server to score through instead of a local model.
        served_model: The vLLM model name (must equal the pinned identity's ``served_model_id``).
        pinned_manifest: The teacher's manifest line. Required with ``vllm_url``; with a local
            teacher, the computed manifest must equal it.
        on_progress: Called as ``on_progress(done, total)`` after each batch; with ``shard_size``, as
            ``on_progress(SetProgress)`` (tokens and shards).
        device: Local teacher device, ``cpu`` or ``cuda``; default CUDA when available.
        storage_options: fsspec options for the examples and the output.
        shard_size: Write shards of at most this many bytes (an int, or text such as ``64MiB``; at most
            64 MiB) into the directory ``out_uri``, resuming a set an earlier run left unfinished.
        workers: Shards scored at once (a vLLM teacher only; a local teacher's parallelism is the batch).

    Returns:
        A ``ScoreResult`` (one file) or a ``ScoreSetResult`` (with ``shard_size``).

    Raises:
        ScoringError: the first refused input or failed step (see ``ScoringError`` for the codes).
    """
    from kiln_core.scoring.writer import CorpusWriter, TokenTexts

    _check_options(top_k, batch_size, dtype, attn_implementation, device, teacher_dir, teacher_alias, vllm_url)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ScoringError("invalid_option", f"workers must be a positive integer, got {workers!r}")
    if workers > 1 and vllm_url is None:
        raise ScoringError("invalid_option", "--workers applies to a vLLM teacher; a local teacher scores one "
                                             "batch at a time in this process (raise --batch-size instead)")
    shard_size, total, student, binding, load_scorer = _open_inputs(
        examples_uri, student_dir, top_k, out_uri=out_uri, shard_size=shard_size, storage_options=storage_options,
        teacher_dir=teacher_dir, teacher_alias=teacher_alias, registry_root=registry_root, dtype=dtype,
        attn_implementation=attn_implementation, vllm_url=vllm_url, served_model=served_model,
        pinned_manifest=pinned_manifest, device=device, batch_size=batch_size,
    )
    if shard_size is not None:
        from kiln_core.scoring.shards import score_shard_set

        return score_shard_set(
            examples_uri, student=student, binding=binding, load_scorer=load_scorer, top_k=top_k,
            out_uri=out_uri, shard_size=shard_size, batch_size=batch_size, workers=workers,
            on_progress=on_progress, storage_options=storage_options,
        )
    scorer = load_scorer()

    token_text = TokenTexts(student.tokenizer)
    done = action_tokens = reused = 0
    seen: dict[bytes, tuple[int, int]] = {}  # (ids, targets) digest → (offset, length) of its teacher_tokens
    try:
        with CorpusWriter(out_uri, storage_options) as writer:
            writer.write_line(binding.manifest_line)
            for batch in batched(iter_examples(examples_uri, storage_options), batch_size):
                requests = _encode(student, batch, binding.identity.max_model_len)
                reused += _score_and_write(scorer, writer, batch, requests, top_k, token_text, seen)
                done += len(batch)
                action_tokens += sum(int(r.positions.shape[0]) for r in requests)
                if on_progress is not None:
                    on_progress(done, total)
            uri = writer.commit()
    finally:
        if hasattr(scorer, "close"):
            scorer.close()
    return ScoreResult(
        out_uri=uri,
        examples=done,
        action_tokens=action_tokens,
        manifest_line=binding.manifest_line,
        identity_revision=binding.identity.identity_revision(),
        sha256=writer.sha256,
        size_bytes=writer.bytes_written,
        reused_rows=reused,
    )


def _open_inputs(examples_uri: str, student_dir: str, top_k: int, *, out_uri: str, shard_size, storage_options,
                 **teacher):
    """The checks every scoring run makes before any teacher weight loads, in this order: the shard size and
    the output directory (with ``shard_size``), every example line, the student and its vocabulary; then the
    teacher bound (``_bind_teacher``'s keywords in ``teacher``).

    Returns:
        ``(shard_size, examples, student, binding, load_scorer)``: the parsed size (or None), the example count.
    """
    if shard_size is not None:
        from kiln_core.scoring.shards import check_out_directory, parse_shard_size

        shard_size = parse_shard_size(shard_size)
        check_out_directory(out_uri, storage_options)
    total = count_examples(examples_uri, storage_options)
    student = _load_student(student_dir)
    if top_k > student.vocab_size:
        raise ScoringError("invalid_option", f"top_k {top_k} exceeds the student's vocab_size {student.vocab_size}")
    binding, load_scorer = _bind_teacher(student, top_k, **teacher)
    return shard_size, total, student, binding, load_scorer


def _check_options(top_k, batch_size, dtype, attn_implementation, device, teacher_dir, teacher_alias, vllm_url) -> None:
    sources = [name for name, value in (("teacher_dir", teacher_dir), ("teacher_alias", teacher_alias),
                                        ("vllm_url", vllm_url)) if value is not None]
    if len(sources) != 1:
        raise ScoringError("invalid_option", f"give exactly one teacher: a directory, an alias or a vLLM URL (got {sources or 'none'})")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ScoringError("invalid_option", f"top_k must be a positive integer, got {top_k!r}")
    if top_k < min(SUPPORTED_TOP_K):
        # Admission resolves its K to 32 or 16 and needs that many candidates per token (too_few_candidates):
        # a corpus scored with fewer could be written, but nothing would ever admit it.
        raise ScoringError("top_k_unsupported", f"--top-k {top_k} would score {top_k} candidates per token, but "
                           f"admission trains with top-K {' or '.join(map(str, SUPPORTED_TOP_K))} and refuses rows with "
                           f"fewer (too_few_candidates): score with --top-k {min(SUPPORTED_TOP_K)} or more")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ScoringError("invalid_option", f"batch_size must be a positive integer, got {batch_size!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ScoringError("invalid_option", f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ScoringError("invalid_option", f"attn_implementation must be one of {list(ATTN_IMPLEMENTATIONS)}")
    if device is not None and device not in ("cpu", "cuda"):
        raise ScoringError("invalid_option", f"device must be 'cpu' or 'cuda', got {device!r}")


def _bind_teacher(student, top_k, *, teacher_dir, teacher_alias, registry_root, dtype, attn_implementation, vllm_url,
                  served_model, pinned_manifest, device, batch_size) -> tuple[_Binding, Callable[[], Any]]:
    """The teacher's identity (cheap checks first) and a function that loads the scorer (the expensive step)."""
    if vllm_url is not None:
        from kiln_core.scoring.vllm import VllmTeacher

        binding = _bind_vllm(student, top_k, served_model, pinned_manifest)
        # A client is cheap: built now, so a bad URL or served model is refused before any work.
        teacher = VllmTeacher(vllm_url, binding.identity, served_model, concurrency=batch_size)
        return binding, lambda: teacher
    from kiln_core.scoring.local import LocalTeacher, default_device, default_dtype

    device = device or default_device()
    dtype = dtype or default_dtype(device)
    options = {"dtype": dtype, "attn_implementation": attn_implementation, "device_kind": device}
    binding = _bind_local(student, top_k, teacher_dir, teacher_alias, registry_root, options)
    if pinned_manifest is not None and pinned_manifest.rstrip("\r\n") != binding.manifest_line:
        raise ScoringError("teacher_mismatch", "the teacher's manifest differs from the pinned manifest")

    def load_local() -> Any:
        return LocalTeacher.load(binding.teacher_dir, vocab_size=student.vocab_size, dtype=dtype,
                                 attn_implementation=attn_implementation, device=device,
                                 adapter_dir=binding.adapter_dir, alias=binding.alias, identity=binding.identity)

    return binding, load_local


def _load_student(student_dir: str):
    from kiln_core.tokenization import TokenizationError, load_student_tokenizer

    try:
        return load_student_tokenizer(student_dir)
    except TokenizationError as error:
        raise ScoringError("invalid_option", f"student {student_dir}: {error}") from None


def _check_compatible(what: str, vocab_sha: str, vocab_size: int, max_top_k: int | None, student, top_k: int) -> None:
    """The teacher must speak the student's token ids, at the student's logit width, with ≥ K candidates."""
    from kiln_core.identity.hashing import tokenizer_vocab_sha256

    student_sha = tokenizer_vocab_sha256(student.tokenizer)
    if vocab_sha != student_sha:
        raise ScoringError(
            "teacher_mismatch",
            f"{what} has tokenizer_vocab_sha256 {vocab_sha}, the student {student.model_dir} has {student_sha}: "
            "its token ids would not mean the student's tokens",
        )
    if vocab_size != student.vocab_size:
        raise ScoringError(
            "teacher_mismatch",
            f"{what} has vocab_size (logit width) {vocab_size}, the student's config has {student.vocab_size}",
        )
    if max_top_k is not None and max_top_k < top_k:
        raise ScoringError("teacher_mismatch", f"top_k {top_k} exceeds {what}'s identity max_top_k {max_top_k}")


def _parse_manifest(line: str, what: str):
    from kiln_core.contracts.identity import ManifestError, parse_manifest_line

    try:
        return parse_manifest_line(line.rstrip("\r\n")).teacher_identity
    except ManifestError as error:
        raise ScoringError("teacher_invalid", f"{what} is not a usable manifest: {error}") from None


def _bind_vllm(student, top_k: int, served_model: str | None, pinned_manifest: str | None) -> _Binding:
    if served_model is None or pinned_manifest is None:
        raise ScoringError("invalid_option", "a vLLM teacher needs --served-model and --teacher-manifest (the pinned manifest line)")
    identity = _parse_manifest(pinned_manifest, "the pinned teacher manifest")
    _check_compatible("the vLLM teacher", identity.tokenizer_vocab_sha256, identity.vocab_size, identity.max_top_k, student, top_k)
    return _Binding(identity, pinned_manifest.rstrip("\r\n"), None)


def _bind_local(student, top_k, teacher_dir, teacher_alias, registry_root, options) -> _Binding:
    """Check a local teacher's tokenizer and width before hashing or loading anything heavy."""
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.identity.hashing import IdentityHashError, model_vocab_size, tokenizer_vocab_sha256
    from kiln_core.identity.local_teacher import DEFAULT_MAX_TOP_K, local_teacher_identity, with_adapter
    from kiln_core.teachers.local_registry import LocalRegistryError, get_local_teacher
    from kiln_core.teachers.lora_teacher import TeacherAdapterError, check_pinned_adapter

    adapter_dir = None
    try:
        registered = None
        if teacher_alias is not None:
            entry = get_local_teacher(registry_root or DEFAULT_REGISTRY_ROOT, teacher_alias)
            registered = _parse_manifest(entry.off_policy_manifest, f"registered teacher {teacher_alias!r}")
            _check_compatible(f"registered teacher {teacher_alias!r}", registered.tokenizer_vocab_sha256,
                              registered.vocab_size, registered.max_top_k, student, top_k)
            teacher_dir, adapter_dir = entry.teacher_dir, entry.adapter_dir
            if adapter_dir is not None:  # a LoRA teacher: its adapter must still be the pinned one (Kiln: at use)
                check_pinned_adapter(teacher_alias, registered, adapter_dir)
        what = f"teacher {teacher_dir}"
        # The directory's own tokenizer and width: before its weights are hashed or loaded.
        _check_compatible(what, tokenizer_vocab_sha256(_tokenizer_dir(teacher_dir)),
                          model_vocab_size(_config_dir(teacher_dir)), None, student, top_k)
        if registered is None:
            max_top_k = min(max(top_k, DEFAULT_MAX_TOP_K), student.vocab_size)
            identity = local_teacher_identity(teacher_dir, max_top_k=max_top_k, **options)
            return _Binding(identity, build_manifest_line(identity), str(teacher_dir))
        identity = local_teacher_identity(
            teacher_dir, served_model_id=registered.served_model_id, max_top_k=registered.max_top_k,
            max_model_len=registered.max_model_len, **options,
        )
        if adapter_dir is not None:
            identity = with_adapter(identity, name=registered.adapter.name, adapter_dir=adapter_dir)
    except TeacherAdapterError as error:
        raise ScoringError(error.code, error.message) from None
    except (LocalRegistryError, IdentityHashError) as error:
        raise ScoringError("teacher_invalid", str(error)) from None
    if identity != registered:
        differing = [name.rstrip("_") for name in type(identity).model_fields
                     if getattr(identity, name) != getattr(registered, name)]
        raise ScoringError(
            "teacher_changed",
            f"teacher {teacher_dir} no longer matches alias {teacher_alias!r} ({registered.identity_revision()}); "
            f"differing fields: {', '.join(differing)}. Either its files changed or the scoring options "
            f"({options}) differ from the registration's",
        )
    return _Binding(registered, entry.off_policy_manifest, str(teacher_dir), adapter_dir, teacher_alias)


def _tokenizer_dir(teacher_dir: str) -> str:
    """Where a teacher's tokenizer lives: the directory, or an adapter's local base model."""
    from pathlib import Path

    root = Path(teacher_dir)
    if (root / "tokenizer.json").exists() or not (root / "adapter_config.json").exists():
        return str(root)
    return _config_dir(teacher_dir)


def _config_dir(teacher_dir: str) -> str:
    """The directory whose ``config.json`` sets the logit width (an adapter's base model)."""
    import json
    from pathlib import Path

    root = Path(teacher_dir)
    adapter = root / "adapter_config.json"
    if not adapter.exists():
        return str(root)
    try:
        base = json.loads(adapter.read_bytes()).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        raise ScoringError("teacher_invalid", f"{adapter} is not a JSON object") from None
    if not isinstance(base, str) or not base:
        raise ScoringError("teacher_invalid", f"{adapter} has no base_model_name_or_path")
    candidate = Path(base) if Path(base).is_absolute() else root / base
    return str(candidate if candidate.is_dir() else Path(base))


def _score_and_write(scorer, writer, batch, requests, top_k, token_text, seen) -> int:
    """Score one batch (each distinct sequence once) and append its rows; returns rows reused."""
    from kiln_core.scoring.writer import row_head, teacher_tokens_json

    keys = [_sequence_key(r) for r in requests]
    fresh: dict[bytes, int] = {}
    for index, key in enumerate(keys):
        if key not in seen and key not in fresh:
            fresh[key] = index
    scored = scorer.score([requests[i] for i in fresh.values()], top_k) if fresh else []
    tokens_by_key = {key: teacher_tokens_json(rows, token_text) for key, rows in zip(fresh, scored)}
    reused = 0
    for example, key in zip(batch, keys):
        head = row_head(example.record)
        if key in tokens_by_key:
            tokens = tokens_by_key.pop(key)
        else:
            offset, length = seen[key]
            tokens = writer.read_back(offset, length).decode("utf-8")
            reused += 1
        offset = writer.write_line(head + tokens + "}")
        tokens_length = len(tokens.encode("utf-8"))
        seen.setdefault(key, (offset + len(head.encode("utf-8")), tokens_length))
    return reused
