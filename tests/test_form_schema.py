"""The run form the Prefect UI builds from ``opd_distill``'s parameter schema explains itself.

The schema is the one a deployment stores (``prefect.utilities.callables.parameter_schema``, what
``serve`` and ``prefect deploy`` send), so what is counted here is what the form shows: every field has
a one-line description, every group a title, no reST markup, no ``oneOf`` (Prefect's default UI shows
one as a raw JSON editor), and no regular expression a validator would quote back to the user.
"""

from __future__ import annotations

import pytest


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
    assert len(fields) >= 60


def test_every_config_field_shows_once_where_it_acts(schema):
    """Kiln's 29 OpdConfig fields (plus our extensions): the sampling settings in the on-policy source
    only, the training mode nowhere (the source decides it), every other field among the config's."""
    from kiln_core.contracts.opd_config import SAMPLING_FIELDS, OpdConfig

    definitions = schema["definitions"]
    config = set(definitions["OpdConfig"]["properties"])
    sampling = set(definitions["OnPolicySampling"]["properties"])
    assert sampling == set(SAMPLING_FIELDS)
    assert not config & sampling
    assert config | sampling | {"training_mode"} == set(OpdConfig.model_fields) >= set(SAMPLING_FIELDS)
    assert len(OpdConfig.model_fields) >= 29
    for name in set(SAMPLING_FIELDS) - {"samples_per_prompt"}:  # one source: the same description in both places
        assert definitions["OnPolicySampling"]["properties"][name]["description"] == OpdConfig.model_fields[name].description


def _walk(node, where="schema"):
    """(where, sub-schema) for every dict in the schema."""
    if isinstance(node, dict):
        yield where, node
        for key, value in node.items():
            yield from _walk(value, f"{where}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{where}[{index}]")


def test_no_choice_is_a_oneof_that_the_default_ui_shows_as_json(schema):
    """Prefect 3.9 opens its V1 UI, which renders a ``oneOf`` (pydantic's discriminated union) as a raw JSON
    editor; a plain enum plus fields renders as a form in V1 and V2 alike."""
    unions = [where for where, node in _walk(schema) if "oneOf" in node or "discriminator" in node]
    assert unions == []
    # The only anyOf left are "a value or nothing" (an optional field), which both UIs show as the field.
    choices = [where for where, node in _walk(schema) if "anyOf" in node
               and [option.get("type") for option in node["anyOf"]].count("null") != 1]
    assert choices == []


def test_training_data_is_one_kind_dropdown_with_one_field_per_kind(schema):
    spec = schema["definitions"]["PipelineSpec"]
    assert "corpus" not in spec["properties"] and "examples" not in spec["properties"]
    assert "source" in spec["required"] and spec["properties"]["source"]["$ref"].endswith("/TrainingData")
    assert spec["properties"]["source"]["title"] == "Training data"
    source = schema["definitions"]["TrainingData"]
    assert source["title"] == "Training data" and source.get("additionalProperties") is False
    assert source["properties"]["kind"]["enum"] == ["corpus", "examples", "prompts"]
    assert source["properties"]["kind"]["title"] == "Kind"
    assert set(source["properties"]) == {"kind", "corpus", "examples", "prompts", "sampling"}
    assert source["properties"]["sampling"]["anyOf"][0]["$ref"].endswith("/OnPolicySampling")


def test_the_optimizer_is_one_kind_dropdown_with_every_setting_optional(schema):
    optimizer = schema["definitions"]["OpdConfig"]["properties"]["optimizer"]
    assert optimizer["type"] == "object" and optimizer["title"] == "Optimizer"
    assert optimizer["properties"]["kind"]["enum"] == ["muon", "adam_w", "sgd"]
    assert optimizer["properties"]["kind"]["default"] == "muon"
    settings = {name: prop for name, prop in optimizer["properties"].items() if name != "kind"}
    assert set(settings) == {"momentum", "nesterov", "ns_iters", "weight_decay", "beta1", "beta2", "eps"}
    # no value as default (a default of one optimizer would be sent along with another): null, which a form
    # sends as "not set"; and each says whose it is
    assert [name for name, prop in settings.items() if prop.get("default", "absent") is not None] == []
    # unset settings open on "None" (a bool switch opened on "bool" would send false for every optimizer)
    assert [name for name, prop in settings.items() if prop["anyOf"][0] != {"type": "null"}] == []
    assert settings["beta1"]["description"].startswith("adam_w only: ")
    assert settings["weight_decay"]["description"].startswith("muon and adam_w only: ")
    stable = schema["definitions"]["OnPolicySampling"]["properties"]["stable_opd"]
    assert stable["properties"]["mode"]["enum"] == ["off", "auto", "manual"]


@pytest.mark.parametrize("definition, field", [("OpdConfig", "top_k"), ("OpdConfig", "learning_rate"),
                                               ("OpdConfig", "lora_alpha"), ("OpdConfig", "checkpoint_interval"),
                                               ("OnPolicySampling", "samples_per_prompt"),
                                               ("OnPolicySampling", "sampler_segments")])
def test_numbers_that_must_be_positive_say_so(schema, definition, field):
    """Kiln refuses 0 at submit; the form refuses it inline (``exclusiveMinimum: 0``)."""
    from prefect.utilities.schema_tools import validate

    prop = schema["definitions"][definition]["properties"][field]
    numeric = [option for option in prop.get("anyOf", [prop]) if option.get("type") in ("number", "integer")]
    assert len(numeric) == 1 and numeric[0]["exclusiveMinimum"] == 0 and "minimum" not in numeric[0]
    from kiln_core.contracts.form_choices import complete_for_form
    from kiln_core.contracts.pipeline import PipelineSpec

    config = {"top_k": 16, field: 0} if definition == "OpdConfig" else {}
    source = {"kind": "prompts", "prompts": "/p", "sampling": {field: 0}} if definition != "OpdConfig" \
        else {"kind": "corpus", "corpus": "/c"}
    spec = complete_for_form({**BASE, "source": source, "config": config}, PipelineSpec.model_json_schema())
    with pytest.raises(Exception, match="less than or equal to the minimum of 0"):
        validate({"spec": spec}, schema, raise_on_error=True, ignore_required=False)


def _number_fields(schema):
    """(object, field name, property, the object's required list) for every number field of the form."""
    for where, node in _walk(schema):
        for name, prop in (node.get("properties") or {}).items():
            if isinstance(prop, dict) and any(branch.get("type") in ("number", "integer")
                                              for branch in prop.get("anyOf", [prop])):
                yield where, name, prop, node.get("required") or []


def test_every_number_field_is_required_so_a_value_the_form_dropped_is_refused(schema):
    """Prefect's V1 number boxes refuse the letter e: ``1e-5`` typed into Learning Rate becomes "1-5", the form
    leaves the field out, and the run used to train at the optimizer's default. Every number field is
    required: the form refuses the gap under the field, and so does the server (a run through the API names
    each number; null is Kiln's default where the field takes one)."""
    from prefect.utilities.schema_tools import validate

    from tests.integration.conftest import pipeline_spec

    fields = list(_number_fields(schema))
    optional = [f"{where}.{name}" for where, name, _, required in fields
                if name not in required and not name.startswith("thinking_budget")]
    assert optional == [] and len(fields) >= 40
    # each has a default (null for "not set"), so a form opens with it and sends it
    assert [f"{where}.{name}" for where, name, prop, required in fields if name in required and "default" not in prop
            and {"type": "null"} in prop.get("anyOf", [])] == []
    inputs = {"teacher": "/t", "student": "/s", "storage_root": "/r"}
    spec = pipeline_spec(inputs, "/c.jsonl", "a")
    validate({"spec": spec}, schema, raise_on_error=True, ignore_required=False)
    dropped = {**spec, "config": {key: value for key, value in spec["config"].items() if key != "learning_rate"}}
    with pytest.raises(Exception, match="'learning_rate' is a required property"):
        validate({"spec": dropped}, schema, raise_on_error=True, ignore_required=False)


def test_what_a_form_holds_for_a_field_left_out_is_its_default():
    """A field the form shows but a spec leaves out is filled as the form holds it: its default (25 for the
    checkpoint interval, never null, which turns checkpoints off), null where null is the default."""
    from kiln_core.contracts.form_choices import complete_for_form
    from kiln_core.contracts.pipeline import PipelineSpec, parse_spec

    spec = complete_for_form({**BASE, "source": {"kind": "corpus", "corpus": "/c"}, "config": {"top_k": 16},
                              "eval": {"corpus": "/h", "every_steps": 5}}, PipelineSpec.model_json_schema())
    assert spec["config"]["checkpoint_interval"] == 25 and spec["config"]["learning_rate"] is None
    assert spec["eval"]["flat_window"] == 50
    assert parse_spec(spec) == parse_spec({**BASE, "corpus": "/c", "config": {"top_k": 16},
                                           "eval": {"corpus": "/h", "every_steps": 5}})


def test_the_deployments_default_parameters_pass_the_servers_check(schema):
    """A Quick run of ``opd-distill/nightly`` sends deployments/prefect.yaml's defaults as they are: they must
    name every field the schema requires."""
    from pathlib import Path

    import yaml
    from prefect.utilities.schema_tools import validate

    from kiln_core.contracts.pipeline import parse_spec

    root = Path(__file__).resolve().parents[1]
    deployments = yaml.safe_load((root / "deployments" / "prefect.yaml").read_text(encoding="utf-8"))["deployments"]
    [nightly] = [deployment for deployment in deployments if deployment["entrypoint"] == "flows.opd_distill.opd_distill"]
    validate(nightly["parameters"], schema, raise_on_error=True, ignore_required=False)
    parse_spec(nightly["parameters"]["spec"])


def test_the_forms_samples_per_prompt_is_what_the_run_uses():
    """Kiln's 4 is its auto-scaling value (64 per prompt below 50 prompts): the form shows it empty, says what
    empty runs, and a number typed there is the run's."""
    from kiln_core.contracts.opd_config import effective_samples_per_prompt
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.contracts.sources import OnPolicySampling

    prop = OnPolicySampling.model_json_schema()["properties"]["samples_per_prompt"]
    assert prop["default"] is None and "64 per prompt below 50 prompts" in prop["description"]
    auto = parse_spec({**BASE, "source": {"kind": "prompts", "prompts": "/p", "sampling": {"samples_per_prompt": None}}})
    assert effective_samples_per_prompt(auto.config, 2) == 64
    assert parse_spec(auto.form_defaults()).config == auto.config
    assert auto.form_defaults()["source"]["sampling"]["samples_per_prompt"] is None
    typed = parse_spec({**BASE, "source": {"kind": "prompts", "prompts": "/p", "sampling": {"samples_per_prompt": 8}}})
    assert effective_samples_per_prompt(typed.config, 2) == 8
    yaml_view = parse_spec({**BASE, "prompts": "/p", "config": {"samples_per_prompt": 4}})
    assert yaml_view.source.sampling.samples_per_prompt is None and yaml_view.config == auto.config


def test_the_learning_rate_is_a_number_field(schema):
    """Letters typed into it are refused (a number input), never passed on as text."""
    from prefect.utilities.schema_tools import validate

    from kiln_core.contracts.form_choices import complete_for_form
    from kiln_core.contracts.pipeline import PipelineSpec

    prop = schema["definitions"]["OpdConfig"]["properties"]["learning_rate"]
    assert [option["type"] for option in prop["anyOf"]] == ["number", "null"]
    spec = complete_for_form({**BASE, "source": {"kind": "corpus", "corpus": "/c"}, "config": {"learning_rate": "3e-4x"}},
                             PipelineSpec.model_json_schema())
    with pytest.raises(Exception, match="'3e-4x' is not valid"):
        validate({"spec": spec}, schema, raise_on_error=True, ignore_required=False)


def test_descriptions_render_the_same_in_both_uis(schema):
    """V1 renders descriptions as HTML, so ``<adapter>`` vanishes; V2 shows them as text, so backticks stay
    raw. A description holds neither."""
    import re

    texts = [(where, node["description"]) for where, node in _walk(schema) if isinstance(node.get("description"), str)]
    assert len(texts) >= 60
    assert [where for where, text in texts if "`" in text or re.search(r"<[^>]*>", text)] == []


def test_every_switch_shows_a_human_name(schema):
    """An optional group is a switch between the group and None, labelled with the group's title in both UIs:
    a class name (PostEvalConfig) is not a name a person reads."""
    import re

    definitions = schema["definitions"]
    labels = {definitions[branch["$ref"].rsplit("/", 1)[-1]]["title"]
              for _, node in _walk(schema) for branch in node.get("anyOf", []) if "$ref" in branch}
    assert len(labels) >= 8
    assert [label for label in labels if re.fullmatch(r"([A-Z][a-z0-9]+){2,}", label)] == []


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


def test_no_regular_expression_reaches_the_form(schema):
    """A schema ``pattern`` comes back to the user as "does not match '<regex>'" in both UIs; the adapter
    field carries its length only, and the rule in words is its description."""
    patterns = [where for where, node in _walk(schema) if "pattern" in node and isinstance(node["pattern"], str)]
    assert patterns == []
    adapter = schema["definitions"]["PipelineSpec"]["properties"]["adapter"]
    assert (adapter["minLength"], adapter["maxLength"]) == (1, 128)
    assert "1-128 characters of letters, digits" in adapter["description"]


@pytest.mark.parametrize("name", ["my adapter/v2!", ".hidden", "a..b", "run.kiln-checkpoint", "../up"])
def test_a_bad_adapter_name_is_refused_in_words(schema, name):
    """The server takes the form's value (the schema has no pattern); the run's first check refuses it,
    quoting the name and the rule, never the regular expression."""
    from prefect.utilities.schema_tools import validate

    from kiln_core.contracts.names import NAME_PATTERN
    from kiln_core.contracts.pipeline import SpecError, parse_spec
    from tests.integration.conftest import pipeline_spec

    inputs = {"teacher": "/t", "student": "/s", "storage_root": "/r"}
    validate({"spec": pipeline_spec(inputs, "/c.jsonl", "fine-name")}, schema, raise_on_error=True, ignore_required=False)
    validate({"spec": pipeline_spec(inputs, "/c.jsonl", name)}, schema, raise_on_error=True, ignore_required=False)
    with pytest.raises(SpecError) as caught:
        parse_spec(pipeline_spec(inputs, "/c.jsonl", name))
    assert caught.value.code == "invalid_adapter_name" and caught.value.field == "adapter"
    assert f"{name!r} must be 1-128 characters of letters" in caught.value.message
    assert NAME_PATTERN not in str(caught.value) and "(?!" not in str(caught.value)


def test_a_too_long_adapter_name_is_refused_by_the_form(schema):
    from prefect.utilities.schema_tools import validate

    from tests.integration.conftest import pipeline_spec

    inputs = {"teacher": "/t", "student": "/s", "storage_root": "/r"}
    with pytest.raises(Exception, match="is too long"):
        validate({"spec": pipeline_spec(inputs, "/c.jsonl", "x" * 129)}, schema, raise_on_error=True,
                 ignore_required=False)


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


# ---------------------------------------------------------------------------------------------
# the spec's two views: the form's `source`, YAML's and Kiln requests' `corpus`/`examples`

BASE = {"teacher": {"kind": "local_dir", "path": "/t"}, "student": "/s", "adapter": "a"}
CONFIG = {"top_k": 16, "epochs": 2, "lora_rank": 8, "lora_alpha": 16.0, "seed": 3, "optimizer": {"kind": "adam_w"}}


def test_form_and_yaml_views_are_the_same_run():
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.contracts.settings import ResolvedSettings

    yaml_view = parse_spec({**BASE, "corpus": "/c.jsonl", "config": {**CONFIG, "training_mode": "off_policy"}})
    form_view = parse_spec({**BASE, "source": {"kind": "corpus", "corpus": "/c.jsonl"}, "config": CONFIG})
    assert form_view == yaml_view
    assert (form_view.corpus, form_view.examples) == ("/c.jsonl", None)
    form_settings, yaml_settings = (ResolvedSettings.resolve(view.config, adapter=view.adapter)
                                    for view in (form_view, yaml_view))
    assert form_settings.run_key_config() == yaml_settings.run_key_config()
    assert form_settings.kiln_effective_config(3) == yaml_settings.kiln_effective_config(3)
    # a dump is the form's view, and it validates back to the same spec
    dumped = yaml_view.model_dump(mode="json", by_alias=True)
    assert dumped["source"] == {"kind": "corpus", "corpus": "/c.jsonl"} and "corpus" not in dumped
    assert parse_spec(dumped) == yaml_view
    examples = parse_spec({**BASE, "source": {"kind": "examples", "examples": "/e.jsonl"}})
    assert (examples.corpus, examples.examples, examples.config.training_mode) == (None, "/e.jsonl", "off_policy")


def test_the_prompts_source_is_an_on_policy_spec_with_its_sampling_settings():
    """The form's prompts tab and a YAML spec's `prompts:` + config give the same on-policy spec."""
    from kiln_core.contracts.pipeline import parse_spec

    form_view = parse_spec({**BASE, "source": {"kind": "prompts", "prompts": "/p.jsonl",
                                               "sampling": {"temperature": 0.7, "max_tokens": 64}},
                            "config": {"top_k": 16}})
    yaml_view = parse_spec({**BASE, "prompts": "/p.jsonl", "config": {"top_k": 16, "temperature": 0.7, "max_tokens": 64}})
    for spec in (form_view, yaml_view):
        assert (spec.prompts, spec.corpus, spec.examples) == ("/p.jsonl", None, None)
        assert (spec.config.training_mode, spec.config.temperature, spec.config.max_tokens) == ("on_policy", 0.7, 64)
    assert form_view.config == yaml_view.config and form_view.source == yaml_view.source
    assert parse_spec(yaml_view.model_dump(mode="json", by_alias=True)).config == yaml_view.config


def test_the_prompts_tab_takes_the_held_out_watch_and_the_quality_gate():
    """The watch and the quality gate measure against a teacher-scored held-out corpus, for either mode."""
    from kiln_core.contracts.pipeline import parse_spec

    spec = parse_spec({**BASE, "source": {"kind": "prompts", "prompts": "/p.jsonl"}, "config": {"top_k": 16},
                       "eval": {"corpus": "/h.jsonl", "every_steps": 5, "stop_on_divergence": True},
                       "quality_gate": {"corpus": "/h.jsonl", "max_reverse_kl": 2.0}})
    assert spec.config.training_mode == "on_policy" and spec.eval.every_steps == 5 and spec.eval.stop_on_divergence
    assert spec.quality_gate.thresholds() == {"max_reverse_kl": 2.0}


def test_a_spec_as_the_form_holds_it_is_what_the_server_accepts(schema):
    """``form_defaults`` names every field the form requires, the ones a dump leaves out included: the
    optimizers' other settings, the Ray fields of a torchrun block."""
    from prefect.utilities.schema_tools import validate

    from kiln_core.contracts.pipeline import parse_spec

    spec = parse_spec({**BASE, "corpus": "/c.jsonl", "config": CONFIG, "distributed": {"nproc": 2}})
    dumped = spec.model_dump(mode="json", by_alias=True)
    assert "momentum" not in dumped["config"]["optimizer"] and "workers" not in dumped["distributed"]
    defaults = spec.form_defaults()
    validate({"spec": defaults}, schema, raise_on_error=True, ignore_required=False)
    assert parse_spec(defaults) == spec


@pytest.mark.parametrize("spec, field, message", [
    ({**BASE, "source": {"kind": "corpus", "corpus": "/c"}, "examples": "/e"}, "source", "give the training data once"),
    ({**BASE, "source": {"kind": "corpus", "corpus": "/c", "examples": "/e"}}, "source.examples",
     "the training data is corpus (source kind); clear examples, or choose kind examples"),
    ({**BASE, "source": {"kind": "prompts", "corpus": "/c"}}, "source.prompts",
     "required when the training data is prompts"),
    ({**BASE, "source": {"kind": "corpus", "corpus": "/c", "sampling": {"temperature": 0.5}}}, "source.sampling",
     "sampling settings act on-policy only"),
    ({**BASE, "source": {"kind": "prompts", "prompts": "/p", "sampling": {"top_p": "high"}}}, "source.sampling.top_p",
     "valid number"),
    ({**BASE, "source": {"kind": "corpus", "corpus": "/c"}, "config": {"optimizer": {"kind": "sgd", "beta1": 0.5}}},
     "config.optimizer.beta1", "a setting of another kind than sgd"),
    ({**BASE, "source": {"kind": "prompts", "prompts": "/p", "sampling": {"stable_opd": {"mode": "off", "kl_beta": 1.0}}}},
     "source.sampling.stable_opd.kl_beta", "a setting of another mode than off"),
    ({**BASE}, "spec", "give exactly one of `corpus`"),
])
def test_source_rules_name_the_field(spec, field, message):
    from kiln_core.contracts.pipeline import SpecError, parse_spec

    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert (caught.value.field or "spec") == field and message in str(caught.value), str(caught.value)


def test_kiln_request_files_parse_as_before():
    """The form hides fields from the schema only: a Kiln config still takes every field."""
    from kiln_core.contracts.opd_config import parse_opd_config

    config = parse_opd_config({"training_mode": "on_policy", "temperature": 0.7, "top_p": 0.5, "max_tokens": 9,
                               "samples_per_prompt": 2, "rollout_prompt_rendering": "chat_template"})
    assert (config.training_mode, config.temperature, config.top_p, config.max_tokens) == ("on_policy", 0.7, 0.5, 9)


def test_every_optional_group_has_its_own_title(schema):
    """An optional nested block renders as a group titled by the property's title; without one the UI
    shows "Field (Optional)"."""
    untitled = [f"{model}.{name}" for model, definition in schema["definitions"].items()
                for name, prop in definition.get("properties", {}).items()
                if any("$ref" in option for option in prop.get("anyOf", [])) and not prop.get("title")]
    assert untitled == []


def test_what_the_form_sends_for_untouched_fields_is_not_a_choice():
    """A form sends every field it shows: empty text boxes ("" or null) and unset settings (null) of the
    kinds not chosen are not given, and the defaults of the sampling group ride along harmlessly."""
    from kiln_core.contracts.pipeline import parse_spec

    spec = parse_spec({**BASE, "source": {"kind": "corpus", "corpus": "/c", "examples": "", "prompts": None,
                                          "sampling": {}},
                       "config": {"top_k": 16, "optimizer": {"kind": "adam_w", "beta1": 0.8, "momentum": None,
                                                             "nesterov": None, "ns_iters": None}}})
    assert (spec.corpus, spec.examples, spec.prompts, spec.source.sampling) == ("/c", None, None, None)
    assert spec.config.optimizer.kind == "adam_w" and spec.config.optimizer.beta1 == 0.8


def test_a_served_spec_does_not_pin_what_the_source_kind_decides():
    """``serve --spec`` stores the file's spec as the deployment's defaults; a run from the form with the
    other kind of source trains in that kind's mode with that kind's sampling settings (issue 19)."""
    from kiln_core.contracts.opd_config import OpdConfig
    from kiln_core.contracts.pipeline import parse_spec

    served = parse_spec({**BASE, "corpus": "/c.jsonl", "config": {**CONFIG, "training_mode": "off_policy"}})
    defaults = served.form_defaults()
    assert not {"training_mode", "temperature", "stable_opd", "samples_per_prompt"} & set(defaults["config"])
    assert parse_spec(defaults) == served
    # the form: Source → prompts, the prompts file filled in, the corpus cleared, one sampling setting edited
    on_policy = {**defaults, "source": {"kind": "prompts", "corpus": "", "prompts": "/p.jsonl",
                                        "sampling": {"temperature": 0.5}}}
    spec = parse_spec(on_policy)
    assert (spec.config.training_mode, spec.prompts, spec.config.temperature) == ("on_policy", "/p.jsonl", 0.5)
    assert spec.config.top_p == OpdConfig().top_p and spec.config.top_k == 16
    # a deployment stored before this change still carries training_mode: the source kind decides it
    stale = {**on_policy, "config": {**defaults["config"], "training_mode": "off_policy", "temperature": 1.0}}
    assert parse_spec(stale).config.training_mode == "on_policy" and parse_spec(stale).config.temperature == 0.5
    # and the other way round: a served prompts spec run from the form with a corpus
    prompts = parse_spec({**BASE, "prompts": "/p.jsonl", "config": {"top_k": 16, "temperature": 0.7}}).form_defaults()
    assert prompts["source"] == {"kind": "prompts", "prompts": "/p.jsonl",
                                 "sampling": {**prompts["source"]["sampling"], "temperature": 0.7}}
    off = parse_spec({**prompts, "source": {"kind": "corpus", "corpus": "/c.jsonl"}})
    assert (off.config.training_mode, off.corpus, off.prompts) == ("off_policy", "/c.jsonl", None)


def test_served_defaults_are_what_the_server_accepts(schema):
    from prefect.utilities.schema_tools import validate

    from kiln_core.contracts.pipeline import parse_spec

    for spec in ({**BASE, "corpus": "/c.jsonl", "config": CONFIG},
                 {**BASE, "prompts": "/p.jsonl", "config": {"temperature": 0.7, "optimizer": {"kind": "sgd"}}}):
        validate({"spec": parse_spec(spec).form_defaults()}, schema, raise_on_error=True, ignore_required=False)
