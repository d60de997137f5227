"""OpdConfig / OpdRequest: every default, every rejection message, and the resolution rules (Kiln's ``opd.rs``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kiln_core.contracts.opd_config import (
    ConfigError,
    OpdConfig,
    effective_samples_per_prompt,
    parse_opd_config,
    parse_opd_request,
    resolve_learning_rate,
    resolve_top_k,
    unknown_request_keys,
)
from kiln_core.contracts.opd_submit import validate_for_offline_training, validate_request_for_offline_training

OFF = {"training_mode": "off_policy"}


def _rejects(overrides: dict, fragment: str, field: str | None = None) -> ConfigError:
    config = parse_opd_config({**OFF, **overrides})
    with pytest.raises(ConfigError) as caught:
        validate_for_offline_training(config)
    assert fragment in caught.value.message
    if field is not None:
        assert caught.value.field == field
    return caught.value


def test_every_default_matches_kiln():
    c = OpdConfig()
    assert c.training_mode == "on_policy"
    assert c.objective == "reverse_kl"
    assert c.loss == "teacher_top_k"
    assert c.top_k == 32
    assert c.samples_per_prompt == 4
    assert c.temperature == 1.0 and c.top_p == 0.9 and c.max_tokens == 7168
    assert c.sampler_segments is None
    assert c.rollout_prompt_rendering == "legacy_action_boundary"
    assert c.stable_opd.mode == "off"
    assert c.discount == 0.0 and c.clip_epsilon == 0.0
    assert c.learning_rate is None
    assert c.lora_rank == 16 and c.lora_alpha == 32.0 and c.allow_high_lora_scale is False
    assert c.base_adapter is None and c.output_name is None and c.auto_load is True
    assert c.checkpoint_interval == 25
    assert c.resume_checkpoint is None and c.detect_anomaly is False and c.seed is None
    assert c.optimizer.model_dump() == {"kind": "muon", "momentum": 0.95, "nesterov": True, "ns_iters": 5, "weight_decay": 0.0}
    assert c.echo is None and c.epochs == 1 and c.max_cost_usd is None
    assert c.sequences_per_step == 1  # our extension; 1 = Kiln's one sequence per step


def test_optimizer_variants_defaults_and_denied_keys():
    assert parse_opd_config({"optimizer": {"kind": "adam_w"}}).optimizer.model_dump() == {
        "kind": "adam_w", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    assert parse_opd_config({"optimizer": {"kind": "sgd"}}).optimizer.model_dump() == {"kind": "sgd"}
    for bad, field in [
        ({"kind": "muon", "lr": 1.0}, "config.optimizer.muon.lr"),
        ({"kind": "sgd", "momentum": 0.9}, "config.optimizer.sgd.momentum"),
        ({"kind": "muon", "momentum": 1.0}, "config.optimizer.muon.momentum"),
        ({"kind": "muon", "ns_iters": 0}, "config.optimizer.muon.ns_iters"),
        ({"kind": "muon", "ns_iters": 21}, "config.optimizer.muon.ns_iters"),
        ({"kind": "adam_w", "beta2": -0.1}, "config.optimizer.adam_w.beta2"),
        ({"kind": "adam_w", "eps": 0.0}, "config.optimizer.adam_w.eps"),
        ({"kind": "adam_w", "weight_decay": -1.0}, "config.optimizer.adam_w.weight_decay"),
        ({"kind": "lion"}, "config.optimizer"),
    ]:
        with pytest.raises(ConfigError) as caught:
            parse_opd_config({"optimizer": bad})
        assert caught.value.field == field, bad


def test_echo_block_defaults():
    echo = parse_opd_config({"echo": {}}).echo
    assert (echo.lambda_, echo.env_mask_mode, echo.warning_filter) == (0.05, "env_only", True)
    echo = parse_opd_config({"echo": {"lambda": 0.2, "env_mask_mode": "full_obs", "warning_filter": False}}).echo
    assert (echo.lambda_, echo.env_mask_mode, echo.warning_filter) == (0.2, "full_obs", False)
    with pytest.raises(ConfigError):
        parse_opd_config({"echo": {"env_mask_mode": "everything"}})


def test_the_config_model_ignores_unknown_fields_like_kilns_serde():
    config = parse_opd_config({"future_knob": 1, "grad_checkpoint_segments": 4})
    assert "future_knob" not in config.model_dump()


@pytest.mark.parametrize("body, path, suggestion", [
    ({"config": {"learnign_rate": 0.01}}, "config.learnign_rate", "learning_rate"),
    ({"datset_path": "/x.jsonl"}, "datset_path", "dataset_path"),
    ({"config": {"echo": {"lamda": 0.1}}}, "config.echo.lamda", "lambda"),
    ({"config": {"stable_opd": {"mode": "manual", "kl_beta": 1.0, "sft_lamda": 1.0}}}, "config.stable_opd.sft_lamda",
     "sft_lambda"),
    ({"config": {"optimizer": {"kind": "adam_w", "betta1": 0.9}}}, "config.optimizer.betta1", "beta1"),
    ({"priority": "high"}, "priority", None),
])
def test_an_unknown_request_key_is_refused_naming_its_path_and_the_closest_field(body, path, suggestion):
    with pytest.raises(ConfigError) as caught:
        parse_opd_request({"teacher": "t", "dataset_path": "/x.jsonl", **body})
    error = caught.value
    assert (error.code, error.field) == ("invalid_request", path)
    assert error.message.startswith(f"invalid OPD request: `{path}`: unknown key")
    if suggestion is None:
        assert "did you mean" not in error.message
    else:
        assert error.message.endswith(f"did you mean `{suggestion}`?")


def test_kiln_lenient_ignores_unknown_keys_as_kiln_does_except_where_kiln_refuses_them():
    body = {"teacher": "t", "dataset_path": "/x.jsonl", "priority": "high",
            "config": {"learnign_rate": 0.5, "grad_checkpoint_segments": 4, "echo": {"lamda": 0.3}}}
    request = parse_opd_request(body, kiln_lenient=True)
    assert request.config.learning_rate is None and request.config.echo.lambda_ == 0.05  # Kiln's defaults
    assert [key.path for key in unknown_request_keys(body)] == ["priority", "config.learnign_rate", "config.echo.lamda"]
    # Kiln's optimizer denies unknown fields: refused even when lenient
    with pytest.raises(ConfigError) as caught:
        parse_opd_request({"teacher": "t", "config": {"optimizer": {"kind": "muon", "momentm": 0.9}}}, kiln_lenient=True)
    assert (caught.value.code, caught.value.field) == ("invalid_request", "config.optimizer.momentm")
    # Kiln never reads grad_checkpoint_segments from a request (skip_deserializing): never refused
    assert parse_opd_request({"teacher": "t", "config": {"grad_checkpoint_segments": 4}}).config.lora_rank == 16


def test_strict_types_like_serde():
    for bad in [{"top_k": "32"}, {"top_k": 32.0}, {"epochs": True}, {"detect_anomaly": 1}, {"seed": -1}, {"seed": 2**64}]:
        with pytest.raises(ConfigError):
            parse_opd_config(bad)
    assert parse_opd_config({"lora_alpha": 16}).lora_alpha == 16.0  # an integer is a valid JSON number
    assert parse_opd_config({"seed": 2**64 - 1}).seed == 2**64 - 1


def test_checkpoint_interval_null_disables_and_zero_is_refused():
    assert parse_opd_config({}).checkpoint_interval == 25
    assert parse_opd_config({"checkpoint_interval": None}).checkpoint_interval is None
    _rejects({"checkpoint_interval": 0}, "OPD checkpoint_interval must be greater than zero", "config.checkpoint_interval")


@pytest.mark.parametrize(
    "overrides, message, field",
    [
        ({"training_mode": "on_policy"}, 'OPD teacher-logprob JSONL requires config.training_mode="off_policy"; ', "config.training_mode"),
        ({"objective": "cross_entropy"}, "OPD objective: cross_entropy is not wired into the production OPD loss root; use reverse_kl", "config.objective"),
        ({"loss": "sampled_token"}, "OPD loss is unavailable: sampled_token is unsupported: the teacher contract does not return the sampled token's logprob, and using ranked top-1 would produce an identically zero loss", "config.loss"),
        ({"loss": "full_vocab"}, "OPD loss is unavailable: full_vocab has no concrete server-built teacher source; use teacher_top_k", "config.loss"),
        ({"stable_opd": {"mode": "auto"}}, 'OPD stable_opd: Stable-OPD is not wired into the production loss root; use {"mode":"off"}', "config.stable_opd"),
        ({"stable_opd": {"mode": "manual", "kl_beta": 0.1, "sft_lambda": 0.2}}, "Stable-OPD is not wired", "config.stable_opd"),
        ({"discount": 0.5}, "OPD discount=0.5 is unsupported because discounted advantages are not wired; use 0", "config.discount"),
        ({"clip_epsilon": 0.2}, "importance-ratio clipping is not wired; use 0", "config.clip_epsilon"),
        ({"max_cost_usd": 3.0}, "OPD max_cost_usd is unavailable: ", "config.max_cost_usd"),
        ({"top_k": 0}, "OPD top_k must be > 0", "config.top_k"),
        ({"top_k": 8}, "OPD top_k 8 is not executable with source cap 8: ", "config.top_k"),
        ({"samples_per_prompt": 0}, "OPD samples_per_prompt must be > 0", "config.samples_per_prompt"),
        ({"sampler_segments": 0}, "OPD sampler_segments must be greater than zero", "config.sampler_segments"),
        ({"lora_rank": 8, "lora_alpha": 32.0}, "unsafe LoRA scaling: alpha/rank = 4.000 exceeds the default limit of 2.000; ", "config.lora_alpha"),
        ({"lora_alpha": 0.0}, "OPD lora_alpha must be a positive finite number", "config.lora_alpha"),
        ({"learning_rate": -1.0}, "OPD learning_rate must be a positive finite number", "config.learning_rate"),
        ({"base_adapter": "warm", "resume_checkpoint": "a-checkpoint-step-00000001.kiln-checkpoint"},
         "OPD base_adapter cannot be combined with resume_checkpoint", "config.base_adapter"),
        ({"base_adapter": "  "}, "OPD base_adapter must not be blank", "config.base_adapter"),
    ],
)
def test_every_submit_time_rejection(overrides, message, field):
    _rejects(overrides, message, field)


def test_a_warm_start_passes_the_submit_rules():
    """base_adapter alone is a valid request: what it names is resolved when the run is planned."""
    assert validate_for_offline_training(OpdConfig(training_mode="off_policy", base_adapter="warm")) == []


def test_submit_time_rejections_carry_kiln_wording_exactly():
    error = _rejects({"top_k": 15}, "")
    assert error.message.startswith(
        "OPD top_k 15 is not executable with source cap 15: OPD teacher_top_k has no executable support size: "
        "requested 15, source cap 15, KT kernels require one of {16, 32}")
    assert _rejects({"lora_rank": 4, "lora_alpha": 9.0}, "").code == "unsafe_lora_scale"


def test_accepted_configs_and_high_lora_scale_override():
    assert validate_for_offline_training(parse_opd_config(OFF)) == []
    assert validate_for_offline_training(parse_opd_config({**OFF, "lora_rank": 4, "lora_alpha": 64.0, "allow_high_lora_scale": True})) == []
    assert validate_for_offline_training(parse_opd_config({**OFF, "loss": "teacher_top_k_tail", "sampler_segments": 3})) == []
    assert validate_for_offline_training(parse_opd_config({**OFF, "lora_rank": 16, "lora_alpha": 32.0})) == []  # exactly 2.0


def test_top_k_resolution():
    assert [resolve_top_k(k) for k in (16, 20, 31, 32, 33, 100)] == [16, 16, 16, 32, 32, 32]
    for bad in (0, -3, 1, 15):
        with pytest.raises(ConfigError):
            resolve_top_k(bad)


@pytest.mark.parametrize(("requested", "cap", "expected"), [
    (32, 32, 32), (64, 32, 32), (32, 31, 16), (32, 20, 16), (20, 64, 16), (16, 16, 16), (100, 10_000, 32)])
def test_top_k_resolution_under_a_source_cap(requested, cap, expected):
    assert resolve_top_k(requested, source_cap=cap) == expected


@pytest.mark.parametrize(("requested", "cap", "code"), [
    (32, 8, "top_k_unsupported"), (15, 64, "top_k_unsupported"), (0, 64, "invalid_config"),
    (-1, None, "invalid_config"), (True, None, "invalid_config")])
def test_one_top_k_error_names_the_request_and_the_cap(requested, cap, code):
    with pytest.raises(ConfigError) as caught:
        resolve_top_k(requested, source_cap=cap)
    assert (caught.value.code, caught.value.field) == (code, "config.top_k")
    if code == "top_k_unsupported":
        assert f"requested {requested}, source cap {cap if cap is not None else requested}" in caught.value.message


def test_the_supported_top_k_sizes_are_defined_once():
    """Admission, the on-policy teacher binding and the plan call the one resolver (issue: three copies)."""
    root = Path(__file__).resolve().parents[1]
    defining = [path.relative_to(root).as_posix() for package in ("kiln_core", "tasks", "flows")
                for path in (root / package).rglob("*.py")
                if re.search(r"^SUPPORTED_TOP_K\s*=|^def resolve_top_k\(", path.read_text(encoding="utf-8"), re.M)]
    assert defining == ["kiln_core/contracts/opd_config.py"]


def test_learning_rate_resolution_and_far_away_warning():
    assert resolve_learning_rate(parse_opd_config({})) == 2e-3
    assert resolve_learning_rate(parse_opd_config({"optimizer": {"kind": "adam_w"}})) == 1e-5
    assert resolve_learning_rate(parse_opd_config({"optimizer": {"kind": "sgd"}})) == 1e-5
    assert resolve_learning_rate(parse_opd_config({"learning_rate": 0.5})) == 0.5
    warnings = validate_for_offline_training(parse_opd_config({**OFF, "learning_rate": 1.0}))
    assert len(warnings) == 1 and "50x away" in warnings[0]
    assert validate_for_offline_training(parse_opd_config({**OFF, "learning_rate": 3e-3})) == []


def test_samples_per_prompt_rule():
    assert effective_samples_per_prompt(parse_opd_config(OFF)) == 1
    assert effective_samples_per_prompt(parse_opd_config({**OFF, "samples_per_prompt": 4})) == 1  # the default value
    assert effective_samples_per_prompt(parse_opd_config({**OFF, "samples_per_prompt": 2})) == 2
    assert effective_samples_per_prompt(parse_opd_config({**OFF, "samples_per_prompt": 1})) == 1
    on = parse_opd_config({})
    assert [effective_samples_per_prompt(on, n) for n in (10, 100, 500)] == [64, 16, 4]


def test_kilns_effective_config_of_the_resolved_settings():
    from kiln_core.contracts.settings import ResolvedSettings

    config = parse_opd_config({**OFF, "resume_checkpoint": "x-checkpoint-step-00000001.kiln-checkpoint", "top_k": 20,
                               "echo": {"lambda": 0.1}})
    eff = ResolvedSettings.resolve(config, adapter="x").kiln_effective_config(123)
    assert "resume_checkpoint" not in eff
    assert eff["learning_rate"] == 2e-3 and eff["seed"] == 123 and eff["output_name"] == "x"
    assert eff["effective_top_k"] == 16 and eff["top_k"] == 20  # Kiln records requested AND effective top-K
    assert eff["effective_samples_per_prompt"] == 1 and "sequences_per_step" not in eff  # ours: the extension file
    assert eff["echo"] == {"env_mask_mode": "env_only", "lambda": 0.1, "warning_filter": True}
    assert list(eff) == sorted(eff)
    assert json.loads(json.dumps(eff)) == eff
    without_resume = parse_opd_config({**OFF, "top_k": 20, "echo": {"lambda": 0.1}})
    assert eff == ResolvedSettings.resolve(without_resume, adapter="x").kiln_effective_config(123)


def test_request_rules():
    ok = parse_opd_request({"teacher": "t", "dataset_path": " /data.jsonl ", "config": OFF})
    assert ok.dataset_path == "/data.jsonl"
    assert validate_request_for_offline_training(ok) == []
    assert parse_opd_request({"teacher": "t", "dataset_path": "   "}).dataset_path is None
    for body, fragment in [
        ({"teacher": "t", "config": OFF}, "OPD request must use exactly one of non-empty prompts or dataset_path"),
        ({"teacher": "t", "prompts": [], "dataset_path": "  ", "config": OFF}, "exactly one of non-empty prompts or dataset_path"),
        ({"teacher": "t", "prompts": [{"messages": []}], "dataset_path": "/d.jsonl", "config": OFF}, "exactly one of"),
        ({"teacher": "t", "prompts": [{"messages": []}], "config": OFF}, "not supported by kiln-flows"),
        ({"teacher": "  ", "dataset_path": "/d.jsonl", "config": OFF}, "non-blank registered alias"),
    ]:
        with pytest.raises(ConfigError) as caught:
            validate_request_for_offline_training(parse_opd_request(body))
        assert fragment in caught.value.message
    with pytest.raises(ConfigError):
        parse_opd_request({"dataset_path": "/d.jsonl"})  # teacher is required
    warned = validate_request_for_offline_training(
        parse_opd_request({"teacher": "t", "dataset_path": "/d", "config": OFF, "post_eval": {"suite": "x"}}))
    assert warned == []  # post_eval runs after training now (kiln_core.engine.gate): nothing to warn about
