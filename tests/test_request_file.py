"""The one reader of request files (``kiln_core.contracts.request_file``): the OPD request and the distill/self,
distill/pump and distill_merge requests fail the same two ways, each naming the route and the file."""

from __future__ import annotations

import pytest

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.contracts.request_file import read_request_json


def test_a_request_file_decodes_to_its_json(tmp_path):
    path = tmp_path / "self.json"
    path.write_text('{"name": "s", "prompts": [{"messages": []}]}')
    assert read_request_json(str(path), "distill/self") == {"name": "s", "prompts": [{"messages": []}]}


def test_a_missing_file_is_an_invalid_request_naming_the_route_and_the_file(tmp_path):
    path = tmp_path / "missing.json"
    with pytest.raises(ConfigError) as refused:
        read_request_json(str(path), "distill/pump")
    assert refused.value.code == "invalid_request"
    assert refused.value.message.startswith(f"cannot read distill/pump request {path}: ")


def test_text_that_is_not_json_is_an_invalid_request_with_the_parsers_reason(tmp_path):
    path = tmp_path / "merge.json"
    path.write_text('{"name": "m",')
    with pytest.raises(ConfigError) as refused:
        read_request_json(str(path), "distill_merge")
    assert refused.value.code == "invalid_request"
    assert refused.value.message.startswith(f"distill_merge request {path} is not valid JSON: Expecting")


def test_a_request_deeper_than_kilns_parser_accepts_is_refused(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200 + "]" * 200)
    with pytest.raises(Exception) as refused:
        read_request_json(str(path), "OPD")
    assert refused.value.code == "nesting_too_deep"
