"""``kiln-flows eval``: how close a student (with or without its adapter) is to the teacher, held out.

    $ kiln-flows eval --student models/student --corpus heldout.jsonl
    $ kiln-flows eval --student models/student --adapter kiln-data/runs/demo/adapter --corpus heldout.jsonl \\
          --teacher-manifest teacher.manifest --train-corpus train.jsonl --json
    $ kiln-flows eval --student models/student --adapter ADAPTER --corpus heldout.jsonl \\
          --teacher models/teacher --generate 3

The corpus is admitted with training's rules and masks. Means over every action token:
``reverse_kl`` (Kiln's renormalized top-K loss), ``top1_agreement`` (student full-vocabulary argmax =
teacher's first candidate), ``teacher_token_nll`` (−log student probability of the corpus token).
``--json`` prints one JSON object (with ``tokens``) as the last stdout line. ``--generate N`` answers
the first N held-out prompts with the teacher, the base student and the adapted student, greedily, and
measures each student's *own* answers against the teacher (``own_answers``: top-K reverse KL, top-1
agreement, the teacher's NLL of the answer, tokens per answer; ``kiln_core.evaluation.own_answers``): the
measure on-policy training minimizes, on the text a user reads.
Exit codes: 0, 2 rejected input (admission rule, another teacher, another vocabulary, overlap with the
training corpus, adapter that does not fit), 3 failure.
"""

from __future__ import annotations

import argparse

from flows.commands._options import add_json_argument, add_quiet_argument

NAME = "eval"
HELP = "Evaluate a student (and adapter) on a held-out teacher-scored corpus: KL, top-1 agreement, NLL."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--student", required=True, metavar="DIR", help="student model directory")
    parser.add_argument("--adapter", metavar="DIR", help="PEFT adapter directory trained on the student")
    parser.add_argument("--corpus", required=True, metavar="SCORED.jsonl", help="held-out teacher-scored corpus")
    parser.add_argument("--top-k", type=int, default=32, metavar="K", help="requested top-K, resolved to 32 or 16 (default 32)")
    parser.add_argument("--teacher-manifest", metavar="FILE",
                        help="file whose first line is the expected teacher's manifest; another teacher is refused")
    parser.add_argument("--train-corpus", metavar="FILE", help="the training corpus; shared prompts are refused")
    parser.add_argument("--limit", type=int, metavar="N", help="evaluate only the first N examples")
    parser.add_argument("--teacher", metavar="DIR", help="teacher model directory (needed by --generate)")
    parser.add_argument("--generate", type=int, default=0, metavar="N", help="answer N held-out prompts side by side")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="answer length limit (default 64)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    add_json_argument(parser)
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Evaluate; a rejection (exit 2) or a storage failure (exit 3) goes to the CLI's guard (``flows/cli.py``)."""
    import json
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = evaluate(args)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    elif not args.quiet:
        print(format_report(result))
    return 0


def evaluate(args: argparse.Namespace) -> dict:
    """Admit, check, evaluate and (optionally) generate; returns the JSON summary."""
    from kiln_core.evaluation import EvalInputError, admit_eval_corpus, evaluate_tables, load_eval_model

    if args.generate < 0 or (args.limit is not None and args.limit < 1):
        raise EvalInputError("invalid_option", "--generate must be >= 0 and --limit >= 1", field="generate")
    if args.generate and not args.teacher:
        raise EvalInputError("invalid_option", "--generate needs --teacher DIR to answer beside the student",
                             field="teacher")
    if args.teacher:
        from kiln_core.models import check_same_vocabulary

        check_same_vocabulary(args.teacher, args.student)
    manifest = _read_manifest(args.teacher_manifest) if args.teacher_manifest else None
    admission = admit_eval_corpus(args.corpus, args.student, top_k=args.top_k, teacher_manifest=manifest,
                                  train_corpus_uri=args.train_corpus)
    model = load_eval_model(args.student, args.adapter, device=args.device)
    metrics = evaluate_tables(model, admission.tables, limit=args.limit)
    result = {"status": "evaluated", **metrics.to_json(), "student": args.student, "adapter": args.adapter,
              "corpus": args.corpus, "corpus_sha256": admission.dataset_sha256}
    if args.generate:
        result["answers"], result["own_answers"] = _side_by_side(args, model)
    return result


def _read_manifest(path: str) -> str:
    from kiln_core.evaluation import EvalInputError

    try:
        with open(path, encoding="utf-8") as handle:
            line = handle.readline()
    except (OSError, UnicodeDecodeError) as error:
        raise EvalInputError("invalid_option", f"cannot read --teacher-manifest: {error}", file=path) from None
    return line.rstrip("\r\n")


def _side_by_side(args: argparse.Namespace, adapted) -> tuple[list[dict], dict[str, dict]]:
    """First N held-out prompts answered by the teacher, the base student and the evaluated student, and each
    student's own answers measured against the teacher (``kiln_core.evaluation.own_answers``)."""
    from kiln_core.admission.records import parse_corpus
    from kiln_core.admission.source import read_corpus
    from kiln_core.evaluation import generate_answers, load_eval_model
    from kiln_core.evaluation.models import EvalInputError, PromptRefused
    from kiln_core.evaluation.own_answers import own_answer_metrics

    parsed = parse_corpus(read_corpus(args.corpus).data)
    prompts = [list(c.messages) for c in parsed.conversations][: args.generate]
    teacher = load_eval_model(args.teacher, device=args.device)
    columns = {"teacher": teacher}
    if args.adapter:
        columns["base_student"] = load_eval_model(args.student, device=args.device)
    columns["student" if not args.adapter else "distilled_student"] = adapted
    try:
        answers = {name: generate_answers(model, prompts, max_new_tokens=args.max_new_tokens)
                   for name, model in columns.items()}
    except PromptRefused as refused:  # the corpus line is the place a user can find
        raise EvalInputError(refused.code, refused.message, file=args.corpus,
                             line=int(parsed.example_lines[refused.index])) from None
    own = {name: own_answer_metrics(model, teacher, prompts, max_new_tokens=args.max_new_tokens, top_k=args.top_k)
           for name, model in columns.items() if name != "teacher"}
    rows = [{"prompt": prompt[-1].get("content", ""), **{name: answers[name][i] for name in answers}}
            for i, prompt in enumerate(prompts)]
    return rows, own


def format_report(result: dict) -> str:
    """The readable table (and the side-by-side answers)."""
    lines = [
        f"held-out evaluation of {result['student']}" + (f" + adapter {result['adapter']}" if result.get("adapter") else ""),
        f"  corpus {result['corpus']} ({result['examples']} examples, {result['tokens']} action tokens)",
        "",
        f"  {'metric':<20} {'value':>10}",
        f"  {'reverse_kl':<20} {result['reverse_kl']:>10.4f}   (top-K renormalized; lower is better)",
        f"  {'top1_agreement':<20} {result['top1_agreement']:>10.2%}   (student argmax = teacher's first candidate)",
        f"  {'teacher_token_nll':<20} {result['teacher_token_nll']:>10.4f}   (nats per corpus token; lower is better)",
    ]
    if result.get("own_answers"):
        lines += ["", f"  on each student's own greedy answers to {len(result['answers'])} held-out prompts (teacher top-K there):",
                  f"  {'student':<20} {'reverse_kl':>10} {'top1_agree':>10} {'teacher_nll':>11} {'tokens/answer':>13}"]
        for name, own in result["own_answers"].items():
            lines.append(f"  {name:<20} {own['reverse_kl']:>10.4f} {own['top1_agreement']:>10.2%} "
                         f"{own['teacher_nll']:>11.4f} {own['answer_tokens']:>13.1f}")
    for i, row in enumerate(result.get("answers") or []):
        lines.append("")
        lines.append(f"  [{i + 1}] {row['prompt']}")
        for name, text in row.items():
            if name != "prompt":
                lines.append(f"      {name:<18} {text}")
    return "\n".join(lines)
