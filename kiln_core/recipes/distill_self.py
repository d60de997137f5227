"""``distill self``: privileged-information self-distillation (Kiln's ``/v1/distill/self``), as a corpus and a spec.

Kiln's run (``crates/kiln-server/src/training_queue.rs`` · ``run_distill_self``,
``prepare_self_distill_prompts``, ``validate_self_distill_target_alignment``, ``build_self_distill_teacher``),
step by step, and where each lives here:

1. **Student sequence** (``tokenize_prompts``): the prompt's messages tokenized as for training (the corpus
   row ``messages[:-1]`` + ``teacher_response = messages[-1]``, ``kiln_core.tokenization``); the targets are
   every assistant token.
2. **Teacher sequence**: a system message with Kiln's privileged text (``privileged_text``), then the
   prompt's messages unchanged (an existing system message stays: the teacher sees two), tokenized the same way.
3. **Alignment**: both sides must have the same number of action tokens with the same ids, pair by pair,
   else Kiln's error (``self_distill_misaligned``), before any model loads.
4. **Teacher forward** (``score_corpus``): one forward per prompt of the bare base model (the student's own
   directory, no LoRA) or, with ``teacher``, of a registered local teacher (which may wear a LoRA); the top-K
   of the teacher's action rows is written under the student's rows, one Kiln corpus row per prompt.
5. **Training**: the corpus is an ordinary teacher-scored corpus; the ``PipelineSpec`` names it, off-policy,
   with the request's ``config`` and ``post_eval`` and ``recipe`` set, and ``run_pipeline`` trains it.

The corpus lives under ``<out_root>/recipes/distill_self/<key>.jsonl``, the key a digest of everything that
decides its bytes (the teacher's manifest line, K, and every prompt's rows and token ids on both sides), so
a retry finds it and skips the teacher. Its manifest is the scoring teacher's identity; for the bare base
model its ``served_model_id`` is Kiln's teacher id ``self-<name>:<Mode>`` (valid identity text as it is).

Example:
    >>> request = check_distill_self_request(json.load(open("self.json")))  # doctest: +SKIP
    >>> spec = prepare_distill_self(request, student_dir="./student", out_root="./kiln-data")  # doctest: +SKIP
    >>> run_pipeline(spec).status  # doctest: +SKIP
    'success'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kiln_core.contracts.distill_self import (
    DistillSelfRequest,
    check_distill_self_request,
    self_teacher_id,
)
from kiln_core.contracts.opd_config import resolve_top_k
from kiln_core.contracts.opd_prompt import kiln_prompt_value
from kiln_core.contracts.pipeline import PipelineSpec, parse_spec
from kiln_core.contracts.recipe_record import RecipeRecord, TeacherDescriptor
from kiln_core.errors import Rejection

__all__ = ["check_distill_self_request", "prepare_distill_self", "privileged_text", "teacher_messages",
           "tokenize_prompts", "SelfDistillPair"]

CORPUS_DIR = ("recipes", "distill_self")
"""Where the scored corpora live under the storage root."""

PRIVILEGED_PREFIX = "Privileged context (visible only to the teacher)"
# Kiln's exact texts (training_queue.rs · prepare_self_distill_prompts), em dash and blank line included.
GROUND_TRUTH_TEXT = PRIVILEGED_PREFIX + ": the correct answer is: {answer}"
CONCISENESS_TEXT = (PRIVILEGED_PREFIX + ": respond with maximal concision; trim every unnecessary word; never explain "
                    "reasoning unless explicitly asked.")
DOCUMENT_TEXT = PRIVILEGED_PREFIX + " \u2014 use the following retrieved document to answer:\n\n{document}"
SYSTEM_TURN_REFUSED = ("; the teacher's messages open with the privileged system message (as in Kiln), which the "
                       "student's chat template refuses (docs/chat-templates.md)")


@dataclass(frozen=True)
class SelfDistillPair:
    """One prompt, as the student trains on it and as the teacher scores it.

    Attributes:
        record: The corpus row's input fields (``messages``, ``teacher_response``) on the student's side.
        student_ids: ``int32 [n]`` the student's token ids; ``student_targets`` its action positions.
        teacher_ids: ``int32 [m]`` the teacher's token ids (privileged system message first);
            ``teacher_targets`` its action positions, the same count and the same ids as the student's.
    """

    record: dict[str, Any]
    student_ids: np.ndarray
    student_targets: np.ndarray
    teacher_ids: np.ndarray
    teacher_targets: np.ndarray


def privileged_text(request: DistillSelfRequest, index: int) -> str:
    """Kiln's privileged system message for prompt ``index`` in the request's mode.

    Example:
        >>> privileged_text(DistillSelfRequest(name="x", mode="ground_truth_conditioning",
        ...                                    ground_truth=["4"]), 0)
        'Privileged context (visible only to the teacher): the correct answer is: 4'
    """
    if request.mode == "ground_truth_conditioning":
        return GROUND_TRUTH_TEXT.format(answer=request.ground_truth[index])
    if request.mode == "conciseness":
        return CONCISENESS_TEXT
    if request.mode == "document_as_pi":
        return DOCUMENT_TEXT.format(document=request.documents[index])
    raise ValueError(f"no privileged text for mode {request.mode!r}")  # reverse_teacher: refused at submit


def teacher_messages(request: DistillSelfRequest, index: int) -> list[dict[str, Any]]:
    """The teacher's messages for prompt ``index``: the privileged system message, then the prompt's own.

    Example:
        >>> request = DistillSelfRequest(name="x", mode="conciseness", prompts=[{"messages": [
        ...     {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}])
        >>> [m["role"] for m in teacher_messages(request, 0)]
        ['system', 'user', 'assistant']
    """
    messages = kiln_prompt_value(request.prompts[index])["messages"]
    return [{"role": "system", "content": privileged_text(request, index)}, *messages]


def tokenize_prompts(request: DistillSelfRequest, student) -> list[SelfDistillPair]:
    """Steps 1-3 for every prompt: both sequences tokenized as for training, their action tokens aligned.

    Args:
        request: A request ``check_distill_self_request`` accepted.
        student: The student's ``StudentTokenizer`` (the teacher shares its vocabulary).

    Raises:
        Rejection: ``prompt_tokenization_failed`` (the template or the mask builder refuses a side, Kiln's
            "student/teacher tokenization failed" or "produced no active assistant tokens"),
            ``self_distill_misaligned`` (Kiln's two alignment errors), each naming ``prompts[i]``.

    Example:
        >>> pairs = tokenize_prompts(request, load_student_tokenizer("./student"))  # doctest: +SKIP
    """
    from kiln_core.tokenization import Conversation, TokenizationError, encode_conversations

    pairs = []
    for index in range(len(request.prompts)):
        student_messages = kiln_prompt_value(request.prompts[index])["messages"]
        sides = {"student": student_messages, "teacher": teacher_messages(request, index)}
        encoded = {}
        for side, messages in sides.items():
            try:
                (one,) = encode_conversations(student, [Conversation(messages[:-1], messages[-1]["content"])])
            except TokenizationError as error:
                # The student's side rendered, so the template refuses what the teacher's side adds.
                hint = SYSTEM_TURN_REFUSED if side == "teacher" else ""
                raise _tokenization_failed(index, side, f"{error}{hint}") from None
            if one.problem is not None:
                raise _tokenization_failed(index, side, one.problem.message)
            encoded[side] = one
        check_alignment(index, encoded["student"].input_ids, encoded["student"].action_positions,
                        encoded["teacher"].input_ids, encoded["teacher"].action_positions)
        record = {"messages": student_messages[:-1], "teacher_response": student_messages[-1]["content"]}
        pairs.append(SelfDistillPair(record, encoded["student"].input_ids, encoded["student"].action_positions,
                                     encoded["teacher"].input_ids, encoded["teacher"].action_positions))
    return pairs


def _tokenization_failed(index: int, side: str, detail: str) -> Rejection:
    return Rejection("prompt_tokenization_failed", f"self-distill prompt {index} {side} tokenization failed: {detail}",
                     field=f"prompts[{index}]")


def check_alignment(index: int, student_ids: np.ndarray, student_targets: np.ndarray, teacher_ids: np.ndarray,
                    teacher_targets: np.ndarray) -> None:
    """Kiln's ``validate_self_distill_target_alignment``: as many action tokens on both sides, the same ids.

    Raises:
        Rejection: ``self_distill_misaligned`` with Kiln's message, field ``prompts[i]``.

    Example:
        >>> check_alignment(0, np.array([1, 5, 6]), np.array([1, 2]), np.array([9, 1, 5, 7]), np.array([2, 3]))
        Traceback (most recent call last):
        ...
        kiln_core.errors.Rejection: [self_distill_misaligned] field prompts[0]: self-distill prompt 0 action pair 1 differs: student token 6 at 2, teacher token 7 at 3
    """
    if len(student_targets) != len(teacher_targets):
        raise Rejection("self_distill_misaligned", f"self-distill prompt {index} has {len(student_targets)} student "
                        f"action tokens but {len(teacher_targets)} teacher action tokens", field=f"prompts[{index}]")
    for pair, (s, t) in enumerate(zip(student_targets.tolist(), teacher_targets.tolist())):
        if int(student_ids[s]) != int(teacher_ids[t]):
            raise Rejection("self_distill_misaligned", f"self-distill prompt {index} action pair {pair} differs: "
                            f"student token {int(student_ids[s])} at {s}, teacher token {int(teacher_ids[t])} at {t}",
                            field=f"prompts[{index}]")


# ---------------------------------------------------------------------------------------------- the teacher


@dataclass(frozen=True)
class SelfTeacher:
    """The teacher that scores the privileged sequences, bound before its weights load.

    Attributes:
        identity: Its ``TeacherIdentity`` (the corpus manifest's).
        manifest_line: The corpus's first line.
        load: Loads the scorer (``kiln_core.scoring.local.LocalTeacher``): the expensive step, called last.
    """

    identity: Any
    manifest_line: str
    load: Callable[[], Any]


def bind_teacher(request: DistillSelfRequest, student, *, student_dir: str, out_root: str, teacher: str | None,
                 top_k: int, device: str | None, dtype: str | None) -> SelfTeacher:
    """The bare base model (the student's directory), or the registered local teacher ``teacher``.

    The base model's identity is computed with ``served_model_id`` = ``self-<name>:<Mode>``. A registered
    teacher is bound as ``kiln-flows score --teacher-alias`` binds it: same vocabulary and width as the
    student, ``max_top_k`` ≥ K, and its files still the registered identity (a LoRA teacher's adapter digests
    included), else refused before any weight loads.

    Raises:
        Rejection: ``teacher_not_registered``, ``teacher_invalid``, ``teacher_mismatch``, ``teacher_changed``
            (field ``teacher``); ``student_invalid`` when the student's own identity cannot be computed.
    """
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.scoring.local import LocalTeacher, default_device, default_dtype

    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if teacher is not None:
        return _bind_registered(student, out_root=out_root, alias=teacher, top_k=top_k, device=device, dtype=dtype)
    from kiln_core.identity.hashing import IdentityHashError
    from kiln_core.identity.local_teacher import DEFAULT_MAX_TOP_K, local_teacher_identity

    try:
        identity = local_teacher_identity(student_dir, served_model_id=self_teacher_id(request),
                                          max_top_k=min(max(top_k, DEFAULT_MAX_TOP_K), student.vocab_size),
                                          dtype=dtype, attn_implementation="eager", device_kind=device)
    except IdentityHashError as error:
        raise Rejection("student_invalid", f"the student's identity (the self-teacher's) cannot be computed: {error}",
                        field="student") from None
    return SelfTeacher(identity, build_manifest_line(identity), lambda: LocalTeacher.load(
        student_dir, vocab_size=student.vocab_size, dtype=dtype, attn_implementation="eager", device=device))


def _bind_registered(student, *, out_root: str, alias: str, top_k: int, device: str, dtype: str) -> SelfTeacher:
    from kiln_core.scoring import _bind_teacher  # the scoring binding, shared with sharded scoring
    from kiln_core.scoring.examples import ScoringError
    from kiln_core.teachers.local_registry import LocalRegistryError, get_local_teacher

    try:
        get_local_teacher(out_root, alias)
    except (LocalRegistryError, ValueError) as error:
        detail = error.message if isinstance(error, LocalRegistryError) else "not a valid alias"
        raise Rejection("teacher_not_registered", f"teacher {alias!r} is not registered under {out_root}: {detail}",
                        field="teacher") from None
    try:
        binding, load = _bind_teacher(student, top_k, teacher_dir=None, teacher_alias=alias, registry_root=out_root,
                                      dtype=dtype, attn_implementation="eager", vllm_url=None, served_model=None,
                                      pinned_manifest=None, device=device, batch_size=1)
    except ScoringError as error:
        if not isinstance(error, Rejection):
            raise
        raise Rejection(error.code, error.message, field="teacher") from None
    return SelfTeacher(binding.identity, binding.manifest_line, load)


# ---------------------------------------------------------------------------------------------- the corpus


def corpus_location(out_root: str, pairs: list[SelfDistillPair], manifest_line: str, top_k: int) -> str:
    """``<out_root>/recipes/distill_self/<key>.jsonl``, the key a digest of everything that decides its bytes."""
    import json

    from kiln_core.storage import resolve

    digest = hashlib.sha256(b"kiln-flows.distill-self.corpus.v1\0")
    digest.update(manifest_line.encode("utf-8") + b"\0" + str(top_k).encode() + b"\0")
    for pair in pairs:
        digest.update(json.dumps(pair.record, ensure_ascii=False, sort_keys=True).encode("utf-8") + b"\0")
        for array in (pair.student_ids, pair.student_targets, pair.teacher_ids, pair.teacher_targets):
            digest.update(np.asarray(array, dtype="<i4").tobytes() + b"|")
    return resolve(out_root).child(*CORPUS_DIR, f"{digest.hexdigest()[:24]}.jsonl").uri


def score_corpus(pairs: list[SelfDistillPair], teacher: SelfTeacher, *, student, top_k: int, out_uri: str,
                 on_progress: Callable[[int, int], None] | None = None) -> int:
    """Step 4: one teacher forward per prompt, its top-K written under the student's row; published atomically.

    A prompt whose student and teacher sequences both repeat an earlier prompt's reuses its rows byte for
    byte (admission refuses two different scores for one exact sequence, and scores of one sequence may
    differ in their last bits).

    Returns:
        Action tokens written (one ``teacher_tokens`` entry each).

    Raises:
        Rejection: ``self_distill_conflicting_rows`` when two prompts share a student sequence but not a
            teacher sequence (Kiln: "conflicting exact-sequence fixture row"), before the teacher loads.
    """
    from kiln_core.scoring.examples import ScoreRequest
    from kiln_core.scoring.writer import CorpusWriter, TokenTexts, row_head, teacher_tokens_json

    firsts = _first_occurrences(pairs)
    scorer = teacher.load()
    token_text = TokenTexts(student.tokenizer)
    tokens_json: dict[int, str] = {}
    written = 0
    with CorpusWriter(out_uri) as writer:
        writer.write_line(teacher.manifest_line)
        for index, pair in enumerate(pairs):
            first = firsts[index]
            if first not in tokens_json:
                request = ScoreRequest(line=index + 1, input_ids=pair.teacher_ids, positions=pair.teacher_targets)
                (rows,) = scorer.score([request], top_k)
                tokens_json[first] = teacher_tokens_json(rows, token_text)
            writer.write_line(row_head(pair.record) + tokens_json[first] + "}")
            written += len(pair.student_targets)
            if on_progress is not None:
                on_progress(index + 1, len(pairs))
        writer.commit()
    return written


def _first_occurrences(pairs: list[SelfDistillPair]) -> list[int]:
    """For each prompt, the first prompt with the same student sequence (itself when it is the first)."""
    seen: dict[bytes, int] = {}
    firsts = []
    for index, pair in enumerate(pairs):
        key = _sequence_key(pair.student_ids, pair.student_targets)
        first = seen.setdefault(key, index)
        if first != index and _sequence_key(pairs[first].teacher_ids, pairs[first].teacher_targets) != _sequence_key(
                pair.teacher_ids, pair.teacher_targets):
            raise Rejection("self_distill_conflicting_rows", f"self-distill prompts {first} and {index} tokenize to "
                            "the same student sequence but different teacher sequences, so they would give one "
                            "sequence two different scores; deduplicate the prompts", field=f"prompts[{index}]")
        firsts.append(first)
    return firsts


def _sequence_key(ids: np.ndarray, targets: np.ndarray) -> bytes:
    digest = hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes())
    digest.update(b"|" + np.asarray(targets, dtype="<i4").tobytes())
    return digest.digest()


# ---------------------------------------------------------------------------------------------- the spec


def prepare_distill_self(request: DistillSelfRequest, *, student_dir: str, out_root: str,
                         base_adapter: str | None = None, recipe: str | None = None, step: int | None = None,
                         teacher: str | None = None, device: str | None = None, dtype: str | None = None,
                         on_progress: Callable[[int, int], None] | None = None) -> PipelineSpec:
    """The checks that need files, the teacher's corpus (scored once, reused on a retry), and the spec.

    ``post_eval``'s suite is checked by the engine before training (``check_gate_inputs``); the CLI and the
    task check it first, before the teacher runs.

    Args:
        request: A request ``check_distill_self_request`` accepted.
        student_dir: The student model directory; without ``teacher`` also the teacher (the bare base model).
        out_root: The storage root (runs, registry, eval suites, and the corpus under ``recipes/distill_self``).
        base_adapter: A published adapter the student warm-starts from (``config.base_adapter``; a recipe's
            chained step); default the request's own ``config.base_adapter``.
        recipe: The recipe file's name when this is one of its steps; ``step`` its 0-based index.
        teacher: A local teacher alias registered under ``out_root`` (it may wear a LoRA) instead of the base.
        device: Teacher device, ``cpu`` or ``cuda`` (default CUDA when available).
        dtype: Teacher dtype (default fp32 on CPU, bf16 on CUDA).
        on_progress: Called as ``on_progress(done, total)`` after each prompt the teacher scores.

    Returns:
        The spec ``run_pipeline`` trains: the corpus with its manifest as the teacher, off-policy, the request's
        config (``output_name`` = name, ``auto_load`` false, as Kiln's runner sets them) and ``post_eval``,
        adapter = name, and ``recipe`` = the ``RecipeRecord`` every receipt of the run carries.

    Raises:
        Rejection: ``student_invalid``, the tokenization and alignment codes
            of ``tokenize_prompts``, ``context_too_long``, the teacher codes of ``bind_teacher``,
            ``self_distill_conflicting_rows``; all before any weight loads.

    Example:
        >>> spec = prepare_distill_self(request, student_dir="./student", out_root="./kiln-data")  # doctest: +SKIP
        >>> spec.recipe.teacher.alias  # doctest: +SKIP
        'self-terse:Conciseness'
    """
    from kiln_core.storage import resolve

    student = _student_tokenizer(student_dir)
    top_k = resolve_top_k(request.config.top_k)  # Kiln's self rule: the cap is the requested K
    pairs = tokenize_prompts(request, student)
    self_teacher = bind_teacher(request, student, student_dir=student_dir, out_root=out_root, teacher=teacher,
                                top_k=top_k, device=device, dtype=dtype)
    _check_lengths(pairs, self_teacher.identity.max_model_len)
    corpus = corpus_location(out_root, pairs, self_teacher.manifest_line, top_k)
    if not resolve(corpus).exists():  # published atomically: when it is there, it is whole
        score_corpus(pairs, self_teacher, student=student, top_k=top_k, out_uri=corpus, on_progress=on_progress)
    config = request.config.model_copy(update={
        "output_name": request.name, "auto_load": False,
        "base_adapter": base_adapter if base_adapter is not None else request.config.base_adapter,
    })
    spec = parse_spec({"teacher": {"kind": "manifest_file", "path": corpus}, "corpus": corpus, "student": student_dir,
                       "storage_root": out_root, "adapter": request.name, "config": config,
                       "post_eval": request.post_eval})
    record = RecipeRecord(kind="distill_self", mode=request.mode, name=request.name,
                          teacher=TeacherDescriptor(alias=self_teacher_id(request), model_id=self_teacher_id(request)),
                          teacher_identity_revision=self_teacher.identity.identity_revision(),
                          teacher_identity=self_teacher.identity.as_ordered_dict(),
                          request=request_json(request), recipe=recipe, step=step)
    return spec.model_copy(update={"recipe": record})


def request_json(request: DistillSelfRequest) -> dict[str, Any]:
    """The whole request as JSON, as Kiln records it (``hyperparameters``): every field with its value or
    default; ``post_eval`` left out when absent (Kiln's ``skip_serializing_if``).

    Example:
        >>> request_json(DistillSelfRequest(name="x", mode="conciseness"))["config"]["training_mode"]
        'off_policy'
    """
    value = request.model_dump(mode="json", exclude={"prompts"})
    value["prompts"] = None if request.prompts is None else [kiln_prompt_value(p) for p in request.prompts]
    if value.get("post_eval") is None:
        value.pop("post_eval", None)
    return value


def _student_tokenizer(student_dir: str):
    from kiln_core.tokenization import TokenizationError, load_student_tokenizer

    try:
        return load_student_tokenizer(student_dir)
    except TokenizationError as error:
        raise Rejection("student_invalid", f"student {student_dir}: {error}", field="student") from None


def _check_lengths(pairs: list[SelfDistillPair], max_model_len: int) -> None:
    for index, pair in enumerate(pairs):
        length = max(len(pair.student_ids), len(pair.teacher_ids))
        if length > max_model_len:
            raise Rejection("context_too_long", f"self-distill prompt {index} is {length} tokens with the privileged "
                            f"context, more than the teacher's max_model_len {max_model_len}", field=f"prompts[{index}]")
