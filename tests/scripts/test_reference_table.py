"""scripts/reference_table.py reports every reference check the tests make (the grid methods' too)
into its section of docs/reference_checks.md, and leaves the page's prose alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import load_script

from posbench.methods import list_methods

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "reference_table.py"
PAGE = ROOT / "docs" / "reference_checks.md"
ref = load_script("reference_table")


def record(test: str, method: str, diff: float = 1e-7) -> dict:
    return {"method": method, "reference": "formula", "dtype": "float64", "max_abs_diff": diff, "elements": 10,
            "atol": 1e-5, "rtol": 1e-5, "test": test}


def test_every_test_file_that_checks_a_reference_is_run():
    """A test file that logs reference checks (directly, or through the grid's backend check) but
    is in no section would be left out of the page."""
    logging = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                     if re.search(r"assert_matches_reference\(|assert_backends_agree\(", p.read_text()))
    listed = {entry.split("::")[0] for entries in ref.SECTIONS.values() for entry in entries}
    assert logging and [f for f in logging if f not in listed] == []
    assert all((ROOT / f).is_file() for f in listed)


def test_the_page_has_a_region_per_section_and_reports_every_grid_method():
    page = PAGE.read_text()
    ref.render(page, dict.fromkeys(ref.SECTIONS, ""))  # raises when a region is missing
    grid = page.split("<!-- reference-table: grid -->")[1].split("<!-- reference-table: grid end -->")[0]
    rows = [line for line in grid.splitlines() if line.startswith("| ") and not line.startswith("| method |")]
    reported = {row.split(" | ")[0].lstrip("| ").split(" (")[0] for row in rows}
    assert reported == set(list_methods("grid")) - {"nope"}


def test_records_go_to_their_test_file_s_section_and_only_regions_change():
    records = [record("tests/unit/methods/test_grid_t5_2d.py::test_x", "t5_2d", 3e-7),
               record("tests/unit/methods/test_grid_t5_2d.py::test_y", "t5_2d", 1e-7),
               record("tests/unit/methods/test_methods.py::test_z", "rope"),
               record("tests/unit/methods/test_fidelity.py::test_t5_default_bias_scale_is_sqrt_head_dim_as_x_transformers",
                      "t5")]
    tables = ref.tables(records)
    assert "| t5_2d | formula | 2 | 20 | float64 | 3.00e-07 | atol 1e-05, rtol 1e-05 |" in tables["grid"]
    assert "| t5 |" in tables["methods"] and "rope" in tables["methods"] and "rope" not in tables["grid"] and "t5_2d" not in tables["schedules"]
    page = "prose\n" + "".join(f"<!-- reference-table: {s} -->\nold\n<!-- reference-table: {s} end -->\nmore prose {s}\n"
                               for s in ref.SECTIONS)
    out = ref.render(page, tables)
    assert "old" not in out and out.count("prose") == 1 + len(ref.SECTIONS) and tables["grid"] in out


def test_a_page_without_the_regions_is_one_line_before_any_test_runs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# a page without regions\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(page)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("reference_table.py: error: the reference page needs one '<!-- reference-table: ")
    assert len(proc.stderr.splitlines()) == 1 and page.read_text() == "# a page without regions\n"
