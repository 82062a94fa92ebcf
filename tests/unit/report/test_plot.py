"""Run discovery, comparison figures/tables and the Hydra sweep callback, on fake run dirs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from posbench.commands.sweep import ComparePlotsCallback, failed_jobs_of_last_sweep
from posbench.core.errors import PosbenchError
from posbench.evaluation.curves import band_means
from posbench.report.plot import plot_runs, plot_single_run
from posbench.runs.results import build_results, read_results, validate_results, write_results
from posbench.runs.run_record import discover_runs, read_metrics
from posbench.runs.status import read_status, write_status

PNG = b"\x89PNG\r\n\x1a\n"
METHODS = {"rope": 0.0, "alibi": -0.1, "nope": 0.3}  # loss offsets; nope also blows up past 256


def curve(method: str, seed: int, length: int) -> list[float]:
    pos = np.arange(length)
    loss = 2.0 + 3.0 * np.exp(-pos / 30) + METHODS.get(method, 0.0) + 0.01 * seed * np.sin(pos)
    if method == "nope":
        loss = loss + np.where(pos >= 256, 6.0, 0.0)
    return loss.tolist()


def make_run(run_dir: Path, method: str, seed: int) -> dict:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"method:\n  name: {method}\nseed: {seed}\n")
    evals = [
        {"split": "validation", "length": L, "num_sequences": 4, "loss_by_position": curve(method, seed, L),
         "bands": band_means(curve(method, seed, L), 256)}
        for L in (512, 1024)
    ]
    results = build_results(
        method=method, seed=seed, train_context=256,
        train={"tokens": 6400, "steps": 20, "final_loss": 2.5, "tokens_per_second": 1e4,
               "wall_seconds": 1.0, "device": "cpu"},
        eval=evals, run_name=run_dir.name,
    )
    write_results(run_dir, results)
    lines = [json.dumps({"step": s, "tokens": 320 * s, "loss": 8.0 / (1 + s) + 2 + seed * 0.01, "lr": 1e-3,
                         "tokens_per_second": 1e4, "elapsed_seconds": s * 0.1}) for s in range(1, 21)]
    lines.append(json.dumps({"step": 20, "tokens": 6400, "val_loss": 2.6}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 21, "tok')  # truncated last line
    write_status(run_dir, "completed", method=method, seed=seed)
    return results


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    job = 0
    for method in METHODS:
        for seed in (0, 1):
            make_run(root / str(job), method, seed)
            job += 1
    failed = root / str(job)
    failed.mkdir()
    write_status(failed, "failed", error="RuntimeError: CUDA out of memory", method="t5", seed=0)
    corrupt = root / str(job + 1)
    make_run(corrupt, "relative", 0)
    (corrupt / "results.json").write_text('{"schema_version": 1, "method": ')
    hydra_only = root / str(job + 2) / ".hydra"  # a job that died before the trainer started
    hydra_only.mkdir(parents=True)
    (hydra_only / "config.yaml").write_text("seed: 0\n")
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def expected_stats(band: str, length: int, method: str) -> tuple[float, float]:
    a, b = map(int, band.split("-"))
    values = [float(np.mean(curve(method, seed, length)[a:b])) for seed in (0, 1)]
    return float(np.mean(values)), float(np.std(values, ddof=1))


def test_results_roundtrip_and_validation(tmp_path: Path) -> None:
    results = make_run(tmp_path / "run", "rope", 3)
    assert read_results(tmp_path / "run") == json.loads(json.dumps(results))
    assert read_status(tmp_path / "run")["status"] == "completed"
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 21 and "val_loss" in metrics[-1]  # truncated line skipped
    broken = dict(results)
    del broken["train_context"]
    with pytest.raises(ValueError, match="train_context"):
        validate_results(broken)
    broken = json.loads(json.dumps(results))
    del broken["eval"][0]["bands"]
    with pytest.raises(ValueError, match="bands"):
        validate_results(broken)
    with pytest.raises(ValueError):
        write_status(tmp_path / "run", "exploded")


def test_discover_runs(sweep: Path, tmp_path: Path) -> None:
    ok, problems = discover_runs([sweep])
    assert sorted((r.method, r.seed) for r in ok) == sorted((m, s) for m in METHODS for s in (0, 1))
    reasons = {Path(p).name: r for p, r in problems}
    assert reasons["6"] == "failed: RuntimeError: CUDA out of memory"
    assert reasons["7"].startswith("corrupt results.json")
    assert reasons["8"].startswith("no results.json")
    # globs, a results.json path, a missing path; duplicates are counted once
    ok2, problems2 = discover_runs([str(sweep / "[01]"), str(sweep / "2" / "results.json"), str(sweep / "0"),
                                    str(tmp_path / "nowhere")])
    assert [r.path.name for r in ok2] == ["0", "1", "2"]
    assert problems2 == [(str(tmp_path / "nowhere"), "no such file or directory")]
    running = tmp_path / "running"
    running.mkdir()
    write_status(running, "running", method="rope", seed=0)
    assert discover_runs([running]) == ([], [(str(running), "no results.json (still running?)")])
    write_status(running, "interrupted", error="stopped at step 7", method="rope", seed=0)
    assert discover_runs([running])[1][0][1].startswith("interrupted: stopped at step 7")


@pytest.mark.slow
def test_plot_runs_writes_figures_and_tables(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    lines: list[str] = []
    summary = plot_runs([sweep], out, log=lines.append)
    for name in ("train_loss", "loss_by_position", "loss_by_position_1024", "band_256_512"):
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 1000, name
    assert summary["methods"] == {"nope": 2, "rope": 2, "alibi": 2}  # registry order
    assert summary["headline_band"] == "256-512"
    assert len(summary["runs"]) == 6

    with open(out / "bands.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["alibi", "rope", "nope"]  # sorted by 256-512
    for row in rows:
        assert row["seeds"] == "2"
        for band, length in (("0-256", 512), ("256-512", 512), ("512-1024", 1024)):
            mean, std = expected_stats(band, length, row["method"])
            assert float(row[f"{band}_mean"]) == pytest.approx(mean, abs=1e-9)
            assert float(row[f"{band}_std"]) == pytest.approx(std, abs=1e-9)

    problems = {Path(p).name: r for p, r in summary["problems"]}
    assert problems["6"].startswith("failed: RuntimeError") and problems["7"].startswith("corrupt")
    md = (out / "bands.md").read_text()
    assert "| alibi | 2 |" in md and "CUDA out of memory" in md and "corrupt results.json" in md
    assert str(sweep / "6") in md and str(sweep / "7") in md
    assert sum("skipping" in line for line in lines) == 3


@pytest.mark.slow
def test_svg_and_pdf(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "vec"
    plot_runs([str(sweep / "0"), str(sweep / "2")], out, formats=("svg", "pdf"), log=lambda _: None)
    assert b"<svg" in (out / "train_loss.svg").read_bytes()[:2000]
    assert (out / "band_256_512.pdf").read_bytes().startswith(b"%PDF")
    assert not list(out.glob("*.png")) and not list(out.glob(".tmp-*"))
    with pytest.raises(PosbenchError, match="format"):
        plot_runs([sweep], out, formats=("bmp",))


def test_no_valid_runs_is_an_error(sweep: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PosbenchError, match="empty"):
        plot_runs([empty], tmp_path / "o", log=lambda _: None)
    with pytest.raises(PosbenchError, match="results.json"):
        plot_runs([sweep / "6", sweep / "7"], tmp_path / "o", log=lambda _: None)


@pytest.mark.slow
def test_plot_single_run(sweep: Path, tmp_path: Path) -> None:
    written = plot_single_run(sweep / "0")
    names = sorted(p.name for p in written)
    assert names == ["loss_by_position.png", "loss_by_position_1024.png", "train_loss.png"]
    assert all(p.parent == sweep / "0" / "figures" and p.read_bytes().startswith(PNG) for p in written)
    running = tmp_path / "running"
    running.mkdir()
    (running / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens": 10, "loss": 5.0}) + "\n")
    assert [p.name for p in plot_single_run(running)] == ["train_loss.png"]


@pytest.mark.slow
def test_sweep_callback(sweep: Path, tmp_path: Path) -> None:
    callback = ComparePlotsCallback()
    callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert (sweep / "comparison" / "band_256_512.png").read_bytes().startswith(PNG)
    assert (sweep / "comparison" / "bands.csv").stat().st_size > 0
    summary = (sweep / "summary.md").read_text()
    assert "Finished (6)" in summary and "Failed or missing (3)" in summary and "CUDA out of memory" in summary
    assert failed_jobs_of_last_sweep() == 3

    empty = tmp_path / "empty_sweep"
    empty.mkdir()
    callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(empty)}}}))
    assert "Finished (0)" in (empty / "summary.md").read_text()
    assert not (empty / "comparison").exists()
    assert failed_jobs_of_last_sweep() == 0
    callback.on_multirun_end(OmegaConf.create({}))  # no hydra node: a warning, not an exception


# ----------------------------------------------------------------------------------- what the figures say


def _legend_clear_of_data(fig, ax) -> bool:
    """The legend (the axes' or the figure's) lies inside the figure and outside the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # lays the figure out as savefig does
    legend = (ax.get_legend() or fig.legends[0]).get_window_extent()
    inside = fig.bbox.x0 - 1 <= legend.x0 and legend.x1 <= fig.bbox.x1 + 1 and fig.bbox.y0 - 1 <= legend.y0
    return inside and not legend.overlaps(ax.get_window_extent())


def test_single_seed_figures_do_not_claim_a_mean_over_seeds() -> None:
    from posbench.report.plot import position_figure, training_extrapolation_figure

    one = {"rope": [np.asarray(curve("rope", 0, 512))], "alibi": [np.asarray(curve("alibi", 0, 512))]}
    title = position_figure(one, [256], 512, "Loss by position").axes[0].get_title()
    assert "mean over seeds" not in title and "one run per curve" in title
    two = {"rope": [np.asarray(curve("rope", s, 512)) for s in (0, 1)]}
    assert "mean over seeds (band" in position_figure(two, [256], 512, "t").axes[0].get_title()
    mixed = {**one, **two}
    assert "where a curve has several" in position_figure(mixed, [256], 512, "t").axes[0].get_title()
    metrics = {"rope": [[{"tokens": 100 * s, "val_loss_256_512": 3.0 / s} for s in (1, 2, 3)]]}
    title = training_extrapolation_figure(metrics, "val_loss_256_512", "t").axes[0].get_title()
    assert "mean over seeds" not in title and "one run per curve" in title


def test_band_chart_does_not_start_at_zero_when_that_hides_the_differences() -> None:
    from posbench.evaluation.stats import Interval
    from posbench.report.compare import Row
    from posbench.report.plot import band_figure

    def row(label: str, inner: float, head: float) -> Row:
        return Row(label, label, 1, {"band:0-256": Interval(inner, inner - 0.01, inner + 0.01, 6, "bootstrap"),
                                     "band:256-512": Interval(head, head - 0.01, head + 0.01, 6, "bootstrap")}, {})

    fig = band_figure([row("rope", 3.40, 3.44), row("alibi", 3.40, 3.42)], "0-256", "256-512", "t")
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert 3.3 < low < 3.39 and 3.45 < high < 3.6, (low, high)  # the 0.02 nats apart are visible
    assert f"y-axis starts at {low:.2f}, not 0" in ax.get_title()
    assert _legend_clear_of_data(fig, ax)
    far = band_figure([row("rope", 3.4, 3.44), row("nope", 3.4, 9.0)], "0-256", "256-512", "t").axes[0]
    assert far.get_ylim()[0] == 0 and "not 0" not in far.get_title()  # a blow-up is shown from 0


def test_sixteen_plus_curves_get_distinct_styles_and_the_legend_is_outside() -> None:
    import posbench
    from posbench.report.plot import line_styles, position_figure

    labels = posbench.list_methods() + ["rope[steps=60]", "rope[copy 2]", "alibi[precision=fp32]", "window"]
    assert len(labels) >= 16
    styles = line_styles(labels)
    colours = [tuple(styles[label]["color"]) for label in labels]
    assert len(set(colours)) == min(len(labels), 20)  # 20 qualitative colours, then markers
    assert len({(tuple(styles[l]["color"]), styles[l]["marker"]) for l in labels}) == len(labels)
    assert all(styles[l]["marker"] for l in labels)
    assert line_styles(["rope", "alibi"])["rope"] == styles["rope"] | {"marker": None}  # a method keeps its colour
    curves = {label: [np.asarray(curve("rope", 0, 512)) + i * 0.01] for i, label in enumerate(labels)}
    fig = position_figure(curves, [256], 512, "many")
    ax = fig.axes[0]
    drawn = [line for line in ax.get_lines() if not line.get_label().startswith("_") and line.get_label() in labels]
    assert len({(tuple(line.get_color()), line.get_marker()) for line in drawn}) == len(labels)
    assert _legend_clear_of_data(fig, ax)
    assert ax.get_legend()._ncols == 2  # more entries than LEGEND_ONE_COLUMN: two columns, a wider figure
    curves[labels[0]] = curves[labels[0]] * 2  # mixed seed counts: the longest title
    fig = position_figure(curves, [256], 512, "Loss by position (validation, length 512)")
    ax = fig.axes[0]
    assert _legend_clear_of_data(fig, ax)
    title = ax.title.get_window_extent()  # the figure widens with the legend, so the title is not cut off
    assert fig.bbox.x0 - 1 <= title.x0 and title.x1 <= fig.bbox.x1 + 1


def test_each_run_has_one_kind_selected_from_its_record(tmp_path) -> None:
    """plot, the sweep summary and a run's figures ask the run's kind (posbench.runs.kinds, the
    report half in posbench.report.kinds); a kind is chosen once, from results.json's ``kind``, or
    for a file from before the key from whether it holds a task."""
    from posbench.report.kinds import TaskKind, TextKind, by_kind, kind_of, split_unscored
    from posbench.runs.kinds import RUN_KINDS
    from posbench.runs.run_record import RunRecord

    text = RunRecord(path=tmp_path / "a", results={"method": "rope", "eval": []})
    task = RunRecord(path=tmp_path / "b", results={"method": "rope", "eval": [], "task": {
        "name": "flipflop", "entries": [{"length": 64, "accuracy": {"mean": float("nan")}}]}})
    recorded = RunRecord(path=tmp_path / "c", results={"kind": "text", "method": "rope", "eval": []})
    assert isinstance(kind_of(text), TextKind) and isinstance(kind_of(task), TaskKind)
    assert isinstance(kind_of(recorded), TextKind)
    reports = [kind.report for kind in RUN_KINDS.values()]
    assert list(by_kind([task, text])) == reports[:2]  # reported text first, whatever the order found
    assert kind_of(text).reads_text and not kind_of(task).reads_text
    kept, dropped = split_unscored([text, task])  # the task kind refuses NaN accuracies
    assert kept == [text] and dropped[0][0] == str(task.path) and "NaN" in dropped[0][1]
    other = RunRecord(path=tmp_path / "d", results={"kind": "not_here", "method": "rope", "eval": []})
    assert "kind 'not_here', which this posbench cannot report" in split_unscored([other])[1][0][1]
