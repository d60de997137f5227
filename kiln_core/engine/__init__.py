"""The engine: one path from a spec (or a Kiln request file) to a published adapter.

``run_pipeline(spec)`` validates, admits, plans (one process or ``torchrun``), trains and publishes;
``kiln-flows train`` calls it with plain stages, the ``opd_distill`` flow with Prefect tasks wrapping
the same stage functions. Modules, in the order the work happens:

* ``request`` — a Kiln ``OpdRequest`` file → ``PipelineSpec`` (``kiln-flows train``): ``spec_from_request``,
  then ``run_pipeline``, is the one way a request is trained;
* ``stages`` — teacher manifest, scoring, fingerprint, admission, verification;
* ``prompts`` — the on-policy source: prompt checks (the data stage) and ``train_on_policy`` (training);
* ``runs`` — the run directory ``<root>/runs/<adapter>/<run key>/``, the seed, where to resume;
* ``training`` — train in this process or under ``torchrun``; Ctrl-C stops at a step (``interrupt``);
* ``publish`` — verify the adapter against its receipt, write ``latest.json``;
* ``pipeline`` — the order itself (``run_pipeline``, ``prepare``, ``prepare_job``, ``LocalStages``);

The small values the stages hand each other (the refs and the ``TrainPlan``) are wire formats:
``kiln_core.contracts.stage_refs``.

Nothing here imports Prefect.
"""

from kiln_core.contracts.stage_refs import (CorpusRef, InputsRef, ManifestRef, PipelineResult, PublishRef, ScoredRef,
                                            TrainPlan, TrainRef)
from kiln_core.engine.pipeline import LocalStages, PreparedRun, Stages, prepare, prepare_job, run_pipeline
from kiln_core.engine.request import RequestRun, spec_from_request
from kiln_core.engine.runs import ResumeRequired

__all__ = ["CorpusRef", "InputsRef", "LocalStages", "ManifestRef", "PipelineResult", "PreparedRun", "PublishRef",
           "RequestRun", "ResumeRequired", "ScoredRef", "Stages", "TrainPlan", "TrainRef", "prepare", "prepare_job",
           "run_pipeline", "spec_from_request"]
