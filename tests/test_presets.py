"""Named recipes (``config.preset``): opt-in, explicit fields win, Kiln requests untouched."""

from __future__ import annotations

import pytest

from kiln_core.contracts.opd_config import PRESETS, ConfigError, OpdConfig, parse_opd_config
from kiln_core.contracts.settings import ResolvedSettings


def test_a_preset_fills_the_fields_a_config_leaves_unset():
    config = parse_opd_config({"preset": "quality", "epochs": 2})
    for key, value in PRESETS["quality"].items():
        actual = getattr(config, key)
        if hasattr(actual, "model_dump"):  # a nested block: the preset's keys, the block's defaults for the rest
            actual = {k: v for k, v in actual.model_dump().items() if k in value}
        assert actual == value, key
    assert config.epochs == 2 and config.loss != "teacher_top_k"


def test_explicit_fields_win_over_the_preset():
    config = parse_opd_config({"preset": "quality", "loss": "teacher_top_k", "learning_rate": 0.005,
                               "optimizer": {"kind": "sgd"}})
    assert (config.loss, config.learning_rate, config.optimizer.kind) == ("teacher_top_k", 0.005, "sgd")


def test_unknown_preset_is_refused_naming_the_available_ones():
    with pytest.raises(ConfigError) as caught:
        parse_opd_config({"preset": "fastest"})
    assert "unknown preset 'fastest'" in caught.value.message and "quality" in caught.value.message


def test_kiln_requests_keep_kilns_loss_and_effective_config():
    config = OpdConfig(training_mode="off_policy")
    assert config.loss == "teacher_top_k" and config.preset is None
    assert "preset" not in ResolvedSettings.resolve(config, adapter="a").kiln_effective_config(7)  # Kiln's keys only
    preset = ResolvedSettings.resolve(parse_opd_config({"preset": "quality"}), adapter="a")
    assert preset.run_key_config()["preset"] == "quality"  # another run than the same fields without the preset


def test_the_pipeline_spec_takes_a_preset():
    from flows.spec import parse_spec

    spec = parse_spec({"corpus": "c.jsonl", "student": "s", "adapter": "a",
                       "config": {"training_mode": "off_policy", "preset": "quality"}})
    assert spec.config.loss == PRESETS["quality"]["loss"]
