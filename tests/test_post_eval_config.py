"""post_eval contracts: PostEvalConfig and its submit-time rules, suites, the registry, identity hashes.

Kiln sources: crates/kiln-eval/src/suite.rs (+ its #[test]s), crates/kiln-server/src/eval/registry.rs,
crates/kiln-server/src/api/training.rs · validate_post_eval_suite, crates/kiln-eval/src/replay.rs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from kiln_core.errors import Rejection
from kiln_core.post_eval import (PostEvalRejection, SuiteRegistry, load_suite, parse_post_eval_config,
                                 suite_sha256, validate_post_eval_config)
from kiln_core.post_eval.identity import effective_generation_sha256
from kiln_core.contracts.post_eval.suite import effective_generation

EXAMPLE = {"messages": [{"role": "user", "content": "1+1?"}], "target": "2"}


def suite_doc(**overrides):
    doc = {"name": "math", "default_scorer": {"kind": "exact_match"}, "examples": [dict(EXAMPLE)]}
    doc.update(overrides)
    return doc


def load(doc) -> object:
    return load_suite(json.dumps(doc))


def rejected(doc) -> PostEvalRejection:
    with pytest.raises(PostEvalRejection) as caught:
        load(doc)
    return caught.value


def test_importing_post_eval_stays_light():
    code = "import sys, kiln_core.post_eval; print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- PostEvalConfig ------------------------------------------------------------------------------


def test_config_defaults_and_kebab_case_scope():
    config = parse_post_eval_config({"suite": "fixture"})
    assert (config.data_scope, config.min_accuracy, config.include_baseline, config.generation) == (
        "held-out", None, False, None)
    assert not config.gated
    assert parse_post_eval_config({"suite": "s", "data_scope": "train-set-eval"}).data_scope == "train-set-eval"
    assert parse_post_eval_config(None) is None


@pytest.mark.parametrize("raw, field", [
    ({"suite": "s", "data_scope": "held_out"}, "post_eval.data_scope"),
    ({"suite": "s", "min_accuracy": "0.5"}, "post_eval.min_accuracy"),
    ({"suite": "s", "include_baseline": 1}, "post_eval.include_baseline"),
    ({"data_scope": "held-out"}, "post_eval.suite"),
    ({"suite": "s", "generation": {"max_tokens": 1.5}}, "post_eval.generation.max_tokens"),
])
def test_config_parse_errors_name_the_field(raw, field):
    with pytest.raises(PostEvalRejection) as caught:
        parse_post_eval_config(raw)
    assert caught.value.code == "post_eval_invalid_config"
    assert caught.value.field == field
    assert isinstance(caught.value, Rejection) and caught.value.exit_code == 2


@pytest.mark.parametrize("floor", [-0.01, 1.0001, float("nan"), float("inf"), 1e39])
def test_min_accuracy_must_be_finite_in_unit_interval(floor):
    with pytest.raises(PostEvalRejection) as caught:
        validate_post_eval_config(parse_post_eval_config({"suite": "s", "min_accuracy": floor}), None)
    assert caught.value.code == "post_eval_min_accuracy_out_of_range"
    assert caught.value.message == "post_eval.min_accuracy must be finite and in [0.0, 1.0]"


@pytest.mark.parametrize("floor", [0.0, 0.5, 1.0])
def test_min_accuracy_bounds_are_inclusive(floor):
    validate_post_eval_config(parse_post_eval_config({"suite": "s", "min_accuracy": floor}), None)


def test_train_set_eval_cannot_gate():
    config = parse_post_eval_config({"suite": "s", "data_scope": "train-set-eval", "min_accuracy": 0.5})
    with pytest.raises(PostEvalRejection) as caught:
        validate_post_eval_config(config, None)
    assert caught.value.code == "post_eval_train_set_eval_gated"
    assert caught.value.message == 'post_eval.data_scope "train-set-eval" is diagnostic only and cannot set min_accuracy'
    # as a diagnostic without a floor it is fine
    validate_post_eval_config(parse_post_eval_config({"suite": "s", "data_scope": "train-set-eval"}), None)


def test_range_rule_is_checked_before_the_scope_rule():
    config = parse_post_eval_config({"suite": "s", "data_scope": "train-set-eval", "min_accuracy": 2.0})
    with pytest.raises(PostEvalRejection) as caught:
        validate_post_eval_config(config, None)
    assert caught.value.code == "post_eval_min_accuracy_out_of_range"


def test_unknown_suite_lists_the_installed_ones(tmp_path):
    registry = SuiteRegistry(str(tmp_path / ".eval"))
    for name in ("zeta", "alpha"):
        registry.save(load(suite_doc(name=name)))
    with pytest.raises(PostEvalRejection) as caught:
        validate_post_eval_config(parse_post_eval_config({"suite": "agentic-core"}), registry)
    assert caught.value.code == "post_eval_suite_not_installed"
    assert caught.value.message == "post_eval.suite 'agentic-core' is not an installed eval suite — available: [alpha, zeta]"
    validate_post_eval_config(parse_post_eval_config({"suite": "alpha"}), registry)


# ---- suites --------------------------------------------------------------------------------------


def test_resolved_id_matches_an_independent_hash_and_explicit_ids_win():
    doc = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
           "target": "hello", "aliases": ["hey", "yo"]}
    expected = hashlib.sha256(b"system\x00be brief\x00user\x00hi\x00|t|hello|a|hey|a|yo").hexdigest()[:16]
    suite = load(suite_doc(examples=[doc]))
    assert suite.examples[0].resolved_id() == expected
    assert load(suite_doc(examples=[dict(doc, id="custom-id")])).examples[0].resolved_id() == "custom-id"


@pytest.mark.parametrize("overrides, message", [
    ({"name": ""}, "suite name must be non-empty"),
    ({"name": "   "}, "suite name must be non-empty"),
    ({"name": "bad/name"}, "suite name 'bad/name' must not contain path separators"),
    ({"name": "a..b"}, "suite name 'a..b' must not contain path separators"),
    ({"examples": []}, "suite must contain at least one example"),
    ({"schema_version": 3}, "unsupported suite schema_version 3; supported versions are 1 and 2"),
    ({"schema_version": 2, "aggregation": {"kind": "pass_at_k", "k": 0}}, "aggregation pass@0 requires k in 1..=128"),
    ({"schema_version": 2, "aggregation": {"kind": "mean_at_k", "k": 129}}, "aggregation mean@129 requires k in 1..=128"),
    ({"schema_version": 2, "aggregation": {"kind": "majority_at_k", "k": 2}},
     "aggregation majority@2 requires an odd k so ties are impossible"),
    ({"generation": {"n": 3}}, "schema-v1 multi-completion results are ambiguous; migrate the suite to "
                               "schema_version 2 and choose an explicit aggregation"),
    ({"schema_version": 2, "generation": {"n": 3}, "aggregation": {"kind": "mean_at_k", "k": 2}},
     "example 0 generation.n 3 does not match aggregation mean@2 (k=2)"),
    ({"generation": {"n": 0}}, "example 0 generation.n 0 must be in 1..=128"),
    ({"examples": [dict(EXAMPLE, weight=-1)]}, "example 0 weight -1 must be finite and non-negative"),
    ({"examples": [dict(EXAMPLE, weight=1e39)]}, "example 0 weight inf must be finite and non-negative"),
    ({"examples": [dict(EXAMPLE, messages=[])]}, "example 0 has empty messages"),
    ({"examples": [dict(EXAMPLE, id=" ")]}, "example 0 has an empty explicit id"),
    ({"examples": [dict(EXAMPLE, id="")]}, "example 0 has an empty explicit id"),
    ({"examples": [EXAMPLE, EXAMPLE]}, 'example 1 has duplicate resolved id "'),
    ({"tools": [{"type": "function"}]}, "suite-level tools: entry 0 is missing a non-empty `function.name`"),
    ({"examples": [dict(EXAMPLE, tools=["x"])]}, "example 0 tools: entry 0 must be a JSON object"),
])
def test_kiln_suite_rules_and_messages(overrides, message):
    error = rejected(suite_doc(**overrides))
    assert error.code == "eval_suite_invalid"
    assert error.message.startswith(message)


def test_valid_multi_completion_and_per_example_generation():
    suite = load(suite_doc(schema_version=2, generation={"n": 3, "temperature": 0.7},
                           aggregation={"kind": "pass_at_k", "k": 3},
                           examples=[EXAMPLE, {"messages": [{"role": "user", "content": "x"}],
                                               "generation": {"n": 3, "max_tokens": 4}}]))
    assert suite.aggregation.label() == "pass@3"
    assert suite.examples[1].generation.max_tokens == 4
    tools = load(suite_doc(tools=[{"type": "function", "function": {"name": "search"}}, {"name": "flat"}]))
    assert len(tools.tools) == 2


def test_aggregation_denies_unknown_keys_but_suites_ignore_them():
    assert load(suite_doc(unknown_key=1, examples=[dict(EXAMPLE, extra=True)])).name == "math"
    error = rejected(suite_doc(schema_version=2, aggregation={"kind": "single", "k": 1}))
    assert error.code == "eval_suite_invalid" and "aggregation" in error.message


@pytest.mark.parametrize("scorer, kind", [({"kind": "tool_call"}, "tool_call"), ({"kind": "code"}, "code"),
                                          ({"kind": "all", "scorers": [{"kind": "python_doctest"}]}, "python_doctest")])
def test_unported_scorers_are_rejected_by_name(scorer, kind):
    error = rejected(suite_doc(default_scorer=scorer))
    assert error.code == "eval_scorer_unsupported"
    assert error.message.startswith(f"scorer `{kind}` is not supported by kiln-flows")


def test_unknown_scorer_kind_and_strict_types_are_invalid():
    assert rejected(suite_doc(default_scorer={"kind": "vibes"})).code == "eval_suite_invalid"
    assert rejected(suite_doc(default_scorer={"kind": "exact_match", "case_sensitive": "yes"})).code == "eval_suite_invalid"
    assert rejected(suite_doc(generation={"top_k": -1})).code == "eval_suite_invalid"


def test_jsonl_layout_counts_physical_lines_and_refuses_inline_examples():
    header = json.dumps({"name": "math", "default_scorer": {"kind": "exact_match"}})
    lines = json.dumps(EXAMPLE) + "\n\n   \n" + json.dumps({"messages": [{"role": "user", "content": "3+3?"}], "target": "6"})
    suite = load_suite(header, lines)
    assert [example.target for example in suite.examples] == ["2", "6"]
    with pytest.raises(PostEvalRejection) as caught:
        load_suite(header, lines + '\n{"messages": "nope"}\n', examples_file="examples.jsonl")
    assert (caught.value.line, caught.value.file) == (5, "examples.jsonl")
    assert caught.value.message.startswith("invalid example at line 5:")
    with pytest.raises(PostEvalRejection) as caught:
        load_suite(json.dumps(suite_doc()), lines)
    assert caught.value.message == "header file already contains examples; remove them when pairing with JSONL"
    with pytest.raises(PostEvalRejection) as caught:
        load_suite(header, "\n")
    assert caught.value.message == "suite must contain at least one example"


def test_invalid_json_is_rejected_not_raised_raw():
    for text in ("{", '{"name": "a", "name": "b"}', '{"name": NaN}'):
        with pytest.raises(PostEvalRejection) as caught:
            load_suite(text)
        assert caught.value.code == "eval_suite_invalid"


# ---- registry ------------------------------------------------------------------------------------


@pytest.mark.parametrize("root", ["local", "memory"])
def test_registry_round_trip_on_local_disk_and_fsspec(tmp_path, root):
    eval_root = str(tmp_path / ".eval") if root == "local" else f"memory://post-eval-{tmp_path.name}/.eval"
    registry = SuiteRegistry(eval_root)
    suite = load(suite_doc(generation={"temperature": 0.7, "thinking_budget_tokens": None}))
    registry.save(suite)
    loaded = registry.load("math")
    assert suite_sha256(loaded) == suite_sha256(suite)  # inherit-vs-null budgets and f32 values survive
    assert registry.names() == ["math"]
    with pytest.raises(PostEvalRejection) as caught:
        registry.save(suite)
    assert caught.value.code == "eval_suite_exists"
    registry.save(suite, force=True)
    registry.delete("math")
    assert registry.names() == []
    with pytest.raises(PostEvalRejection) as caught:
        registry.load("math")
    assert caught.value.code == "eval_suite_not_found"


def test_registry_reads_header_plus_jsonl_and_skips_broken_or_hidden_dirs(tmp_path):
    suites = tmp_path / ".eval" / "suites"
    (suites / "split").mkdir(parents=True)
    (suites / "split" / "suite.json").write_text(json.dumps({"name": "split", "default_scorer": {"kind": "contains",
                                                                                                 "phrases": ["2"]}}))
    (suites / "split" / "examples.jsonl").write_text(json.dumps(EXAMPLE) + "\n")
    (suites / "broken").mkdir()
    (suites / "broken" / "suite.json").write_text("{ not json")
    (suites / ".hidden").mkdir()
    (suites / ".hidden" / "suite.json").write_text(json.dumps(suite_doc(name=".hidden")))
    registry = SuiteRegistry.for_storage_root(str(tmp_path))
    assert registry.names() == ["split"]
    assert registry.load("split").examples[0].target == "2"
    assert not registry.is_installed("broken")
    with pytest.raises(PostEvalRejection) as caught:
        registry.load("broken")
    assert caught.value.code == "eval_suite_invalid" and caught.value.file.endswith("broken/suite.json")


def test_registry_register_from_files_and_refuses_bad_names(tmp_path):
    header = tmp_path / "h.json"
    header.write_text(json.dumps({"name": "jl", "default_scorer": {"kind": "exact_match"}}))
    lines = tmp_path / "e.jsonl"
    lines.write_text(json.dumps(EXAMPLE) + "\n")
    registry = SuiteRegistry(str(tmp_path / ".eval"))
    registry.register(str(header), str(lines))
    stored = json.loads((tmp_path / ".eval" / "suites" / "jl" / "suite.json").read_text())
    assert stored["examples"][0]["target"] == "2"  # saved with inline examples
    with pytest.raises(PostEvalRejection) as caught:
        registry.register(str(tmp_path / "missing.json"))
    assert caught.value.code == "eval_suite_unreadable"
    for bad in ("", "..", "a/b", "a\\b", "/abs"):
        with pytest.raises(PostEvalRejection) as caught:
            registry.load(bad)
        assert caught.value.code == "eval_suite_name_invalid"


# ---- identity hashes (replay.rs) -----------------------------------------------------------------


def framed(domain: bytes, body: bytes) -> str:
    return "sha256:" + hashlib.sha256(domain + len(body).to_bytes(8, "little") + body).hexdigest()


def test_suite_hash_is_kiln_framing_over_serde_bytes():
    suite = load(suite_doc(generation={"temperature": 0.7}))
    # serde_json::to_vec(&suite), written out by hand from the struct declarations: defaults filled,
    # Option/empty fields skipped where Kiln skips them, f32 0.7 printed as Ryū prints it.
    expected = (b'{"name":"math","default_scorer":{"kind":"exact_match","case_sensitive":true,"strip_whitespace":true},'
                b'"generation":{"temperature":0.7,"top_p":1.0,"top_k":0,"max_tokens":256,"n":1,"stop":[],"seed":null},'
                b'"aggregation":{"kind":"single"},"examples":[{"messages":[{"role":"user","content":"1+1?"}],'
                b'"target":"2","weight":1.0}],"schema_version":1}')
    assert suite_sha256(suite) == framed(b"kiln.eval-suite.v1\x00", expected)


def test_suite_hash_covers_optional_fields_in_declaration_order():
    doc = suite_doc(description="d", system_prompt="sys", tools=[{"name": "t", "b": 1, "a": 2.5}],
                    default_scorer={"kind": "numeric_tolerance", "atol": 1, "integer_only": True},
                    examples=[dict(EXAMPLE, id="e", tags=["x"], metadata={"z": 1, "a": None}, weight=0.5,
                                   scorer={"kind": "regex", "pattern": "\\d"},
                                   generation={"seed": 7, "thinking_budget_ms": 0, "chat_template_kwargs": {"b": 1, "a": False}})])
    expected = (b'{"name":"math","description":"d","default_scorer":{"kind":"numeric_tolerance","atol":1.0,"rtol":0.0,'
                b'"integer_only":true},"generation":{"temperature":0.0,"top_p":1.0,"top_k":0,"max_tokens":256,"n":1,'
                b'"stop":[],"seed":null},"aggregation":{"kind":"single"},"system_prompt":"sys","examples":[{"id":"e",'
                b'"messages":[{"role":"user","content":"1+1?"}],"target":"2","tags":["x"],"metadata":{"a":null,"z":1},'
                b'"scorer":{"kind":"regex","pattern":"\\\\d","capture_group":null,"case_sensitive":true},'
                b'"generation":{"temperature":0.0,"top_p":1.0,"top_k":0,"max_tokens":256,"n":1,"stop":[],"seed":7,'
                b'"thinking_budget_ms":0,"chat_template_kwargs":{"a":false,"b":1}},"weight":0.5}],"schema_version":1,'
                b'"tools":[{"a":2.5,"b":1,"name":"t"}]}')
    assert suite_sha256(load(doc)) == framed(b"kiln.eval-suite.v1\x00", expected)


def test_effective_generation_hash_binds_seed_override_and_budgets():
    suite = load(suite_doc())
    override = parse_post_eval_config({"suite": "math", "generation": {"max_tokens": 8}}).generation
    budget = (b'{"configured":false,"applied":false,"tokens_source":"unlimited","time_source":"unlimited",'
              b'"triggered":false}')
    body = (b'{"seed_derivation":"kiln.eval-seed.v1","effective_seed":"42","suite_sha256":"' +
            suite_sha256(suite).encode() + b'","generation_override":{"temperature":0.0,"top_p":1.0,"top_k":0,'
            b'"max_tokens":8,"n":1,"stop":[],"seed":null},"resolved_thinking_budgets":[' + budget + b']}')
    assert effective_generation_sha256(suite, override, 42) == framed(b"kiln.eval-effective-generation.v1\x00", body)
    assert effective_generation_sha256(suite, override, 43) != effective_generation_sha256(suite, override, 42)
    assert effective_generation_sha256(suite, None, 42) != effective_generation_sha256(suite, override, 42)


def test_generation_precedence_is_whole_object_example_then_override_then_suite():
    suite = load(suite_doc(generation={"max_tokens": 5},
                           examples=[EXAMPLE, dict(EXAMPLE, id="own", generation={"temperature": 0.5})]))
    override = parse_post_eval_config({"suite": "m", "generation": {"max_tokens": 9}}).generation
    first, second = suite.examples
    assert effective_generation(suite, first, None) == (suite.generation, "suite")
    assert effective_generation(suite, first, override) == (override, "run_override")
    params, source = effective_generation(suite, second, override)
    assert (source, params.max_tokens, params.temperature) == ("example", 256, 0.5)  # no field merge
