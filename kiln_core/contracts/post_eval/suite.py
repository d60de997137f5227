"""Kiln eval suites: ``EvalSuite``, ``EvalExample``, ``EvalGenerationParams``, ``EvalAggregation``.

Source: crates/kiln-eval/src/suite.rs (the version with ``aggregation`` and ``PostEvalDataScope``).
Parsing is as strict as serde where serde is strict (an integer field refuses ``1.0``; a bool refuses
``1``) and ignores unknown keys where serde ignores them (everywhere but ``aggregation``).
``EvalSuite.validate`` applies Kiln's rules in Kiln's order with Kiln's messages, then refuses the
scorers kiln-flows does not run. A suite comes as one JSON document with inline ``examples``, or as a
header JSON without examples plus a JSONL file of examples (``load_suite``).

Each model's ``wire()`` is its serde encoding in Kiln's field order; ``identity.py`` hashes it.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln_core.contracts.post_eval.errors import PostEvalRejection
from kiln_core.contracts.post_eval.scorers import Scorer, unported_kinds, SUPPORTED_SCORERS
from kiln_core.serde_json import F32, json_value, rust_debug_str, rust_display_float, to_f32
from kiln_core.strict_json import StrictJsonError, loads_strict

__all__ = ["EvalGenerationParams", "EvalAggregation", "EvalChatMessage", "EvalExample", "EvalSuite",
           "SUITE_SCHEMA_VERSION", "load_suite", "parse_suite", "effective_generation", "validation_message"]

SUITE_SCHEMA_VERSION = 2  # crates/kiln-eval/src/lib.rs · SUITE_SCHEMA_VERSION (docs/EVAL_GUIDE.md "schema-v2")
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
U32 = Annotated[int, Field(ge=0, le=U32_MAX)]
U64 = Annotated[int, Field(ge=0, le=U64_MAX)]


class _Serde(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class EvalGenerationParams(_Serde):
    """Decode settings of one eval completion (defaults tuned for verifiable, greedy evaluation)."""

    # Each field's docstring is its one-line description in the run form (use_attribute_docstrings); the
    # title names the form's switch.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, use_attribute_docstrings=True,
                              title="Generation override")

    temperature: float = 0.0
    """Sampling temperature; 0 (default) = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; default 1.0 = off."""
    top_k: U32 = 0
    """Sample from the k most likely tokens; default 0 = off."""
    max_tokens: U64 = 256
    """Most tokens generated per completion; default 256."""
    n: U64 = 1
    """Completions per example; must equal the suite aggregation's k. Default 1."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a completion; default none."""
    seed: U64 | None = None
    """Base seed for this generation's examples; default none = the job's effective seed."""
    thinking_budget_tokens: U64 | None = None
    """Thinking budget in tokens: absent = the server default (kiln-flows has none), null = unlimited."""
    thinking_budget_ms: U64 | None = None
    """Thinking budget in milliseconds: absent = the server default (kiln-flows has none), null = unlimited."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra chat-template variables, e.g. {"enable_thinking": false}; default none."""

    def budget(self, name: str) -> int | None | Literal["inherit"]:
        """``inherit`` when the field was absent, else its value (None = unlimited)."""
        return getattr(self, name) if name in self.model_fields_set else "inherit"

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": F32(to_f32(self.temperature)), "top_p": F32(to_f32(self.top_p)), "top_k": self.top_k,
            "max_tokens": self.max_tokens, "n": self.n, "stop": list(self.stop), "seed": self.seed,
        }
        for name in ("thinking_budget_tokens", "thinking_budget_ms"):
            if self.budget(name) != "inherit":
                out[name] = getattr(self, name)
        if self.chat_template_kwargs is not None:
            out["chat_template_kwargs"] = json_value(self.chat_template_kwargs)
        return out


class _Aggregation(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)  # deny_unknown_fields


class Single(_Aggregation):
    kind: Literal["single"] = "single"

    @property
    def k(self) -> int:
        return 1

    def label(self) -> str:
        return "single"

    def wire(self) -> dict[str, Any]:
        return {"kind": "single"}


class _AtK(_Aggregation):
    k: U64

    def label(self) -> str:
        return f"{self.kind.removesuffix('_at_k')}@{self.k}"

    def wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "k": self.k}


class MeanAtK(_AtK):
    kind: Literal["mean_at_k"]


class PassAtK(_AtK):
    kind: Literal["pass_at_k"]


class MajorityAtK(_AtK):
    kind: Literal["majority_at_k"]


EvalAggregation = Annotated[Union[Single, MeanAtK, PassAtK, MajorityAtK], Field(discriminator="kind")]


class EvalChatMessage(_Serde):
    """A prompt message (kiln_core::tokenizer::ChatMessage)."""

    role: str
    content: str = ""
    tool_calls: list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            out["tool_calls"] = json_value(self.tool_calls)
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class EvalExample(_Serde):
    """One prompt with its expected answer and optional per-example overrides."""

    id: str | None = None
    messages: list[EvalChatMessage]
    target: str | None = None
    aliases: list[str] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    metadata: Any = None
    scorer: Scorer | None = None
    generation: EvalGenerationParams | None = None
    """Whole-object override of the run's generation for this example."""
    weight: float = 1.0
    """Affects only ``weighted_mean_score``; finite and ≥ 0."""
    tools: list[Any] | None = None

    def resolved_id(self) -> str:
        """The explicit id, else 16 hex chars of SHA-256 over roles, contents, target and aliases.

        Example:
            >>> EvalExample.model_validate({"messages": [{"role": "user", "content": "q"}]}).resolved_id()
            'f49fcdcec898bd24'
        """
        if self.id:
            return self.id
        hasher = hashlib.sha256()
        for message in self.messages:
            hasher.update(message.role.encode() + b"\0" + message.content.encode() + b"\0")
        if self.target is not None:
            hasher.update(b"|t|" + self.target.encode())
        for alias in self.aliases:
            hasher.update(b"|a|" + alias.encode())
        return hasher.hexdigest()[:16]

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
        out["messages"] = [message.wire() for message in self.messages]
        if self.target is not None:
            out["target"] = self.target
        if self.aliases:
            out["aliases"] = list(self.aliases)
        if self.tags:
            out["tags"] = list(self.tags)
        if self.metadata is not None:
            out["metadata"] = json_value(self.metadata)
        if self.scorer is not None:
            out["scorer"] = self.scorer.wire()
        if self.generation is not None:
            out["generation"] = self.generation.wire()
        out["weight"] = F32(to_f32(self.weight))
        if self.tools is not None:
            out["tools"] = json_value(self.tools)
        return out


class EvalSuite(_Serde):
    """A named, versioned set of examples with a default scorer, generation and aggregation."""

    name: str
    description: str | None = None
    default_scorer: Scorer
    generation: EvalGenerationParams = Field(default_factory=EvalGenerationParams)
    aggregation: EvalAggregation = Field(default_factory=Single)
    system_prompt: str | None = None
    """Prepended as a system message unless the example already starts with one."""
    examples: list[EvalExample] = Field(default_factory=list)
    schema_version: U32 = 1
    tools: list[Any] | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["default_scorer"] = self.default_scorer.wire()
        out["generation"] = self.generation.wire()
        out["aggregation"] = self.aggregation.wire()
        if self.system_prompt is not None:
            out["system_prompt"] = self.system_prompt
        out["examples"] = [example.wire() for example in self.examples]
        out["schema_version"] = self.schema_version
        if self.tools is not None:
            out["tools"] = json_value(self.tools)
        return out

    def validate_rules(self, file: str | None = None) -> "EvalSuite":
        """Kiln's ``EvalSuite::validate``, then kiln-flows' scorer support check; returns ``self``.

        Raises:
            PostEvalRejection: ``eval_suite_invalid`` with Kiln's message, or
                ``eval_scorer_unsupported``.
        """
        message = validation_message(self)
        if message is not None:
            raise PostEvalRejection("eval_suite_invalid", message, file=file)
        for where, scorer in [("default_scorer", self.default_scorer)] + [
                (f"examples[{i}].scorer", ex.scorer) for i, ex in enumerate(self.examples) if ex.scorer]:
            kinds = unported_kinds(scorer)
            if kinds:
                raise PostEvalRejection(
                    "eval_scorer_unsupported",
                    f"scorer `{kinds[0]}` is not supported by kiln-flows; supported: {', '.join(SUPPORTED_SCORERS)}",
                    field=where, file=file)
        return self


def validation_message(suite: EvalSuite) -> str | None:
    """The first rule of Kiln's ``EvalSuite::validate`` the suite breaks, in Kiln's words, else None."""
    if suite.schema_version not in (1, SUITE_SCHEMA_VERSION):
        return (f"unsupported suite schema_version {suite.schema_version}; supported versions are 1 and "
                f"{SUITE_SCHEMA_VERSION}")
    aggregation, k = suite.aggregation, suite.aggregation.k
    if k == 0 or k > 128:
        return f"aggregation {aggregation.label()} requires k in 1..=128"
    if isinstance(aggregation, MajorityAtK) and k % 2 == 0:
        return f"aggregation {aggregation.label()} requires an odd k so ties are impossible"
    if not suite.name.strip():
        return "suite name must be non-empty"
    if "/" in suite.name or "\\" in suite.name or ".." in suite.name:
        return f"suite name '{suite.name}' must not contain path separators"
    if not suite.examples:
        return "suite must contain at least one example"
    problem = _tools_problem(suite.tools, "suite-level tools")
    if problem:
        return problem
    seen: set[str] = set()
    for index, example in enumerate(suite.examples):
        if example.id is not None and not example.id.strip():
            return f"example {index} has an empty explicit id"
        resolved = example.resolved_id()
        if resolved in seen:
            return f"example {index} has duplicate resolved id {rust_debug_str(resolved)}; assign unique explicit ids"
        seen.add(resolved)
        if not example.messages:
            return f"example {index} has empty messages"
        weight = to_f32(example.weight)
        if weight != weight or weight in (float("inf"), float("-inf")) or weight < 0.0:
            return f"example {index} weight {rust_display_float(weight, single=True)} must be finite and non-negative"
        n = (example.generation or suite.generation).n
        if n == 0 or n > 128:
            return f"example {index} generation.n {n} must be in 1..=128"
        if suite.schema_version == 1 and (n != 1 or not isinstance(aggregation, Single)):
            return ("schema-v1 multi-completion results are ambiguous; migrate the suite to schema_version "
                    f"{SUITE_SCHEMA_VERSION} and choose an explicit aggregation")
        if n != k:
            return f"example {index} generation.n {n} does not match aggregation {aggregation.label()} (k={k})"
        problem = _tools_problem(example.tools, f"example {index} tools")
        if problem:
            return problem
    return None


def _tools_problem(tools: list[Any] | None, context: str) -> str | None:
    for index, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            return f"{context}: entry {index} must be a JSON object, got {tool!r}"
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) and "name" in function else tool.get("name")
        if not isinstance(name, str) or not name.strip():
            return f"{context}: entry {index} is missing a non-empty `function.name` (or top-level `name`)"
    return None


def _first_error(error: ValidationError) -> str:
    detail = error.errors()[0]
    where = ".".join(str(part) for part in detail["loc"])
    return f"{where}: {detail['msg']}" if where else detail["msg"]


def parse_suite(document: bytes | str, *, file: str | None = None) -> EvalSuite:
    """Parse and validate one suite JSON document (inline ``examples``) [suite.rs · load_json].

    Raises:
        PostEvalRejection: ``eval_suite_invalid`` (bad JSON, bad field, broken rule) or
            ``eval_scorer_unsupported``.
    """
    return _parse_header(document, file).validate_rules(file)


def _parse_header(document: bytes | str, file: str | None) -> EvalSuite:
    try:
        return EvalSuite.model_validate(loads_strict(document))
    except StrictJsonError as error:
        raise PostEvalRejection("eval_suite_invalid", f"invalid suite JSON: {error.message}", file=file) from None
    except ValidationError as error:
        raise PostEvalRejection("eval_suite_invalid", f"invalid suite: {_first_error(error)}", file=file) from None


def load_suite(header: bytes | str, examples_jsonl: bytes | str | None = None, *, header_file: str | None = None,
               examples_file: str | None = None) -> EvalSuite:
    """A suite from one JSON document, or from a header plus JSONL examples [suite.rs · load_jsonl].

    Args:
        header: The suite JSON (with inline examples when ``examples_jsonl`` is None).
        examples_jsonl: One ``EvalExample`` per non-empty line; the header must then have no examples.
        header_file: Path shown in rejections.
        examples_file: Path shown in rejections (``line`` is the 1-based physical line).

    Example:
        >>> suite = load_suite('{"name": "s", "default_scorer": {"kind": "exact_match"}}',
        ...                    '{"messages": [{"role": "user", "content": "1+1?"}], "target": "2"}\\n')
        >>> suite.examples[0].target
        '2'
    """
    if examples_jsonl is None:
        return parse_suite(header, file=header_file)
    suite = _parse_header(header, header_file)
    if suite.examples:
        raise PostEvalRejection("eval_suite_invalid",
                                "header file already contains examples; remove them when pairing with JSONL",
                                file=header_file)
    if isinstance(examples_jsonl, bytes):
        try:
            examples_jsonl = examples_jsonl.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PostEvalRejection("eval_suite_unreadable", f"examples file is not UTF-8 (byte {error.start})",
                                    file=examples_file) from None
    examples = []
    for number, line in enumerate(examples_jsonl.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            examples.append(EvalExample.model_validate(loads_strict(line.strip())))
        except (StrictJsonError, ValidationError) as error:
            detail = error.message if isinstance(error, StrictJsonError) else _first_error(error)
            raise PostEvalRejection("eval_suite_invalid", f"invalid example at line {number}: {detail}",
                                    line=number, file=examples_file) from None
    return suite.model_copy(update={"examples": examples}).validate_rules(examples_file or header_file)


def effective_generation(suite: EvalSuite, example: EvalExample,
                         override: EvalGenerationParams | None) -> tuple[EvalGenerationParams, str]:
    """The example's own generation, else the run override, else the suite's; and which it was.

    Whole-object replacement, never a field merge [crates/kiln-server/src/eval/executor.rs ·
    effective_generation].
    """
    if example.generation is not None:
        return example.generation, "example"
    if override is not None:
        return override, "run_override"
    return suite.generation, "suite"
