"""``--keep-layers auto:N``: choose which N teacher layers a depth-pruned student keeps, by measurement.

Candidates are the contiguous blocks kept at both ends: the first ``a`` layers and the last ``N - a``, for
``a = 1 … N-1`` (the embedding side and the head side both keep a block; the middle is what gets cut, as in
depth-pruning practice). Each candidate is built in memory from one loaded teacher (its layers shared, no copy)
and scored, untrained, on a small teacher-scored slice: the held-out top-K reverse KL of the pruned model
against the teacher's scores (``kiln_core.evaluation.evaluate_examples``). The lowest wins (ties: the
first). A budget keeps the search short on big teachers: at most ``budget`` candidates, spread evenly over
``a``. The whole search goes into ``kiln-derivation.json``.

Example:
    >>> search = search_layers("models/smollm2-135m", 15, "probe.jsonl")  # doctest: +SKIP
    >>> search["kept_teacher_layers"][:3]  # doctest: +SKIP
    [0, 1, 2]
"""

from __future__ import annotations

import os
from typing import Any

from kiln_core.models.gguf import ModelImportError

__all__ = ["AUTO_PREFIX", "both_ends_candidates", "is_auto", "parse_auto", "search_layers"]

AUTO_PREFIX = "auto:"
DEFAULT_PROBE_EXAMPLES = 16


def is_auto(spec: str) -> bool:
    """Whether a ``--keep-layers`` spec asks for the measured search (``auto:N``), valid or not.

    Example:
        >>> is_auto(" auto:15"), is_auto("every:2")
        (True, False)
    """
    return spec.strip().startswith(AUTO_PREFIX)


def parse_auto(spec: str, num_layers: int) -> int | None:
    """N of an ``auto:N`` spec (None for any other spec).

    Raises:
        ModelImportError: ``invalid_keep_layers`` unless 2 ≤ N < the teacher's layer count.

    Example:
        >>> parse_auto("auto:15", 30), parse_auto("every:2", 30)
        (15, None)
    """
    if not is_auto(spec):
        return None
    count = spec.strip().removeprefix(AUTO_PREFIX)
    if not count.isdigit() or not 2 <= int(count) < num_layers:
        raise ModelImportError("invalid_keep_layers", f"--keep-layers {spec!r}: auto:N needs 2 <= N < {num_layers} "
                               "(the teacher's layer count)", field="keep_layers")
    return int(count)


def both_ends_candidates(num_layers: int, keep: int, budget: int | None = None) -> list[list[int]]:
    """The first ``a`` and the last ``keep - a`` layers, for ``a = 1 … keep-1``; with a budget, at most
    ``budget`` of them, evenly spread (the two extremes always included when ``budget`` ≥ 2).

    Example:
        >>> both_ends_candidates(6, 3)
        [[0, 4, 5], [0, 1, 5]]
    """
    heads = list(range(1, keep))
    if budget is not None and budget < len(heads):
        if budget < 1:
            raise ModelImportError("invalid_option", "--probe-budget must be at least 1", field="probe_budget")
        picks = [round(i * (len(heads) - 1) / max(1, budget - 1)) for i in range(budget)] if budget > 1 else [0]
        heads = [heads[i] for i in sorted(set(picks))]
    return [list(range(a)) + list(range(num_layers - (keep - a), num_layers)) for a in heads]


def search_layers(teacher_dir: str | os.PathLike[str], keep: int, probe_corpus: str, *,
                  probe_examples: int = DEFAULT_PROBE_EXAMPLES, budget: int | None = None) -> dict[str, Any]:
    """Score every candidate layer set on ``probe_corpus`` and return the search record (best first in
    ``kept_teacher_layers``).

    Args:
        teacher_dir: The teacher model directory (the student will share its tokenizer).
        keep: N, the student's layer count.
        probe_corpus: A teacher-scored Kiln corpus (its rules are training's; the student's vocabulary is the
            teacher's), held out from training.
        probe_examples: Its first examples used (default 16).
        budget: Most candidates scored (default: all ``keep - 1``).

    Raises:
        ModelImportError: ``invalid_option`` for a bad probe size or budget; an admission rejection of the
            probe corpus propagates with its own code.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from kiln_core.canonical import sha256_prefixed
    from kiln_core.evaluation import admit_eval_corpus, evaluate_tables
    from kiln_core.evaluation.models import EvalModel, load_eval_model

    if probe_examples < 1:
        raise ModelImportError("invalid_option", "--probe-examples must be at least 1", field="probe_examples")
    admission = admit_eval_corpus(probe_corpus, str(teacher_dir), top_k=32)
    teacher: EvalModel = load_eval_model(teacher_dir, device="cpu")
    model = teacher.model
    num_layers = model.config.num_hidden_layers
    candidates = both_ends_candidates(num_layers, keep, budget)
    all_layers = model.model.layers
    all_types = getattr(model.config, "layer_types", None)
    results = []
    try:
        for kept in candidates:
            model.model.layers = torch.nn.ModuleList([all_layers[i] for i in kept])
            model.config.num_hidden_layers = len(kept)
            if isinstance(all_types, list):
                model.config.layer_types = [all_types[i] for i in kept]
            metrics = evaluate_tables(teacher, admission.tables, limit=probe_examples)
            results.append({"kept_teacher_layers": kept, **metrics.to_json()})
    finally:
        model.model.layers, model.config.num_hidden_layers = all_layers, num_layers
        if isinstance(all_types, list):
            model.config.layer_types = all_types
    best = min(range(len(results)), key=lambda i: (results[i]["reverse_kl"], i))
    with open(probe_corpus, "rb") as handle:
        probe_digest = sha256_prefixed(handle.read())
    return {
        "kept_teacher_layers": results[best]["kept_teacher_layers"],
        "search": {
            "method": "both-ends-blocks/held-out-top-k-reverse-kl",
            "keep": keep,
            "probe_corpus": str(probe_corpus),
            "probe_corpus_sha256": probe_digest,
            "probe_examples": results[best]["examples"],
            "probe_tokens": results[best]["tokens"],
            "budget": budget,
            "candidates": results,
            "chosen": best,
        },
    }
