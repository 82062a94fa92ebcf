"""Extensions, lengths added to some seeds only: every number and curve is paired by seed and
names its seeds (``posbench eval run=<seed 0> eval.extension=[ntk] eval.lengths=[512,1024]``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from posbench.evaluation.curves import curve_summary
from posbench.runs.results import write_results
from posbench.runs.run_record import discover_runs
from unit.report.test_compare import C, entry, make_run, per_sequence


def long_entry(method: str, seed: int, length: int = 1024, **extra: object) -> dict:
    """A full-context entry at ``length`` (the 512 positions of ``per_sequence`` repeated),
    marked added as ``posbench eval`` marks a new length."""
    full = np.tile(per_sequence(method, seed), (1, length // 512))
    return {"split": "validation", "length": length, "num_sequences": full.shape[0], "sequences_sha256": "long",
            **curve_summary(full, C), "added": True, **extra}


@pytest.fixture()
def extended(tmp_path: Path) -> Path:
    """rope and alibi with seeds 0 and 1; rope seed 0 alone also has ntk at 512 and 1024 (the plain
    model's numbers: an extension that changes nothing) and a plain entry at 1024."""
    for method in ("rope", "alibi"):
        for seed in (0, 1):
            make_run(tmp_path / "sw" / f"{method}-s{seed}", method, seed)
    run = tmp_path / "sw" / "rope-s0"
    results = json.loads((run / "results.json").read_text())
    ntk = {**entry("rope", 0), "extension": "ntk", "extension_factor": 2.0}
    results["eval"] += [ntk, long_entry("rope", 0), long_entry("rope", 0, extension="ntk", extension_factor=4.0)]
    write_results(run, results)
    return tmp_path / "sw"


def test_an_extension_on_one_seed_is_paired_with_that_seed(extended: Path) -> None:
    """ntk on seed 0 equals seed 0's plain model: its change is 0, not seed 0 against the mean of
    seeds 0 and 1 (which read as +/-0.02 and coloured the cell "worse")."""
    from posbench.report.extension import _heatmap, _markdown, extension_matrix

    runs = discover_runs([extended])[0]
    seed0 = entry("rope", 0)["bands"]["256-512"]
    mean = np.mean([entry("rope", s)["bands"]["256-512"] for s in (0, 1)])
    assert abs(seed0 - mean) > 0.002  # the unpaired change the table showed (-0.004)
    bands, rows = extension_matrix(runs, "validation")
    text = _markdown(bands, rows, "validation")
    row = next(line for line in text.splitlines() if line.startswith("| rope | ntk |"))
    assert f"{seed0:.4f} (+0.000, seed 0)" in row
    plain = next(line for line in text.splitlines() if line.startswith("| rope | none |"))
    assert f"{np.tile(per_sequence('rope', 0), (1, 2)).mean(0)[512:].mean():.4f} [seed 0]" in plain  # 512-1024
    grid = _heatmap(bands, rows, "validation").axes[0].images[0].get_array()  # rope: none, ntk x bands
    assert np.ma.getdata(grid)[1, bands.index("256-512")] == 0.0
    ntk = next(r for r in rows if r["method"] == "rope" and r["extension"] == "ntk")
    assert ntk["change"]["256-512"] == {"mean": 0.0, "std": None, "n": 1, "seeds": ["0"]}


@pytest.mark.slow
def test_the_extension_files_name_the_seeds(extended: Path, tmp_path: Path) -> None:
    from posbench.report.plot import plot_runs

    out = tmp_path / "out"
    plot_runs([extended], out, log=lambda _: None)
    with open(out / "extensions.csv") as f:
        ntk = next(r for r in csv.DictReader(f) if r["extension"] == "ntk")
    assert (ntk["change_256-512_mean"], ntk["change_256-512_seeds"], ntk["loss_256-512_seeds"]) == ("0.0", "0", "0")


def test_extension_curves_name_the_seeds_they_are_over(extended: Path) -> None:
    """extension_curves said "2 seed(s)" and drew seed 0 only."""
    from posbench.report.extension import _curves
    from posbench.report.groups import group_runs

    runs = group_runs(discover_runs([extended])[0])["rope"].runs
    fig = _curves(runs, "rope", "validation")
    ax, diff_ax = fig.axes[:2]
    assert "seed 0 of 2" in ax.get_title() and "2 seed(s)" not in ax.get_title()
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert labels == ["none (seed 0)", "ntk (seed 0)"]
    diff = next(line for line in diff_ax.get_lines() if line.get_label() == "ntk (seed 0)")
    assert np.allclose(diff.get_ydata(), 0.0)
    # at 512 both seeds have the plain model: its curve is over both, ntk's over seed 0
    for run in runs:
        results = json.loads((run.path / "results.json").read_text())
        write_results(run.path, {**results, "eval": [e for e in results["eval"] if e["length"] == 512]})
    ax = _curves(group_runs(discover_runs([extended])[0])["rope"].runs, "rope", "validation").axes[0]
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert labels == ["none (seeds 0, 1)", "ntk (seed 0)"] and "seeds 0, 1)" in ax.get_title()


@pytest.mark.slow
def test_a_length_some_seeds_lack_is_drawn_with_its_seeds_named(extended: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """loss_by_position_1024 drew seed 0 of the 2-seed rope group as "rope", and alibi, never
    evaluated at 1024, went missing without a note."""
    import posbench.report.curves as curves
    import posbench.report.plot as plot

    drawn = {}
    original = curves.save

    def keep(fig, out, stem, formats):
        drawn[stem] = fig
        return original(fig, out, stem, formats)

    monkeypatch.setattr(curves, "save", keep)
    plot.plot_runs([extended], tmp_path / "out", log=lambda _: None)
    ax = drawn["loss_by_position_1024"].axes[0]
    labels = [text.get_text() for text in (ax.get_legend() or drawn["loss_by_position_1024"].legends[0]).get_texts()]
    assert "rope (seed 0 of 2)" in labels and "rope" not in labels
    assert "no curve at length 1024: alibi (2 seeds)" in ax.get_title()
    full = [t.get_text() for t in (drawn["loss_by_position"].axes[0].get_legend()
                                   or drawn["loss_by_position"].legends[0]).get_texts()]
    assert "rope (2 seeds)" in full and "no curve" not in drawn["loss_by_position"].axes[0].get_title()
