"""The on-policy contract: ``OpdPrompt`` parsing, Kiln's prompt-list digest and receipt value, auto-scaled S.

What a user depends on: a Kiln request with ``prompts`` parses as Kiln parses it, and the digest that
binds checkpoints and receipts to the prompts equals Kiln's ``sha256_json_serializable(&prompts)``
(serde's sorted compact JSON of Kiln's re-serialized prompt list), so a checkpoint written here is
recognized as the same data by Kiln and vice versa.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from kiln_core.contracts.opd_config import (
    ConfigError,
    OpdConfig,
    effective_samples_per_prompt,
    parse_opd_request,
)
from kiln_core.contracts.opd_prompt import (
    OpdPrompt,
    kiln_prompt_value,
    prompts_content_sha256,
    training_data_receipt,
)
from kiln_core.contracts.settings import ResolvedSettings
from kiln_core.serde_json import serde_json_text


def _prompt(value: dict) -> OpdPrompt:
    return OpdPrompt.model_validate(value)


RICH = {
    "messages": [
        {"role": "system", "content": "Be brief.", "name": None, "extra_field": 1},
        {"role": "user", "content": [{"type": "text", "text": "2+2"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ],
    "teacher_extra_messages": [{"role": "user", "content": "Answer: 4"}],
    "trajectory": [{"role": "assistant", "content": "four", "kind": "action", "warning_prefix_len": 0},
                   {"role": "user", "content": "ok"}],
    "unknown_top_level": {"ignored": True},
}


def _reference_kiln_value(raw: dict) -> dict:
    """Kiln's re-serialization of one prompt, written out by hand from the Rust structs.

    ``ChatMessage {role, content: String, tool_calls?, name?, tool_call_id?}`` (options skipped when
    None), ``TurnSegment {role, content, kind (default context), tool_call_id?, warning_prefix_len?}``,
    ``OpdPrompt`` with both lists skipped when empty; text parts concatenated.
    """
    def message(m):
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        out = {"role": m["role"], "content": content or ""}
        for key in ("tool_calls", "name", "tool_call_id"):
            if m.get(key) is not None:
                out[key] = m[key]
        return out

    def segment(s):
        out = {"role": s["role"], "content": s["content"], "kind": s.get("kind") or "context"}
        for key in ("tool_call_id", "warning_prefix_len"):
            if s.get(key) is not None:
                out[key] = s[key]
        return out

    value = {"messages": [message(m) for m in raw["messages"]]}
    if raw.get("teacher_extra_messages"):
        value["teacher_extra_messages"] = [message(m) for m in raw["teacher_extra_messages"]]
    if raw.get("trajectory"):
        value["trajectory"] = [segment(s) for s in raw["trajectory"]]
    return value


def test_prompt_parses_like_kiln_and_reserializes_kiln_fields_only():
    prompt = _prompt(RICH)
    assert kiln_prompt_value(prompt) == _reference_kiln_value(RICH)
    bare = _prompt({"messages": [{"role": "user", "content": "q"}]})
    assert bare.teacher_extra_messages == [] and bare.trajectory == []
    assert kiln_prompt_value(bare) == {"messages": [{"role": "user", "content": "q"}]}  # empty lists omitted


@pytest.mark.parametrize("bad", [
    {},  # messages is required
    {"messages": None},
    {"messages": [{"role": "user", "content": "q"}], "teacher_extra_messages": None},  # serde: null is not a Vec
    {"messages": [{"role": "user", "content": "q"}], "trajectory": None},
    {"messages": [{"content": "q"}]},  # role is required
    {"messages": [{"role": "user", "content": 4}]},
])
def test_prompt_shapes_kiln_refuses_are_refused(bad):
    with pytest.raises(ValueError):
        _prompt(bad)


def test_digest_is_sha256_of_sorted_compact_json_of_the_whole_list():
    prompts = [_prompt(RICH), _prompt({"messages": [{"role": "user", "content": "é ünïcode \u2028 \x01"}]})]
    reference = json.dumps([_reference_kiln_value(RICH), _reference_kiln_value(
        {"messages": [{"role": "user", "content": "é ünïcode \u2028 \x01"}]})],
        sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    expected = hashlib.sha256(reference.encode("utf-8")).hexdigest()
    assert prompts_content_sha256(prompts) == expected
    assert training_data_receipt(prompts) == {"source": "inline_opd_prompts", "path": None,
                                              "sha256": "sha256:" + expected}


def test_digest_changes_with_content_and_order_but_not_with_ignored_fields():
    a = _prompt({"messages": [{"role": "user", "content": "a"}]})
    b = _prompt({"messages": [{"role": "user", "content": "b"}]})
    assert prompts_content_sha256([a, b]) != prompts_content_sha256([b, a])
    assert prompts_content_sha256([a]) != prompts_content_sha256([b])
    noisy = _prompt({"messages": [{"role": "user", "content": "a", "name": None, "x": 3}], "trajectory": [], "y": 1})
    assert prompts_content_sha256([noisy]) == prompts_content_sha256([a])


@pytest.mark.parametrize("value, text", [
    # serde_json writes floats with the ryu crate: shortest digits, no '+' in exponents, '.0' on
    # integral values below 1e16, plain decimals down to 1e-5.
    (1.0, "1.0"), (-0.0, "-0.0"), (0.5, "0.5"), (123.456, "123.456"), (1e15, "1000000000000000.0"),
    (1e16, "1e16"), (1.5e20, "1.5e20"), (1e-5, "0.00001"), (1.25e-5, "0.0000125"), (1e-6, "1e-6"),
    (2.5e-7, "2.5e-7"), (-3.0e300, "-3e300"), (12345678901234567890, "12345678901234567890"),
    (1.2345678901234567e19, "1.2345678901234567e19"),
    (2**64, "1.8446744073709552e19"), (-(2**63), "-9223372036854775808"), (2**64 - 1, "18446744073709551615"),
])
def test_numbers_are_written_as_serde_json_writes_them(value, text):
    assert serde_json_text(value) == text


def test_strings_and_keys_follow_serde_escaping_and_byte_order():
    assert serde_json_text({"b": 1, "a": [True, None], "é": "x", "Z": "\"\\\n\t\x7f"}) == \
        '{"Z":"\\"\\\\\\n\\t\x7f","a":[true,null],"b":1,"é":"x"}'
    with pytest.raises(UnicodeEncodeError):
        serde_json_text("\ud800")


def test_request_accepts_prompts_and_refuses_null():
    request = parse_opd_request({"teacher": "t", "prompts": [RICH]})
    assert isinstance(request.prompts[0], OpdPrompt)
    assert parse_opd_request({"teacher": "t", "dataset_path": "/d"}).prompts == []
    with pytest.raises(ConfigError):
        parse_opd_request({"teacher": "t", "prompts": None})


def test_samples_per_prompt_auto_scales_from_the_request_prompt_count():
    on = OpdConfig()
    assert [effective_samples_per_prompt(on, n) for n in (1, 49, 50, 199, 200, 5000)] == [64, 64, 16, 16, 4, 4]
    assert effective_samples_per_prompt(OpdConfig(samples_per_prompt=3), 10) == 3  # explicit values stand
    for count, samples in ((10, 64), (300, 4)):
        settings = ResolvedSettings.resolve(on, adapter="a", prompt_count=count)
        assert settings.samples_per_prompt == samples == settings.kiln_effective_config(1)["effective_samples_per_prompt"]
