"""The real-model preparation shared by ``kiln-flows demo --real`` and ``bench/distill_quality.py``.

Each step is cached under one directory and content-addressed, so a rerun skips what it already has
and a change of any input makes a new entry instead of reusing a stale one:

1. ``prepare_teacher`` — SmolLM2-135M-Instruct imported from the installed GGUF
   (``models/<gguf sha256 prefix>/teacher``);
2. ``teacher_examples`` — the teacher's greedy answers to the shipped prompts
   (``examples/<key>.jsonl``, key = SHA-256 of the teacher's weight digest, the prompts and the
   generation settings);
3. ``scored_corpus`` — those examples scored by the teacher through ``kiln_core.scoring`` (the path
   ``kiln-flows score`` takes) into a corpus admission accepts (``corpora/<key>.jsonl``);
4. ``prepare_student`` — the teacher's depth-pruned student (``…/student-<spec>``, beside the teacher),
   after the corpora because an ``auto:N`` student is chosen by a search probed on a scored corpus.

Everything is published atomically (a temp file renamed, or a staged directory), so an interrupted
run leaves no half entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["prepare_teacher", "teacher_examples", "scored_corpus", "prepare_student"]

GENERATION_FORMAT = "kiln-flows.teacher-greedy-answers.v1"


def prepare_teacher(cache_dir: str | os.PathLike[str], on_stage: Callable[[str], None] | None = None) -> Path:
    """SmolLM2-135M-Instruct imported from the installed GGUF, once per GGUF file."""
    from kiln_core.identity.hashing import sha256_file
    from kiln_core.models import import_gguf, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    teacher = Path(cache_dir, "models", sha256_file(gguf)[0].hex()[:16], "teacher")
    if not (teacher / "kiln-import.json").is_file():
        if on_stage:
            on_stage("import")
        import_gguf(gguf, teacher)
    return teacher


def prepare_student(teacher: str | os.PathLike[str], keep_layers: str = "every:2", *,
                    probe_corpus: str | os.PathLike[str] | None = None,
                    on_stage: Callable[[str], None] | None = None) -> Path:
    """The student ``derive-student --keep-layers keep_layers`` makes from ``teacher``, once per spec.

    ``probe_corpus`` is the layer search's scored slice, used by ``auto:N`` only (which needs it); its name
    is then part of the cache entry, so another probe makes another student.
    """
    from kiln_core.models.derive import derive_student
    from kiln_core.models.layer_search import is_auto

    name = "student-" + keep_layers.replace(":", "").replace(",", "_")
    if probe_corpus is not None and is_auto(keep_layers):
        name += "-probe-" + Path(probe_corpus).stem[:12]
    student = Path(teacher).parent / name  # beside its teacher: the GGUF's digest names both
    if not (student / "kiln-derivation.json").is_file():
        if on_stage:
            on_stage("derive")
        derive_student(teacher, keep_layers, student,
                       probe_corpus=None if probe_corpus is None else str(probe_corpus))
    return student


def teacher_examples(teacher_dir: str | os.PathLike[str], prompts: Sequence[dict[str, Any]], cache_dir: str | os.PathLike[str], *,
                     max_new_tokens: int = 32, batch_size: int = 32,
                     on_progress: Callable[[int, int], None] | None = None) -> Path:
    """Examples (``id``, ``messages``, ``teacher_response``) with the teacher's greedy answers, cached.

    Args:
        teacher_dir: The teacher model directory.
        prompts: ``{"id", "prompt"}`` rows (``kiln_core.data.load_prompts``).
        cache_dir: The cache root.
        max_new_tokens: Answer length limit.
        batch_size: Prompts generated together.
        on_progress: Called as ``(done, total)`` after each batch.

    Returns:
        The examples JSONL path.
    """
    from kiln_core.evaluation import generate_answers, load_eval_model
    from kiln_core.identity.hashing import base_model_sha256

    settings = {"format": GENERATION_FORMAT, "teacher_base_model_sha256": base_model_sha256(teacher_dir),
                "max_new_tokens": max_new_tokens, "decoding": "greedy",
                "prompts": [[row["id"], row["prompt"]] for row in prompts]}
    path = Path(cache_dir, "examples", _key(settings) + ".jsonl")
    if path.is_file():
        return path
    # Answers are appended batch by batch to a partial file under the same key, so an interrupted run
    # resumes where it stopped instead of answering everything again; the finished file is published
    # atomically and never regenerated.
    partial = path.with_suffix(".partial.jsonl")
    done = {json.loads(line)["id"]: line for line in _complete_lines(partial)}
    todo = [row for row in prompts if row["id"] not in done]
    model = load_eval_model(teacher_dir, device="cpu") if todo else None
    partial.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "a", encoding="utf-8") as sink:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            messages = [[{"role": "user", "content": row["prompt"]}] for row in chunk]
            answers = generate_answers(model, messages, max_new_tokens=max_new_tokens, batch_size=batch_size)
            for row, prompt, answer in zip(chunk, messages, answers):
                line = json.dumps({"id": row["id"], "messages": prompt, "teacher_response": answer or "."},
                                  ensure_ascii=False) + "\n"
                sink.write(line)
                done[row["id"]] = line
            sink.flush()
            if on_progress:
                on_progress(len(prompts) - len(todo) + min(start + batch_size, len(todo)), len(prompts))
    _write_atomic(path, "".join(done[row["id"]] for row in prompts).encode("utf-8"))
    partial.unlink()
    return path


def _complete_lines(path: Path) -> list[str]:
    """The newline-terminated lines of a partial file (a line cut by a crash is dropped)."""
    if not path.is_file():
        return []
    return [line + "\n" for line in path.read_text(encoding="utf-8").split("\n")[:-1] if line.strip()]


def scored_corpus(examples: str | os.PathLike[str], teacher_dir: str | os.PathLike[str],
                  student_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str], *, top_k: int = 32,
                  on_progress: Callable[[int, int], None] | None = None) -> Path:
    """``examples`` scored by the teacher for the student's masks, cached by content.

    The cache key binds the examples' bytes, the teacher's weights, the student's tokenizer and
    template (which pick the targets) and K.
    """
    from kiln_core.identity.hashing import base_model_sha256
    from kiln_core.scoring import score_examples
    from kiln_core.tokenization import load_student_tokenizer

    identity = load_student_tokenizer(student_dir).identity()
    key = _key({"examples_sha256": hashlib.sha256(Path(examples).read_bytes()).hexdigest(),
                "teacher": base_model_sha256(teacher_dir), "student_tokenizer": identity, "top_k": top_k})
    path = Path(cache_dir, "corpora", key + ".jsonl")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        score_examples(str(examples), teacher_dir=str(teacher_dir), student_dir=str(student_dir), top_k=top_k,
                       out_uri=str(path), batch_size=8, on_progress=on_progress)
    return path


def _key(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:32]


def _write_atomic(path: Path, data: bytes) -> None:
    from kiln_core.storage import resolve, write_bytes_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(resolve(str(path)), data)
