"""``EvalWatch``: held-out evaluation while a run trains, and the rules that warn about (or stop) it.

Extension (issue 14 item 4; not part of Kiln's ``OpdConfig``). Off unless a caller passes one to
``train_opd`` / ``train_on_policy`` (``eval_watch=``), so a Kiln request keeps Kiln's step semantics
and its checkpoints and adapter bytes exactly. When it is on, every ``every_steps`` optimizer steps the
trainer scores a small, fixed held-out slice with ``kiln_core.evaluation``'s metrics and applies three
rules (``kiln_core.training.eval_curve`` states them precisely):

* ``diverged`` — held-out reverse KL rose at each of the last ``patience`` evaluations;
* ``stalled`` — held-out reverse KL has not improved on its best for ``patience`` evaluations;
* ``flat`` — the training loss stopped moving: the mean loss of the last ``flat_window`` steps is
  within ``flat_tolerance`` (relative) of the mean of the ``flat_window`` steps before them.

A rule that starts firing is a warning (log and receipt); with ``stop_on_divergence`` it also stops
the run cleanly: a checkpoint, a ``failed`` receipt (``training_error`` plus our ``stop_reason``).

Example:
    >>> EvalWatch(corpus="heldout.jsonl", every_steps=25).patience
    3
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln_core.contracts.opd_config import ConfigError

__all__ = ["EvalWatch", "parse_eval_watch"]


class EvalWatch(BaseModel):
    """What to evaluate during training, how often, and when to warn or stop."""

    # Each field's docstring is its one-line description in the run form (use_attribute_docstrings);
    # docs/eval-watch.md explains the rules at length.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, use_attribute_docstrings=True,
                              title="Held-out watch during training")

    corpus: str = Field(min_length=1)
    """Held-out teacher-scored JSONL (path or URI): same teacher and vocabulary, no prompt shared with training."""
    every_steps: int = Field(ge=1)
    """Evaluate every this many optimizer steps (also before the first and after the last); required."""
    max_examples: int = Field(default=16, ge=1)
    """Most held-out examples in the slice, spread evenly over the corpus; default 16."""
    max_tokens: int = Field(default=2048, ge=1)
    """Most action tokens in the slice (the first chosen example always stays); default 2048."""
    patience: int = Field(default=3, ge=1)
    """Evaluations without improvement (stalled) or each with a rise (diverged) before a rule fires; default 3."""
    min_improvement: float = Field(default=0.01, ge=0.0, lt=1.0)
    """Relative change of held-out reverse KL that counts as an improvement or a rise; default 0.01."""
    flat_window: int | None = Field(default=50, ge=1)
    """Steps per window of the flat-loss rule (best a multiple of the examples per epoch); null = off; default 50."""
    flat_tolerance: float = Field(default=0.01, gt=0.0, lt=1.0)
    """Relative difference of two window means under which the training loss is flat; default 0.01."""
    stop_on_divergence: bool = False
    """Stop the run when a rule fires with steps left (checkpoint, failed receipt naming the rule); default false."""


def parse_eval_watch(value: Any) -> EvalWatch:
    """Validate a decoded ``eval`` block; a pydantic failure becomes one ``ConfigError`` (exit 2).

    Example:
        >>> parse_eval_watch({"corpus": "heldout.jsonl", "every_steps": 10}).max_examples
        16
    """
    try:
        return EvalWatch.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(["eval", *(str(part) for part in first["loc"])])
        raise ConfigError(f"invalid {where}: {first['msg']}", where) from None
