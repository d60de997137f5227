"""``kiln-flows score``: score unscored examples with a teacher into a Kiln-admissible corpus.

    $ kiln-flows score examples.jsonl --teacher ./teacher --student ./student --top-k 32 --out teacher-data.jsonl
    $ kiln-flows score examples.jsonl --teacher tiny-teacher --registry ./kiln-data --student ./student \\
          --top-k 16 --out s3://bucket/teacher-data.jsonl
    $ kiln-flows score examples.jsonl --vllm http://127.0.0.1:8000 --served-model teacher \\
          --teacher-manifest manifest.jsonl --student ./student --top-k 16 --out teacher-data.jsonl
    $ kiln-flows score examples.jsonl --teacher ./teacher --student ./student --top-k 32 \\
          --out scored/ --shard-size 64MiB
    $ kiln-flows score s3://bucket/examples.jsonl --teacher ./teacher --student ./student --top-k 32 \\
          --out s3://bucket/scored/ --shard-size 64MiB --ray ray://head:10001

``--teacher`` is a directory when one exists at that path, else an alias in the local registry
under ``--registry``. The corpus is published atomically: on any failure nothing appears at ``--out``
(here the output *file*, as for ``oracle make-request``). With ``--shard-size`` ``--out`` is a
directory that receives shards of at most that size and ``index.json`` (``kiln_core.scoring.shards``);
running the command again resumes an interrupted set, scoring only its unfinished shards.
With ``--ray ADDRESS`` the shards are scored on a Ray cluster, one Prefect ``score-shard`` task each: the
command runs the ``score-corpus`` flow (``flows.score_corpus``), since the fan-out is prefect-ray's task
runner, and the flow scores with the local teacher's defaults (``--batch-size`` 8, default dtype, device
and attention), so those options and the vLLM ones are refused with ``--ray`` rather than ignored.
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
    parser.add_argument("--out", required=True, metavar="CORPUS|DIR",
                        help="output corpus: a local path or fsspec URI (with --shard-size: a directory)")
    parser.add_argument("--shard-size", metavar="SIZE",
                        help="write shards of at most SIZE bytes (e.g. 64MiB, 500KiB, 4096; at most 64MiB) and "
                             "index.json into the directory --out; a rerun resumes unfinished shards")
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="score the shards on a Ray cluster (local, auto, ray://host:10001 or host:port), one "
                             "Prefect task per shard; needs --shard-size and a local teacher (docs/distributed.md)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="shards scored at once with a vLLM teacher (default 1)")
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
    if args.ray is not None:
        return _run_on_ray(args)
    sharded = args.shard_size is not None
    progress = None if args.quiet else (_SetProgressLine() if sharded else _ProgressBar())
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
            shard_size=args.shard_size,
            workers=args.workers,
        )
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        print(json.dumps(result.model_dump(mode="json"), ensure_ascii=False))
    elif args.quiet:
        pass
    elif sharded:
        print(
            f"scored {result.examples} examples, {result.action_tokens} action tokens with teacher "
            f"{result.identity_revision}\n  {len(result.shards)} shards ({result.resumed_shards} finished by an "
            f"earlier run) in {result.out_uri}\n  index {result.index_uri} (set {result.set_sha256})"
        )
    else:
        print(
            f"scored {result.examples} examples, {result.action_tokens} action tokens with teacher "
            f"{result.identity_revision}\n  {result.out_uri} ({result.sha256}, {result.size_bytes} bytes)"
        )
    if not sharded and result.size_bytes > KILN_MAX_CORPUS_BYTES:  # a shard never is (the split bounds it)
        print(f"kiln-flows score: warning: the corpus is {result.size_bytes} bytes; Kiln admits at most 64 MiB",
              file=sys.stderr)
    return 0


# Options the score-corpus flow does not take: refused with --ray, never silently dropped.
_NOT_WITH_RAY = (("vllm", None, "--vllm"), ("served_model", None, "--served-model"),
                 ("teacher_manifest", None, "--teacher-manifest"), ("workers", 1, "--workers"),
                 ("batch_size", 8, "--batch-size"), ("dtype", None, "--dtype"), ("device", None, "--device"),
                 ("attn_implementation", "eager", "--attn-implementation"))


def _run_on_ray(args: argparse.Namespace) -> int:
    """``--ray``: the ``score-corpus`` flow with its shards fanned out on the cluster (prefect-ray)."""
    import json
    import sys

    from flows.score_corpus import ray_options, score_corpus
    from kiln_core.scoring.shards import parse_shard_size

    given = [flag for name, default, flag in _NOT_WITH_RAY if getattr(args, name) != default]
    if given:
        print(f"kiln-flows score: {', '.join(given)} cannot be combined with --ray (the score-corpus flow scores "
              "with a local teacher and its defaults)", file=sys.stderr)
        return 2
    shard_size = None if args.shard_size is None else parse_shard_size(args.shard_size)
    ray_options(args.ray, shard_size, args.examples, args.out)  # refused before Prefect starts
    from flows.local_api import offline_settings, start_local_api

    offline_settings()  # as `run`: no telemetry (its errors were logged at ERROR), an API Ctrl-C does not kill
    start_local_api()
    teacher = _teacher_source(args)
    if "registry_root" in teacher:  # the flow reads its registry under its storage root
        teacher["storage_root"] = teacher.pop("registry_root")
    scored = score_corpus(args.examples, args.student, **teacher, top_k=args.top_k, out=args.out,
                          shard_size=shard_size, ray_address=args.ray)
    if args.json:
        print(json.dumps(scored, ensure_ascii=False))
    else:
        print(f"scored {scored['examples']} examples on Ray at {args.ray}\n  index {scored['uri']} "
              f"(set {scored['sha256']}{', every shard finished by an earlier run' if scored['reused'] else ''})")
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


class _SetProgressLine:
    """Tokens and shards with a rate and an ETA on stderr: ``shards 3/16 · 1.2M/2.7M tokens · 850tok/s · ETA 04:10``.

    The rate and the ETA count only tokens scored by this run (shards an earlier run finished start the
    bar at their tokens, tqdm's ``initial``), so a resumed run's ETA is not flattered by them.
    """

    FORMAT = "{desc} · {n_fmt}/{total_fmt} tokens · {rate_noinv_fmt} · ETA {remaining}"

    def __init__(self) -> None:
        self._bar = None

    def __call__(self, progress) -> None:
        import sys

        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=progress.tokens_total, initial=progress.tokens_resumed, unit="tok", unit_scale=True,
                             file=sys.stderr, dynamic_ncols=True, bar_format=self.FORMAT,
                             desc=f"shards {progress.shards_done}/{progress.shards_total}")
        self._bar.set_description_str(f"shards {progress.shards_done}/{progress.shards_total}", refresh=False)
        self._bar.update(progress.tokens_done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
