"""One rule shared by every stage that puts a teacher and a student side by side: same vocabulary.

Distillation compares the two models token id by token id, so both must map the same strings to the
same ids (``kiln.tokenizer-vocab.v1`` digest, Kiln's scripts/vllm_teacher.py) and have the same
logit width (``vocab_size``). Scoring applies the same rule to its teacher (``kiln_core.scoring``);
this module states it for two model directories (``kiln-flows eval --teacher``, the real demo, the
quality bench).
"""

from __future__ import annotations

import os

from kiln_core.errors import Rejection

__all__ = ["VocabularyMismatch", "check_same_vocabulary"]


class VocabularyMismatch(Rejection):
    """The student's token ids would not mean the teacher's tokens (code ``vocabulary_mismatch``)."""

    def __init__(self, message: str, *, file: str | None = None) -> None:
        super().__init__("vocabulary_mismatch", message, file=file)


def check_same_vocabulary(teacher_dir: str | os.PathLike[str], student_dir: str | os.PathLike[str]) -> str:
    """Refuse a student whose tokenizer vocabulary or logit width differs from the teacher's.

    Returns:
        The shared ``tokenizer_vocab_sha256``.

    Raises:
        VocabularyMismatch: the digests or the ``vocab_size`` differ.
        IdentityHashError: a directory without a fast tokenizer or a usable ``config.json``.

    Example:
        >>> check_same_vocabulary("models/teacher", "models/student")  # doctest: +SKIP
        'a3f…'
    """
    from kiln_core.identity.hashing import model_vocab_size, tokenizer_vocab_sha256

    teacher_vocab, student_vocab = tokenizer_vocab_sha256(str(teacher_dir)), tokenizer_vocab_sha256(str(student_dir))
    if teacher_vocab != student_vocab:
        raise VocabularyMismatch(
            f"student {student_dir} has tokenizer_vocab_sha256 {student_vocab}, the teacher {teacher_dir} has "
            f"{teacher_vocab}: the student's token ids would not mean the teacher's tokens", file=str(student_dir))
    teacher_width, student_width = model_vocab_size(teacher_dir), model_vocab_size(student_dir)
    if teacher_width != student_width:
        raise VocabularyMismatch(
            f"student {student_dir} has vocab_size (logit width) {student_width}, the teacher {teacher_dir} has "
            f"{teacher_width}", file=str(student_dir))
    return teacher_vocab
