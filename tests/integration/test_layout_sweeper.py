"""posbench's sweeper: ``'method=glob(*)'`` keeps meaning every method that runs on the sweep's
model, now that sequence and grid methods share ``configs/method/``."""

from __future__ import annotations

import pytest
from helpers import QUICK_TRAIN, compose_config, posbench_cli, results_of

from hydra_plugins.posbench_launcher.layout_sweeper import job_layouts


@pytest.mark.parametrize("overrides, expected", [
    (["method=rope"], ("sequence", ("sequence",))),
    (["method=axial_rope"], ("sequence", ("grid",))),
    (["method=axial_rope", "task=life"], ("grid", ("grid",))),
    (["method=nope", "task=life"], ("grid", ("sequence", "grid"))),
    (["method=rope", "task=flipflop"], ("sequence", ("sequence",))),
])
def test_job_layouts_of_composed_jobs(overrides, expected):
    assert job_layouts(compose_config("train", overrides)) == expected


@pytest.mark.slow
def test_a_text_sweep_leaves_out_the_grid_methods(tmp_path):
    """Without the sweeper, the axial_rope job of a text sweep fails (its method is refused on the
    sequence model) and the sweep exits 1."""
    sweep = tmp_path / "sweep"
    proc = posbench_cli("train", "-m", *QUICK_TRAIN, "method=rope,axial_rope", f"hydra.sweep.dir={sweep}")
    runs = [p for p in sweep.iterdir() if (p / "results.json").exists()]
    assert [results_of(p)["method"] for p in runs] == ["rope"]
    assert "leaving out the jobs of 1 method(s) not made for the sequence model" in proc.stderr + proc.stdout
    assert "axial_rope" in (proc.stderr + proc.stdout)


@pytest.mark.slow  # a CLI sweep; test_job_layouts_of_composed_jobs guards the sweeper in the fast lane
def test_a_sweep_of_no_method_made_for_its_model_is_one_line(tmp_path):
    proc = posbench_cli("train", "-m", *QUICK_TRAIN, "method=axial_rope,mixed_rope", f"hydra.sweep.dir={tmp_path / 's'}",
                        check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no job of this sweep has a method made for its model" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
