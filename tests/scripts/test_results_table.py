"""scripts/results_table.py: the README's table from a comparison's bands.csv and copy.csv."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "results_table.py"
spec = importlib.util.spec_from_file_location("results_table", SCRIPT)
results_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_table)


def write(tmp_path: Path) -> Path:
    names = ["0-256", "256-512", "512-1024", "cost_256-512", "cost_512-1024", "ppl_ratio_0-256",
             "effective_length_512", "effective_length_1024", "effective_length_windowed_1024"]
    bands = ["label,seeds," + ",".join(f"{b}_mean,{b}_low,{b}_high" for b in names)]
    bands.append("rope,3," + ",".join(["3.4,3.3,3.5", "3.5,3.4,3.6", "3.7,3.6,3.8", "0.1,0.08,0.12", "0.3,0.2,0.4", "1,1,1", "300,290,310", "343,337,349", "1024,1024,1024"]))
    bands.append("alibi,1," + ",".join(["3.3,3.2,3.4", "3.2,3.1,3.3", "3.25,3.2,3.3", "0.001,0.0,0.002", "0.001,,", "1,1,1", "512,,", "790,754,826", "1024,,"]))
    (tmp_path / "bands.csv").write_text("\n".join(bands) + "\n")
    copy = [("group,kind,region,distance,retrieval_gain,retrieval_gain_low,retrieval_gain_high,retrieval_gain_interval,"
             "retrieval_gain_runs,sensitivity,sensitivity_low,sensitivity_high,sensitivity_interval,sensitivity_runs,"
             "windows,reach"),
            "rope,random,inside,32,0.5,0.4,0.6,t,3,7,7,7,t,3,64,0", "rope,random,inside,64,0.4,0.3,0.5,t,3,7,7,7,t,3,64,0",
            "rope,random,past,320,0.1,0.0,0.2,t,3,7,7,7,t,3,64,0", "rope,text,past,320,9,9,9,t,3,7,7,7,t,3,64,0",
            "alibi,random,inside,32,0.2,0.1,0.3,bootstrap,1,7,7,7,bootstrap,1,64,0"]
    (tmp_path / "copy.csv").write_text("\n".join(copy) + "\n")
    return tmp_path


def test_rows_sorted_by_the_extrapolation_band_with_half_widths_and_gaps(tmp_path, capsys):
    assert results_table.main([str(write(tmp_path)), "--distances", "320"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| method | seeds | 0-256 | 256-512 | 512-1024 | cost 256-512 | cost 512-1024 | "
                               "effective length 1024 | retrieval")
    assert lines[0].endswith("| retrieval gain, inside d=32 | retrieval gain, past d=320 |")  # the smallest inside distance
    alibi, rope = lines[2], lines[3]  # alibi's 256-512 (3.2) sorts before rope's (3.5)
    assert alibi.startswith("| alibi | 1 | 3.300 ± 0.100 | 3.200 ± 0.100 |")
    assert "| +0.001 ± 0.001 | +0.001 | 790 ± 36 |" in alibi  # a cost without bounds: no half-width
    assert alibi.endswith("| +0.200 ± 0.100 | - |")  # no past-C cell for alibi
    assert rope.endswith("| +0.100 ± 0.020 | +0.300 ± 0.100 | 343 ± 6 | +0.500 ± 0.100 | +0.100 ± 0.100 |")  # random spans only


def test_a_folder_without_the_csvs_is_one_line_and_exit_2(tmp_path, capsys):
    assert results_table.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "posbench plot" in err and "eval.probes=[copy]" in err


def test_labels_rename_groups_and_a_wrong_one_is_one_line(tmp_path, capsys):
    folder = str(write(tmp_path))
    assert results_table.main([folder, "--label", "rope=rope (C = 256)", "--label", "alibi=ALiBi"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| ALiBi", "| rope (C = 256)"]
    for wrong in (["--label", "rope"], ["--label", "rope="], ["--label", "t5=T5"]):
        assert results_table.main([folder, *wrong]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"--label {wrong[1]!r} is not GROUP=SHOWN" in err and "rope, alibi" in err


def test_a_copy_csv_without_the_matched_control_shows_no_retrieval_gain(tmp_path, capsys):
    """An older copy.csv (its ``gain`` column: the sensitivity) is never shown as a retrieval gain."""
    folder = write(tmp_path)
    (folder / "copy.csv").write_text("group,kind,region,distance,gain,low,high,interval,runs,windows,reach\n"
                                     "rope,random,inside,32,0.5,0.4,0.6,t,3,64,0\n")
    assert results_table.main([str(folder), "--distances", "320"]) == 0
    rope = capsys.readouterr().out.splitlines()[3]
    assert rope.endswith("| - | - |") and "0.500" not in rope


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["header only", "empty files", "not a number"])
def test_empty_or_corrupt_csvs_are_one_line_and_exit_2(tmp_path, case):
    """bands.csv without rows (a plot of no finished run) printed a header-only table with exit
    0; a cell that is not a number was a traceback. Now one line naming the fix, exit 2."""
    write(tmp_path)
    bands = tmp_path / "bands.csv"
    if case == "header only":
        bands.write_text(bands.read_text().splitlines()[0] + "\n")
        (tmp_path / "copy.csv").write_text((tmp_path / "copy.csv").read_text().splitlines()[0] + "\n")
    elif case == "empty files":
        bands.write_text("")
        (tmp_path / "copy.csv").write_text("")
    else:
        bands.write_text(bands.read_text().replace("3.4,3.3,3.5", "abc,3.3,3.5"))
    proc = run_script(str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("results_table: error: ") and proc.stderr.count("\n") == 1
    assert "posbench plot" in proc.stderr
