"""Reading a comparison from saved results.json files needs neither torch nor the method modules:
the method order is read from the method modules' source, an option a run records is taken as
recorded, and only a run from before one of its method's options existed imports its method."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import posbench
from posbench.config import load_group_option, method_option_names
from posbench.methods import list_methods, method_class, saved_options
from posbench.report.listing import method_names
from posbench.runs.run_record import RunRecord
from unit.report import test_compare
from unit.report.test_compare import make_run

READ = """
import sys
import posbench.report.compare as c
from posbench.runs.run_record import discover_runs
runs, problems = discover_runs([sys.argv[1]])
assert len(runs) == 4 and not problems, problems
comparison = c.compare_runs(runs)
table = c.summary_markdown(comparison.metrics, comparison.rows, comparison.split, comparison.headline)
table += c.summary_csv(comparison.metrics, comparison.rows, comparison.groups) + c.paired_markdown(comparison.pairs)
assert list(comparison.groups) == ["rope", "t5"], list(comparison.groups)
assert "| t5 | 2 |" in table and "| rope | 2 |" in table, table
print("torch" in sys.modules, "posbench.methods" in sys.modules)
"""


def shipped(method: str) -> dict:
    options = load_group_option("method", method)
    options.pop("name")
    return options


def test_a_table_from_saved_results_imports_neither_torch_nor_the_methods(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(test_compare.OFFSET, "t5", 0.1)
    for method in ("rope", "t5"):
        for seed in (0, 1):
            make_run(tmp_path / "runs" / f"{method}-{seed}", method, seed, options=shipped(method))
    done = subprocess.run([sys.executable, "-c", READ, str(tmp_path / "runs")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_the_listing_order_read_from_the_method_configs_is_the_registry_order() -> None:
    assert list(method_names()) == list_methods(None)  # sequence and grid methods
    assert posbench.list_methods() == list_methods() == [m for m in method_names() if m in list_methods()]
    assert method_names()[:3] == ("nope", "learned", "sinusoidal")  # METHOD_LISTING_ORDER first
    assert method_names().index("swan") > method_names().index("stickbreaking")  # then by name (layers.py holds swan)


def test_the_report_reads_the_method_order_without_parsing_sources() -> None:
    import posbench.report.listing as listing

    assert "ast" not in vars(listing) and "read_text" not in Path(listing.__file__).read_text()


@pytest.mark.parametrize("method", list_methods())
def test_every_option_of_options_before_is_a_shipped_option(method: str) -> None:
    """What makes a run that records every shipped option safe to read without its method."""
    assert set(method_class(method).options_before) <= method_option_names(method)


def run_of(method: str, options: dict) -> RunRecord:
    return RunRecord(Path("run"), {"method": method, "method_options": options})


def test_an_unrecorded_option_takes_its_value_from_before_it_existed() -> None:
    old = {k: v for k, v in shipped("t5").items() if k not in ("bias_scale", "fast")}
    assert run_of("t5", old).method_options == saved_options("t5", old) == {**old, "bias_scale": 1.0, "fast": False}
    new = {**shipped("t5"), "fast": True}
    assert run_of("t5", new).method_options == new  # recorded: taken as recorded
    assert run_of("unknown_method", {"a": 1}).method_options == {"a": 1}
