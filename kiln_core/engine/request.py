"""From a Kiln ``OpdRequest`` file to a ``PipelineSpec``: what ``kiln-flows train`` hands the engine.

1. read and validate the request (``OpdRequest``, Kiln's submit-time rules), the adapter name, and the
   resume checkpoint's name — all before any work. An unknown key (``config.learnign_rate``) is refused
   with ``invalid_request``, naming it and the closest field; ``kiln_lenient`` (``--kiln-lenient``) ignores
   it as Kiln does, and then each ignored key is a warning and is recorded in the run's receipt
   (the spec's ``ignored_request_keys``, carried by the plan into the receipt);
2. ``teacher`` is a file whose first line is the pinned manifest (relative to the request file), or
   an alias in the local registry under the storage root;
3. ``dataset_path`` (relative paths are taken relative to the request file, so a request and its
   corpus can move together; Kiln resolves it on its server) becomes the spec's corpus;
4. ``post_eval`` (Kiln's ``OpdRequest.post_eval``, crates/kiln-train/src/opd.rs) is parsed and checked
   with Kiln's submit-time rules, the installed suite included (crates/kiln-server/src/api/training.rs ·
   validate_post_eval_suite), and becomes the spec's gate (``kiln_core.engine.gate``);
5. an on-policy request's inline ``prompts`` (Kiln's default ``training_mode``) are written once to
   ``<root>/prompts/<digest>.jsonl`` and become the spec's ``prompts``; the teacher must be a
   registered local alias (the engine's prompt stage applies the rest of Kiln's on-policy checks
   before any model loads: teacher vocabulary, prompt + ``max_tokens`` within the context, top-K).

This is the one door that trains a request: ``spec_from_request``, then ``run_pipeline`` like any other
spec — admitted, planned (run directory ``<root>/runs/<adapter>/<run key>/``), trained in this process,
under ``torchrun`` or on Ray, published. ``kiln-flows train`` and the drills call exactly that; a
multi-node run stops after planning (``RequestRun.job``) and hands the job to torchrun on every node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln_core.contracts.eval_watch import EvalWatch, parse_eval_watch
from kiln_core.contracts.names import check_name
from kiln_core.contracts.opd_config import ConfigError, OpdRequest, parse_opd_request, unknown_request_keys
from kiln_core.contracts.opd_submit import validate_request_for_offline_training
from kiln_core.contracts.pipeline import DistributedOptions, PipelineSpec, TeacherSource, parse_spec
from kiln_core.contracts.spec_blocks import DEFAULT_MAX_TRAINING_HOURS
from kiln_core.contracts.post_eval.config import PostEvalConfig, parse_post_eval_config, validate_post_eval_config
from kiln_core.contracts.settings import check_one_process
from kiln_core.contracts.unknown_keys import UnknownKey
from kiln_core.engine.pipeline import LocalStages, prepare_job
from kiln_core.post_eval.registry import SuiteRegistry
from kiln_core.storage import anchored_path
from kiln_core.teachers.local_registry import teacher_source


@dataclass(frozen=True)
class RequestRun:
    """A request turned into a spec, the resume point it asks for, and the warnings it raised.

    Attributes:
        ignored_keys: Unknown request keys ``--kiln-lenient`` ignored (dotted paths), each also a warning.
    """

    spec: PipelineSpec
    resume: str | None
    warnings: list[str] = field(default_factory=list)
    ignored_keys: tuple[str, ...] = ()

    def stages(self, **options) -> LocalStages:
        """The ``LocalStages`` that run this request (``options``: theirs)."""
        return LocalStages(**options)

    def job(self, *, device: str | None = None, precision: str | None = None, gradient_checkpointing: bool = False):
        """The ``DistributedJob`` the ranks of a multi-node run execute (``kiln-flows train --write-job``):
        admitted and planned for the spec's world size (``nproc``); its plan carries the ignored keys to the receipt."""
        return prepare_job(self.spec, resume=self.resume, device=device, precision=precision,
                           gradient_checkpointing=gradient_checkpointing)


@dataclass(frozen=True)
class LoadedRequest:
    """A parsed request, the warnings Kiln's submit rules raised, and the unknown keys it ignored."""

    request: OpdRequest
    warnings: list[str]
    ignored_keys: tuple[str, ...] = ()


def load_request(request_path: str, *, kiln_lenient: bool = False) -> LoadedRequest:
    """Read, parse and validate an ``OpdRequest`` JSON file.

    Args:
        request_path: The request file.
        kiln_lenient: Ignore unknown keys as Kiln does; each one becomes a warning and an ignored key.

    Raises:
        ConfigError: ``invalid_request`` (unreadable, not JSON, an unknown key) or a rule Kiln enforces at
            submit time; NestingTooDeep: ``nesting_too_deep`` — deeper than Kiln's parser accepts.
    """
    from kiln_core.contracts.request_file import read_request_json

    value = read_request_json(request_path, "OPD")
    request = parse_opd_request(value, kiln_lenient=kiln_lenient)
    ignored = [key for key in unknown_request_keys(value) if not key.kiln_refuses] if kiln_lenient else []
    warnings = [_ignored_warning(key) for key in ignored]
    if request.prompts or request.dataset_path is None:
        # On-policy (or no source at all): Kiln's submit rules for prompts, `source_not_exactly_one` first.
        from kiln_core.on_policy.submit import check_request

        warnings += check_request(request)
    else:
        warnings += validate_request_for_offline_training(request)
    return LoadedRequest(request, warnings, tuple(key.path for key in ignored))


def _ignored_warning(key: UnknownKey) -> str:
    """``ignored unknown request key `config.learnign_rate` (--kiln-lenient); did you mean `learning_rate`?``"""
    hint = f"; did you mean `{key.suggestion}`?" if key.suggestion else ""
    return f"ignored unknown request key `{key.path}` (--kiln-lenient, as Kiln does){hint}"


def spec_from_request(request_path: str, *, adapter: str, student_dir: str, out_root: str = "./kiln-data",
                      resume_checkpoint: str | None = None, nproc: int = 1, backend: str = "auto",
                      eval_watch: dict | None = None, vllm: dict | None = None,
                      kiln_lenient: bool = False, admit_workers: int = 1, ray: dict | None = None,
                      strategy: str = "ddp", max_training_hours: float | None = DEFAULT_MAX_TRAINING_HOURS) -> RequestRun:
    """Validate a request file and build the spec ``run_pipeline`` trains (nothing is read but the request;
    an on-policy request's inline prompts are written to ``<out_root>/prompts/<digest>.jsonl``).

    ``eval_watch`` is the held-out watch (``EvalWatch`` fields, from ``kiln-flows train --eval-corpus``);
    a Kiln request has no such field, so it is off unless the caller sets it. ``vllm`` is the spec's
    ``vllm:`` block (``VllmBackends`` fields, from ``--vllm-rollouts``/``--vllm-teacher``): on-policy only.
    ``kiln_lenient`` (``--kiln-lenient``) ignores unknown request keys as Kiln does, naming each in a warning
    and in ``RequestRun.ignored_keys``. ``admit_workers`` (``--admit-workers``): shards admitted at once when
    ``dataset_path`` names a set of shards (a directory or an index). ``ray`` (``--ray ADDRESS --workers N``):
    the Ray fields of the spec's ``distributed`` block (``address``, ``workers``, ``gpus_per_worker``,
    ``max_failures``); training then runs on that Ray cluster instead of here or under torchrun.
    ``strategy`` (``--strategy``): ``distributed.strategy`` (``fsdp``: two or more ranks on GPUs).
    ``max_training_hours`` (``--max-training-hours``): the time bound, ``options.max_training_hours`` (None: none).

    Raises:
        ConfigError: the request (``invalid_request`` for an unknown key), the adapter name (``invalid_adapter_name``), ``nproc``, the watch
            (``eval.*``); CheckpointError: ``invalid_checkpoint_name`` for a resume checkpoint that is not one of
            the adapter's; PostEvalRejection: a ``post_eval`` Kiln would refuse at submit time.

    Example:
        >>> prepared = spec_from_request("opd-request.json", adapter="demo", student_dir="./student")  # doctest: +SKIP
        >>> prepared.spec.corpus  # doctest: +SKIP
        '/abs/path/teacher-data.jsonl'
    """
    from kiln_core.engine.runs import check_resume_name

    loaded = load_request(request_path, kiln_lenient=kiln_lenient)
    request, warnings, ignored = loaded.request, loaded.warnings, loaded.ignored_keys
    check_name(adapter, field="adapter")
    if nproc < 1:
        raise ConfigError(f"nproc must be at least 1; got {nproc}", "nproc")
    if ray is not None and nproc != 1:
        raise ConfigError(f"--nproc {nproc} and --ray do not go together: on Ray, --workers counts the ranks", "nproc",
                          code="unsupported")
    config = request.config
    if config.output_name is not None and config.output_name != adapter:
        warnings.append(f"config.output_name {config.output_name!r} is replaced by --adapter {adapter!r}")
    resume = resume_checkpoint or config.resume_checkpoint
    if resume is not None:  # traversal and foreign names are refused before any admission work
        check_resume_name(resume, out_root, adapter)
    post_eval = parse_post_eval_config(request.post_eval)
    validate_post_eval_config(post_eval, SuiteRegistry.for_storage_root(out_root) if post_eval else None)
    teacher = teacher_source(request.teacher, request_path, out_root)
    watch = parse_eval_watch(eval_watch) if eval_watch is not None else None
    if request.prompts:
        check_one_process(ray=ray is not None, field="ray")
        check_one_process(strategy=strategy, field="distributed.strategy")
    if request.prompts:
        spec = _on_policy_spec(request, teacher, post_eval, watch, adapter=adapter, student_dir=student_dir,
                               out_root=out_root, nproc=nproc, request_path=request_path, vllm=vllm,
                               max_training_hours=max_training_hours)
        return RequestRun(spec=spec.model_copy(update={"ignored_request_keys": ignored}), resume=resume,
                          warnings=warnings, ignored_keys=ignored)
    spec = parse_spec({
        "teacher": teacher,
        "corpus": anchored_path(request.dataset_path or "", request_path),
        "student": student_dir,
        "storage_root": out_root,
        "adapter": adapter,
        "config": config,  # already validated with Kiln's rules
        "distributed": _distributed_block(nproc, backend, ray, strategy),
        "post_eval": post_eval,
        "eval": watch,
        "vllm": vllm,  # refused (invalid_spec): a corpus is already scored
        "options": {"admit_workers": admit_workers, "max_training_hours": max_training_hours},
    }, file=request_path)
    return RequestRun(spec=spec.model_copy(update={"ignored_request_keys": ignored}), resume=resume, warnings=warnings,
                      ignored_keys=ignored)


def _distributed_block(nproc: int, backend: str, ray: dict | None, strategy: str = "ddp") -> dict | None:
    """The spec's ``distributed`` block: Ray's fields with ``--ray``, torchrun's above one process or with a
    strategy other than ddp (validated with the spec: fsdp with one process is refused there), else none."""
    if ray is not None:
        return {"engine": "ray", "backend": backend, "strategy": strategy,
                **{key: value for key, value in ray.items() if value is not None}}
    if strategy != "ddp":
        return {"nproc": nproc, "backend": backend, "strategy": strategy}
    return DistributedOptions(nproc=nproc, backend=backend) if nproc > 1 else None


def _on_policy_spec(request: OpdRequest, teacher: TeacherSource, post_eval: PostEvalConfig | None,
                    watch: EvalWatch | None, *, adapter: str, student_dir: str, out_root: str, nproc: int,
                    request_path: str, vllm: dict | None = None,
                    max_training_hours: float | None = DEFAULT_MAX_TRAINING_HOURS) -> PipelineSpec:
    """The spec of an on-policy request: its prompts written as a prompt file, a local teacher, one process,
    its ``post_eval`` gate and the held-out watch, if any."""
    from kiln_core.engine.prompts import write_inline_prompts
    from kiln_core.errors import Rejection

    if teacher.kind != "local_registry":  # Kiln's require_remote_teacher_off_policy
        raise Rejection("remote_teacher_on_policy", 'OPD cannot use a remote teacher with training_mode="on_policy": '
                        f"{request.teacher!r} is a manifest file, not a registered local teacher "
                        "(`kiln-flows teachers register ALIAS DIR`)", field="teacher")
    check_one_process(world_size=nproc, field="nproc")
    return parse_spec({
        "teacher": teacher, "prompts": write_inline_prompts(request.prompts, out_root), "student": student_dir,
        "storage_root": out_root, "adapter": adapter, "config": request.config, "post_eval": post_eval,
        "eval": watch, "vllm": vllm, "options": {"max_training_hours": max_training_hours},
    }, file=request_path)
