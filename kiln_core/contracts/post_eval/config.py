"""``PostEvalConfig``: the ``post_eval`` block of a training request, and its submit-time rules.

Source: crates/kiln-eval/src/suite.rs · PostEvalConfig, PostEvalDataScope (fields, defaults,
kebab-case scope names); crates/kiln-server/src/api/training.rs · validate_post_eval_suite (the
three rules, their order and their messages). Unknown keys are ignored, as serde ignores them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln_core.contracts.post_eval.errors import PostEvalRejection
from kiln_core.contracts.post_eval.suite import EvalGenerationParams
from kiln_core.serde_json import to_f32

__all__ = ["PostEvalConfig", "parse_post_eval_config", "validate_post_eval_config"]


class PostEvalConfig(BaseModel):
    """What to evaluate after training, and whether the result may gate the adapter."""

    # Each field's docstring is its one-line description in the run form (use_attribute_docstrings).
    # The title names the run form's switch (a class name would be shown otherwise).
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, use_attribute_docstrings=True,
                              title="Promotion gate (Kiln post_eval)")

    suite: str
    """Name of an eval suite registered with kiln-flows eval-suites register (kept under the storage root, in .eval/suites/NAME)."""
    data_scope: Literal["held-out", "train-set-eval"] = "held-out"
    """held-out (default): training data overlapping the suite is rejected; train-set-eval: a diagnostic that may overlap and never gates."""
    generation: EvalGenerationParams | None = Field(default=None, title="Generation override")
    """Generation settings for both arms, replacing the suite's (an example's own settings still win); default none."""
    min_accuracy: float | None = None
    """Accuracy floor in [0, 1] (compared as f32); when set, the paired promotion gate runs. Default none: report only."""
    include_baseline: bool = False
    """Also evaluate the base model, for display only (never the gate's baseline). Default false."""

    @property
    def gated(self) -> bool:
        return self.min_accuracy is not None

    @property
    def min_accuracy_f32(self) -> float | None:
        """``min_accuracy`` as Kiln holds it (f32), the value every gate comparison uses."""
        return None if self.min_accuracy is None else to_f32(self.min_accuracy)


def parse_post_eval_config(raw: Any) -> PostEvalConfig | None:
    """Parse a request's ``post_eval`` value (None when the request has none).

    Raises:
        PostEvalRejection: ``post_eval_invalid_config`` naming the offending field.

    Example:
        >>> parse_post_eval_config({"suite": "math", "min_accuracy": 0.5}).data_scope
        'held-out'
    """
    if raw is None:
        return None
    try:
        return PostEvalConfig.model_validate(raw)
    except ValidationError as error:
        detail = error.errors()[0]
        where = ".".join(str(part) for part in ("post_eval", *detail["loc"]))
        raise PostEvalRejection("post_eval_invalid_config", f"{where}: {detail['msg']}", field=where) from None


def validate_post_eval_config(config: PostEvalConfig | None, registry: Any | None) -> None:
    """Kiln's submit-time checks, in Kiln's order; nothing to check when ``config`` is None.

    Args:
        config: The parsed ``post_eval`` block.
        registry: A ``SuiteRegistry``; None skips the installed-suite check (Kiln does not block
            submission when the server has no registry).

    Raises:
        PostEvalRejection: ``post_eval_min_accuracy_out_of_range``, ``post_eval_train_set_eval_gated``
            or ``post_eval_suite_not_installed``.

    Example:
        >>> validate_post_eval_config(PostEvalConfig(suite="s", min_accuracy=1.5), None)
        Traceback (most recent call last):
        ...
        kiln_core.contracts.post_eval.errors.PostEvalRejection: [post_eval_min_accuracy_out_of_range] field post_eval.min_accuracy: post_eval.min_accuracy must be finite and in [0.0, 1.0]
    """
    if config is None:
        return
    floor = config.min_accuracy_f32
    if floor is not None and not 0.0 <= floor <= 1.0:  # NaN fails the range test too
        raise PostEvalRejection("post_eval_min_accuracy_out_of_range",
                                "post_eval.min_accuracy must be finite and in [0.0, 1.0]", field="post_eval.min_accuracy")
    if config.data_scope == "train-set-eval" and config.min_accuracy is not None:
        raise PostEvalRejection("post_eval_train_set_eval_gated",
                                'post_eval.data_scope "train-set-eval" is diagnostic only and cannot set min_accuracy',
                                field="post_eval.data_scope")
    if registry is None:
        return
    if not registry.is_installed(config.suite):
        available = ", ".join(registry.names())
        raise PostEvalRejection("post_eval_suite_not_installed",
                                f"post_eval.suite '{config.suite}' is not an installed eval suite — available: [{available}]",
                                field="post_eval.suite")
