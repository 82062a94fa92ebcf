"""Intervals, paired tables, grouping and the training-time figure over synthetic sweeps."""

from __future__ import annotations

import csv
import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest

from posbench.commands.sweep import sweep_summary
from posbench.evaluation.curves import band_means, curve_summary, sequence_band_means
from posbench.evaluation.stats import bootstrap_interval
from posbench.report.plot import plot_runs
from posbench.runs.results import build_results, write_results
from posbench.runs.run_record import discover_runs
from posbench.runs.status import write_status

PNG = b"\x89PNG\r\n\x1a\n"
T2 = 4.303  # t_{0.975, 2}: three seeds
OFFSET = {"alibi": 0.0, "rope": 0.05, "nope": 0.4}
N_SEQ, LENGTH, C = 6, 512, 256


def per_sequence(method: str, seed: int, windowed: bool = False) -> np.ndarray:
    """[N, L] losses: a decaying curve, a per-method offset past C, per-seed and per-sequence noise."""
    rng = np.random.default_rng(zlib.crc32(f"{method}-{seed}-{windowed}".encode()))
    pos = np.arange(LENGTH)
    base = 2.0 + 3.0 * np.exp(-pos / 30) + rng.normal(0, 0.02) + rng.normal(0, 0.05, (N_SEQ, 1))
    past = np.where(pos >= C, 0.0 if windowed else OFFSET[method], 0.0)
    return base + past + rng.normal(0, 0.01, (N_SEQ, LENGTH))


def entry(method: str, seed: int) -> dict:
    full = per_sequence(method, seed)
    windowed = np.concatenate([full[:, :C], per_sequence(method, seed, True)[:, C:]], axis=1)
    cost = full - windowed
    return {"split": "validation", "length": LENGTH, "num_sequences": N_SEQ, "sequences_sha256": "same-windows",
            **curve_summary(full, C), "effective_length": {"eps": 0.05, "window": 64, "in_context": 300 + seed,
                                                          "windowed": 400},
            "windowed": {"stride": 64, **curve_summary(windowed, C)},
            "cost": {"loss_by_position": cost.mean(0).tolist(), "bands": band_means(cost.mean(0), C),
                     "sequence_bands": sequence_band_means(cost, C)}}


def make_run(run_dir: Path, method: str, seed: int, options: dict | None = None, steps: int = 1,
             **extra: object) -> dict:
    run_dir.mkdir(parents=True)
    results = build_results(method=method, seed=seed, train_context=C,
                            train={"tokens": steps, "steps": steps, "final_loss": 1.0, "tokens_per_second": 1.0,
                                   "wall_seconds": 1.0, "device": "cpu"},
                            eval=[entry(method, seed)], run_name=run_dir.name, method_options=options or {},
                            model={"flavour": "tiny", "d_model": 64}, **extra)
    write_results(run_dir, results)
    key = f"val_loss_{C}_{2 * C}"
    lines = [json.dumps({"step": s, "tokens": 100 * s, "loss": 3.2 / s, "val_loss": 3.0 / s, key: 3.5 / s + OFFSET[method] + seed / 100})
             for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    write_status(run_dir, "completed", method=method, seed=seed)
    return results


@pytest.fixture()
def three_seeds(tmp_path: Path) -> Path:
    for method in OFFSET:
        for seed in (0, 1, 2):
            make_run(tmp_path / "sweep" / f"{method}-{seed}", method, seed)
    return tmp_path / "sweep"


def t_interval_explicit(values: list[float]) -> tuple[float, float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    half = T2 * sd / math.sqrt(len(values))
    return mean, mean - half, mean + half


@pytest.mark.slow
def test_tables_hold_intervals_costs_and_paired_differences(three_seeds: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = plot_runs([three_seeds], out, log=lambda _: None)
    for name in ("val_loss_256_512", "cost_by_position", "cumulative_perplexity", "loss_by_position"):
        assert (out / f"{name}.png").read_bytes().startswith(PNG), name
    assert summary["methods"] == {"nope": 3, "rope": 3, "alibi": 3}
    with open(out / "bands.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    for method in OFFSET:
        values = [entry(method, s)["bands"]["256-512"] for s in (0, 1, 2)]
        mean, low, high = t_interval_explicit(values)
        row = rows[method]
        assert float(row["256-512_mean"]) == pytest.approx(mean, abs=1e-12)
        assert float(row["256-512_low"]) == pytest.approx(low, abs=2e-4 * (high - low) + 1e-9)
        assert float(row["256-512_high"]) == pytest.approx(high, abs=2e-4 * (high - low) + 1e-9)
        costs = [entry(method, s)["cost"]["bands"]["256-512"] for s in (0, 1, 2)]
        assert float(row["cost_256-512_mean"]) == pytest.approx(np.mean(costs), abs=1e-12)
        assert float(row["cum_ppl_512_mean"]) == pytest.approx(
            np.mean([entry(method, s)["cumulative_perplexity"][-1] for s in (0, 1, 2)]))
        assert float(row["effective_length_512_mean"]) == pytest.approx(301.0)
        assert row["interval"] == "t, 3 seeds"
    with open(out / "paired.csv") as f:
        pairs = {(r["metric"], r["a"], r["b"]): r for r in csv.DictReader(f)}
    diffs = [entry("alibi", s)["bands"]["256-512"] - entry("rope", s)["bands"]["256-512"] for s in (0, 1, 2)]
    mean, low, high = t_interval_explicit(diffs)
    pair = pairs[("band:256-512", "alibi", "rope")]
    assert float(pair["difference"]) == pytest.approx(mean, abs=1e-12)
    assert float(pair["low"]) == pytest.approx(low, abs=1e-4) and float(pair["high"]) == pytest.approx(high, abs=1e-4)
    assert pair["distinguishable"] == str(not low <= 0 <= high).lower()
    assert pairs[("cost:256-512", "alibi", "nope")]["distinguishable"] == "true"  # 0.4 nats apart
    md = (out / "bands.md").read_text()
    assert "cost 256-512" in md and "effective length vs windowed @512" in md and "| alibi | rope |" in md
    text = sweep_summary(three_seeds, *discover_runs([three_seeds]))
    assert "Paired differences on 256-512" in text and "t, 3 seeds" in text


@pytest.mark.slow
def test_a_single_seed_gets_a_bootstrap_over_sequences_and_pairs_no_verdict(tmp_path: Path) -> None:
    for method in ("rope", "alibi"):
        make_run(tmp_path / "s" / method, method, 0)
    out = tmp_path / "out"
    plot_runs([tmp_path / "s"], out, log=lambda _: None)
    with open(out / "bands.csv") as f:
        row = {r["method"]: r for r in csv.DictReader(f)}["rope"]
    expected = bootstrap_interval(entry("rope", 0)["sequence_bands"]["256-512"])
    assert row["interval"] == f"bootstrap, {N_SEQ} seqs"
    assert float(row["256-512_low"]) == pytest.approx(expected.low)
    with open(out / "paired.csv") as f:
        pair = next(r for r in csv.DictReader(f) if r["metric"] == "band:256-512")
    a = entry(pair["a"], 0)["bands"]["256-512"]
    b = entry(pair["b"], 0)["bands"]["256-512"]
    # One seed, and no pair with two seeds to estimate the seed spread from: the difference
    # alone, no interval and no verdict (the sequences' interval would be 3-9x too narrow).
    assert pair["kind"] == "1 seed" and float(pair["difference"]) == pytest.approx(a - b)
    assert (pair["low"], pair["high"], pair["distinguishable"], pair["seeds"]) == ("", "", "", "0")
    row = next(line for line in (out / "paired.md").read_text().splitlines() if line.startswith("| band:256-512"))
    assert "(1 seed)" in row and "distinguishable" not in row and "one seed: no interval" in row


def test_a_single_seed_is_widened_by_the_seed_spread_of_the_others(three_seeds: Path, tmp_path: Path) -> None:
    """A one-seed group beside three-seed groups: its row and its pairs are widened by the
    between-seed sd pooled over the groups (rows) and the pairs (differences) with seeds, and
    its pairs get no verdict however far apart."""
    from posbench.report.compare import compare_runs

    make_run(three_seeds / "nope-9", "nope", 0, steps=2)  # another experiment: its own group, one seed
    comparison = compare_runs(discover_runs([three_seeds])[0])
    row = next(r for r in comparison.rows if r.label == "nope[steps=2]")
    spread = row.spreads["band:256-512"]
    values = {m: [entry(m, s)["bands"]["256-512"] for s in (0, 1, 2)] for m in OFFSET}
    squares = sum(((np.array(v) - np.mean(v)) ** 2).sum() for v in values.values())
    assert spread.sd == pytest.approx(math.sqrt(squares / 6)) and spread.df == 6 and spread.samples == 3
    interval = row.intervals["band:256-512"]
    sequences = bootstrap_interval(entry("nope", 0)["sequence_bands"]["256-512"])
    assert interval.kind == "1 seed" and interval.half_width == pytest.approx(
        math.hypot(sequences.half_width, 2.447 * spread.sd), rel=1e-3)  # t_{0.975, 6}
    pair = next(p for p in comparison.pairs if p.metric == "band:256-512" and {p.a, p.b} == {"alibi", "nope[steps=2]"})
    assert pair.seeds == ["0"] and pair.difference.kind == "1 seed" and pair.difference.distinguishable is None
    diffs = [[values[a][s] - values[b][s] for s in range(3)] for a, b in (("alibi", "rope"), ("alibi", "nope"),
                                                                           ("rope", "nope"))]
    squares = sum(((np.array(d) - np.mean(d)) ** 2).sum() for d in diffs)
    assert pair.spread.sd == pytest.approx(math.sqrt(squares / 6))
    assert pair.spread.df == 4  # three groups of three seeds: (3 - 1)(3 - 1), not 3 x 2
    assert abs(pair.difference.mean) > 0.3  # 0.4 nats apart, and still no verdict from one seed


COMMITTED = Path(__file__).resolve().parents[3] / "docs" / "cpu_quick" / "runs"


def test_committed_runs_one_seed_orders_nothing() -> None:
    """The committed cpu_quick runs: fox - alibi per seed is -0.015 / +0.014 / -0.008 on 256-512.
    Over the three seeds it is not distinguishable; seed 0 alone (a bootstrap over sequences of
    +-0.005) called it distinguishable. With one seed it now gets no verdict, and an interval
    widened by the seed spread of the pairs with three seeds, which holds 0."""
    from posbench.report.compare import compare_runs, paired_markdown
    from posbench.runs.run_record import finished_runs

    names = [f"{m}-s{s}" for m in ("alibi", "rope", "nope") for s in (0, 1, 2)]
    three = finished_runs(*discover_runs([COMMITTED / n for n in names + ["fox-s0", "fox-s1", "fox-s2"]]))[0]
    pair = next(p for p in compare_runs(three).pairs if p.metric == "band:256-512" and {p.a, p.b} == {"fox", "alibi"})
    assert pair.difference.kind == "t" and pair.difference.distinguishable is False and pair.difference.n == 3
    one = [r for r in three if not (r.method == "fox" and r.seed != 0)]
    pairs = compare_runs(one).pairs
    pair = next(p for p in pairs if p.metric == "band:256-512" and {p.a, p.b} == {"fox", "alibi"})
    diff = pair.difference
    assert abs(diff.mean) == pytest.approx(0.015, abs=0.001)
    assert diff.distinguishable is None and diff.low < 0 < diff.high and diff.kind == "1 seed"
    assert diff.half_width > 5 * 0.005  # the seed spread, not the sequences, sets the width
    line = next(x for x in paired_markdown([pair]).splitlines() if x.startswith("| band:256-512"))
    assert "distinguishable" not in line and "1 seed" in line and pair.seeds == ["0"]
    # every pair with three seeds keeps its t verdict; no one-seed pair has one
    assert all((p.difference.kind == "t") == (len(p.seeds) == 3) for p in pairs)
    assert all(p.difference.distinguishable is None for p in pairs if len(p.seeds) == 1)


@pytest.mark.slow
def test_runs_with_different_options_are_kept_apart(tmp_path: Path) -> None:
    for base in (500, 10000):
        for seed in (0, 1):
            make_run(tmp_path / "s" / f"rope-{base}-{seed}", "rope", seed, {"base": base})
    make_run(tmp_path / "s" / "alibi", "alibi", 0)
    lines: list[str] = []
    summary = plot_runs([tmp_path / "s"], tmp_path / "out", log=lines.append)
    assert summary["methods"] == {"rope[base=10000]": 2, "rope[base=500]": 2, "alibi": 1}
    assert any("kept apart" in line and "rope[base=500]" in line for line in lines)
    with open(tmp_path / "out" / "bands.csv") as f:
        labels = {r["label"] for r in csv.DictReader(f)}
    assert labels == {"rope[base=10000]", "rope[base=500]", "alibi"}


def test_a_truncated_windowed_curve_is_invalid(tmp_path: Path) -> None:
    from posbench.runs.results import validate_results

    results = make_run(tmp_path / "r", "rope", 0)
    results["eval"][0]["windowed"]["loss_by_position"] = results["eval"][0]["windowed"]["loss_by_position"][:-1]
    with pytest.raises(ValueError, match="windowed.loss_by_position"):
        validate_results(results)


# ---------------------------------------------------------------------------------- groups = seeds only


def bands_rows(out: Path) -> dict[str, dict[str, str]]:
    with open(out / "bands.csv") as f:
        return {r["label"]: r for r in csv.DictReader(f)}


@pytest.mark.slow
def test_a_400_step_and_a_60_step_run_of_one_seed_are_shown_apart(tmp_path: Path) -> None:
    make_run(tmp_path / "s" / "rope-400", "rope", 0, steps=400)
    make_run(tmp_path / "s" / "rope-60", "rope", 0, steps=60)
    lines: list[str] = []
    summary = plot_runs([tmp_path / "s"], tmp_path / "out", log=lines.append)
    assert summary["methods"] == {"rope[steps=400]": 1, "rope[steps=60]": 1}  # never "rope (2 seeds)"
    rows = bands_rows(tmp_path / "out")
    assert {r["seeds"] for r in rows.values()} == {"1"}
    assert all(r["interval"].startswith("bootstrap") for r in rows.values())  # no t-interval over 2 "seeds"
    assert any("differ in more than the seed" in line for line in lines)
    text = sweep_summary(tmp_path / "s", *discover_runs([tmp_path / "s"]))
    assert "| rope[steps=400] | 1 |" in text and "| rope[steps=60] | 1 |" in text


@pytest.mark.slow
def test_two_seeds_of_identical_settings_pool(tmp_path: Path) -> None:
    env = {"environment": {"precision": "bf16"}}
    for seed in (0, 1):
        make_run(tmp_path / "s" / f"rope-{seed}", "rope", seed, steps=60, **env)
    summary = plot_runs([tmp_path / "s"], tmp_path / "out", log=lambda _: None)
    assert summary["methods"] == {"rope": 2}
    assert bands_rows(tmp_path / "out")["rope"]["interval"] == "t, 2 seeds"


@pytest.mark.slow
def test_runs_in_other_precision_or_windows_or_settings_are_kept_apart(tmp_path: Path) -> None:
    make_run(tmp_path / "s" / "bf16", "rope", 0, environment={"precision": "bf16"})
    make_run(tmp_path / "s" / "fp32", "rope", 1, environment={"precision": "fp32"})
    make_run(tmp_path / "s" / "old", "rope", 2)  # results.json from before the precision was recorded
    lines: list[str] = []
    summary = plot_runs([tmp_path / "s"], tmp_path / "out", log=lines.append)
    assert summary["methods"] == {"rope[precision=bf16]": 1, "rope[precision=fp32]": 1, "rope[precision=unknown]": 1}
    assert any("1 run(s) do not record the precision" in line for line in lines)

    other = tmp_path / "w"
    make_run(other / "a", "alibi", 0)
    results = make_run(other / "b", "alibi", 1)
    results["eval"][0]["sequences_sha256"] = "other-windows"
    write_results(other / "b", results)
    (other / "b" / "config.yaml").write_text("trainer:\n  lr: 0.001\n")
    groups = plot_runs([other], tmp_path / "out2", log=lambda _: None)["methods"]
    assert len(groups) == 2 and all(n == 1 for n in groups.values())
    assert any("windows=" in label and "trainer.lr=unknown" in label for label in groups), groups


@pytest.mark.slow
def test_two_runs_of_one_seed_never_count_as_two_seeds(tmp_path: Path) -> None:
    for name in ("a", "b"):
        for seed in (0, 1):
            make_run(tmp_path / "s" / name / f"rope-{seed}", "rope", seed)
    make_run(tmp_path / "s" / "c" / "rope-2", "rope", 2)
    lines: list[str] = []
    summary = plot_runs([tmp_path / "s"], tmp_path / "out", log=lines.append)
    # seeds 0, 1 (from a) and 2 pool; b's repeats of seeds 0 and 1 are shown apart
    assert summary["methods"] == {"rope": 3, "rope[copy 2]": 2}
    assert bands_rows(tmp_path / "out")["rope"]["interval"] == "t, 3 seeds"
    assert any("rope[copy 2] repeats seed(s) 0, 1" in line for line in lines)
    text = sweep_summary(tmp_path / "s", *discover_runs([tmp_path / "s"]))
    assert "rope[copy 2]" in text and "| `b/rope-0` | rope | 0 | rope[copy 2] |" in text


@pytest.mark.slow
def test_a_failed_or_refused_run_never_enters_the_table(tmp_path: Path) -> None:
    """Fault case L10: a failed job (its results.json from an earlier finish, or its start refused,
    or without final results) must not be pooled into the tables and figures."""
    for seed in (0, 1):
        make_run(tmp_path / "s" / f"rope-{seed}", "rope", seed)
    make_run(tmp_path / "s" / "failed", "rope", 2)
    write_status(tmp_path / "s" / "failed", "failed", error="loss is nan")
    make_run(tmp_path / "s" / "refused", "rope", 3)
    (tmp_path / "s" / "refused" / "refused.json").write_text(json.dumps({"error": "another config"}))
    results = make_run(tmp_path / "s" / "empty", "rope", 4)
    write_results(tmp_path / "s" / "empty", {**results, "eval": []})
    summary = plot_runs([tmp_path / "s"], tmp_path / "out", log=lambda _: None)
    assert summary["methods"] == {"rope": 2}
    reasons = dict(summary["problems"])
    assert reasons[str(tmp_path / "s" / "failed")].startswith("failed: loss is nan")
    assert reasons[str(tmp_path / "s" / "refused")].startswith("refused")
    assert reasons[str(tmp_path / "s" / "empty")].startswith("no final results")
    assert "| rope | 2 |" in (tmp_path / "out" / "bands.md").read_text()
    text = sweep_summary(tmp_path / "s", *discover_runs([tmp_path / "s"]))
    assert "Finished (2)" in text and "Failed or missing (3)" in text


def test_the_extension_matrix_keeps_unlike_runs_apart(tmp_path: Path) -> None:
    from posbench.report.extension import extension_matrix

    runs = []
    for name, seed, steps in (("a", 0, 400), ("b", 1, 400), ("c", 0, 60)):
        results = make_run(tmp_path / name, "rope", seed, steps=steps)
        results["eval"].append({**entry("rope", seed), "extension": "yarn", "extension_factor": 2.0})
        write_results(tmp_path / name, results)
        runs += discover_runs([tmp_path / name])[0]
    _, rows = extension_matrix(runs, "validation")
    seeds = {(r["method"], r["extension"]): r["seeds"] for r in rows}
    assert seeds == {("rope[steps=400]", "none"): 2, ("rope[steps=400]", "yarn"): 2,
                     ("rope[steps=60]", "none"): 1, ("rope[steps=60]", "yarn"): 1}


def test_precision_of_older_results(tmp_path: Path) -> None:
    """Without ``environment``: an explicit trainer.precision is what ran; auto is unknown."""
    make_run(tmp_path / "fp32", "rope", 0)
    (tmp_path / "fp32" / "config.yaml").write_text("trainer:\n  precision: fp32\n")
    make_run(tmp_path / "auto", "rope", 1)
    (tmp_path / "auto" / "config.yaml").write_text("trainer:\n  precision: auto\n")
    make_run(tmp_path / "broken", "rope", 2)
    (tmp_path / "broken" / "config.yaml").write_text("trainer: [unclosed\n")  # unreadable: no crash
    runs = {r.path.name: r for r in discover_runs([tmp_path])[0]}
    assert {name: r.precision for name, r in runs.items()} == {"fp32": "fp32", "auto": "unknown", "broken": "unknown"}


# --------------------------------------------------------------- faults found by a review


def test_variant_label_of_an_entry_without_a_checksum() -> None:
    """results.json files from before ``sequences_sha256`` was recorded: another count is the
    variant, without a ValueError for the checksum that is not there."""
    from posbench.runs.entries import variant_label

    old = {"split": "validation", "length": 512, "num_sequences": 8, "bands": {}}
    new = {"split": "validation", "length": 512, "num_sequences": 64, "sequences_sha256": "abc", "bands": {}}
    assert variant_label(new, old) == "num_sequences=64"
    assert variant_label({k: v for k, v in new.items() if k != "sequences_sha256"}, old) == "num_sequences=64"


def test_an_added_length_never_changes_the_bands_table(tmp_path: Path) -> None:
    """``posbench eval eval.lengths=[384]`` adds an entry marked ``added``: bands.md and the
    paired differences stay those of the training-time evaluation."""
    from posbench.report.compare import compare_runs

    for method in ("alibi", "rope"):
        make_run(tmp_path / "s" / method, method, 0)
    before = compare_runs(discover_runs([tmp_path / "s"])[0])
    results = json.loads((tmp_path / "s" / "rope" / "results.json").read_text())
    worse = per_sequence("rope", 0)[:, :384] + 1.0  # 1 nat worse: seen in 0-256 if it were read
    shorter = {"split": "validation", "length": 384, "num_sequences": N_SEQ, "sequences_sha256": "same-windows",
               **curve_summary(worse, C), "added": True}
    write_results(tmp_path / "s" / "rope", {**results, "eval": [shorter, *results["eval"]]})
    after = compare_runs(discover_runs([tmp_path / "s"])[0])
    assert [(r.label, r.intervals) for r in after.rows] == [(r.label, r.intervals) for r in before.rows]
    assert after.pairs == before.pairs


def test_presets_crossed_with_a_model_setting_keep_four_groups(tmp_path: Path) -> None:
    """``-m model=mini,small model.n_layers=2,4``: the preset alone does not tell the four
    groups apart, so the labels name the layers too; no group replaces another and the sweep
    summary lists every job."""
    from posbench.report.groups import group_runs

    for flavour, d_model in (("mini", 64), ("small", 128)):
        for layers in (2, 4):
            make_run(tmp_path / "s" / f"{flavour}-{layers}", "rope", 0)
            results = json.loads((tmp_path / "s" / f"{flavour}-{layers}" / "results.json").read_text())
            results["model"] = {"flavour": flavour, "d_model": d_model, "n_layers": layers}
            write_results(tmp_path / "s" / f"{flavour}-{layers}", results)
    runs, problems = discover_runs([tmp_path / "s"])
    groups = group_runs(runs)
    assert sorted(groups) == ["rope[model.n_layers=2,model.flavour=mini]", "rope[model.n_layers=2,model.flavour=small]",
                              "rope[model.n_layers=4,model.flavour=mini]", "rope[model.n_layers=4,model.flavour=small]"]
    text = sweep_summary(tmp_path / "s", runs, problems)
    assert "Finished (4)" in text and "| `small-4` | rope | 0 | rope[model.n_layers=4,model.flavour=small] |" in text


def test_an_unrecorded_setting_and_a_null_one_are_kept_apart(tmp_path: Path) -> None:
    """One run lacks an option (older results.json), another records it as null: two groups,
    labelled ``unknown`` and ``none``; a null setting never reads as ``unknown``."""
    from posbench.report.groups import group_runs

    make_run(tmp_path / "s" / "old", "rope", 0)
    make_run(tmp_path / "s" / "full", "rope", 1, {"window": None})
    make_run(tmp_path / "s" / "local", "rope", 2, {"window": 64})
    groups = group_runs(discover_runs([tmp_path / "s"])[0])
    assert {label: [r.path.name for r in g.runs] for label, g in groups.items()} == {
        "rope[window=64]": ["local"], "rope[window=none]": ["full"], "rope[window=unknown]": ["old"]}


def test_labels_that_print_alike_never_replace_a_group(tmp_path: Path) -> None:
    from posbench.report.groups import group_runs

    make_run(tmp_path / "s" / "int", "rope", 0, {"base": 2})
    make_run(tmp_path / "s" / "text", "rope", 1, {"base": "2"})
    groups = group_runs(discover_runs([tmp_path / "s"])[0])
    assert sorted(groups) == ["rope[base=2]", "rope[base=2]#2"]
    assert sorted(r.path.name for g in groups.values() for r in g.runs) == ["int", "text"]


def test_a_windowed_group_shows_its_window_even_alone(tmp_path: Path) -> None:
    """The window baseline without a plain rope run beside it was labelled just ``rope`` (a
    method with one group takes its name), so its numbers read as plain rope's."""
    from posbench.report.groups import group_runs

    def windowed(name: str, seed: int, window: int | None) -> None:
        make_run(tmp_path / name, "rope", seed)
        results = json.loads((tmp_path / name / "results.json").read_text())
        results["model"]["attention_window"] = window
        write_results(tmp_path / name, results)

    for seed in (0, 1):
        windowed(f"w/rope-w256-s{seed}", seed, 256)
    assert sorted(group_runs(discover_runs([tmp_path / "w"])[0])) == ["rope[model.attention_window=256]"]
    windowed("w/rope-s0", 0, None)  # beside the plain model: the same label, the plain one unchanged
    groups = group_runs(discover_runs([tmp_path / "w"])[0])
    assert sorted(groups) == ["rope[model.attention_window=256]", "rope[model.attention_window=none]"]
    windowed("p/rope-s0", 0, None)  # a plain run alone is just rope
    assert sorted(group_runs(discover_runs([tmp_path / "p"])[0])) == ["rope"]


def test_a_recurrent_group_is_never_named_as_its_method_alone(tmp_path: Path) -> None:
    """A mamba2 model (method=nope) alone was labelled ``nope``, and beside a plain nope run its
    label listed every mixer option; it shows its mixer, and the mixer stands for its options."""
    from posbench.report.groups import group_runs

    def mixed(name: str, seed: int, mixer: str | None, options: dict | None = None) -> None:
        make_run(tmp_path / name, "nope", seed)
        results = json.loads((tmp_path / name / "results.json").read_text())
        if mixer is not None:
            results["model"].update(mixer=mixer, mixer_options={mixer: options or {"d_state": 64}})
        write_results(tmp_path / name, results)

    for seed in (0, 1):
        mixed(f"m/mamba2-s{seed}", seed, "mamba2")
    assert sorted(group_runs(discover_runs([tmp_path / "m"])[0])) == ["nope[model.mixer=mamba2]"]
    mixed("m/nope-s0", 0, None)  # an attention run records no mixer
    mixed("m/gdn-s0", 0, "gated_deltanet")
    groups = group_runs(discover_runs([tmp_path / "m"])[0])
    assert sorted(groups) == ["nope[model.mixer=attention]", "nope[model.mixer=gated_deltanet]",
                              "nope[model.mixer=mamba2]"]
    mixed("p/nope-s0", 0, None)  # a plain run alone is just nope
    assert sorted(group_runs(discover_runs([tmp_path / "p"])[0])) == ["nope"]
    for seed, passing in ((0, {"mode": "carry"}), (1, {"mode": "noise", "noise": 0.5})):
        mixed(f"s/gdn-s{seed}", seed, "gated_deltanet")  # trained with state passing: never pooled as without
        results = json.loads((tmp_path / f"s/gdn-s{seed}" / "results.json").read_text())
        results["train"]["state_passing"] = passing
        write_results(tmp_path / f"s/gdn-s{seed}", results)
    mixed("s/plain-s0", 0, "gated_deltanet")
    assert sorted(group_runs(discover_runs([tmp_path / "s"])[0])) == [
        "nope[trainer.state_passing=carry,model.mixer=gated_deltanet]",
        "nope[trainer.state_passing=noise(0.5),model.mixer=gated_deltanet]",
        "nope[trainer.state_passing=none,model.mixer=gated_deltanet]"]


def test_a_run_trained_with_retrieval_text_is_never_pooled_with_plain_runs(tmp_path: Path) -> None:
    """A run trained with ``data.retrieval`` (pass keys and repeated spans written into its
    training windows) was grouped with plain runs of its method as another seed of them."""
    from posbench.report.groups import group_runs

    def trained(name: str, seed: int, retrieval: dict | None) -> None:
        make_run(tmp_path / name, "rope", seed)
        if retrieval is not None:
            results = json.loads((tmp_path / name / "results.json").read_text())
            results.setdefault("data", {})["retrieval"] = retrieval
            write_results(tmp_path / name, results)

    option = {"rate": 0.5, "kinds": ["passkey"], "min_distance": 1, "max_distance": 256, "span": 16}
    trained("a/rope-s0", 0, None)
    trained("a/rope-ret-s1", 1, option)
    groups = group_runs(discover_runs([tmp_path / "a"])[0])
    assert len(groups) == 2 and all(len(g.runs) == 1 for g in groups.values())
    plain = next(label for label in groups if "data.retrieval=none" in label)
    assert [r.path.name for r in groups[plain].runs] == ["rope-s0"]
    trained("b/rope-ret-s0", 0, option)  # alone, it still says what it was trained on
    (label,) = group_runs(discover_runs([tmp_path / "b"])[0])
    assert label.startswith("rope[data.retrieval=") and "rate=0.5" in label
    trained("c/rope-s0", 0, {**option, "rate": 0.0})  # rate 0 is plain text: no facet
    assert sorted(group_runs(discover_runs([tmp_path / "c"])[0])) == ["rope"]
