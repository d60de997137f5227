"""The held-out corpus: admitted with training's rules and masks, plus the rules of held-out data.

``admit_eval_corpus`` runs ``kiln_core.admission.admit_corpus`` (the same parser, row rules and mask
builder as training; a pinned teacher manifest makes a corpus scored by another teacher an
``identity_mismatch``), then adds what makes a held-out score meaningful:

* **same vocabulary** — the corpus teacher's ``tokenizer_vocab_sha256`` must be the student's
  (admission checks only the logit width): ``vocabulary_mismatch``;
* **no overlap with training** — when the training data are given (a corpus, or an on-policy run's
  prompts), no held-out example may have the same prompt as a training example: ``eval_train_overlap``.
  Two examples have the same prompt when their ``messages`` are equal message by message after
  admission's normalization (role, content as text, every other field), i.e. the same conversation up
  to the teacher's answer. Against on-policy prompts (``check_no_prompt_overlap``), a prompt's
  conversation is the one the student samples its answer after
  (``kiln_core.on_policy.render.rollout_messages``): with Kiln's default ``legacy_action_boundary``
  rendering its ``messages`` before the first assistant turn, with ``chat_template`` its ``messages``
  without trailing assistant turns. A single-turn prompt (user turn, then Kiln's empty assistant turn)
  is its user turn either way.
"""

from __future__ import annotations

import json
from typing import Any

from kiln_core.contracts.stage_refs import HeldOutRef
from kiln_core.corpus import CorpusTables
from kiln_core.errors import EnvironmentFailure
from kiln_core.evaluation.models import EvalInputError

__all__ = ["admit_eval_corpus", "admitted_tables", "held_out_ref", "prompt_key", "check_no_overlap",
           "check_no_prompt_overlap"]


def admit_eval_corpus(corpus_uri: str, student_dir: str, *, top_k: int = 32, effective_top_k: int | None = None,
                      teacher_manifest: str | None = None,
                      train_corpus_uri: str | None = None, train_prompts: Any = None,
                      prompt_rendering: str = "legacy_action_boundary", out_root: str | None = None) -> Any:
    """Admit a held-out corpus for ``student_dir`` and apply the held-out rules.

    Args:
        corpus_uri: The held-out teacher-scored JSONL.
        student_dir: The student being evaluated (its tokenizer and template make the masks).
        top_k: Requested K, resolved as admission does (32 or 16).
        effective_top_k: The run's effective top-K (``ResolvedSettings.top_k``), taken as it is.
        teacher_manifest: The expected teacher's manifest line; another teacher is refused.
        train_corpus_uri: The corpus the student was trained on; overlapping prompts are refused.
        train_prompts: The on-policy prompts the student was trained on (``OpdPrompt``s, or the
            ``PromptFile`` they were read from); overlapping prompts are refused.
        prompt_rendering: The run's ``rollout_prompt_rendering`` (which conversation a prompt is).
        out_root: Storage root to materialize the admitted corpus under (``<root>/corpora/<hex>/``, as
            admission does: a committed one is reused), once every held-out rule passed; None keeps it
            in memory.

    Returns:
        The ``AdmissionResult`` (its ``materialized`` URI set with ``out_root``).

    Raises:
        AdmissionError: any admission rule (``identity_mismatch`` for another teacher).
        EvalInputError: ``vocabulary_mismatch``, ``eval_train_overlap``.
    """
    from kiln_core.admission import admit_corpus
    from kiln_core.tokenization import load_student_tokenizer

    student = load_student_tokenizer(student_dir)
    _check_vocabulary(corpus_uri, student)  # before admission: its token rules would fail less clearly

    def held_out_rules() -> None:
        if train_corpus_uri is not None:
            check_no_overlap(corpus_uri, train_corpus_uri)
        if train_prompts is not None:
            check_no_prompt_overlap(corpus_uri, train_prompts, rendering=prompt_rendering)

    return admit_corpus(corpus_uri, student_dir, top_k=top_k, effective_top_k=effective_top_k,
                        pinned_manifest=teacher_manifest, student=student,
                        out_root=out_root, before_commit=held_out_rules)


def admitted_tables(held_out: HeldOutRef) -> CorpusTables:
    """The tables of a held-out corpus admitted earlier in the run (``admit_eval_corpus(out_root=...)``), read
    back from its committed materialization (each file verified against ``admission.json``) instead of
    admitting the corpus again.

    Raises:
        EnvironmentFailure: ``corpus_changed`` when the materialization is not the admitted corpus.
        FileNotFoundError: no committed materialization at ``held_out.uri``.
    """
    from kiln_core.materialize import read_materialization

    materialization = read_materialization(held_out.uri)
    if materialization.record.dataset_sha256 != held_out.corpus_sha256:
        raise EnvironmentFailure("corpus_changed", f"{held_out.uri} holds {materialization.record.dataset_sha256}, "
                                 f"not the held-out corpus admitted for this run ({held_out.corpus_sha256})",
                                 file=held_out.uri)
    return materialization.tables


def held_out_ref(admission: Any) -> HeldOutRef:
    """What a run carries of a held-out corpus ``admit_eval_corpus(out_root=...)`` admitted and materialized."""
    return HeldOutRef(uri=admission.materialized, corpus_sha256=admission.dataset_sha256, examples=admission.examples,
                      action_tokens=admission.action_tokens)


def _check_vocabulary(corpus_uri: str, student: Any) -> None:
    """The manifest's tokenizer must be the student's (a corpus without a usable manifest is left to admission)."""
    from kiln_core.admission.source import read_corpus
    from kiln_core.contracts.identity import ManifestError, parse_manifest_line
    from kiln_core.identity.hashing import tokenizer_vocab_sha256

    data = read_corpus(corpus_uri).data
    first = next((line for line in data.split(b"\n") if line.strip()), b"")
    try:
        identity = parse_manifest_line(first.decode("utf-8").strip()).teacher_identity
    except (ManifestError, UnicodeDecodeError, ValueError):
        return
    student_vocab = tokenizer_vocab_sha256(student.tokenizer)
    if identity.tokenizer_vocab_sha256 != student_vocab:
        raise EvalInputError(
            "vocabulary_mismatch",
            f"the corpus was scored with tokenizer_vocab_sha256 {identity.tokenizer_vocab_sha256}, the student "
            f"{student.model_dir} has {student_vocab}: its token ids would not mean the teacher's tokens",
            file=corpus_uri)


def prompt_key(messages: list[dict[str, Any]]) -> str:
    """The canonical text of a normalized prompt: two examples share a prompt iff their keys are equal."""
    return json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def check_no_overlap(eval_uri: str, train_uri: str) -> None:
    """Refuse a held-out corpus that shares a prompt with the training corpus.

    Raises:
        EvalInputError: ``eval_train_overlap`` naming the first held-out line and its training line.
        AdmissionError: the training corpus cannot be read or parsed.
    """
    from kiln_core.admission.shard_sources import training_files

    train_prompts: dict[str, str] = {}
    for file_uri, where in training_files(train_uri):  # one file, or every shard of a set in order
        for line, messages in _prompts(file_uri):
            train_prompts.setdefault(prompt_key(messages), f"line {line} of {where}")
    _refuse_shared_prompts(eval_uri, train_prompts)


def check_no_prompt_overlap(eval_uri: str, prompts: Any, *, rendering: str = "legacy_action_boundary") -> None:
    """Refuse a held-out corpus that shares a prompt with on-policy training prompts.

    Args:
        eval_uri: The held-out teacher-scored JSONL.
        prompts: ``OpdPrompt``s, or the ``PromptFile`` they were read from (the message then names its
            file and line).
        rendering: The run's ``rollout_prompt_rendering``.

    Raises:
        EvalInputError: ``eval_train_overlap`` naming the first held-out line and the training prompt.
    """
    from kiln_core.contracts.opd_prompt import kiln_prompt_value
    from kiln_core.on_policy.render import rollout_messages

    lines, source = getattr(prompts, "lines", None), getattr(prompts, "uri", None)
    train_prompts: dict[str, str] = {}
    for index, prompt in enumerate(getattr(prompts, "prompts", prompts)):
        messages = rollout_messages(kiln_prompt_value(prompt)["messages"], rendering)
        where = f"training prompt {index}" + (f" (line {lines[index]} of the prompt file {source})" if lines else "")
        train_prompts.setdefault(prompt_key(messages), where)
    _refuse_shared_prompts(eval_uri, train_prompts)


def _refuse_shared_prompts(eval_uri: str, train_prompts: dict[str, str]) -> None:
    """``eval_train_overlap`` at the first held-out example whose prompt key is in ``train_prompts``
    (key → where that prompt is in the training data)."""
    for line, messages in _prompts(eval_uri):
        where = train_prompts.get(prompt_key(messages))
        if where is not None:
            raise EvalInputError(
                "eval_train_overlap",
                f"held-out example has the same prompt messages as {where}; a held-out score must come from "
                "prompts the student never trained on", line=line, file=eval_uri)


def _prompts(uri: str):
    """``(physical line, normalized messages)`` of every example, parsed by admission's parser."""
    from kiln_core.admission.records import parse_corpus
    from kiln_core.admission.source import read_corpus

    parsed = parse_corpus(read_corpus(uri).data)
    for line, conversation in zip(parsed.example_lines.tolist(), parsed.conversations):
        yield int(line), list(conversation.messages)
