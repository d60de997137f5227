"""The gate stage: after a successful train, before publish, decide whether the adapter goes live.

    … → train → **gate** → publish (only ``promoted``, or nothing gated)

A spec gates with Kiln's ``post_eval`` (``kiln_core.post_eval``: a suite, paired evidence against
the base student, ``min_accuracy``), with our ``quality_gate`` (held-out distillation metrics,
``kiln_core.contracts.quality_gate``), or both — then the stronger outcome wins, Kiln's rule for
several gates on one training job. What each outcome does:

| outcome | ``latest.json`` | run directory |
| --- | --- | --- |
| ``promoted`` | moved by the publish stage (``kiln_core.engine.publish``, the one writer) | stays |
| ``kept``, ``inconclusive``, ``error`` | not moved | stays |
| ``demoted``, ``regression`` | not moved | renamed ``<adapter>.failed`` (``kiln_core.engine.fate``) |
| none (``post_eval`` without ``min_accuracy``) | moved, as without a gate | stays |

The baseline arm is the base student: Kiln compares against the active adapter unless it has the
candidate's name, and in kiln-flows the active adapter of ``runs/<adapter>/`` always has it
[crates/kiln-server/src/training_queue.rs · enqueue_post_training_eval]. The decision and its evidence
(``gate_outcome``, ``post_eval``, ``quality_gate``) are in the run's ``train_receipt.json``, which the gate
stage composes once it decided (the trainer leaves a gated run's receipt to it), *before* the pointer moves,
so ``latest.json``'s receipt digest covers them. A retry finds the outcome in the receipt and does not
evaluate again.

``check_gate_inputs`` runs in the validation phase, before training: the suite must be installed, a
``held-out`` suite must not overlap the training data (``post_eval_overlap``), and the quality
gate's corpus must be admissible (same teacher, same vocabulary, no shared prompt). The training data
are a corpus's examples or, on-policy, the prompts (``training_data``): the gates themselves are the
same for both modes.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterator

from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.contracts.outcomes import GateDecision, QualityGateRecord
from kiln_core.contracts.pipeline import PipelineSpec
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.contracts.stage_refs import CorpusRef, GateRef, HeldOutRef, ManifestRef, TrainRef
from kiln_core.errors import EnvironmentFailure
from kiln_core.storage import localize_directory, resolve

__all__ = ["has_gate", "training_data", "check_gate_inputs", "run_gate", "before_after_rows", "describe_gate"]

PUBLISHING_OUTCOMES = (None, "promoted")


def has_gate(spec: PipelineSpec) -> bool:
    """Whether the spec asks for a post-training evaluation of either kind."""
    return spec.post_eval is not None or spec.quality_gate is not None


def training_data(corpus: CorpusRef, config: OpdConfig) -> dict[str, Any]:
    """What the held-out rules compare a held-out corpus against (``admit_eval_corpus``'s and
    ``HeldOutSlice.admit``'s keywords): the training corpus, or an on-policy run's prompt file and how
    its prompts are rendered (``config``: the run's ``OpdConfig``).

    Example:
        >>> training_data(corpus_ref, spec.config)  # doctest: +SKIP
        {'train_corpus_uri': '/abs/train.jsonl'}
    """
    if corpus.kind == "prompts":
        from kiln_core.on_policy.prompt_file import read_prompt_file

        return {"train_prompts": read_prompt_file(corpus.uri), "prompt_rendering": config.rollout_prompt_rendering}
    return {"train_corpus_uri": corpus.source_uri}


def _training_conversations(corpus: CorpusRef) -> Iterator[Any]:
    """What the student trained on, as conversations: a corpus's examples, or an on-policy run's prompts."""
    return _prompt_conversations(corpus.uri) if corpus.kind == "prompts" else _corpus_conversations(corpus.source_uri)


def _prompt_conversations(prompts_uri: str) -> Iterator[Any]:
    """An on-policy prompt file's prompts as conversations (``messages`` only: the answers are the
    student's own, sampled during training), each with its row as written (for Kiln's row identities)."""
    from kiln_core.on_policy.prompt_file import read_prompt_file
    from kiln_core.post_eval.overlap import TrainingConversation

    prompts = read_prompt_file(prompts_uri)
    for row in prompts.rows:
        yield TrainingConversation(list(row["messages"]), row)


def _corpus_conversations(corpus_uri: str) -> Iterator[Any]:
    """The training corpus's examples as conversations (line 1 of each file is the manifest); a set of
    shards gives every shard's in set order."""
    from kiln_core.admission.shard_sources import training_files
    from kiln_core.post_eval import conversation_from_opd_example

    for file_uri, _ in training_files(corpus_uri):
        location = resolve(file_uri)
        with location.fs.open(location.path, "rb") as handle:
            handle.readline()
            for line in handle:
                if line.strip():
                    yield conversation_from_opd_example(json.loads(line))


def check_gate_inputs(spec: PipelineSpec, settings: ResolvedSettings, corpus: CorpusRef, manifest: ManifestRef,
                      student_dir: str) -> HeldOutRef | None:
    """Refuse, before training, a gate that cannot run or a corpus it forbids; returns the quality gate's
    corpus, admitted once for the run at its effective top-K and materialized under the storage root (the gate
    reads it back), or None without a quality gate.

    Raises:
        PostEvalRejection: ``post_eval_suite_not_installed``, ``post_eval_overlap`` (Kiln's message).
        AdmissionError, EvalInputError: the quality gate's corpus (``identity_mismatch``,
            ``vocabulary_mismatch``, ``eval_train_overlap``, any admission rule).
    """
    if spec.post_eval is not None:
        from kiln_core.post_eval import SuiteRegistry, check_training_overlap, validate_post_eval_config

        registry = SuiteRegistry.for_storage_root(spec.storage_root)
        validate_post_eval_config(spec.post_eval, registry)
        check_training_overlap(spec.post_eval, registry.load(spec.post_eval.suite),
                               _training_conversations(corpus))
    if spec.quality_gate is None:
        return None
    from kiln_core.evaluation.corpus import admit_eval_corpus, held_out_ref

    return held_out_ref(admit_eval_corpus(spec.quality_gate.corpus, student_dir, effective_top_k=settings.top_k,
                                          teacher_manifest=manifest.manifest_line, out_root=spec.storage_root,
                                          **training_data(corpus, spec.config)))


def _quality_gate(spec: PipelineSpec, manifest: ManifestRef, student_dir: str, adapter_dir: str,
                  training: CorpusRef, device: str | None, gate_corpus: HeldOutRef | None) -> QualityGateRecord:
    """Evaluate the base and the distilled student on the quality gate's corpus and decide: the corpus
    admitted when the run was prepared (``gate_corpus``), or — for a caller without one — admitted here."""
    from kiln_core.evaluation import admit_eval_corpus, evaluate_tables, load_eval_model
    from kiln_core.evaluation.corpus import admitted_tables

    gate = spec.quality_gate
    if gate_corpus is not None:
        tables, corpus_sha256 = admitted_tables(gate_corpus), gate_corpus.corpus_sha256
    else:
        admission = admit_eval_corpus(gate.corpus, student_dir, top_k=spec.config.top_k,
                                      teacher_manifest=manifest.manifest_line, **training_data(training, spec.config))
        tables, corpus_sha256 = admission.tables, admission.dataset_sha256
    base = evaluate_tables(load_eval_model(student_dir, device=device), tables).to_json()
    distilled = evaluate_tables(load_eval_model(student_dir, adapter_dir, device=device), tables).to_json()
    failures = []
    for name, limit in gate.thresholds().items():
        metric = name.removeprefix("max_").removeprefix("min_")
        value = distilled[metric]
        ok = math.isfinite(value) and (value <= limit if name.startswith("max_") else value >= limit)
        if not ok:
            failures.append(f"{metric} {value:.4f} {'>' if name.startswith('max_') else '<'} {limit:g}")
    if gate.require_improvement and not distilled["reverse_kl"] < base["reverse_kl"]:
        failures.append(f"reverse_kl {distilled['reverse_kl']:.4f} not below the base student's {base['reverse_kl']:.4f}")
    if failures:
        outcome, verdict = "demoted", f"FAILED quality gate: {'; '.join(failures)}; adapter `{spec.adapter}` NOT promoted"
    elif spec.config.auto_load:
        outcome, verdict = "promoted", f"PASSED quality gate ({_thresholds_text(gate)}); adapter `{spec.adapter}` promoted"
    else:
        outcome = "kept"
        verdict = f"PASSED quality gate ({_thresholds_text(gate)}); adapter `{spec.adapter}` kept (auto_load not requested)"
    return QualityGateRecord(corpus=gate.corpus, corpus_sha256=corpus_sha256, thresholds=gate.thresholds(),
                             require_improvement=gate.require_improvement, base=base, distilled=distilled,
                             failures=failures, outcome=outcome, verdict=verdict)


def _thresholds_text(gate: Any) -> str:
    parts = [f"{name} {value:g}" for name, value in gate.thresholds().items()]
    return ", ".join(parts + (["require_improvement"] if gate.require_improvement else []))


def _decided(trained: TrainRef, decision: GateDecision) -> GateRef:
    return GateRef(outcome=decision.outcome, verdict=decision.verdict, publish=decision.outcome in PUBLISHING_OUTCOMES,
                   run_uri=trained.run_uri, receipt_uri=trained.receipt_uri, adapter_uri=trained.adapter_uri,
                   post_eval=decision.post_eval, quality_gate=decision.quality_gate, reused=True)


def run_gate(trained: TrainRef, spec: PipelineSpec, manifest: ManifestRef, student_dir: str, *, seed: int | None,
             training: CorpusRef, device: str | None = None, gate_corpus: HeldOutRef | None = None) -> GateRef:
    """Evaluate a successfully trained adapter, record the evidence, and act on the outcome.

    Args:
        trained: The successful training run (``status == "success"``).
        spec: The spec (its ``post_eval`` / ``quality_gate``, ``adapter``, ``config.auto_load``).
        manifest: The training teacher's manifest (the quality gate's corpus must match it).
        student_dir: Local base student directory.
        seed: The run's seed (the eval's effective seed, as Kiln derives it from the job).
        training: The training data (a corpus or on-policy prompts; the quality gate's corpus must not share
            a prompt with them).
        device: ``cpu``/``cuda`` (default: CUDA when available).
        gate_corpus: The quality gate's corpus as ``check_gate_inputs`` admitted it when the run was
            prepared (read back, not admitted again); None admits it here.

    Returns:
        ``GateRef``; ``publish`` says whether the publish stage moves ``latest.json``.

    Raises:
        EnvironmentFailure: storage refused the receipt update or the rename (retried by the flow).

    Example:
        >>> ref = run_gate(trained, spec, manifest, "./student", seed=7, training=corpus_ref)  # doctest: +SKIP
        >>> ref.outcome, ref.publish  # doctest: +SKIP
        ('demoted', False)
    """
    run = resolve(trained.run_uri)
    decided = _recorded_decision(run)
    if decided is not None:
        return _decided(trained, decided)  # an earlier attempt decided and its receipt records it
    post = _post_eval(trained, spec, student_dir, seed, device) if spec.post_eval is not None else None
    outcome, verdict = (post.outcome, post.verdict) if post is not None else (None, None)
    quality = None
    if spec.quality_gate is not None:
        from kiln_core.post_eval import aggregate_gate_outcome

        quality = _quality_gate(spec, manifest, student_dir, localize_directory(trained.adapter_uri), training,
                                device, gate_corpus)
        outcome, verdict = aggregate_gate_outcome(outcome, quality.outcome, quality.verdict)
    return _act_and_record(trained, spec, outcome, verdict, post, quality)


def _recorded_decision(run: Any) -> GateDecision | None:
    """The decision a finished run's receipt records, or None (no receipt yet: the gate composes it)."""
    from kiln_core.contracts.receipt import gate_decision
    from kiln_core.training.receipt import read_receipt, receipt_status

    return gate_decision(read_receipt(run)) if receipt_status(run) == "success" else None


def _post_eval(trained: TrainRef, spec: PipelineSpec, student_dir: str, seed: int | None, device: str | None) -> Any:
    """Kiln's post-training eval of the new adapter (``PostEvalResult``; ``error`` when it did not complete)."""
    from kiln_core.post_eval import SuiteRegistry, run_post_eval

    try:
        suite = SuiteRegistry.for_storage_root(spec.storage_root).load(spec.post_eval.suite)
        return run_post_eval(spec.post_eval, suite, student_dir=student_dir, candidate_adapter=trained.adapter_uri,
                             candidate_name=spec.adapter, auto_load_on_pass=spec.config.auto_load, seed=seed,
                             device=device)
    except EnvironmentFailure:
        raise  # storage: the task retries
    except Exception as error:  # noqa: BLE001 - Kiln: an eval that did not complete is outcome `error`
        return _incomplete_post_eval(spec, seed, error)


def _act_and_record(trained: TrainRef, spec: PipelineSpec, outcome: str | None, verdict: str | None, post: Any,
                    quality: QualityGateRecord | None) -> GateRef:
    """Rename a loser (``apply_gate_outcome``), then compose the run's receipt, with the decision, where the run
    now is (``kiln_core.training.receipt.compose_receipt``: the receipt is written once, here).

    A promoted run's ``latest.json`` is written by the publish stage, afterwards, so the pointer's receipt
    digest covers the evidence.
    """
    from kiln_core.engine.publish import latest_location
    from kiln_core.engine.fate import GateFate, apply_gate_outcome, post_eval_receipt_block
    from kiln_core.training.receipt import compose_receipt

    run = resolve(trained.run_uri)
    fate = None
    if outcome == "promoted":
        fate = GateFate(outcome, verdict, _stamped(post, outcome), run.uri, latest_uri=latest_location(run).uri)
    elif outcome is not None:
        fate = apply_gate_outcome(run, spec.adapter, outcome, post.evidence if post else None, verdict=verdict)
        verdict = fate.verdict
    where = resolve(fate.run_uri) if fate is not None else run
    post_eval = None
    if post is not None:  # an ungated post_eval is informational: the quality gate's outcome is not its own
        post_eval = post_eval_receipt_block(post, fate if post.gated else None)
        if post.gated:
            post_eval = post_eval.model_copy(update={"gate_outcome": outcome, "post_eval_verdict": verdict})
    decision = GateDecision(outcome=outcome, verdict=verdict, post_eval=post_eval, quality_gate=quality)
    receipt_uri = compose_receipt(where, gate=decision)
    adapter_uri = where.child("adapter").uri if trained.adapter_uri else None
    return GateRef(outcome=outcome, verdict=verdict, publish=outcome in PUBLISHING_OUTCOMES, run_uri=where.uri,
                   receipt_uri=receipt_uri, adapter_uri=adapter_uri, post_eval=post_eval, quality_gate=quality)


def _incomplete_post_eval(spec: PipelineSpec, seed: int | None, error: Exception) -> Any:
    """The result of a post-training eval that did not complete (a model that would not load, a suite
    deleted since submission, a crash while generating): Kiln's ``error`` outcome — the adapter is left
    where it is, not promoted [crates/kiln-server/src/eval/worker.rs · apply_post_eval_gate]."""
    from kiln_core.post_eval import PostEvalResult

    config = spec.post_eval
    result = PostEvalResult(config.suite, config.data_scope, config.min_accuracy_f32, config.gated, "",
                            seed if seed is not None else 0, error=f"{type(error).__name__}: {error}")
    if config.gated:
        result.outcome = "error"
        result.verdict = (f"post-eval did not complete (state: Failed) — adapter `{spec.adapter}` left on disk, "
                          "NOT promoted")
    return result


def _stamped(post: Any, outcome: str) -> dict[str, Any] | None:
    if post is None or post.evidence is None:
        return None
    return {**post.evidence.model_dump(), "outcome": outcome}


def before_after_rows(gate: dict[str, Any]) -> list[dict[str, Any]]:
    """Base vs distilled, one row per metric the gate measured (the flow's table artifact, the CLI's table).

    Example:
        >>> before_after_rows({"post_eval": None, "quality_gate": {"base": {"reverse_kl": 2.0},
        ...     "distilled": {"reverse_kl": 1.0}, "thresholds": {"max_reverse_kl": 1.5}}})
        [{'metric': 'reverse_kl', 'base': 2.0, 'distilled': 1.0, 'threshold': '≤ 1.5'}]
    """
    rows = []
    evidence = ((gate.get("post_eval") or {}).get("post_eval_gate_evidence") or [None])[0]
    if evidence:
        rows.append({"metric": f"accuracy on suite {evidence['suite_name']}", "base": evidence["baseline_accuracy"],
                     "distilled": evidence["candidate_accuracy"], "threshold": f"≥ {evidence['minimum_accuracy']:g} "
                     "(95% Wilson bound)"})
    quality = gate.get("quality_gate")
    if quality:
        limits = {name.removeprefix("max_").removeprefix("min_"): ("≤ " if name.startswith("max_") else "≥ ") + f"{v:g}"
                  for name, v in quality["thresholds"].items()}
        if quality.get("require_improvement"):
            limits["reverse_kl"] = ", ".join(filter(None, [limits.get("reverse_kl"), "< base"]))
        for metric in ("reverse_kl", "top1_agreement", "teacher_token_nll"):
            if metric in quality["distilled"]:
                rows.append({"metric": metric, "base": quality["base"][metric], "distilled": quality["distilled"][metric],
                             "threshold": limits.get(metric, "")})
    return rows


def describe_gate(gate: dict[str, Any]) -> list[str]:
    """The gate's outcome and evidence as the CLI prints it (improved/regressed/tied, p-value, Wilson bounds)."""
    lines = [f"gate: {gate['outcome'] or 'not gated (informational eval)'}"]
    if gate.get("verdict"):
        lines.append(f"  {gate['verdict']}")
    evidence = ((gate.get("post_eval") or {}).get("post_eval_gate_evidence") or [None])[0]
    if evidence:
        lines.append(f"  paired examples {evidence['paired_examples']}: improved {evidence['improved']}, regressed "
                     f"{evidence['regressed']}, tied {evidence['tied']}; exact sign test p = "
                     f"{evidence['exact_sign_test_p_value']:.4g}")
        lines.append(f"  accuracy: base {evidence['baseline_accuracy']:.3f} [{evidence['baseline_accuracy_lower_bound']:.3f}, "
                     f"{evidence['baseline_accuracy_upper_bound']:.3f}], adapter {evidence['candidate_accuracy']:.3f} "
                     f"[{evidence['candidate_accuracy_lower_bound']:.3f}, {evidence['candidate_accuracy_upper_bound']:.3f}] "
                     f"(95% Wilson), floor {evidence['minimum_accuracy']:g}")
    rows = before_after_rows(gate)
    if rows:
        lines.append(f"  {'metric':<28} {'base':>10} {'distilled':>10}  threshold")
        lines += [f"  {row['metric']:<28} {row['base']:>10.4f} {row['distilled']:>10.4f}  {row['threshold']}" for row in rows]
    return lines
