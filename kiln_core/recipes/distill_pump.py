"""``distill pump``: a registered (large) teacher into the student — Kiln's ``/v1/distill/pump``.

``prepare_distill_pump`` takes a request ``check_distill_pump_request`` accepted and does what needs
files, in Kiln's order (``api/training.rs`` ·
``prepare_training_entry_admission``, ``training_queue.rs`` · ``run_distill_pump``): the teacher alias is registered in ``<out_root>/teachers.json`` and still is what was registered (its files are
hashed again and compared with the pinned identity: Kiln's ``teacher_identity_mismatch``); then the
teacher work and the spec:

* ``examples`` off-policy: each prompt becomes the example ``messages[:-1]`` + ``teacher_response`` =
  its last (assistant) message, written once to ``<out_root>/recipes/distill_pump/<digest>.jsonl``; the
  spec names those ``examples`` with the registered teacher, so the pipeline's ``score`` stage scores
  them (content-addressed: a retry reuses the scored corpus);
* ``examples`` on-policy, ``domain`` and ``wide``: the prompts (for ``domain``/``wide`` the user's
  ``prompt_bank``: Kiln's built-in seed banks are 3–4 toy prompts and are not copied) are written as a
  prompt file (``<out_root>/prompts/<digest>.jsonl``, as a request's inline prompts) and the spec trains
  on-policy. A prompt with no assistant turn
  at all gets Kiln's empty assistant turn appended, the cue where the student's rollout starts; without
  it the trainer would drop the prompt (no action tokens), as Kiln's would;
* a vLLM teacher (``vllm_teacher``, the CLI's ``--vllm-teacher``) serving the registered alias: remote
  logits are prefetched, so it runs off-policy only (Kiln's rule). A request that leaves
  ``config.training_mode`` at its default is switched to off_policy with a warning; one that asks for
  on_policy explicitly, and ``domain``/``wide``, are refused with Kiln's text. The examples are scored
  here through the server, pinned to the alias's registered manifest (every response must carry its
  fingerprint), into ``<out_root>/recipes/distill_pump/scored/<key>.jsonl`` (keyed by the examples, the
  teacher identity, the student's tokenizer and top-K: a retry reuses it); the spec trains that corpus.

The ``post_eval`` suite is checked by the engine before training (``check_gate_inputs``), as for any spec:
this module runs one pipeline stage (vLLM scoring) and leaves the rest to the engine.

``samples_per_prompt`` is Kiln's shared rule (``effective_samples_per_prompt``): off-policy the default 4
means each example once; on-policy it scales to 64 below 50 prompts and 16 below 200 — Kiln's "boost
below 200 examples" — counted on the prompts the run is given. ``rollout_budget`` and ``use_cache`` are
logged: Kiln never passes the budget to its trainer, and kiln-flows has no logit cache (docs/recipes.md).

The spec carries a ``RecipeRecord`` (kind ``distill_pump``, the mode, Kiln's registered-teacher
descriptor, the whole request), which ``run_pipeline`` writes into ``train_receipt.json`` and Kiln's
``receipt.json`` beside the adapter.

Example:
    >>> request = check_distill_pump_request(json.load(open("pump.json")))  # doctest: +SKIP
    >>> spec = prepare_distill_pump(request, student_dir="./student", out_root="./kiln-data")  # doctest: +SKIP
    >>> run_pipeline(spec).status  # doctest: +SKIP
    'success'
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Callable

from kiln_core.contracts.distill_pump import (SURFACE, DistillPumpRequest, PumpExamples,  # noqa: F401 - re-exported
                                              check_distill_pump_request, check_off_policy_examples,
                                              effective_pump_config)
from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.contracts.opd_prompt import OpdPrompt, kiln_prompt_value
from kiln_core.contracts.pipeline import PipelineSpec, parse_spec
from kiln_core.contracts.recipe_record import RecipeRecord, TeacherDescriptor
from kiln_core.errors import Rejection

__all__ = ["PUMP_DIR", "REMOTE_ON_POLICY", "prepare_distill_pump", "pump_examples_rows"]

LOG = logging.getLogger(__name__)
PUMP_DIR = ("recipes", "distill_pump")
"""Where the examples of an off-policy pump are written, under the storage root."""
REMOTE_ON_POLICY = (f'{SURFACE} cannot use a remote teacher with training_mode="on_policy": remote logits must be '
                    'prefetched before GPU coordination; use training_mode="off_policy" with fixed assistant actions')
"""Kiln's ``require_remote_teacher_off_policy`` text for this route."""
KILN_ROLLOUT_CUE = {"role": "assistant", "content": ""}
"""Kiln's dummy assistant turn that ends an on-policy prompt (where the rollout starts)."""
# The identity fields that come from the teacher's files; the others (implementation, inference config)
# describe how it is run, which the scoring stage compares in full for a local teacher anyway.
PINNED_FILE_FIELDS = ("base_model_sha256", "tokenizer_vocab_sha256", "tokenizer_config_sha256", "adapter",
                      "vocab_size")


def prepare_distill_pump(request: DistillPumpRequest, *, student_dir: str, out_root: str,
                         base_adapter: str | None = None, recipe: str | None = None, step: int | None = None,
                         prompt_bank: str | None = None, vllm_teacher: str | None = None,
                         on_warning: Callable[[str], None] | None = None) -> PipelineSpec:
    """The checks that need files, the teacher work, and the spec that trains the pump.

    Args:
        request: A request ``check_distill_pump_request`` accepted.
        student_dir: The student model directory.
        out_root: The storage root (``teachers.json``, prompts, examples, runs).
        base_adapter: A published adapter to warm-start from when the request's config names none (a
            recipe chains the previous step's adapter in this way).
        recipe, step: The recipe file's name and the step's index, when a recipe runs this.
        prompt_bank: ``domain``/``wide``: a JSONL of ``OpdPrompt`` (one user-only prompt per line is fine).
        vllm_teacher: Base URL of a vLLM server serving the registered teacher (off-policy examples only).
        on_warning: Called with each warning (default: logged).

    Returns:
        The ``PipelineSpec``: ``adapter`` = ``request.name``, ``recipe`` set.

    Raises:
        Rejection: ``teacher_not_registered`` (Kiln's text), ``teacher_identity_mismatch``,
            ``pump_prompt_bank_required``, ``invalid_option``, ``remote_teacher_on_policy``, the prompt
            bank's line rules, a scoring refusal; EnvironmentFailure: storage,
            an unreachable vLLM server.

    Example:
        >>> spec = prepare_distill_pump(request, student_dir="./student", out_root="./kiln-data",
        ...                             prompt_bank="math-prompts.jsonl")  # doctest: +SKIP
        >>> spec.prompts, spec.recipe.mode  # doctest: +SKIP
        ('/abs/kiln-data/prompts/9c1e….jsonl', 'domain')
    """
    from kiln_core.contracts.post_eval.config import parse_post_eval_config

    warn = on_warning or (lambda message: LOG.warning("%s", message))
    post_eval = parse_post_eval_config(request.post_eval)
    entry = _registered_teacher(out_root, request.teacher)
    config = _run_config(request, base_adapter, vllm_teacher, warn)
    if prompt_bank is not None and isinstance(request.mode, PumpExamples):
        raise Rejection("invalid_option", "--prompt-bank is for domain and wide modes; examples mode trains the "
                        "request's own examples", field="prompt_bank")
    if vllm_teacher is None:
        _check_pinned(entry, request.teacher)
    LOG.info("%s %s: mode %s, teacher %s (%s); rollout_budget %d is logged only (Kiln never passes it to the "
             "trainer); use_cache %s has no effect (kiln-flows keeps no logit cache)", SURFACE, request.name,
             request.mode_name, request.teacher, entry.identity_revision, request.rollout_budget,
             str(request.use_cache).lower())

    base = {"student": student_dir, "storage_root": out_root, "adapter": request.name, "config": config,
            "post_eval": post_eval}
    registered = {"kind": "local_registry", "alias": request.teacher}
    if config.training_mode == "on_policy":
        from kiln_core.on_policy.prompt_file import write_prompt_file

        prompts = _on_policy_prompts(request, prompt_bank, warn)
        spec = parse_spec({**base, "teacher": registered, "prompts": write_prompt_file(prompts, out_root)})
    else:
        examples = _write_examples(request.mode.examples, out_root)
        if vllm_teacher is None:
            spec = parse_spec({**base, "teacher": registered, "examples": examples})
        else:
            corpus = _score_on_vllm(examples, entry, vllm_teacher, student_dir=student_dir, out_root=out_root,
                                    top_k=config.top_k)
            spec = parse_spec({**base, "teacher": {"kind": "manifest_file", "path": corpus}, "corpus": corpus})
    return spec.model_copy(update={"recipe": _record(request, entry, recipe, step)})


def _registered_teacher(out_root: str, alias: str):
    """The registry entry of ``alias`` (Kiln: the pump's teacher must be registered)."""
    from kiln_core.teachers.local_registry import LocalRegistryError, get_local_teacher

    try:
        return get_local_teacher(out_root, alias)
    except LocalRegistryError as error:
        if error.code != "unknown_alias":
            raise Rejection(error.code, error.message, field="teacher") from None
        raise Rejection("teacher_not_registered", f"{SURFACE}: teacher alias '{alias}' is not registered "
                        f"(`kiln-flows teachers register {alias} DIR --out {out_root}`)", field="teacher") from None


def _run_config(request: DistillPumpRequest, base_adapter: str | None, vllm_teacher: str | None,
                warn: Callable[[str], None]) -> OpdConfig:
    """The request's config as the pump trains it: ``rank``, Kiln's overrides, the chained warm start,
    and off_policy for a remote teacher."""
    config = effective_pump_config(request)
    update: dict[str, Any] = {"output_name": request.name, "auto_load": False}  # Kiln's pump arm overrides both
    if base_adapter is not None and config.base_adapter is None:
        update["base_adapter"] = base_adapter
    if vllm_teacher is not None and config.training_mode == "on_policy":
        # Kiln refuses a remote teacher on-policy; only a mode left at its default is switched, never one
        # the request asks for (nor domain/wide, which are on-policy by nature).
        asked = "training_mode" in request.config.model_fields_set
        if asked or not isinstance(request.mode, PumpExamples):
            raise Rejection("remote_teacher_on_policy", REMOTE_ON_POLICY, field="config.training_mode")
        warn(f"{SURFACE}: a vLLM teacher serves prefetched logits, so the pump trains off_policy (Kiln's rule for a "
             "remote teacher); set config.training_mode to off_policy to say so")
        update["training_mode"] = "off_policy"
        check_off_policy_examples(request.mode.examples)
    return config.model_copy(update=update)


def _check_pinned(entry, alias: str) -> None:
    """Hash the registered teacher's files again: a teacher changed since registration is refused
    (Kiln re-checks a pinned teacher before use; an alias is immutable, so re-register under a new one)."""
    from kiln_core.identity.hashing import IdentityHashError
    from kiln_core.identity.local_teacher import local_teacher_identity

    pinned = entry.identity
    try:
        current = local_teacher_identity(entry.teacher_dir, served_model_id=pinned["served_model_id"],
                                         max_top_k=pinned["max_top_k"], max_model_len=pinned["max_model_len"],
                                         device_kind="cpu").as_ordered_dict()
    except IdentityHashError as error:
        raise Rejection("teacher_identity_mismatch", f"teacher '{alias}' is pinned to {entry.identity_revision}, but "
                        f"its files at {entry.teacher_dir} can no longer be hashed: {error.message}",
                        field="teacher") from None
    changed = [name for name in PINNED_FILE_FIELDS if current[name] != pinned[name]]
    if not changed:
        return
    if changed == ["adapter"] and pinned["adapter"] is not None:
        message = (f"teacher '{alias}' is pinned to adapter '{pinned['adapter']['name']}', but the exact registered "
                   f"content could not be loaded from {entry.teacher_dir}; re-register after any adapter rewrite")
    else:
        message = (f"teacher '{alias}' is pinned to {entry.identity_revision}, but its files at {entry.teacher_dir} "
                   f"changed ({', '.join(changed)}); aliases are immutable: register the new teacher under a new alias")
    raise Rejection("teacher_identity_mismatch", message, field="teacher")


def _on_policy_prompts(request: DistillPumpRequest, prompt_bank: str | None,
                       warn: Callable[[str], None]) -> list[OpdPrompt]:
    """The request's examples, or the user's prompt bank for ``domain``/``wide``; each prompt without an
    assistant turn ends with Kiln's rollout cue."""
    if isinstance(request.mode, PumpExamples):
        prompts = list(request.mode.examples)
    else:
        if prompt_bank is None:
            what = f"domain {request.mode.domain!r}" if request.mode_name == "domain" else "wide"
            raise Rejection("pump_prompt_bank_required", f"{SURFACE} {what} needs a prompt bank: Kiln's built-in seed "
                            "banks are 3-4 toy prompts, which kiln-flows does not ship; pass --prompt-bank FILE (a JSONL "
                            "of Kiln OpdPrompt objects, one user prompt per line is enough), or send the prompts as "
                            "mode.examples", field="prompt_bank")
        from kiln_core.on_policy.prompt_file import read_prompt_file

        prompts = list(read_prompt_file(prompt_bank).prompts)
    cued = [_with_rollout_cue(prompt) for prompt in prompts]
    added = sum(1 for before, after in zip(prompts, cued) if before is not after)
    if added:
        warn(f"{SURFACE}: {added} of {len(prompts)} prompts had no assistant turn; each ends with Kiln's empty "
             "assistant turn, where the student's rollout starts")
    return cued


def _with_rollout_cue(prompt: OpdPrompt) -> OpdPrompt:
    """``prompt`` itself when it has an assistant turn or a trajectory, else it with the cue appended."""
    if prompt.trajectory or any(message.role == "assistant" for message in prompt.messages):
        return prompt
    value = kiln_prompt_value(prompt)
    return OpdPrompt.model_validate({**value, "messages": [*value["messages"], KILN_ROLLOUT_CUE]})


def pump_examples_rows(examples: list[OpdPrompt]) -> list[dict[str, Any]]:
    """Off-policy examples as scoring rows: ``messages[:-1]`` and ``teacher_response`` = the last message.

    Example:
        >>> pump_examples_rows([OpdPrompt.model_validate({"messages": [{"role": "user", "content": "2+2?"},
        ...     {"role": "assistant", "content": "4"}]})])
        [{'messages': [{'role': 'user', 'content': '2+2?'}], 'teacher_response': '4'}]
    """
    rows = []
    for prompt in examples:
        messages = kiln_prompt_value(prompt)["messages"]
        rows.append({"messages": messages[:-1], "teacher_response": messages[-1]["content"]})
    return rows


def _write_examples(examples: list[OpdPrompt], out_root: str) -> str:
    """Write the rows once as ``<root>/recipes/distill_pump/<sha256>.jsonl`` (same examples, same file)."""
    from kiln_core.storage import resolve, write_bytes_atomic

    data = "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n"
                   for row in pump_examples_rows(examples)).encode("utf-8")
    location = resolve(out_root).child(*PUMP_DIR, f"{hashlib.sha256(data).hexdigest()}.jsonl")
    if not location.exists():
        write_bytes_atomic(location, data)
    return location.uri


def _score_on_vllm(examples_uri: str, entry, url: str, *, student_dir: str, out_root: str, top_k: int) -> str:
    """Score the examples through the vLLM server pinned to the alias's registered manifest, once."""
    from kiln_core.canonical import kiln_compact_json
    from kiln_core.contracts.identity import parse_manifest_line
    from kiln_core.scoring import score_examples
    from kiln_core.storage import resolve
    from kiln_core.tokenization import load_student_tokenizer

    # Keyed by what decides the scored bytes: the examples, the teacher, the student's tokens, top-K.
    student = dict(sorted(load_student_tokenizer(student_dir).identity().items()))
    key_parts = [hashlib.sha256(resolve(examples_uri).read_bytes()).hexdigest(), entry.identity_revision,
                 kiln_compact_json(student), str(top_k)]
    key = hashlib.sha256("|".join(key_parts).encode("utf-8")).hexdigest()[:24]
    out_uri = resolve(out_root).child(*PUMP_DIR, "scored", f"{key}.jsonl").uri
    if not resolve(out_uri).exists():
        identity = parse_manifest_line(entry.off_policy_manifest).teacher_identity
        score_examples(examples_uri, vllm_url=url, served_model=identity.served_model_id,
                       pinned_manifest=entry.off_policy_manifest, student_dir=student_dir, top_k=top_k, out_uri=out_uri)
    return out_uri


def _record(request: DistillPumpRequest, entry, recipe: str | None, step: int | None) -> RecipeRecord:
    """Kiln's registered-teacher descriptor: alias, served model id, ``sha256:<content revision>``, identity."""
    identity = dict(entry.identity)
    descriptor = TeacherDescriptor(alias=request.teacher, model_id=identity["served_model_id"],
                                   model_version_hash=entry.identity_revision, identity=identity)
    return RecipeRecord(kind="distill_pump", mode=request.mode_name, name=request.name, teacher=descriptor,
                        teacher_identity_revision=entry.identity_revision, request=request.kiln_value(),
                        recipe=recipe, step=step)
