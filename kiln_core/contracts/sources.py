"""The training data of a pipeline spec as the run form shows it: one ``source``, of three kinds.

* ``corpus`` — off-policy, a JSONL corpus the teacher already scored (Kiln's ``dataset_path``);
* ``examples`` — off-policy, unscored examples the local teacher scores first;
* ``prompts`` — on-policy, prompts the student answers, with the sampling settings that only act there
  (``OnPolicySampling``: the same fields as ``OpdConfig``'s, with the same rules and descriptions).

A discriminated union, so the form shows one tab per kind with only its fields, and a spec cannot
name a corpus and examples at once. ``PipelineSpec`` binds the chosen source to its ``corpus`` /
``examples`` fields (``kiln_core.contracts.pipeline``).

Example:
    >>> CorpusSource(corpus="./scored.jsonl").kind
    'corpus'
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from kiln_core.contracts.opd_config import SAMPLING_FIELDS, OpdConfig

# Each branch's `kind` has its value as default so that the form fills it in when its tab is picked;
# parsing still needs `kind` in the input to choose the branch.


class CorpusSource(BaseModel):
    """Off-policy: a JSONL corpus the teacher has already scored (Kiln's dataset_path)."""

    model_config = ConfigDict(extra="forbid", title="Scored corpus")

    kind: Literal["corpus"] = Field(default="corpus", description="Train off-policy on a teacher-scored corpus.")
    corpus: str = Field(description="Teacher-scored JSONL corpus (local path or fsspec URI: file://, s3://, memory://).")


class ExamplesSource(BaseModel):
    """Off-policy: unscored examples that the local teacher scores first."""

    model_config = ConfigDict(extra="forbid", title="Examples to score")

    kind: Literal["examples"] = Field(default="examples",
                                      description="Score examples with the local teacher, then train off-policy.")
    examples: str = Field(description="Unscored examples JSONL, scored by the teacher first (teacher kind local_dir "
                          "or local_registry).")


# The sampling settings of OpdConfig, field for field (same types, rules, defaults and descriptions).
OnPolicySampling = create_model(
    "OnPolicySampling",
    __config__=ConfigDict(strict=True, extra="forbid", frozen=True, title="Sampling"),
    __doc__="How the student's rollouts are sampled and weighted (on-policy only).",
    **{name: (OpdConfig.model_fields[name].annotation, OpdConfig.model_fields[name]) for name in SAMPLING_FIELDS},
)


class PromptsSource(BaseModel):
    """On-policy: prompts that the student answers and the teacher scores (Kiln's prompts)."""

    model_config = ConfigDict(extra="forbid", title="Prompts (on-policy)")

    kind: Literal["prompts"] = Field(default="prompts",
                                     description="Train on-policy: sample the student's answers to prompts.")
    prompts: str = Field(description="Prompts JSONL, one Kiln OpdPrompt per line (local path or fsspec URI).")
    sampling: OnPolicySampling = Field(  # type: ignore[valid-type]
        default_factory=OnPolicySampling,
        description="How rollouts are sampled (samples per prompt, temperature, top-p, max tokens, ...).")


Source = Annotated[Union[CorpusSource, ExamplesSource, PromptsSource], Field(discriminator="kind")]
