"""docs/methods-overview.md's tables are what the method classes give (scripts/methods_overview.py):
where a method enters, its reference and what happens past C are written once, in its class."""

from __future__ import annotations

import pytest
from helpers import assert_page_is_generated, load_script

from posbench.core.errors import PosbenchError
from posbench.methods import PositionMethod, list_methods, register, unregister

ref = load_script("methods_overview")


@pytest.mark.slow
def test_the_committed_page_is_the_generated_one_and_a_hand_edit_is_caught():
    assert_page_is_generated("methods_overview", ("| `alibi` | score | Press et al. 2022 |",
                                                  "| `alibi` | score | Press et al. 2021 |"))


def test_every_method_has_one_row_in_its_layout_s_table():
    page = ref.PAGE.read_text()
    for layout in ref.LAYOUTS:
        begin, end = ref.marks(layout)
        region = page.split(begin)[1].split(end)[0]
        names = [line.split("`")[1] for line in region.splitlines()[3:]]
        assert names == ref.methods(layout)
    grid_only = [n for n in list_methods("grid") if n != "nope"]
    assert sorted(ref.methods("grid")) == sorted(grid_only) and "nope" in ref.methods("sequence")


def test_the_backend_column_is_the_model_s_own_choice():
    """Computed, not written: alibi's score term takes flex on CUDA; swan's windowed layers run in
    flex there beside its sdpa layers; relative's value term keeps it in eager."""
    assert ref.backends("alibi") == "sdpa / flex"
    assert ref.backends("swan").startswith("sdpa / sdpa+flex (")
    assert ref.backends("relative").startswith("eager / eager (")


def test_a_method_without_its_description_is_refused():

    @register
    class Undescribed(PositionMethod):
        name = "undescribed_for_test"
        enters = "input"

    try:
        with pytest.raises(PosbenchError, match="method undescribed_for_test .* sets no source, past_context"):
            ref.row("undescribed_for_test")
    finally:
        unregister("undescribed_for_test")


def test_every_recipe_has_a_row_naming_its_reference_layers_and_departures():
    page = ref.PAGE.read_text()
    begin, end = ref.marks("recipes")
    rows = page.split(begin)[1].split(end)[0].strip().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == ref.recipes()
    assert "gemma3" in ref.recipes() and "rope" not in ref.recipes()
    gemma3 = rows[ref.recipes().index("gemma3")]
    assert "`Gemma3Attention`" in gemma3 and "0-4 mod 6: local (window 32; RoPE 10000" in gemma3
    assert "5 mod 6: global (full; RoPE 1000000" in gemma3 and "1024 -> 32" in gemma3
