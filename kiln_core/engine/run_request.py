"""Request preparation for the ``torchrun`` worker's ``--request`` mode (multi-node runs).

The request → spec → admission → plan path is the engine's (``kiln_core.engine``); this module keeps
the name the worker (``kiln_core.engine.worker``) imports, and builds its ``DistributedJob``
with the same run directory rule as ``kiln-flows train`` and the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["PreparedRequest", "prepare_train_request"]


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request; ``job()`` admits it (rank 0 first) and plans the run for a world size."""

    request_path: str
    adapter: str
    student_dir: str
    out_root: str
    resume_checkpoint: str | None
    kiln_lenient: bool = False

    def job(self, *, world_size: int, device: str | None = None, precision: str | None = None,
            gradient_checkpointing: bool = False, backend: str = "auto", strategy: str = "ddp"):
        """The ``DistributedJob`` every rank of a ``world_size``-process run executes (refused like
        ``kiln-flows train --nproc``'s: e.g. ``strategy: fsdp`` on CPU)."""
        from kiln_core.engine.pipeline import prepare
        from kiln_core.engine.request import spec_from_request
        from kiln_core.engine.runs import newest_checkpoint
        from kiln_core.engine.training import distributed_job

        run = spec_from_request(self.request_path, adapter=self.adapter, student_dir=self.student_dir,
                                out_root=self.out_root, resume_checkpoint=self.resume_checkpoint,
                                nproc=world_size, backend=backend, kiln_lenient=self.kiln_lenient,
                                strategy=strategy)
        ready = prepare(run.spec, resume=run.resume, device=device, precision=precision,
                        gradient_checkpointing=gradient_checkpointing)
        plan = ready.plan
        if plan.resume == "latest":
            plan = plan.model_copy(update={"resume": newest_checkpoint(plan.run_uri, self.adapter)})
        return distributed_job(plan, ready.corpus, ready.manifest, ready.student_dir)


def prepare_train_request(request_path: str, *, adapter: str, student_dir: str, out_root: str = "./kiln-data",
                          resume_checkpoint: str | None = None, kiln_lenient: bool = False,
                          on_warning: Callable[[str], None] | None = None) -> PreparedRequest:
    """Validate the request file now (rejections before any launch); ``job()`` does the rest."""
    from kiln_core.engine.request import spec_from_request

    run = spec_from_request(request_path, adapter=adapter, student_dir=student_dir, out_root=out_root,
                            resume_checkpoint=resume_checkpoint, kiln_lenient=kiln_lenient)
    for warning in run.warnings:
        if on_warning:
            on_warning(warning)
    return PreparedRequest(request_path, adapter, student_dir, out_root, resume_checkpoint, kiln_lenient)
