"""``kiln-flows distill merge``: merge LoRAs by distilling each into one student (Kiln's ``distill_merge``).

    $ kiln-flows distill merge --request merge.json --student ./student --out ./kiln-data
    $ kiln-flows distill merge --request merge.json --student ./student --out ./kiln-data --weighted-sampling --json

The request is Kiln's ``DistillMergeRequest`` (``{name, sources: [{adapter, weight}], student, rollout_budget,
config, post_eval}``); it is checked with Kiln's submit-time rules before any file is read or model loaded
(exit 2 naming the field). Each source is a published adapter under ``--out`` (``runs/<adapter>/latest.json``)
whose ``replay.jsonl`` lists the prompts it trained on; each source's LoRA (on the ``--student`` base) scores
its own prompts into one teacher-scored corpus, and the engine trains ``name`` on it exactly as
``kiln-flows train`` does (same run directory, checkpoints, ``latest.json``, gate, exit codes 0/2/3/4, the
``--json`` summary as the last stdout line). ``--weighted-sampling`` (kiln-flows extension, off by default;
the same as ``"weighted_sampling": true`` in the request) draws ``rollout_budget`` rows from the sources in
proportion to their weights instead of Kiln's contract (docs/recipes.md).
"""

from __future__ import annotations

import argparse

from flows.commands._options import add_dtype_argument, add_json_argument, add_out_argument, add_quiet_argument

HELP = ("Merge LoRAs (Kiln's distill_merge): each source adapter scores the prompts it trained on, one student "
        "learns them all.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request", required=True, metavar="FILE", help="Kiln DistillMergeRequest JSON")
    parser.add_argument("--student", required=True, metavar="DIR",
                        help="student base model directory (every source LoRA is loaded on it)")
    add_out_argument(parser, help="storage root holding the source adapters (runs/<adapter>/latest.json); the "
                                  "corpus and the merged run are written there too (default ./kiln-data)")
    parser.add_argument("--weighted-sampling", action="store_true",
                        help="kiln-flows extension: draw rollout_budget training rows from the sources in "
                        "proportion to their weights (seeded by config.seed) instead of Kiln's contract "
                        "(rollout_budget = prompts x epochs, weights = row shares)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="scoring and training device (default: cuda "
                        "when available)")
    add_dtype_argument(parser, help="training precision (default: bf16 on cuda, fp32 on cpu)")
    add_json_argument(parser)
    add_quiet_argument(parser)


def load_merge_request(path: str, *, weighted_sampling: bool = False):
    """Read and check a ``DistillMergeRequest`` file; ``weighted_sampling`` turns the extension on in it.

    Raises:
        ConfigError: ``invalid_request`` (unreadable, not JSON) or a Kiln submit-time rule (exit 2).
    """
    from kiln_core.contracts.distill_merge import check_distill_merge_request
    from kiln_core.contracts.request_file import read_request_json

    value = read_request_json(path, "distill_merge")
    if weighted_sampling and isinstance(value, dict):
        value = {**value, "weighted_sampling": True}
    return check_distill_merge_request(value, file=path)


def run(args: argparse.Namespace) -> int:
    """Check the request (before anything heavy loads), prepare the merged corpus, train through the engine."""
    import sys

    request = load_merge_request(args.request, weighted_sampling=args.weighted_sampling)

    from flows.commands.train import exit_code, print_result
    from kiln_core.engine.pipeline import LocalStages, run_pipeline
    from kiln_core.recipes.distill_merge import prepare_distill_merge

    if not args.quiet:
        names = ", ".join(f"{s.adapter} ({s.weight:g})" for s in request.sources)
        print(f"distill merge {request.name}: scoring each source's replay prompts with its LoRA: {names}",
              file=sys.stderr, flush=True)
    spec = prepare_distill_merge(request, student_dir=args.student, out_root=args.out, device=args.device)
    if not args.quiet:
        rows = ", ".join(f"{s.adapter}: {s.rows} rows of {s.prompts} prompts" for s in spec.recipe.sources)
        print(f"corpus {spec.corpus} ({spec.recipe.sampling['method']}; {rows})", file=sys.stderr, flush=True)
    result = run_pipeline(spec, LocalStages(), device=args.device, precision=args.dtype)
    print_result(result, request.name, as_json=args.json, quiet=args.quiet)
    return exit_code(result)
