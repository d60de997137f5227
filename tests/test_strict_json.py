"""serde_json's nesting limit, as every reader applies it (kiln_core.strict_json).

serde_json starts ``remaining_depth`` at 128, decrements it on entering an array or object and fails
when it reaches 0: 127 nested containers parse, the 128th is refused. The raw-text depth scanner is
checked against an independent depth computed here from the parsed value.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln_core.contracts.identity import ManifestError, parse_identity_json, parse_manifest_line
from kiln_core.errors import Rejection
from kiln_core.strict_json import (
    SERDE_JSON_RECURSION_LIMIT,
    NestingTooDeep,
    StrictJsonError,
    check_nesting,
    check_text_nesting,
    loads_nesting_limited,
    loads_strict,
    text_nesting_depth,
)


def reference_depth(value) -> int:
    """Containers on the deepest path of a parsed value (a scalar is depth 0)."""
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    return 0


def nest(depth: int, kind: str = "array") -> str:
    opening, closing = ("[", "]") if kind == "array" else ('{"k":', "}")
    if kind == "object":
        return opening * depth + "1" + closing * depth
    return opening * depth + closing * depth


@pytest.mark.parametrize("kind", ["array", "object"])
def test_the_128th_nested_container_is_refused(kind):
    assert SERDE_JSON_RECURSION_LIMIT == 128
    ok, deep = nest(127, kind), nest(128, kind)
    check_nesting(json.loads(ok))
    check_text_nesting(ok)
    assert loads_nesting_limited(ok) == json.loads(ok)
    for check in (lambda: check_nesting(json.loads(deep)), lambda: check_text_nesting(deep), lambda: loads_nesting_limited(deep)):
        with pytest.raises(NestingTooDeep) as caught:
            check()
        assert caught.value.code == "nesting_too_deep" and isinstance(caught.value, Rejection)
        assert caught.value.depth == 128 and "128" in caught.value.message


def test_depth_beyond_pythons_recursion_is_refused_not_a_crash():
    with pytest.raises(NestingTooDeep):
        loads_nesting_limited("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StrictJsonError) as caught:
        loads_strict("[" * 100_000 + "]" * 100_000)
    assert caught.value.rule == "nesting_too_deep"


def test_a_too_deep_container_before_a_syntax_error_wins():
    with pytest.raises(NestingTooDeep):
        loads_nesting_limited("[" * 200 + "oops")
    with pytest.raises(json.JSONDecodeError):
        loads_nesting_limited("[oops" + "[" * 200)


@pytest.mark.parametrize(
    "text, depth",
    [
        ('"[[[["', 0),
        ('{"a":"x\\"[[["}', 1),
        ('["\\\\", [[]]]', 3),
        ('["\\\\\\"[", []]', 2),
        ('{"a":[1,{"b":"]]]]"}]}', 3),
        ("[1, 2]\n[[3]]\n", 2),
    ],
)
def test_text_depth_skips_strings_and_escapes(text, depth):
    assert text_nesting_depth(text) == depth


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[]{}"\\ \n\u00e9', max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(alphabet='k[]"\\', max_size=3), children, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ensure_ascii=st.booleans())
def test_text_depth_equals_the_parsed_depth(value, ensure_ascii):
    text = json.dumps(value, ensure_ascii=ensure_ascii)
    assert text_nesting_depth(text) == reference_depth(value)


def test_manifest_and_identity_parsers_refuse_deep_json():
    for parse in (parse_manifest_line, parse_identity_json):
        with pytest.raises(ManifestError) as caught:
            parse('{"schema":' + nest(130) + "}")
        assert caught.value.kind == "nesting_too_deep" and caught.value.code == "nesting_too_deep"
        assert isinstance(caught.value, Rejection)
        with pytest.raises(ManifestError) as caught:
            parse(nest(20_000))
        assert caught.value.code == "nesting_too_deep"


def test_manifest_error_stays_a_value_error_with_its_message():
    with pytest.raises(ValueError) as caught:
        parse_manifest_line("{")
    assert caught.value.code == "manifest_invalid" and str(caught.value) == caught.value.message
