"""The run form the Prefect UI builds from ``opd_distill``'s parameter schema explains itself.

The schema is the one a deployment stores (``prefect.utilities.callables.parameter_schema``, what
``serve`` and ``prefect deploy`` send), so what is counted here is what the form shows: every field has
a one-line description, every group a title, no reST markup, and the adapter-name rule is a schema
``pattern`` that agrees with the Python rule.
"""

from __future__ import annotations

import re

import pytest

from kiln_core.contracts.names import NAME_PATTERN, is_valid_name


@pytest.fixture(scope="module")
def schema() -> dict:
    from prefect.utilities.callables import parameter_schema

    from flows.opd_distill import opd_distill

    return parameter_schema(opd_distill).model_dump_for_openapi()


def _fields(schema: dict):
    """(where, property schema) for every property of the parameter and of every definition."""
    for name, prop in schema["properties"].items():
        yield f"parameter.{name}", prop
    for model, definition in schema["definitions"].items():
        for name, prop in definition.get("properties", {}).items():
            yield f"{model}.{name}", prop


def test_every_spec_and_config_field_has_a_one_line_description(schema):
    fields = list(_fields(schema))
    missing = [where for where, prop in fields if not (prop.get("description") or "").strip()]
    assert missing == [], f"{len(missing)} of {len(fields)} form fields have no description: {missing}"
    multi_line = [where for where, prop in fields if "\n" in prop["description"]]
    assert multi_line == []
    # the config's fields are all there (29 in Kiln's OpdConfig plus our extensions), each described
    assert len(schema["definitions"]["OpdConfig"]["properties"]) >= 29


def test_descriptions_are_plain_text_and_groups_have_titles(schema):
    texts = [(where, prop["description"]) for where, prop in _fields(schema)]
    texts += [(model, definition.get("description", "")) for model, definition in schema["definitions"].items()]
    marked = [where for where, text in texts if "``" in text or ":class:" in text or "Example:" in text]
    assert marked == [], f"raw reST or docstring sections in form text: {marked}"
    for model, definition in schema["definitions"].items():
        assert definition.get("title") and definition["title"] != "Field", model
    spec = schema["definitions"]["PipelineSpec"]["properties"]
    assert spec["distributed"]["title"] == "Distributed training"
    assert schema["definitions"]["OpdConfig"]["properties"]["echo"]["title"] == "ECHO"


def test_config_descriptions_say_kilns_default(schema):
    config = schema["definitions"]["OpdConfig"]["properties"]
    without_default = [name for name, prop in config.items()
                       if "default" not in prop["description"].lower() and "default" not in prop]
    assert without_default == []
    assert "Kiln default: 32" in config["top_k"]["description"]
    assert "25" in config["checkpoint_interval"]["description"]


@pytest.mark.parametrize("name", ["a", "nightly", "my-adapter_v2.1", "x" * 128, "A.b"])
def test_adapter_pattern_accepts_what_the_rule_accepts(schema, name):
    pattern = schema["definitions"]["PipelineSpec"]["properties"]["adapter"]["pattern"]
    assert pattern == NAME_PATTERN
    assert re.search(pattern, name) and is_valid_name(name)


@pytest.mark.parametrize("name", ["my adapter/v2!", "", ".hidden", "a..b", "x" * 129, "run.kiln-checkpoint",
                                  "../up", "tab\tname"])
def test_adapter_pattern_refuses_what_the_rule_refuses(schema, name):
    pattern = schema["definitions"]["PipelineSpec"]["properties"]["adapter"]["pattern"]
    assert not re.search(pattern, name) and not is_valid_name(name)


def test_server_side_schema_check_refuses_a_bad_adapter(schema):
    """What ``enforce_parameter_schema`` does on the server (and the UI's inline check asks it)."""
    from prefect.utilities.schema_tools import validate

    from tests.integration.conftest import pipeline_spec

    inputs = {"teacher": "/t", "student": "/s", "storage_root": "/r"}
    good = {"spec": pipeline_spec(inputs, "/c.jsonl", "fine-name")}
    validate(good, schema, raise_on_error=True, ignore_required=False)
    bad = {"spec": pipeline_spec(inputs, "/c.jsonl", "my adapter/v2!")}
    with pytest.raises(Exception, match="does not match"):
        validate(bad, schema, raise_on_error=True, ignore_required=False)


def test_docstrings_and_descriptions_are_one_source():
    """A field's description is its attribute docstring (no second copy to drift)."""
    import ast
    import inspect

    from kiln_core.contracts import opd_config

    tree = ast.parse(inspect.getsource(opd_config.OpdConfig))
    body = tree.body[0].body
    docstrings = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            docstrings[node.target.id] = following.value.value
    for name, info in opd_config.OpdConfig.model_fields.items():
        assert info.description == docstrings[name], name
