"""Typed settings: built once from a config section (nested sections too) and never changed after
validation (a later stage copies them with ``dataclasses.replace``)."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
from helpers import compose_config

from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.evaluation.probes import probe_settings
from posbench.evaluation.probes.copy import CopySettings
from posbench.evaluation.probes.passkey import PasskeySettings
from posbench.evaluation.settings import PROBE_SETTINGS, EvalConfig, ReRoPEConfig, SelfExtendConfig, eval_settings
from posbench.runs.spec import build_spec
from posbench.train.settings import TrainerConfig


def test_a_validated_spec_cannot_be_changed():
    spec = build_spec(compose_config("train", ["model=tiny", "eval.extension=all", "trainer.max_steps=4"]))
    assert "all" not in spec.eval.extension and "none" in spec.eval.extension  # resolved once, by build_spec
    for obj, name, value in [(spec, "seed", 1), (spec.trainer, "lr", 1.0), (spec.eval, "extension", []),
                             (probe_settings(spec.eval, "copy"), "span", 3), (spec.eval.rerope, "window", 8),
                             (spec.model, "vocab_size", 1)]:
        with pytest.raises(FrozenInstanceError):
            setattr(obj, name, value)
    changed = replace(spec, model=replace(spec.model, vocab_size=64))  # how a later stage gets another value
    assert changed.model.vocab_size == 64 and spec.model.vocab_size != 64


def test_nested_sections_become_their_dataclasses():
    e = eval_settings({"copy": {"span": 8, "distances": [8, 16]}, "rerope": {"window": 16}})
    assert e.section("copy") == CopySettings(span=8, distances=[8, 16]) and e.rerope == ReRoPEConfig(window=16)
    assert probe_settings(e, "passkey") == PasskeySettings() and e.self_extend == SelfExtendConfig()
    assert eval_settings({}) == from_section(EvalConfig, "eval", {}) == EvalConfig()


@pytest.mark.parametrize("section, message", [
    ({"copy": 3}, "eval.copy must be a mapping of settings, got 3"),
    ({"passkey": {"depth": [0.5]}}, "unknown option(s) eval.passkey.depth"),
    ({"self_extend": {"group": "x"}}, "eval.self_extend.group must be an integer, got 'x'"),
    ({"copy": {"span": 1}}, "eval.copy.span must be at least 2"),
])
def test_a_bad_nested_value_is_one_line_naming_it(section, message):
    with pytest.raises(PosbenchError) as err:
        eval_settings(section)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_trainer_defaults_are_the_dataclass_defaults():
    spec = build_spec(compose_config("train", ["model=tiny"]))
    assert spec.trainer == from_section(TrainerConfig, "trainer", {})
    assert replace(spec.eval, probe_settings={}) == from_section(EvalConfig, "eval", {})
    assert {name: probe_settings(spec.eval, name) for name in spec.eval.probe_settings} == {
        name: settings() for name, settings in PROBE_SETTINGS.items()}  # each probe's section: its defaults
