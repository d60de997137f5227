"""Kiln's scorers: a JSON object tagged by ``kind`` that grades one completion.

Source: crates/kiln-eval/src/scorers/{mod,exact_match,contains,regex_match,numeric,json_validity,
multiple_choice,llm_judge}.rs and crates/kiln-eval/src/qwen3.rs · split_thinking (in ``answer_parsing``). Each completion
gets a kind (``pass | fail | invalid | error``) and a score in [0, 1] held as f32.

* ``<think>…</think>`` is split off first: an unclosed block is ``invalid`` (score 0); otherwise the
  text after the block is scored. ``llm_judge``, ``all`` and ``any`` receive the full text
  (composites re-split per sub-scorer).
* A broken suite (missing target, bad regex, unparseable numeric target) raises ``ScorerError``;
  the runner records that completion as ``error``, as Kiln's executor does.
* ``llm_judge`` needs a judge model. Without one (kiln-flows ships none) the outcome is ``invalid``
  with detail "judge runner unavailable" — Kiln's behaviour with its no-op judge runner.
* ``tool_call``, ``code`` and ``python_doctest`` parse (so a Kiln suite file loads) but are not
  ported; suite validation rejects them with ``eval_scorer_unsupported``.

Regex patterns run on Python's ``re``: Rust's syntax is a subset for the usual patterns
(classes, groups, ``(?i)``), but a Python-only construct (look-around, backreferences) would be
accepted here where Kiln refuses it.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field

from kiln_core.contracts.post_eval import answer_parsing as parse
from kiln_core.serde_json import to_f32

__all__ = ["Scorer", "ScoredCompletion", "ScorerError", "JudgeRunner", "score_completion", "SUPPORTED_SCORERS", "DEFAULT_JUDGE_TEMPLATE", "DEFAULT_JUDGE_REGEX"]

SUPPORTED_SCORERS = ("exact_match", "contains", "regex", "json_validity", "multiple_choice",
                     "numeric_tolerance", "llm_judge", "all", "any")
DEFAULT_JUDGE_TEMPLATE = (
    "You are a strict grader. The user asked:\n\n{question}\n\nReference answer:\n\n{target}\n\n"
    "Model answer:\n\n{answer}\n\n"
    "On a scale of 0 to 1, how correct is the model answer? Output ONLY the score, e.g. `Score: 1` for "
    "fully correct or `Score: 0` for incorrect. Half-credit is allowed.\n\nScore:"
)
DEFAULT_JUDGE_REGEX = r"(?i)score[:\s]*([01](?:\.\d+)?)"


class _Scorer(BaseModel):
    # serde's internally tagged enum ignores unknown keys; types are strict like serde's.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class ExactMatch(_Scorer):
    kind: Literal["exact_match"]
    case_sensitive: bool = True
    strip_whitespace: bool = True

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "case_sensitive": self.case_sensitive, "strip_whitespace": self.strip_whitespace}


class Contains(_Scorer):
    kind: Literal["contains"]
    phrases: list[str]
    mode: Literal["any", "all", "none"] = "any"
    case_sensitive: bool = True

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "phrases": list(self.phrases), "mode": self.mode,
                "case_sensitive": self.case_sensitive}


class RegexMatch(_Scorer):
    kind: Literal["regex"]
    pattern: str
    capture_group: Annotated[int, Field(ge=0)] | None = None
    case_sensitive: bool = True

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "pattern": self.pattern, "capture_group": self.capture_group,
                "case_sensitive": self.case_sensitive}


class JsonValidity(_Scorer):
    kind: Literal["json_validity"]
    require_object: bool = False
    required_paths: list[str] = Field(default_factory=list)

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "require_object": self.require_object, "required_paths": list(self.required_paths)}


class MultipleChoice(_Scorer):
    kind: Literal["multiple_choice"]
    choices: list[str] = Field(default_factory=lambda: ["A", "B", "C", "D"])

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "choices": list(self.choices)}


class NumericTolerance(_Scorer):
    kind: Literal["numeric_tolerance"]
    atol: float = 0.0
    rtol: float = 0.0
    integer_only: bool = False

    def wire(self) -> dict[str, Any]:  # newtype variant: the struct's fields beside the tag
        return {"kind": self.kind, "atol": float(self.atol), "rtol": float(self.rtol), "integer_only": self.integer_only}


class LlmJudge(_Scorer):
    kind: Literal["llm_judge"]
    judge_adapter: str | None = None
    template: str = DEFAULT_JUDGE_TEMPLATE
    score_regex: str = DEFAULT_JUDGE_REGEX

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "judge_adapter": self.judge_adapter, "template": self.template,
                "score_regex": self.score_regex}


class AllOf(_Scorer):
    kind: Literal["all"]
    scorers: list["Scorer"]

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "scorers": [scorer.wire() for scorer in self.scorers]}


class AnyOf(_Scorer):
    kind: Literal["any"]
    scorers: list["Scorer"]

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "scorers": [scorer.wire() for scorer in self.scorers]}


class Unported(BaseModel):
    """A Kiln scorer kind kiln-flows parses but cannot run (rejected by suite validation)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    kind: Literal["tool_call", "code", "python_doctest"]

    def wire(self) -> dict[str, Any]:
        raise NotImplementedError(f"scorer {self.kind!r} is not ported")


Scorer = Annotated[
    Union[ExactMatch, Contains, RegexMatch, JsonValidity, MultipleChoice, NumericTolerance, LlmJudge, AllOf,
          AnyOf, Unported],
    Field(discriminator="kind"),
]
AllOf.model_rebuild()
AnyOf.model_rebuild()


def unported_kinds(scorer: Any) -> list[str]:
    """Kinds inside ``scorer`` (composites included) that kiln-flows cannot run."""
    if isinstance(scorer, Unported):
        return [scorer.kind]
    if isinstance(scorer, (AllOf, AnyOf)):
        return [kind for inner in scorer.scorers for kind in unported_kinds(inner)]
    return []


class ScorerError(Exception):
    """The suite itself is broken for this example (Kiln's ``ScorerError``); recorded as ``error``."""


class JudgeRunner(Protocol):
    """Kiln's ``JudgeRunner``: the judge's reply to one prompt, or None when no judge can run."""

    def __call__(self, adapter: str | None, prompt: str) -> str | None: ...


@dataclass(frozen=True)
class ScoredCompletion:
    kind: str
    score: float
    detail: str | None = None
    reasoning_text: str | None = None
    unclosed_thinking: bool = False


def score_completion(scorer: Any, example: Any, completion: str, judge: JudgeRunner | None = None) -> ScoredCompletion:
    """Grade one completion of ``example`` with ``scorer`` [scorers/mod.rs · score_completion].

    Args:
        scorer: One of the ``Scorer`` models.
        example: The ``EvalExample`` (its ``target``, ``aliases`` and ``messages`` are read).
        completion: The decoded completion text.
        judge: Judge runner for ``llm_judge``; None means no judge (outcome ``invalid``).

    Returns:
        ``ScoredCompletion`` with kind ``pass``/``fail``/``invalid``/``error`` and an f32 score.

    Raises:
        ScorerError: The suite is broken for this example (missing target, bad regex, ...).

    Example:
        >>> from kiln_core.contracts.post_eval.suite import EvalExample
        >>> example = EvalExample.model_validate({"messages": [{"role": "user", "content": "2+2?"}], "target": "4"})
        >>> score_completion(ExactMatch(kind="exact_match"), example, " 4\\n").kind
        'pass'
    """
    split = parse.split_thinking(completion)
    if isinstance(scorer, (LlmJudge, AllOf, AnyOf)):
        answer = completion
    elif split.unclosed:
        return ScoredCompletion("invalid", 0.0, "model emitted <think> but never closed it", split.reasoning, True)
    else:
        answer = split.answer if split.had_thinking else completion
    score, kind, detail = _dispatch(scorer, example, answer, completion, judge)
    return ScoredCompletion(kind, to_f32(score), detail, split.reasoning, split.unclosed)


def _dispatch(scorer: Any, example: Any, answer: str, completion: str, judge: JudgeRunner | None):
    if isinstance(scorer, ExactMatch):
        return _exact_match(example, answer, scorer)
    if isinstance(scorer, Contains):
        return _contains(answer, scorer)
    if isinstance(scorer, RegexMatch):
        return _regex(example, answer, scorer)
    if isinstance(scorer, JsonValidity):
        return _json_validity(example, answer, scorer)
    if isinstance(scorer, MultipleChoice):
        return _multiple_choice(example, answer, scorer)
    if isinstance(scorer, NumericTolerance):
        return _numeric(example, answer, scorer)
    if isinstance(scorer, LlmJudge):
        return _llm_judge(example, answer, scorer, judge)
    if isinstance(scorer, (AllOf, AnyOf)):
        return _composite(scorer, example, completion, judge)
    raise ScorerError(f"scorer `{scorer.kind}` is not supported by kiln-flows")


def _require_target(example: Any, kind: str) -> str:
    if example.target is None:
        raise ScorerError(f"scorer `{kind}` requires `target` on every example")
    return example.target


def _preview(text: str) -> str:
    return text if len(text) <= 32 else text[:32] + "…"


def _exact_match(example, answer: str, scorer: ExactMatch):
    target = _require_target(example, "exact_match")

    def normalize(text: str) -> str:
        text = unicodedata.normalize("NFC", text)
        text = parse.rust_trim(text) if scorer.strip_whitespace else text
        return text if scorer.case_sensitive else text.lower()

    candidates = [normalize(text) for text in [target, *example.aliases]]
    actual = normalize(answer)
    if actual in candidates:
        return 1.0, "pass", None
    return 0.0, "fail", f"expected `{_preview(candidates[0])}`, got `{_preview(actual)}`"


def _contains(answer: str, scorer: Contains):
    if not scorer.phrases:
        return 0.0, "invalid", "no phrases configured"
    fold = (lambda text: text) if scorer.case_sensitive else str.lower
    hits = sum(fold(phrase) in fold(answer) for phrase in scorer.phrases)
    total = len(scorer.phrases)
    if scorer.mode == "any":
        return (1.0, "pass", None) if hits else (0.0, "fail", f"none of {total} phrases matched")
    if scorer.mode == "all":
        return (1.0, "pass", None) if hits == total else (to_f32(hits / total), "fail", f"{hits}/{total} matched")
    return (1.0, "pass", None) if hits == 0 else (0.0, "fail", f"matched {hits} disallowed phrase(s)")


def _compile(pattern: str, flags: int = 0) -> re.Pattern:
    try:
        return re.compile(pattern, flags)
    except re.error as error:
        raise ScorerError(f"invalid regex `{pattern}`: {error}") from None


def _regex(example, answer: str, scorer: RegexMatch):
    compiled = _compile(scorer.pattern, 0 if scorer.case_sensitive else re.IGNORECASE)
    match = compiled.search(answer)
    if match is None:
        return 0.0, "fail", f"pattern `{scorer.pattern}` did not match"
    if scorer.capture_group is None:
        return 1.0, "pass", None
    try:
        captured = match.group(scorer.capture_group)
    except IndexError:
        captured = None
    if captured is None:
        return 0.0, "invalid", f"capture group {scorer.capture_group} did not bind"
    target = _require_target(example, "regex")
    candidates = [target, *example.aliases]
    if scorer.case_sensitive:
        matched = captured in candidates
    else:  # eq_ignore_ascii_case: only ASCII letters fold
        matched = any(c.encode().lower() == captured.encode().lower() for c in candidates)
    if matched:
        return 1.0, "pass", None
    return 0.0, "fail", f"expected `{target}`, captured `{captured}`"


def _json_validity(example, answer: str, scorer: JsonValidity):
    try:
        parsed = parse.parse_json_value(parse.extract_json_body(parse.rust_trim(answer)))
    except (ValueError, RecursionError) as error:
        return 0.0, "invalid", f"parse error: {error}"
    if scorer.require_object and not isinstance(parsed, dict):
        return 0.0, "fail", f"expected object, got {parse.json_kind(parsed)}"
    for path in scorer.required_paths:
        if not parse.json_pointer_exists(parsed, path):
            return 0.0, "fail", f"missing required path `{path}`"
    if example.target is None:
        return 1.0, "pass", None
    try:
        expected = parse.parse_json_value(example.target)
    except (ValueError, RecursionError) as error:
        return 0.0, "invalid", f"target itself failed to parse: {error}"
    if parse.json_equal(parsed, expected):
        return 1.0, "pass", None
    return 0.0, "fail", "parsed JSON did not match target"


def _multiple_choice(example, answer: str, scorer: MultipleChoice):
    target = _require_target(example, "multiple_choice")
    target_label = parse.rust_trim(target).upper()
    valid = [parse.rust_trim(choice).upper() for choice in scorer.choices]
    if target_label not in valid:
        valid.append(target_label)
    accepted = [target_label, *(parse.rust_trim(alias).upper() for alias in example.aliases)]
    label = parse.detect_choice(answer, valid)
    if label is None:
        return 0.0, "invalid", "no answer letter detected"
    if label in accepted:
        return 1.0, "pass", None
    return 0.0, "fail", f"expected `{target}`, got `{label}`"


def _numeric(example, answer: str, scorer: NumericTolerance):
    target_text = _require_target(example, "numeric_tolerance")
    target = parse.parse_target_number(target_text)
    if target is None:
        raise ScorerError("scorer `numeric_tolerance (unparseable target)` requires `target` on every example")
    got = parse.extract_last_number(answer)
    if got is None:
        return 0.0, "invalid", "no number found in completion"
    fraction = got - math.trunc(got) if math.isfinite(got) else math.nan  # Rust's fract()
    if scorer.integer_only and fraction != 0.0:
        return 0.0, "fail", f"expected integer, got {got:g}"
    if abs(got - target) <= scorer.atol + scorer.rtol * abs(target):
        return 1.0, "pass", None
    return 0.0, "fail", f"expected {target:g}, got {got:g}"


def _rust_parse_f32(text: str) -> float | None:
    if not text or "_" in text or text != text.strip():
        return None
    try:
        return to_f32(float(text))
    except ValueError:
        return None


def _llm_judge(example, answer: str, scorer: LlmJudge, judge: JudgeRunner | None):
    question = next((m.content for m in reversed(example.messages) if m.role == "user"),
                    example.messages[-1].content if example.messages else "")
    prompt = (scorer.template.replace("{question}", question).replace("{target}", example.target or "")
              .replace("{answer}", answer))
    compiled = _compile(scorer.score_regex)
    reply = judge(scorer.judge_adapter, prompt) if judge is not None else None
    if reply is None:
        return 0.0, "invalid", "judge runner unavailable"
    match = compiled.search(reply)
    if match is None:
        return 0.0, "invalid", f"score not found in judge reply: `{reply[:80]}`"
    if compiled.groups < 1 or match.group(1) is None:
        raise ScorerError(f"invalid regex `{scorer.score_regex}`: regex must contain a capture group")
    raw = _rust_parse_f32(match.group(1))
    if raw is None:
        return 0.0, "invalid", f"captured `{match.group(1)}` is not a number"
    clamped = min(max(raw, 0.0), 1.0)
    return clamped, "pass" if clamped >= 0.5 else "fail", f"judge score {clamped:.2f}"


def _composite(scorer: AllOf | AnyOf, example, completion: str, judge: JudgeRunner | None):
    if not scorer.scorers:
        return 0.0, "invalid", "empty composite"
    outcomes = [(inner, score_completion(inner, example, completion, judge)) for inner in scorer.scorers]
    details = "; ".join(f"{inner.kind}: {out.detail}" for inner, out in outcomes if out.detail is not None) or None
    if isinstance(scorer, AllOf):
        total = 0.0
        for _, out in outcomes:  # f32 accumulation, as Kiln sums
            total = to_f32(total + out.score)
        kinds = [out.kind for _, out in outcomes]
        kind = "error" if "error" in kinds else "pass" if all(k == "pass" for k in kinds) else "fail"
        return to_f32(total / len(outcomes)), kind, details
    best = max([0.0, *(out.score for _, out in outcomes)])
    return best, "pass" if any(out.kind == "pass" for _, out in outcomes) else "fail", details
