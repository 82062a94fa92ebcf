"""scripts/formation_map.py: the grid's jobs, a map that goes on where it stopped, and its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "formation_map.py"
spec = importlib.util.spec_from_file_location("formation_map", SCRIPT)
formation_map = importlib.util.module_from_spec(spec)
spec.loader.exec_module(formation_map)

GRID = {"common": ["--model", "tiny", "--vocab", "64", "--context", "16", "--batch-size", "2", "--steps", "2",
                   "--every", "1", "--threads", "1"],
        "methods": ["rope", "alibi"], "seeds": [0, 1],
        "settings": [{"name": "half", "args": ["--span-frac", "0.5"]},
                     {"name": "fixed", "args": ["--span", "2", "--distance", "5"], "methods": ["nope"], "seeds": [3]}]}


def test_jobs_cover_each_setting_method_and_seed_with_the_settings_args_last():
    jobs = formation_map.jobs(GRID)
    assert [(n, m, s) for n, m, s, _ in jobs] == [
        ("half", "rope", 0), ("half", "alibi", 0), ("half", "rope", 1), ("half", "alibi", 1), ("fixed", "nope", 3)]
    argv = jobs[-1][3]
    assert argv[-4:] == ["--method", "nope", "--seed", "3"] and argv.index("--distance") > argv.index("--context")


def test_a_map_goes_on_where_it_stopped_and_reports(tmp_path):
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps(GRID))
    out = tmp_path / "map"
    assert formation_map.main(["run", "--grid", str(grid_file), "--out", str(out), "--shard", "1/2"]) == 0
    runs = formation_map.read_runs(out / "runs.jsonl")
    assert sorted(runs) == [("half", "alibi", 0), ("half", "alibi", 1)]
    with (out / "runs.jsonl").open("a") as f:
        f.write('{"setting": "half", "method"')  # a process killed mid-line
    assert formation_map.main(["run", "--grid", str(grid_file), "--out", str(out)]) == 0
    lines = (out / "runs.jsonl").read_text().splitlines()
    runs = formation_map.read_runs(out / "runs.jsonl")
    assert len(runs) == 5 and len(lines) == 6  # the two done runs were not trained again, the torn line kept apart
    record = runs[("fixed", "nope", 3)]
    assert record["span"] == 2 and record["history"][-1]["step"] == 2 and record["formed"] is None
    assert formation_map.main(["report", "--grid", str(grid_file), "--out", str(out)]) == 0
    table = (out / "map.md").read_text()
    assert "| half | rope | 0, 1 | -, - | -, - | 2 |" in table and "| fixed | nope | 3 |" in table
    assert (out / "formation.png").stat().st_size > 0


def test_the_cell_gives_each_seed_and_a_median_only_when_all_formed():
    assert formation_map.cell([{"formed": 500}, {"formed": 700}, {"formed": 600}]) == "500, 700, 600 (median 600)"
    assert formation_map.cell([{"formed": 500}, {"formed": None}]) == "500, -"


@pytest.mark.parametrize("args, fix", [
    (["run", "--grid", "missing.json", "--out", "x"], "cannot read a JSON grid"),
    (["run", "--grid", "GRID", "--out", "x", "--shard", "2/2"], "--shard takes i/n"),
    (["report", "--grid", "GRID", "--out", "nothing_here"], "holds no runs.jsonl: run the map first"),
])
def test_bad_input_is_one_line(args, fix, tmp_path, capsys):
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps(GRID))
    args = [str(grid_file) if a == "GRID" else str(tmp_path / a) if a == "missing.json" else a for a in args]
    assert formation_map.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fix in err


def test_a_bad_setting_anywhere_in_the_grid_is_refused_before_any_run(tmp_path, capsys):
    grid = {**GRID, "settings": [*GRID["settings"], {"name": "bad", "args": ["--span-frac", "0.9"]}]}
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps(grid))
    assert formation_map.main(["run", "--grid", str(grid_file), "--out", str(tmp_path / "m")]) == 2
    assert "--span-frac must be in (0, 0.5]" in capsys.readouterr().err
    assert not (tmp_path / "m" / "runs.jsonl").exists()


def test_the_committed_grid_is_valid():
    grid = formation_map.load_grid(SCRIPT.parents[1] / "docs" / "retrieval" / "formation" / "grid.json")
    for *_, argv in formation_map.jobs(grid):
        formation_map.induction_budget.parse(argv)


def test_the_committed_map_is_the_report_of_the_committed_runs():
    out = SCRIPT.parents[1] / "docs" / "retrieval" / "formation"
    grid = formation_map.load_grid(out / "grid.json")
    assert (out / "map.md").read_text() == formation_map.map_markdown(grid, formation_map.read_runs(out / "runs.jsonl"))
