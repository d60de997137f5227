"""``kiln-flows admit``: admit a teacher-scored corpus for a student, or say exactly why not."""

from __future__ import annotations

import argparse
import json

from flows.commands._options import add_json_argument, add_out_argument

NAME = "admit"
HELP = "Admit a teacher-scored JSONL corpus (validate, and materialize with --out)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("corpus", help="JSONL corpus: a local path or any fsspec URI")
    parser.add_argument("--student", required=True, help="student model directory (config.json + fast tokenizer)")
    parser.add_argument("--top-k", type=int, default=32, help="requested top-K (resolved to 32 or 16; default 32)")
    parser.add_argument("--teacher-manifest", metavar="FILE", help="file holding the registered teacher's manifest line")
    add_out_argument(parser, default=None, help="storage root to materialize under; omit to validate only")
    parser.add_argument("--kiln-strict", action="store_true", help="accept only Kiln's vLLM teacher protocol")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Admit; a rejection (exit 2) or storage failure (exit 3) is reported by the CLI's guard."""
    from kiln_core.admission import admit_corpus

    result = admit_corpus(
        args.corpus,
        args.student,
        top_k=args.top_k,
        pinned_manifest=_read_pinned(args.teacher_manifest),
        kiln_strict=args.kiln_strict,
        out_root=args.out,
    )
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        where = result.materialized or "(validated only; pass --out to materialize)"
        reused = " (already materialized)" if result.reused else ""
        print(
            f"admitted {result.dataset_sha256}: {result.examples} examples, {result.action_tokens} action tokens, "
            f"{result.env_tokens} env tokens (ECHO |O| {result.observation_tokens}), top_k {result.effective_top_k}"
            f"{reused}\n  {where}"
        )
    return 0


def _read_pinned(path: str | None) -> str | None:
    from kiln_core.errors import AdmissionError

    if path is None:
        return None
    try:
        # The manifest is the file's first line: a manifest file, or a scored corpus itself.
        with open(path, "rb") as handle:
            return handle.readline().decode("utf-8", errors="replace")
    except OSError as error:
        raise AdmissionError("file_not_found", None, f"teacher manifest file {path}: {error.strerror}") from None
