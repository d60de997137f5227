"""``kiln-flows admit``: admit a teacher-scored corpus for a student, or say exactly why not."""

from __future__ import annotations

import argparse
import json

from flows.commands._options import add_json_argument, add_out_argument, add_quiet_argument

NAME = "admit"
HELP = "Admit a teacher-scored JSONL corpus or a set of shards (validate, and materialize with --out)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("corpus", help="JSONL corpus, a directory of *.jsonl shards, or a shard index "
                        "(*.index.json): a local path or any fsspec URI")
    parser.add_argument("--student", required=True, help="student model directory (config.json + fast tokenizer)")
    parser.add_argument("--top-k", type=int, default=32, help="requested top-K (resolved to 32 or 16; default 32)")
    parser.add_argument("--teacher-manifest", metavar="FILE", help="file holding the registered teacher's manifest line")
    add_out_argument(parser, default=None, help="storage root to materialize under; omit to validate only")
    parser.add_argument("--kiln-strict", action="store_true", help="accept only Kiln's vLLM teacher protocol")
    parser.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                        help="shards admitted at once, each in its own process (a set of shards only; default 1)")
    add_json_argument(parser)
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Admit; a rejection (exit 2) or storage failure (exit 3) is reported by the CLI's guard."""
    from kiln_core.admission import admit_corpus
    from kiln_core.admission.shards import is_shard_set

    if is_shard_set(args.corpus):
        return _run_set(args)
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
    elif not args.quiet:
        where = result.materialized or "(validated only; pass --out to materialize)"
        reused = " (already materialized)" if result.reused else ""
        print(
            f"admitted {result.dataset_sha256}: {result.examples} examples, {result.action_tokens} action tokens, "
            f"{result.env_tokens} env tokens (ECHO |O| {result.observation_tokens}), top_k {result.effective_top_k}"
            f"{reused}\n  {where}"
        )
    return 0


def _run_set(args: argparse.Namespace) -> int:
    """Admit a directory or an index of shards: every shard as its own corpus, then the set's rules."""
    from kiln_core.admission.shards import admit_shard_set

    result = admit_shard_set(
        args.corpus,
        args.student,
        top_k=args.top_k,
        pinned_manifest=_read_pinned(args.teacher_manifest),
        kiln_strict=args.kiln_strict,
        out_root=args.out,
        workers=args.workers,
    )
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
        return 0
    if args.quiet:
        return 0
    totals = result.totals()
    print(f"admitted set {result.set_sha256}: {totals['shards']} shards, {totals['examples']} examples, "
          f"{totals['action_tokens']} action tokens, {totals['env_tokens']} env tokens "
          f"(ECHO |O| {totals['observation_tokens']}), top_k {result.effective_top_k}")
    for shard in result.shards:
        reused = " (already materialized)" if shard.reused else ""
        print(f"  {shard.name}: {shard.dataset_sha256}, {shard.examples} examples, {shard.action_tokens} action "
              f"tokens{reused}")
    print(f"  {result.record_uri or '(validated only; pass --out to materialize)'}")
    return 0


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid positive integer {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


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
