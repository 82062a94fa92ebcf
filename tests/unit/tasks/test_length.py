"""Length-true task tests (docs/tasks.md): flip-flop's sparse and far-lookback test sets, copy's
training-length strings placed past C, the baselines stored beside every number, the
learnt-at-C gate of the task tables, and `posbench plot` skipping a run with NaN accuracies."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil

import numpy as np
import pytest
import torch
from helpers import compose_config

from posbench.core.errors import PosbenchError
from posbench.evaluation.settings import EvalConfig
from posbench.evaluation.tasks import answer_details, evaluate_task, learnt_at_c
from posbench.model.transformer import ModelConfig, build_model
from posbench.report.plot import plot_runs
from posbench.report.tasks import tables_csv, tables_markdown, task_figure, task_tables
from posbench.runs.run_record import RunRecord
from posbench.tasks import TEST, make_task
from posbench.train.task_workload import TaskWorkload
from posbench.train.trainer import train

C = 64
QUICK = ["logger=none", "trainer.context=32", "trainer.max_steps=4", "trainer.batch_size=8", "trainer.log_every=2",
         "trainer.val_every=2", "trainer.val_sequences=8", "trainer.val_extrapolation_sequences=4",
         "trainer.warmup_steps=1", "trainer.precision=fp32", "eval.lengths=[32,64]", "eval.num_sequences=8",
         "eval.batch_size=8"]


def flipflop(**options):
    return make_task({"name": "flipflop", "tests": ["standard", "sparse", "far"], **options}, C)


def copy(**options):
    return make_task({"name": "copy", "tests": ["standard", "shifted"], **options}, C)


# ----------------------------------------------------------------------------- oracles


def walk_flipflop(tokens: np.ndarray, length: int) -> list[tuple[int, int, int]]:
    """Every read of a sequence as (target position, its last written bit, lookback from the read
    to that bit's token); also checks that the sequence is a valid flip-flop sequence."""
    reads, last = [], None
    assert tokens[0] == 0, "a sequence starts with a write"
    for t in range(0, length, 2):
        op, bit = int(tokens[t]), int(tokens[t + 1])
        assert op in (0, 1, 2) and bit in (3, 4)
        if op == 0:
            last = (bit, t + 1)
        elif op == 2:
            assert bit == last[0], "a read repeats the last written bit"
            reads.append((t, last[0], t - last[1]))
    return reads


def scored_lookbacks(t, batch) -> np.ndarray:
    """The lookback of every scored read, re-derived by walking the instructions."""
    out = []
    for row in range(batch.tokens.shape[0]):
        for at, _, lookback in walk_flipflop(batch.tokens[row], batch.answers.shape[1]):
            if batch.answers[row, at]:
                out.append(lookback)
    return np.array(out)


# ----------------------------------------------------------------------------- flip-flop


def test_far_flipflop_lookback_grows_with_length_and_the_standard_test_does_not():
    t = flipflop()
    standard = {L: scored_lookbacks(t, t.sequences(TEST, L, 200)) for L in (C, 8 * C)}
    far = {L: scored_lookbacks(t, t.sequences(TEST, L, 200, "far")) for L in (C, 8 * C)}
    # today's test: the median lookback barely moves and almost no read looks back C or more
    assert np.median(standard[8 * C]) < 2 * np.median(standard[C]) and (standard[8 * C] >= C).mean() < 0.1
    # the far test: one read per sequence, stratified over 0-C, C-2C, 2C-4C, 4C-8C
    assert len(far[8 * C]) == 200 and np.median(far[8 * C]) > 4 * np.median(far[C])
    assert (far[8 * C] >= C).mean() == pytest.approx(0.75, abs=0.01) and (far[8 * C] >= 4 * C).mean() > 0.2
    assert far[C].max() < C


def test_far_flipflop_is_valid_and_scores_only_the_last_read():
    t = flipflop()
    for L in (C, 3 * C + 1, 8 * C):
        batch = t.sequences(TEST, L, 40, "far")
        assert (batch.answers.sum(axis=1) == 1).all()
        for row in range(40):
            reads = walk_flipflop(batch.tokens[row], L)  # asserts every read (prefix ones too) is right
            at = int(np.flatnonzero(batch.answers[row])[0])
            assert at == reads[-1][0] and at >= L - 2
            ops = batch.tokens[row, 0:at:2]
            last_write = int(np.flatnonzero(ops == 0)[-1])
            assert (ops[last_write + 1:] == 1).all(), "only ignores between the last write and the read"


def test_sparse_flipflop_draws_ignores_at_liu_et_al_rate_and_standard_is_unchanged():
    t = flipflop()
    ops = t.sequences(TEST, 8 * C, 64, "sparse").tokens[:, 2::2]
    assert abs((ops == 1).mean() - 0.98) < 0.01
    plain = make_task({"name": "flipflop"}, C)  # without task.tests: the standard test alone, as before
    assert plain.tests == ("standard",)
    old = plain.generate(np.random.default_rng([0, TEST, C]), 16, C, "test")  # the stream of runs before test sets
    assert np.array_equal(t.sequences(TEST, C, 16).tokens, old.tokens)


def test_flipflop_lookback_axis_and_baselines_match_the_walk():
    t = flipflop()
    for test in ("standard", "sparse", "far"):
        batch = t.sequences(TEST, 4 * C, 50, test)
        axis = t.answer_axes(batch)["lookback"]
        assert sorted(axis[batch.answers].tolist()) == sorted(scored_lookbacks(t, batch).tolist())
        baselines = t.baselines(batch)
        for row in range(50):
            for at, bit, _ in walk_flipflop(batch.tokens[row], 4 * C):
                if not batch.answers[row, at]:
                    continue
                assert baselines["previous_bit"][row, at] == float(batch.tokens[row, at - 1] == bit + 0)
                nearest = max(u for u in range(1, at, 2) if batch.tokens[row, u - 1] in (0, 2))  # w or r bit
                assert baselines["window_C"][row, at] == (1.0 if at - nearest < C else 0.5)
                assert baselines["chance"][row, at] == 0.5
    standard = t.sequences(TEST, 8 * C, 200)
    previous = t.baselines(standard)["previous_bit"][standard.answers].mean()
    assert previous == pytest.approx(0.6, abs=0.03)  # 0.1 + 0.1 + 0.8 / 2 at p_ignore 0.8


# ----------------------------------------------------------------------------- copy


def test_copy_shifted_holds_training_length_strings_past_c():
    t = copy()
    for L in (C, 2 * C, 8 * C):
        batch = t.sequences(TEST, L, 100, "shifted")
        sizes = batch.answers.sum(axis=1)
        assert sizes.min() >= 1 and sizes.max() <= C // 2 and len(set(sizes.tolist())) > C // 8
        for row in range(100):
            n, (first, *_) = sizes[row], np.flatnonzero(batch.answers[row])
            start = first - n  # the string, then | at first, the copy after
            assert start >= L - C and (batch.tokens[row, :start] == t.pad).all()
            assert batch.tokens[row, first] == t.sep
            np.testing.assert_array_equal(batch.tokens[row, first + 1:first + n + 1], batch.tokens[row, start:first])
        if L >= 2 * C:
            assert np.flatnonzero(batch.answers.any(axis=0)).min() >= C  # every copy happens past C
        assert (t.answer_axes(batch)["string_length"][batch.answers] <= C // 2).all()
    # string length is its own axis: quarters of the training range, then beyond it
    shifted = answer_details(t, t.sequences(TEST, 8 * C, 100, "shifted"), np.zeros((100, 8 * C), bool), 8 * C, C)
    assert list(shifted["by_string_length"])[:4] == ["1-9", "9-17", "17-25", "25-33"]
    assert all(b["answers"] > 0 for b in list(shifted["by_string_length"].values())[:4])
    assert sum(b["answers"] for b in shifted["by_string_length"].values()) == sum(
        b["answers"] for b in list(shifted["by_string_length"].values())[:4])
    standard = t.sequences(TEST, 8 * C, 4)  # today's test, kept: the longest string that fits
    assert (standard.answers.sum(axis=1) == 4 * C).all() and (t.answer_axes(standard)["string_length"].max() == 4 * C)


def test_copy_shifted_training_places_training_strings_anywhere_and_is_off_by_default():
    plain, shifted = copy(), copy(shifted_training=True)
    old = plain.generate(np.random.default_rng([0, 0, 0, 3]), 64, C, "train")  # the stream of runs before the option
    np.testing.assert_array_equal(plain.train_batch(0, 3, 64).tokens, old.tokens)
    assert (plain.train_batch(0, 3, 64).answers.argmax(axis=1) == plain.train_batch(0, 3, 64).answers.sum(axis=1)).all()
    batch = shifted.train_batch(0, 3, 64)
    sizes, first = batch.answers.sum(axis=1), batch.answers.argmax(axis=1)
    starts = first - sizes
    assert starts.min() == 0 < starts.max() and len(set(starts.tolist())) > 8
    for row in range(64):
        assert (batch.tokens[row, :starts[row]] == shifted.pad).all() and batch.tokens[row, first[row]] == shifted.sep
        np.testing.assert_array_equal(batch.tokens[row, first[row] + 1:first[row] + sizes[row] + 1],
                                      batch.tokens[row, starts[row]:first[row]])
    np.testing.assert_array_equal(plain.sequences(TEST, 2 * C, 8, "shifted").tokens,
                                  shifted.sequences(TEST, 2 * C, 8, "shifted").tokens)  # the same test sequences
    with pytest.raises(PosbenchError, match="task.shifted_training='yes' must be true or false"):
        copy(shifted_training="yes")


def test_copy_baselines():
    t = copy()
    batch = t.sequences(TEST, 2 * C, 30, "shifted")
    baselines = t.baselines(batch)
    for row in range(30):
        at = np.flatnonzero(batch.answers[row])
        string = batch.tokens[row, at + 1]
        mode = np.bincount(string, minlength=t.num_symbols).argmax()
        np.testing.assert_array_equal(baselines["most_frequent"][row, at], (string == mode).astype(float))
        np.testing.assert_array_equal(baselines["previous_symbol"][row, at], (batch.tokens[row, at] == string).astype(float))
        assert (baselines["window_C"][row, at] == 1.0).all()  # n <= C/2: a reader of the last C tokens copies it
    long = t.sequences(TEST, 2 * C, 4)  # n = 2C / 2 = C: out of a window's reach
    assert (t.baselines(long)["window_C"][long.answers] == 1 / t.num_symbols).all()


def test_bad_test_sets_and_thresholds_are_refused_in_one_line():
    with pytest.raises(PosbenchError, match=r"task.tests=\['bogus'\].*standard, sparse, far"):
        flipflop(tests=["bogus"])
    with pytest.raises(PosbenchError, match="task.tests"):
        copy(tests=["far"])  # flip-flop's test set
    with pytest.raises(PosbenchError, match="task.learnt_at_c=1.5 must be an accuracy"):
        copy(learnt_at_c=1.5)


# ----------------------------------------------------------------------------- evaluation entries


def test_entries_hold_the_test_set_lookback_and_baselines():
    t = flipflop()
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=t.vocab_size, d_model=32, n_layers=2, n_heads=4), "alibi")
    entries = evaluate_task(model, t, EvalConfig(lengths=[C, 4 * C], num_sequences=8, batch_size=8), C,
                            torch.device("cpu"), None, log=lambda _: None)
    assert [(e["test_set"], e["length"]) for e in entries] == [
        ("standard", C), ("standard", 4 * C), ("sparse", C), ("sparse", 4 * C), ("far", C), ("far", 4 * C)]
    far = entries[-1]
    assert set(far["by_lookback"]) == {"0-64", "64-128", "128-256"}  # 4C
    assert sum(b["answers"] for b in far["by_lookback"].values()) == far["answers"] == 8
    assert far["lookback"]["beyond_context"] > 0.5 and far["lookback"]["median"] >= C
    assert set(far["baselines"]) == {"chance", "previous_bit", "window_C"} and far["baselines"]["chance"] == 0.5
    assert entries[0]["lookback"]["beyond_context"] == 0.0  # at C no read can look back C


def test_evaluation_only_options_do_not_change_the_resume_check():
    base = {"name": "flipflop", "seed": 0, "p_ignore": 0.8, "eval_p_ignore": None}
    a = TaskWorkload(make_task(base, C), base)
    b = TaskWorkload(make_task({**base, "tests": ["far"], "learnt_at_c": 0.5}, C),
                     {**base, "tests": ["far"], "learnt_at_c": 0.5})
    assert a.identity() == b.identity()
    assert a.identity() != TaskWorkload(make_task({**base, "p_ignore": 0.9}, C), {**base, "p_ignore": 0.9}).identity()


# ----------------------------------------------------------------------------- the learnt-at-C gate


def fake_run(tmp_path, seed: int, accuracy: dict[int, float], *, method: str = "rope", recorded: bool = True,
             test_set: bool = True) -> RunRecord:
    """A flip-flop run's results with the given accuracy by length (standard test, 4 sequences)."""
    entries = []
    for length, value in accuracy.items():
        block = {"mean": value, "low": value - 0.01, "high": value + 0.01, "n": 4, "kind": "bootstrap",
                 "half_width": 0.01}
        entry = {"split": "test", "length": length, "extension": "none", "accuracy": block,
                 "by_position": {f"0-{C}": {**block, "answers": 4}},
                 "baselines": {"chance": 0.5, "previous_bit": 0.6, "window_C": 1.0}}
        if test_set:
            entry["test_set"] = "standard"
        entries.append(entry)
    task = {"name": "flipflop", "options": {"seed": 0, "p_ignore": 0.8}, "metrics": ["accuracy"], "chance": 0.5,
            "entries": entries}
    results = {"method": method, "seed": seed, "train_context": C, "eval": [], "task": task,
               "train": {"steps": 600, "tokens": 600 * 32 * C}}
    if recorded:
        task["learnt_at_c"] = learnt_at_c(task, C)
    path = tmp_path / f"{method}-s{seed}"
    path.mkdir()
    return RunRecord(path, results)


def test_a_seed_not_learnt_at_c_is_never_averaged(tmp_path):
    runs = [fake_run(tmp_path, 0, {C: 1.0, 8 * C: 0.70}), fake_run(tmp_path, 1, {C: 0.99, 8 * C: 0.80}),
            fake_run(tmp_path, 2, {C: 0.80, 8 * C: 0.79}, recorded=False, test_set=False)]  # an older run
    assert [r.results["task"].get("learnt_at_c", {}).get("learnt") for r in runs] == [True, True, None]
    assert learnt_at_c(runs[2].results["task"], C) == {
        "test_set": "standard", "length": C, "metric": "accuracy", "threshold": 0.95, "value": 0.80, "learnt": False}
    table = task_tables(runs)[0]
    assert [r.seed for r in table.learnt("rope")] == [0, 1] and [r.seed for r in table.not_learnt("rope")] == [2]
    text = tables_markdown([table])
    row = next(line for line in text.splitlines() if line.startswith("| rope |"))
    assert "| rope | 2 | 0.995 ± " in row and "| 0.750 ± " in row and "s2 (0.800 < 0.95)" in row
    assert "not learnt at C" in text and "| rope s2 | s2 (0.800 < 0.95) | 0.800 ± 0.010 | 0.790 ± 0.010 |" in text
    assert "| *baseline: previous_bit* | | 0.600 | 0.600 |" in text and "| *baseline: chance* | | 0.500 | 0.500 |" in text
    rows = list(csv.DictReader(io.StringIO(tables_csv([table]))))
    overall = [r for r in rows if r["positions"] == "all"]
    assert {(r["seeds"], r["not_learnt"]) for r in overall} == {("2", "1")}
    assert [float(r["mean"]) for r in overall] == pytest.approx([0.995, 0.75])
    assert json.loads(overall[0]["baselines"]) == {"chance": 0.5, "previous_bit": 0.6, "window_C": 1.0}


def test_a_run_that_did_not_learn_is_drawn_and_marked_under_a_readable_title(tmp_path):
    """A method none of whose seeds learnt the task at C still shows in the figure, one marked
    line per seed, and the title names the task's options as settings, not as JSON."""
    runs = [fake_run(tmp_path, 0, {C: 1.0, 8 * C: 0.7}), fake_run(tmp_path, 0, {C: 0.706, 8 * C: 0.6}, method="nope")]
    fig = task_figure(task_tables(runs)[0])
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    marked = lines["nope s0: not learnt at C (0.706 < 0.95)"]
    assert list(marked.get_ydata()) == [0.706, 0.6] and marked.get_linestyle() == ":"
    assert not any(label.startswith("rope s0: not learnt") for label in lines)
    title = fig._suptitle.get_text()
    assert title.startswith("flipflop (p_ignore 0.8, seed 0)\n") and "{" not in title


def test_a_method_with_no_learnt_seed_has_no_average(tmp_path):
    runs = [fake_run(tmp_path, s, {C: 0.8, 8 * C: 0.6}, method="nope") for s in (0, 1)]
    table = task_tables(runs)[0]
    text = tables_markdown([table])
    row = next(line for line in text.splitlines() if line.startswith("| nope |"))
    assert row.startswith("| nope | 0 | - | - | - |") and "s0 (0.800 < 0.95), s1 (0.800 < 0.95)" in row
    assert not [r for r in csv.DictReader(io.StringIO(tables_csv([table]))) if r["group"] == "nope"]


# ----------------------------------------------------------------------------- plot


@pytest.mark.slow
def test_plot_skips_a_task_run_with_nan_accuracies(tmp_path):
    good = tmp_path / "runs" / "good"
    cfg = compose_config("train", ["task=flipflop", "method=alibi", *QUICK])
    train(cfg, good, log=lambda _: None)
    bad = tmp_path / "runs" / "bad"
    shutil.copytree(good, bad)
    results = json.loads((bad / "results.json").read_text())
    for entry in results["task"]["entries"]:
        entry["accuracy"].update(mean=float("nan"), low=float("nan"), high=float("nan"))
    (bad / "results.json").write_text(json.dumps(results))  # json writes NaN
    lines: list[str] = []
    out = plot_runs([str(tmp_path / "runs")], tmp_path / "out", log=lines.append)
    skipped = [line for line in lines if line.startswith("skipping")]
    assert len(skipped) == 1 and str(bad) in skipped[0] and "NaN" in skipped[0]
    assert out["runs"] == [str(good)] and [p for p, _ in out["problems"]] == [str(bad)]
    table = (tmp_path / "out" / "tasks.md").read_text()
    assert "nan" not in table.lower() and "| alibi | " in table
    assert not any(math.isnan(float(r["mean"])) for r in csv.DictReader(io.StringIO(
        (tmp_path / "out" / "tasks.csv").read_text())))


def test_a_copy_checkpoint_from_before_shifted_training_still_resumes():
    """copy gained ``task.shifted_training`` (default false); the resume identity of a default copy
    run must equal the one recorded before the option existed, or every earlier copy checkpoint is
    refused. A run that switches it on is another data stream and keeps a different identity."""
    from helpers import compose_config

    from posbench.runs.spec import build_spec
    from posbench.train.task_workload import TaskWorkload

    def identity(*overrides: str) -> dict[str, str]:
        spec = build_spec(compose_config("train", ["task=copy", "logger=none", *overrides]))
        return TaskWorkload(spec.task, spec.task_options).identity()

    before = "copy:[('min_length', 1), ('name', 'copy'), ('num_symbols', 16), ('seed', 0)]"
    assert identity() == {"task": before}
    assert identity("task.shifted_training=true") != {"task": before}
