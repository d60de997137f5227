"""From a Kiln ``OpdRequest`` file to a trained adapter: the glue behind ``kiln-flows train``.

1. read and validate the request (``OpdRequest``, Kiln's submit-time rules, the adapter name);
2. resolve ``teacher`` to the pinned manifest line: a file holding it, or an alias in the local
   registry under the storage root;
3. admit the corpus at ``dataset_path`` against that manifest, materializing it under the root (an
   already-materialized corpus is reused, not re-admitted);
4. train with the run directory ``<root>/runs/<adapter>`` (DESIGN.md decision 7) — in this process, or
   with ``nproc > 1`` on that many ranks under ``torchrun`` (``kiln_core.training.distributed``): steps
   1-3 happen here first, so rejections come before any launch and the ranks read the materialized
   corpus instead of admitting it again.

Relative ``dataset_path`` and teacher-file paths are resolved against the request file's directory,
so a request file and its corpus can move together. (Kiln resolves ``dataset_path`` on the server;
for a local CLI the request file's location is the useful anchor.)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from kiln_core.contracts.opd_config import ConfigError, OpdRequest, parse_opd_request, validate_request_for_offline_training
from kiln_core.storage import resolve
from kiln_core.training.trainer import TrainResult

__all__ = ["load_request", "prepare_train_request", "PreparedRequest", "run_train_request", "run_directory"]

# Adapter names become directory names and checkpoint prefixes: keep them path-safe.
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def run_directory(out_root: str, adapter: str) -> str:
    """``<root>/runs/<adapter>`` as a URI or absolute local path."""
    return resolve(out_root).child("runs", adapter).uri


def check_adapter_name(name: str) -> str:
    """Refuse adapter names that are not a single safe path component."""
    if not _ADAPTER_NAME.match(name) or ".." in name or name.endswith(".kiln-checkpoint"):
        raise ConfigError(
            f"adapter name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-', start with a "
            "letter or digit, and contain no '..'",
            "adapter",
            code="invalid_adapter_name",
        )
    return name


def load_request(request_path: str) -> tuple[OpdRequest, list[str]]:
    """Read, parse and validate an ``OpdRequest`` JSON file; returns the request and its warnings.

    Raises:
        ConfigError: unreadable or invalid JSON, or a rule Kiln enforces at submit time.
    """
    try:
        text = resolve(request_path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read OPD request {request_path}: {error}", None, code="invalid_request") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"OPD request {request_path} is not valid JSON: {error}", None, code="invalid_request") from None
    request = parse_opd_request(value)
    return request, validate_request_for_offline_training(request)


def _anchored(path: str, request_path: str) -> str:
    """A relative local path is taken relative to the request file's directory."""
    if "://" in path or os.path.isabs(path) or "://" in request_path:
        return path
    return os.path.join(os.path.dirname(os.path.abspath(request_path)), path)


def resolve_teacher_manifest(teacher: str, out_root: str, request_path: str) -> str:
    """The pinned manifest line for ``teacher`` (a manifest file, or a local-registry alias).

    Raises:
        ConfigError: ``teacher_not_registered`` when it is neither.
    """
    from kiln_core.teachers.local_registry import LocalRegistryError, resolve_pinned_manifest

    anchored = _anchored(teacher, request_path)
    candidate = anchored if os.path.isfile(anchored) else teacher
    try:
        return resolve_pinned_manifest(out_root, candidate)
    except LocalRegistryError as error:
        code = "teacher_not_registered" if error.code == "unknown_alias" else error.code
        raise ConfigError(error.message, "teacher", code=code) from None


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request whose corpus is admitted: everything ``train_opd`` needs but the callbacks."""

    request: OpdRequest
    config: Any  # OpdConfig with output_name and resume_checkpoint filled in
    adapter: str
    student_dir: str
    run_root: str
    resume_checkpoint: str | None
    admission: Any  # AdmissionResult

    def train_kwargs(self) -> dict[str, Any]:
        admission = self.admission
        return dict(tables=admission.tables, dataset_sha256=admission.dataset_sha256,
                    dataset_path=self.request.dataset_path or "", student_dir=self.student_dir, adapter_name=self.adapter,
                    config=self.config, run_root=self.run_root, teacher_identity=admission.teacher_identity,
                    teacher_alias=self.request.teacher, resume_checkpoint=self.resume_checkpoint)

    def job(self, *, world_size: int, device: str | None = None, precision: str | None = None,
            gradient_checkpointing: bool = False, backend: str = "auto"):
        """The ``DistributedJob`` the ranks of a ``world_size``-process run execute.

        Raises:
            ConfigError: per-process storage (``memory://``); ResumeError: ``resume_world_size`` when the
                resume checkpoint was written by another world size (checked here, before any launch).
        """
        from kiln_core.training.checkpoint import check_world_size, load_checkpoint
        from kiln_core.training.distributed.launcher import DistributedJob
        from kiln_core.training.distributed.world import check_shared_storage

        admission = self.admission
        check_shared_storage(self.run_root, admission.materialized or "")
        if self.resume_checkpoint is not None:
            check_world_size(load_checkpoint(self.run_root, self.resume_checkpoint), world_size)
        return DistributedJob(
            materialization=admission.materialized, dataset_sha256=admission.dataset_sha256,
            dataset_path=self.request.dataset_path or "", student_dir=self.student_dir,
            adapter_name=self.adapter, config=self.config.model_dump(mode="json", by_alias=True), run_root=self.run_root,
            manifest_line=admission.manifest_line, teacher_alias=self.request.teacher,
            resume_checkpoint=self.resume_checkpoint, device=device, precision=precision,
            gradient_checkpointing=gradient_checkpointing, backend=backend)


def prepare_train_request(
    request_path: str,
    *,
    adapter: str,
    student_dir: str,
    out_root: str = "./kiln-data",
    resume_checkpoint: str | None = None,
    on_warning: Callable[[str], None] | None = None,
) -> PreparedRequest:
    """Steps 1-3: validate the request, resolve the teacher, admit (and materialize) the corpus.

    Raises:
        ConfigError, AdmissionError, CheckpointError: rejected input, before training.
    """
    from kiln_core.admission import admit_corpus
    from kiln_core.training.checkpoint import check_resume_basename

    request, warnings = load_request(request_path)
    check_adapter_name(adapter)
    config = request.config
    if config.output_name is not None and config.output_name != adapter:
        warnings.append(f"config.output_name {config.output_name!r} is replaced by --adapter {adapter!r}")
    resume = resume_checkpoint or config.resume_checkpoint
    # The adapter name is part of the effective config (output_name), so every run of it agrees.
    config = config.model_copy(update={"output_name": adapter, "resume_checkpoint": resume})
    run_root = run_directory(out_root, adapter)
    if resume is not None:  # traversal and foreign names are refused before any admission work
        check_resume_basename(resume, resolve(run_root), adapter)
    for warning in warnings:
        if on_warning:
            on_warning(warning)
    manifest_line = resolve_teacher_manifest(request.teacher, out_root, request_path)
    dataset = _anchored(request.dataset_path or "", request_path)
    admission = admit_corpus(dataset, student_dir, top_k=config.top_k, pinned_manifest=manifest_line, out_root=out_root)
    return PreparedRequest(request=request, config=config, adapter=adapter, student_dir=student_dir, run_root=run_root,
                           resume_checkpoint=resume, admission=admission)


def run_train_request(
    request_path: str,
    *,
    adapter: str,
    student_dir: str,
    out_root: str = "./kiln-data",
    resume_checkpoint: str | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    handle_signals: bool = False,
    device: str | None = None,
    precision: str | None = None,
    gradient_checkpointing: bool = False,
    nproc: int = 1,
    backend: str = "auto",
    strategy: str = "ddp",
) -> TrainResult:
    """Validate, admit and train one OPD request file.

    Args:
        request_path: Path or URI of the ``OpdRequest`` JSON.
        adapter: Adapter name (overrides ``config.output_name``).
        student_dir: Local student model directory.
        out_root: Storage root (local path or fsspec URI) for corpora, runs and the teacher registry.
        resume_checkpoint: Checkpoint basename; overrides ``config.resume_checkpoint``.
        should_cancel, on_progress, handle_signals, device, precision, gradient_checkpointing: passed
            to ``train_opd``.
        on_warning: Receives non-blocking warnings (e.g. a learning rate far from the default).
        nproc: Processes on this machine; above 1 the run is launched under ``torchrun`` and each
            optimizer step takes ``nproc × sequences_per_step`` candidates (rank 0's result is returned).
        backend: ``auto`` (gloo on CPU, nccl on CUDA), ``gloo`` or ``nccl``; used when ``nproc > 1``.
        strategy: ``ddp`` (``fsdp`` is refused: not implemented).

    Raises:
        ConfigError, AdmissionError, CheckpointError/ResumeError: rejected input, before training.
        DistributedRunError: a rank of a multi-process run crashed.

    Example:
        >>> result = run_train_request("opd-request.json", adapter="demo", student_dir="./student")  # doctest: +SKIP
        >>> result.status  # doctest: +SKIP
        'success'
    """
    from kiln_core.training import trainer

    if nproc < 1:
        raise ConfigError(f"nproc must be at least 1; got {nproc}", "nproc")
    if nproc > 1:
        from kiln_core.training.distributed.world import check_shared_storage, check_strategy, resolve_backend
        from kiln_core.training.student import resolve_device

        check_strategy(strategy)  # all three are refused before any admission work
        resolve_backend(backend, resolve_device(device))
        check_shared_storage(out_root)
    prepared = prepare_train_request(request_path, adapter=adapter, student_dir=student_dir, out_root=out_root,
                                     resume_checkpoint=resume_checkpoint, on_warning=on_warning)
    if nproc > 1:
        from kiln_core.training.distributed.launcher import launch

        job = prepared.job(world_size=nproc, device=device, precision=precision,
                           gradient_checkpointing=gradient_checkpointing, backend=backend)
        return launch(job, nproc, on_progress=on_progress, should_cancel=should_cancel, forward_signals=handle_signals)
    return trainer.train_opd(
        **prepared.train_kwargs(),
        should_cancel=should_cancel,
        on_progress=on_progress,
        handle_signals=handle_signals,
        device=device,
        precision=precision,
        gradient_checkpointing=gradient_checkpointing,
    )
