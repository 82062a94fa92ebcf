"""MQAR as Zoology's multiquery_ar (docs/tasks.md): values as labels only, distinct keys and
values, N fixed across lengths, power-law gaps, the baselines, and the length checks."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
import torch
from helpers import compose_config

from posbench.core.errors import PosbenchError
from posbench.evaluation.tasks import sequence_accuracy, task_entry
from posbench.report.tasks import tables_csv, tables_markdown, task_figure, task_tables
from posbench.runs.run_record import RunRecord
from posbench.runs.spec import build_spec
from posbench.tasks import IGNORE, TEST, Batch, TaskBatches, make_task

C = 64
N = 8
LENGTHS = (C, 2 * C, 8 * C)


def mqar(**options):
    return make_task({"name": "assoc_recall", "num_pairs": N, "num_keys": 32, "num_values": 32, **options}, C)


def batches(t, n: int = 64):
    """Training batches and test sequences at C, 2C and 8C."""
    return [t.train_batch(0, 1, n)] + [t.sequences(TEST, L, n) for L in LENGTHS]


def key_oracle(t, batch: Batch) -> np.ndarray:
    """Reads each query key and looks it up among the pairs: ``(N, L)`` predictions."""
    pred = np.full(batch.answers.shape, t.filler)
    for row, inputs in enumerate(batch.inputs):
        pairs = dict(zip(inputs[0:2 * N:2].tolist(), inputs[1:2 * N:2].tolist()))
        for at in np.flatnonzero(batch.answers[row]):
            pred[row, at] = pairs[int(inputs[at])]
    return pred


def eliminator(t, batch: Batch) -> np.ndarray:
    """Never reads the query key: the first pair's value not yet shown as an input after the pairs."""
    pred = np.full(batch.answers.shape, t.filler)
    for row, inputs in enumerate(batch.inputs):
        values = inputs[1:2 * N:2].tolist()
        for at in np.flatnonzero(batch.answers[row]):
            shown = set(inputs[2 * N:at + 1].tolist())
            pred[row, at] = next(v for v in values if v not in shown)
    return pred


def accuracy(pred: np.ndarray, batch: Batch) -> float:
    per_sequence, _ = sequence_accuracy(pred == batch.targets, batch.answers)
    return float(per_sequence.mean())


def test_answers_are_labels_never_inputs():
    t = mqar()
    for batch in batches(t):
        _, y = batch.inputs_targets()
        assert (y[torch.from_numpy(batch.answers)] >= t.num_keys).all()  # every answer is a value
        assert ((y == IGNORE) == torch.from_numpy(~batch.answers)).all()
        for row in range(len(batch.answers)):
            at = np.flatnonzero(batch.answers[row])
            assert (batch.tokens[row, at + 1] == t.filler).all()  # the input after a query key
            region = set(batch.inputs[row, 2 * N:].tolist())
            assert not region & set(batch.targets[row, at].tolist()), "an answer value appears as an input"


def test_keys_and_values_are_distinct_and_every_key_is_queried_once():
    t = mqar()
    for batch in batches(t):
        for row in range(len(batch.answers)):
            keys, values = batch.inputs[row, 0:2 * N:2], batch.inputs[row, 1:2 * N:2]
            assert len(set(keys.tolist())) == N and len(set(values.tolist())) == N
            at = np.flatnonzero(batch.answers[row])
            assert sorted(batch.inputs[row, at].tolist()) == sorted(keys.tolist())


def test_the_number_of_pairs_is_the_same_at_every_length():
    t = mqar()
    for batch in batches(t):
        assert (batch.answers.sum(axis=1) == N).all()
        assert (batch.inputs[:, 2 * N:] < t.num_keys).sum(axis=1).tolist() == [N] * len(batch.answers)


def test_gaps_follow_zoologys_power_law_and_grow_with_length():
    """One pair: its query slot is drawn from p(g) ~ (g + 1) ** (a - 1) exactly; with N pairs the
    gaps spread over the longer query region at longer lengths."""
    for power_a in (0.01, 1.0):
        one = mqar(num_pairs=1, power_a=power_a)
        length = 4 * C
        batch = one.sequences(TEST, length, 4000)
        slots = (np.flatnonzero(batch.answers.ravel()) % length - 2) // 2
        expected = one.gap_probabilities((length - 2) // 2)
        edges = [0, 1, 2, 4, 8, 16, 32, 64, len(expected)]  # log-spaced bins of the slot
        seen = np.histogram(slots, edges)[0] / len(slots)
        want = np.add.reduceat(expected, edges[:-1])
        assert 0.5 * np.abs(seen - want).sum() < 0.03, (power_a, seen, want)  # total variation distance
    p = one.gap_probabilities(100)
    assert np.isclose(p.sum(), 1.0) and np.allclose(mqar().gap_probabilities(10)[:3] / mqar().gap_probabilities(10)[0],
                                                    [1.0, 2 ** -0.99, 3 ** -0.99])
    t = mqar()
    mean_gap = {L: np.mean(np.flatnonzero(t.sequences(TEST, L, 200).answers.ravel()) % L - 2 * N) for L in LENGTHS}
    assert mean_gap[8 * C] > 4 * mean_gap[C]


def test_an_oracle_that_reads_keys_is_right_and_elimination_is_the_in_context_guess():
    t = mqar()
    for batch in batches(t, 200):
        assert accuracy(key_oracle(t, batch), batch) == 1.0
        base = t.baseline_accuracy(batch)
        assert base == {"chance": 1 / 32, "in_context": 1 / N, "elimination": 1 / N}
        assert abs(accuracy(eliminator(t, batch), batch) - 1 / N) < 0.04  # not 0.34: nothing to eliminate


def test_the_elimination_baseline_sees_the_shortcut_where_answers_are_inputs():
    """The same sequences with each value written after its query key (posbench's MQAR before it
    followed Zoology): elimination answers the j-th query with probability 1 / (N - j)."""
    t = mqar()
    batch = t.sequences(TEST, C, 400)
    tokens = batch.tokens.copy()
    rows, at = np.nonzero(batch.answers)
    tokens[rows, at + 1] = batch.labels[rows, at]
    shown = Batch(tokens, batch.answers, batch.labels)
    odds = t.guesses(shown)["elimination"]
    ranks = np.cumsum(batch.answers, axis=1) - 1  # (S, L): the query rank j at each answer
    for j in range(N):
        assert np.allclose(odds[batch.answers & (ranks == j)], 1 / (N - j))
    assert abs(t.baseline_accuracy(shown)["elimination"] - np.mean([1 / (N - j) for j in range(N)])) < 1e-9
    assert abs(accuracy(eliminator(t, shown), shown) - 0.34) < 0.04


def test_training_batches_carry_the_labels_and_entries_the_baselines():
    t = mqar()
    x, y = TaskBatches(t, 8, seed=0).get(3)
    batch = t.train_batch(0, 3, 8)
    assert torch.equal(x, torch.from_numpy(batch.inputs)) and torch.equal(y, torch.from_numpy(batch.labels))

    test = t.sequences(TEST, 2 * C, 50)
    entry = task_entry(t, test, key_oracle(t, test) == test.targets, np.zeros(test.answers.shape), length=2 * C,
                       train_context=C)
    assert entry["accuracy"]["mean"] == 1.0 and entry["answers"] == 50 * N
    assert entry["baselines"] == {"chance": 1 / 32, "in_context": 1 / N, "elimination": 1 / N}
    flipflop = make_task({"name": "flipflop"}, C)
    other = flipflop.sequences(TEST, C, 4)
    flipflop_baselines = task_entry(flipflop, other, np.zeros(other.answers.shape, dtype=bool),
                                    np.zeros(other.answers.shape), length=C, train_context=C)["baselines"]
    assert "in_context" not in flipflop_baselines and "elimination" not in flipflop_baselines


def test_the_shortest_length_is_checked_and_named_at_once():
    def refusal(*overrides: str) -> str:
        with pytest.raises(PosbenchError) as err:
            build_spec(compose_config("train", ["task=assoc_recall", "logger=none", *overrides]))
        assert "\n" not in str(err.value)
        return str(err.value)

    # N is fixed: 8 keys serve every length (this asked for 16, then 32, then 64 keys)
    spec = build_spec(compose_config("train", ["task=assoc_recall", "logger=none", "task.num_keys=8",
                                               "task.num_values=8"]))
    assert spec.task.num_keys == 8 and max(spec.eval.lengths) == 8 * C
    assert "raise task.num_keys to 8" in refusal("task.num_keys=4")
    assert "raise task.num_values to 8" in refusal("task.num_values=7")
    assert "task.num_pairs=17 needs a training context of at least 68" in refusal("task.num_pairs=17")
    # eval.lengths are >= C >= 4 N in a run; the task itself names the shortest length that cannot hold N pairs
    with pytest.raises(PosbenchError) as err:
        mqar().check_lengths([24, 16, 64])
    message = str(err.value)
    assert "at length 16" in message and "task.num_pairs<=4" in message and "below 32" in message
    mqar().check_lengths([32, 64, 512])
    assert "task.power_a=0 must be in (0, 1]" in refusal("task.power_a=0")


def test_the_task_report_shows_the_baselines_beside_the_accuracy(tmp_path):
    t = mqar()
    entries = []
    for L in (C, 2 * C):
        test = t.sequences(TEST, L, 20)
        correct = key_oracle(t, test) == test.targets
        entries.append({**task_entry(t, test, correct, np.zeros(test.answers.shape), length=L, train_context=C),
                        "extension": "none"})
    results = {"method": "rope", "seed": 0, "train_context": C, "eval": [], "train": {"steps": 1},
               "task": {"name": t.name, "options": {"num_pairs": N}, "metrics": ["accuracy"], "chance": t.chance(),
                        "entries": entries}}
    table = task_tables([RunRecord(tmp_path / "run", results)])[0]
    for L in (C, 2 * C):
        assert table.baselines("standard", L) == {"chance": 1 / 32, "in_context": 1 / N, "elimination": 1 / N}
    markdown = tables_markdown([table])
    assert "| *baseline: in_context* | | 0.125 | 0.125 |" in markdown
    assert "| *baseline: elimination* | | 0.125 | 0.125 |" in markdown and "| rope | 1 | 1.000" in markdown
    rows = [r for r in csv.DictReader(io.StringIO(tables_csv([table]))) if r["positions"] == "all"]
    assert {json.loads(r["baselines"])["elimination"] for r in rows if r["length"] == str(C)} == {0.125}
    labels = [line.get_label() for line in task_figure(table).axes[0].get_lines()]
    assert "chance" in labels and "best shortcut" in labels


@pytest.mark.parametrize("name", ["flipflop", "copy"])
def test_other_tasks_still_predict_the_next_input(name):
    """Labels apart from the inputs are MQAR's alone: flip-flop and copy targets are the next
    input token, and their sequences' checksums are over the tokens, as before."""
    batch = make_task({"name": name}, C).sequences(TEST, 2 * C, 8)
    x, y = batch.inputs_targets()
    want = torch.from_numpy(batch.tokens[:, 1:].copy())
    want[~torch.from_numpy(batch.answers)] = IGNORE
    assert batch.labels is None and torch.equal(x, torch.from_numpy(batch.tokens[:, :-1])) and torch.equal(y, want)
    assert batch.fingerprint_ids() is batch.tokens
