"""Grid tasks (docs/grid.md): lookup and same_line against naive oracles, determinism, their
baselines, ``by_position`` by ring, bad options, and the CLI end to end with the comparison."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from helpers import compose_config, posbench_cli

from posbench.core.errors import PosbenchError
from posbench.evaluation.tasks import task_entry
from posbench.tasks import TEST, TRAIN, VALID, list_tasks, make_task
from posbench.tasks.grid_lookup import OFFSETS
from posbench.train.trainer import train

C = 64  # 8 x 8


def grid_task(name: str, context: int = C, **options):
    return make_task({"name": name, **options}, context)


def cells(length: int) -> list[tuple[int, int]]:
    side = int(round(length ** 0.5))
    return [(i // side, i % side) for i in range(length)]


# ----------------------------------------------------------------------------- oracles


def oracle_lookup(inputs: np.ndarray, num_symbols: int) -> tuple[int, int]:
    """Walk the grid: the one query token's cell and the symbol at its offset."""
    side = int(round(len(inputs) ** 0.5))
    queries = [i for i, token in enumerate(inputs) if token >= num_symbols]
    assert len(queries) == 1, "one query cell per grid"
    (q,) = queries
    dy, dx = OFFSETS[int(inputs[q]) - num_symbols]
    row, col = divmod(q, side)
    assert 0 <= row + dy < side and 0 <= col + dx < side, "the asked cell lies inside the grid"
    return q, int(inputs[(row + dy) * side + col + dx])


def oracle_same_line(inputs: np.ndarray, vocab: tuple[str, ...]) -> tuple[int, str]:
    """Find A and B: B's cell and the answer (row, col or neither)."""
    found = {vocab[t]: i for i, t in enumerate(inputs) if vocab[t] in ("A", "B")}
    assert sorted(found) == ["A", "B"] and sum(vocab[t] != "empty" for t in inputs) == 2
    (ra, ca), (rb, cb) = (cells(len(inputs))[found[m]] for m in ("A", "B"))
    return found["B"], "row" if ra == rb else "col" if ca == cb else "neither"


@pytest.mark.parametrize("length", [64, 256, 1024])
def test_lookup_answers_match_the_oracle(length):
    t = grid_task("lookup")
    batch = t.sequences(TEST, length, 40)
    assert batch.inputs.shape == (40, length) and batch.answers.sum() == 40
    used = set()
    for row in range(40):
        q, expected = oracle_lookup(batch.inputs[row], t.num_symbols)
        assert np.flatnonzero(batch.answers[row]).tolist() == [q]
        assert batch.labels[row, q] == expected
        used.add(int(batch.inputs[row, q]))
    assert len(used) == len(OFFSETS)  # every offset is asked
    assert all(1 <= max(abs(dy), abs(dx)) <= 3 for dy, dx in OFFSETS) and len(set(OFFSETS)) == len(OFFSETS)


@pytest.mark.parametrize("length", [64, 256, 1024])
def test_same_line_answers_match_the_oracle_and_are_balanced(length):
    t = grid_task("same_line")
    batch = t.sequences(TEST, length, 60)
    kinds = Counter()
    for row in range(60):
        b, expected = oracle_same_line(batch.inputs[row], t.vocab)
        assert np.flatnonzero(batch.answers[row]).tolist() == [b]
        assert t.vocab[batch.labels[row, b]] == expected
        kinds[expected] += 1
    assert kinds == {"row": 20, "col": 20, "neither": 20}
    train_kinds = Counter(t.vocab[x] for x in t.train_batch(0, 0, 33).labels[t.train_batch(0, 0, 33).answers])
    assert train_kinds == {"row": 11, "col": 11, "neither": 11}  # balanced in training too


@pytest.mark.parametrize("name", ["lookup", "same_line"])
def test_grids_are_a_pure_function_of_seed_stream_and_length(name):
    t = grid_task(name)
    for a, b in [(t.sequences(TEST, 256, 8), grid_task(name).sequences(TEST, 256, 8)),
                 (t.train_batch(3, 7, 8), grid_task(name).train_batch(3, 7, 8))]:
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.labels, b.labels)
        assert np.array_equal(a.answers, b.answers)
    streams = [t.sequences(VALID, C, 8).tokens, t.sequences(TEST, C, 8).tokens, t.train_batch(0, 0, 8).tokens]
    assert not np.array_equal(streams[0], streams[1]) and not np.array_equal(streams[1], streams[2])
    assert not np.array_equal(t.sequences(TEST, C, 8).tokens, grid_task(name, seed=1).sequences(TEST, C, 8).tokens)
    assert TRAIN != VALID


# ----------------------------------------------------------------------------- baselines


def test_lookup_baselines_are_right():
    t = grid_task("lookup")
    batch = t.sequences(TEST, 256, 50)
    side, k = 16, t.num_symbols
    frequent, per_offset = [], {o: [] for o in OFFSETS}
    for row in range(50):
        q, answer = oracle_lookup(batch.inputs[row], k)
        counts = Counter(int(s) for s in batch.inputs[row] if s < k)
        top = max(counts.values())
        frequent.append(float(min(s for s, c in counts.items() if c == top) == answer))  # lowest on a tie
        r, c = divmod(q, side)
        for dy, dx in OFFSETS:
            inside = 0 <= r + dy < side and 0 <= c + dx < side
            per_offset[(dy, dx)].append(float(batch.inputs[row, (r + dy) * side + c + dx] == answer) if inside else 1 / k)
    got = t.baseline_accuracy(batch)
    assert got["chance"] == pytest.approx(1 / 8)
    assert got["most_frequent"] == pytest.approx(np.mean(frequent))
    assert got["one_offset"] == pytest.approx(max(np.mean(v) for v in per_offset.values()))
    assert got["one_offset"] < 0.5 and got["most_frequent"] < 0.5  # no shortcut reads the asked cell


def test_same_line_baselines_are_right():
    t = grid_task("same_line")
    batch = t.sequences(TEST, C, 200)
    answers = Counter(oracle_same_line(batch.inputs[row], t.vocab)[1] for row in range(200))
    got = t.baseline_accuracy(batch)
    assert got["chance"] == pytest.approx(1 / 3)
    assert got["majority"] == pytest.approx(max(answers.values()) / 200)


# ----------------------------------------------------------------------------- ring bands


def test_grid_entries_report_by_ring_and_sequence_tasks_by_position():
    t = grid_task("lookup")
    batch = t.sequences(TEST, 1024, 100)
    correct = np.random.default_rng(0).random(batch.answers.shape) < 0.5
    entry = task_entry(t, batch, correct, np.zeros(batch.answers.shape), length=1024, train_context=C)
    assert list(entry["by_position"]) == ["0-8", "8-16", "16-32"]
    rings = np.array([max(r, c) for r, c in cells(1024)])
    for band, (a, b) in {"0-8": (0, 8), "8-16": (8, 16), "16-32": (16, 32)}.items():
        inside = batch.answers & ((rings >= a) & (rings < b))[None, :]
        assert entry["by_position"][band]["answers"] == inside.sum() > 0
        rows = inside.any(axis=1)
        assert entry["by_position"][band]["mean"] == pytest.approx(correct[inside].sum() / rows.sum())
    assert sum(v["answers"] for v in entry["by_position"].values()) == 100
    assert entry["by_position"] == entry["by_ring"]  # the answer axis and the bands agree
    assert list(task_entry(t, t.sequences(TEST, C, 4), correct[:4, :C], np.zeros((4, C)), length=C,
                           train_context=C)["by_position"]) == ["0-8"]
    copy = make_task({"name": "copy", "num_symbols": 8}, 32)  # a sequence task: by target position
    batch = copy.sequences(TEST, 128, 4)
    entry = task_entry(copy, batch, np.ones(batch.answers.shape, bool), np.zeros(batch.answers.shape), length=128,
                       train_context=32)
    assert list(entry["by_position"]) == ["0-32", "32-64", "64-128"]
    assert entry["by_position"]["64-128"]["answers"] == batch.answers[:, 64:].sum()


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("section, context, message", [
    ({"name": "lookup", "num_symbols": 1}, C, "task.num_symbols=1 must be an integer >= 2 (task=lookup)"),
    ({"name": "lookup"}, 9, "task=lookup needs grids of at least 4 x 4; set trainer.context >= 16"),
    ({"name": "lookup", "bogus": 1}, C, "valid options: seed, num_symbols, tests, learnt_at_c"),
    ({"name": "same_line"}, 60, "trainer.context=60 is not a square grid"),
    ({"name": "same_line", "radius": 2}, C, "valid options: seed, tests, learnt_at_c"),
])
def test_bad_grid_task_options_are_one_line(section, context, message):
    with pytest.raises(PosbenchError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        make_task(section, context)
    assert "\n" not in str(err.value)


def test_grid_tasks_are_listed_after_the_sequence_tasks():
    assert list_tasks()[:6] == ["flipflop", "assoc_recall", "copy", "life", "lookup", "same_line"]
    with pytest.raises(PosbenchError, match="eval length 9"):
        grid_task("lookup").check_lengths([64, 9])


# ----------------------------------------------------------------------------- end to end

QUICK_GRID = ["logger=none", "trainer.context=16", "trainer.max_steps=4", "trainer.batch_size=8",
              "trainer.log_every=2", "trainer.val_every=2", "trainer.val_sequences=8",
              "trainer.val_extrapolation_sequences=4", "trainer.warmup_steps=1", "trainer.precision=fp32",
              "eval.lengths=[16,64]", "eval.num_sequences=8", "eval.batch_size=8", "task.learnt_at_c=0"]


@pytest.mark.slow
def test_cli_trains_grid_tasks_and_plots_them_by_grid_side(tmp_path):
    runs = []
    for name, method, seed in [("lookup", "axial_rope", 0), ("lookup", "axial_rope", 1), ("lookup", "nope", 0),
                               ("same_line", "axial_rope", 0)]:
        run = tmp_path / f"{name}-{method}-s{seed}"
        overrides = [f"task={name}", f"method={method}", f"seed={seed}", *QUICK_GRID]
        if not runs:  # one through the command line, the others in process
            posbench_cli("train", *overrides, f"hydra.run.dir={run}")
        else:
            train(compose_config("train", overrides), run, log=lambda _: None)
        runs.append(run)
    results = json.loads((runs[0] / "results.json").read_text())
    assert results["task"]["name"] == "lookup" and results["method"] == "axial_rope"
    assert [e["length"] for e in results["task"]["entries"]] == [16, 64]
    assert list(results["task"]["entries"][-1]["by_position"]) == ["0-4", "4-8"]  # rings, not flat indices
    out = tmp_path / "cmp"
    posbench_cli("plot", f"runs=[{','.join(map(str, runs))}]", f"out={out}")
    table = (out / "tasks.md").read_text()
    assert "| method | seeds | 4x4 | 8x8 | interval | not learnt at C |" in table
    assert "**accuracy by ring = max(row, col) at 8x8** (learnt seeds)" in table
    assert "| *baseline: one_offset* |" in table and "| *baseline: majority* |" in table
    assert "Training context 4x4 = 16 cells" in table
    assert "t over 2 seeds" in table  # axial_rope's two seeds of lookup are one group
    assert (out / "tasks_lookup.png").stat().st_size > 0 and (out / "tasks_same_line.png").stat().st_size > 0
    assert (out / "tasks_paired.md").read_text().startswith("# Synthetic tasks: paired differences of accuracy")
    rows = (out / "tasks.csv").read_text().splitlines()
    assert any(r.startswith("lookup,") and ",64,4-8," in r for r in rows)


def fake_run(tmp_path, method: str, seed: int, name: str = "same_line"):
    """A grid task run's record: entries of random right answers on the real test grids."""
    from posbench.runs.run_record import RunRecord

    t = grid_task(name)
    entries = []
    for length in (64, 256, 1024):
        batch = t.sequences(TEST, length, 30)
        correct = np.random.default_rng([seed, length]).random(batch.answers.shape) < (0.99 if length == 64 else 0.5)
        entries.append({**task_entry(t, batch, correct, np.zeros(batch.answers.shape), length=length, train_context=C),
                        "extension": "none"})
    return RunRecord(tmp_path / f"{method}-s{seed}", {
        "method": method, "seed": seed, "train_context": C, "eval": [], "train": {"steps": 600},
        "task": {"name": name, "options": {"seed": 0}, "metrics": ["accuracy"], "chance": t.chance(),
                 "entries": entries, "learnt_at_c": {"learnt": True, "value": 1.0, "threshold": 0.95}}})


def test_grid_comparisons_are_drawn_against_grid_side(tmp_path):
    from posbench.report.tasks import tables_markdown, task_figure, task_tables

    runs = [fake_run(tmp_path, method, seed) for method in ("nope", "axial_rope") for seed in (0, 1)]
    (table,) = task_tables(runs)
    assert table.grid and list(table.groups) == ["nope", "axial_rope"]
    text = tables_markdown([table])
    assert "| method | seeds | 8x8 | 16x16 | 32x32 | interval | not learnt at C |" in text
    assert "| nope | 2 |" in text and "t over 2 seeds" in text
    assert "| *baseline: majority* |" in text and "**accuracy by ring = max(row, col) at 32x32**" in text
    ax = task_figure(table).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8x8", "16x16", "32x32"]
    assert list(ax.get_xticks()) == [8, 16, 32] and ax.get_xlabel().startswith("test grid side")
    assert {line.get_label() for line in ax.get_lines()} >= {"chance", "best shortcut"}
    sequence = task_tables([as_sequence_task(run) for run in runs[:1]])[0]
    assert not sequence.grid and sequence.length_name(128) == "L=128 (2C)"


def as_sequence_task(run):
    """The same record named as a sequence task (copy): lengths stay lengths."""
    from posbench.runs.run_record import RunRecord

    return RunRecord(run.path, {**run.results, "task": {**run.results["task"], "name": "copy"}})


@pytest.mark.parametrize("lengths, message", [
    ("[64]", r"eval.lengths \[64\] has no grid of twice the training side \(\(2 x 8\)\^2 = 256 cells\)"
             r".*e.g. eval.lengths=\[64,256\]$"),
    ("[64,128]", "eval.lengths=128 is not a square grid"),
    ("[16,64,256]", r"has a length below trainer.context=64; .* e.g. eval.lengths=\[64,256\]$"),  # was [128]: no grid
])
def test_grid_eval_lengths_name_a_grid_that_exists(lengths, message):
    """A grid run's lengths were checked as a sequence run's: it asked for 2C = 128 cells, which is
    no grid, and suggested eval.lengths=[64,128], itself refused."""
    from posbench.runs.spec import build_spec

    with pytest.raises(PosbenchError, match=message):
        build_spec(compose_config("train", ["task=life", "method=axial_rope", f"eval.lengths={lengths}"]))
