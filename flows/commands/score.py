"""``kiln-flows score``: score unscored examples with a teacher into a Kiln-admissible corpus.

    $ kiln-flows score examples.jsonl --teacher ./teacher --student ./student --top-k 32 --out teacher-data.jsonl
    $ kiln-flows score examples.jsonl --teacher tiny-teacher --registry ./kiln-data --student ./student \\
          --top-k 16 --out s3://bucket/teacher-data.jsonl
    $ kiln-flows score examples.jsonl --vllm http://127.0.0.1:8000 --served-model teacher \\
          --teacher-manifest manifest.jsonl --student ./student --top-k 16 --out teacher-data.jsonl

``--teacher`` is a directory when one exists at that path, else an alias in the local registry
under ``--registry``. The corpus is published atomically: on any failure nothing appears at ``--out``
(here the output *file*, as for ``oracle make-request``).
Exit codes: 0 written, 2 rejected input (bad example, mismatched teacher, contract violation),
3 failure (vLLM unreachable or 5xx, storage).
"""

from __future__ import annotations

import argparse

from flows.commands._options import DTYPES, add_dtype_argument, add_json_argument, add_quiet_argument, add_registry_argument

NAME = "score"
HELP = "Score unscored examples with a local or vLLM teacher into a teacher-scored JSONL corpus."
# Kiln admits corpora of at most 64 MiB (Kiln's docs/OPD_TEACHER_JSONL.md).
KILN_MAX_CORPUS_BYTES = 64 * 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``score`` options to its subparser."""
    parser.add_argument("examples", metavar="EXAMPLES", help="JSONL of examples: a local path or fsspec URI")
    parser.add_argument("--teacher", metavar="DIR|ALIAS", help="local teacher directory, or an alias registered under --registry")
    parser.add_argument("--student", required=True, metavar="DIR", help="student model directory (tokenizer + chat template)")
    parser.add_argument("--top-k", type=int, required=True, metavar="K", help="candidates per action token")
    parser.add_argument("--out", required=True, metavar="CORPUS", help="output corpus: a local path or fsspec URI")
    add_registry_argument(parser)
    parser.add_argument("--batch-size", type=int, default=8, metavar="N",
                        help="examples per forward pass, or vLLM requests in flight (default 8)")
    add_dtype_argument(parser, help="local teacher dtype (default: fp32 CPU, bf16 CUDA)")
    parser.add_argument("--attn-implementation", default="eager", choices=["eager", "sdpa"],
                        help="local teacher attention kernel (default eager)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="local teacher device (default: cuda if available)")
    vllm = parser.add_argument_group("vLLM teacher (instead of --teacher)")
    vllm.add_argument("--vllm", metavar="URL", help="vLLM server base URL, e.g. http://127.0.0.1:8000")
    vllm.add_argument("--served-model", metavar="ID", help="the served model name (the identity's served_model_id)")
    vllm.add_argument("--teacher-manifest", metavar="FILE",
                      help="file whose first line is the teacher's pinned manifest (required with --vllm)")
    add_json_argument(parser)
    add_quiet_argument(parser)


def _teacher_source(args: argparse.Namespace) -> dict:
    import os

    if args.teacher is None:
        return {}
    if os.path.isdir(args.teacher):
        return {"teacher_dir": args.teacher}
    return {"teacher_alias": args.teacher, "registry_root": args.registry}


def run(args: argparse.Namespace) -> int:
    """Score and print a summary (or JSON); rejections (exit 2) and failures (exit 3) go to the guard."""
    import json
    import sys

    from kiln_core.scoring import score_examples
    from kiln_core.teachers.local_registry import read_manifest_file

    if (args.teacher is None) == (args.vllm is None):
        print("kiln-flows score: give exactly one of --teacher DIR|ALIAS or --vllm URL", file=sys.stderr)
        return 2
    progress = None if args.quiet else _ProgressBar()
    if args.quiet:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # the weight-loading bar too
    try:
        pinned = read_manifest_file(args.teacher_manifest) if args.teacher_manifest else None
        result = score_examples(
            args.examples,
            **_teacher_source(args),
            student_dir=args.student,
            top_k=args.top_k,
            out_uri=args.out,
            batch_size=args.batch_size,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            attn_implementation=args.attn_implementation,
            vllm_url=args.vllm,
            served_model=args.served_model,
            pinned_manifest=pinned,
            on_progress=progress,
            device=args.device,
        )
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        print(json.dumps(result.model_dump(mode="json"), ensure_ascii=False))
    else:
        print(
            f"scored {result.examples} examples, {result.action_tokens} action tokens with teacher "
            f"{result.identity_revision}\n  {result.out_uri} ({result.sha256}, {result.size_bytes} bytes)"
        )
    if result.size_bytes > KILN_MAX_CORPUS_BYTES:
        print(f"kiln-flows score: warning: the corpus is {result.size_bytes} bytes; Kiln admits at most 64 MiB",
              file=sys.stderr)
    return 0


class _ProgressBar:
    """A tqdm bar on stderr, created on the first progress report (when the total is known)."""

    def __init__(self) -> None:
        self._bar = None

    def __call__(self, done: int, total: int) -> None:
        import sys

        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=total, unit="ex", desc="scoring", file=sys.stderr, dynamic_ncols=True)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
