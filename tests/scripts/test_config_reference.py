"""docs/configuration.md's tables of the settings groups (trainer, eval) are what their dataclasses
give (scripts/config_reference.py): each key's default and meaning are written once, in the code."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from helpers import assert_page_is_generated, compose_config, load_script
from omegaconf import OmegaConf

from posbench.config import composed_groups, settings_groups
from posbench.core.errors import PosbenchError

ref = load_script("config_reference")


def leaves(section: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in section.items():
        out += leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return out


def test_the_committed_page_is_the_generated_one_and_a_hand_edit_is_caught():
    assert_page_is_generated("config_reference", ("| `lr` | 0.001 |", "| `lr` | 0.002 |"))


@pytest.mark.parametrize("group", [g for g in settings_groups() if g in composed_groups("train")])
def test_every_composed_key_has_one_row_with_its_composed_default(group):
    rows = {key: ref.value_text(default) for key, default, _ in ref.rows(settings_groups()[group])}
    section = OmegaConf.to_container(compose_config("train", [])[group])
    assert list(rows) == leaves(section)
    for key, default in rows.items():
        value = OmegaConf.select(OmegaConf.create(section), key)
        assert default == ref.value_text(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value), key


def test_a_field_without_a_docstring_is_refused():

    @dataclass
    class Undocumented:
        documented: int = 1
        """Has a docstring."""
        bare: int = 2

    with pytest.raises(PosbenchError, match="Undocumented.bare has no docstring"):
        list(ref.rows(Undocumented))


def test_a_docstring_renders_as_one_cell():
    text = ref.meaning_text("auto | fp32: ``x``; None = off;\n    see docs/benchmarks.md#faster-paths")
    assert text == "auto \\| fp32: `x`; null = off; see [benchmarks.md](benchmarks.md#faster-paths)"
