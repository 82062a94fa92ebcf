"""Synthetic tasks (docs/tasks.md): generators against oracles, seeds, answer-only
scoring, a tiny model learning flip-flop, and the CLI end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import QUICK_TASK, compose_config

from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.evaluation.settings import EvalConfig
from posbench.evaluation.tasks import answer_scores, evaluate_task, task_entry
from posbench.methods import list_methods
from posbench.model.transformer import ModelConfig, build_model, lm_loss
from posbench.runs.spec import build_spec
from posbench.tasks import IGNORE, TEST, VALID, TaskBatches, list_tasks, make_task
from posbench.train.trainer import train

C = 32
TASKS = {"flipflop": {}, "assoc_recall": {"num_pairs": 4, "num_keys": 32, "num_values": 16}, "copy": {"num_symbols": 8}}


def task(name: str, **options):
    return make_task({"name": name, **TASKS[name], **options}, C)


# ----------------------------------------------------------------------------- oracles


def oracle_flipflop(tokens: np.ndarray, length: int) -> tuple[np.ndarray, list[int]]:
    """Walk the instructions: answers after every read, each the last written bit."""
    answers, expected, last = np.zeros(length, dtype=bool), [], None
    for t in range(0, length, 2):
        op, bit = int(tokens[t]), int(tokens[t + 1])
        assert op in (0, 1, 2) and bit in (3, 4)
        if t == 0:
            assert op == 0, "a sequence starts with a write"
        if op == 0:
            last = bit
        elif op == 2:
            answers[t] = True
            expected.append(last)
    return answers, expected


def oracle_assoc_recall(tokens: np.ndarray, length: int, keys: int, filler: int) -> tuple[np.ndarray, list[int]]:
    """Read the key-value pairs up to the first filler or repeated key; every later key is a
    query whose answer is its pair's value (a label: the next input is the filler)."""
    pairs: dict[int, int] = {}
    t = 0
    while t + 1 <= length and tokens[t] < keys and int(tokens[t]) not in pairs:
        assert keys <= tokens[t + 1] < filler
        pairs[int(tokens[t])] = int(tokens[t + 1])
        t += 2
    answers, expected = np.zeros(length, dtype=bool), []
    for u in range(t, length):
        if tokens[u] < keys:
            answers[u] = True
            expected.append(pairs[int(tokens[u])])
            assert tokens[u + 1] == filler, "the value is never an input in the query region"
    assert sum(answers) == len(pairs), "every key is queried once"
    return answers, expected


def oracle_copy(tokens: np.ndarray, length: int, sep: int) -> tuple[np.ndarray, list[int]]:
    n = int(np.flatnonzero(tokens == sep)[0])
    answers = np.zeros(length, dtype=bool)
    answers[n:2 * n] = True
    return answers, [int(v) for v in tokens[:n]]


@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("length", [C, 2 * C, 4 * C + 1])
def test_generated_answers_match_an_oracle(name, length):
    t = task(name)
    for batch in (t.sequences(TEST, length, 16), t.train_batch(0, 3, 16) if length == C else t.sequences(TEST, length, 1)):
        L = batch.answers.shape[1]
        assert batch.tokens.shape == (batch.answers.shape[0], L + 1) and batch.tokens.max() < t.vocab_size
        for row in range(batch.tokens.shape[0]):
            tokens = batch.tokens[row]
            if name == "flipflop":
                answers, expected = oracle_flipflop(tokens, L)
            elif name == "assoc_recall":
                answers, expected = oracle_assoc_recall(tokens, L, t.num_keys, t.filler)
                assert answers.sum() == t.num_pairs
            else:
                answers, expected = oracle_copy(tokens, L, t.sep)
            np.testing.assert_array_equal(batch.answers[row], answers)
            assert [int(v) for v in batch.targets[row][answers]] == expected  # the target at each answer


def test_copy_tests_the_longest_string_and_trains_on_strings_up_to_c():
    t = task("copy")
    test = t.sequences(TEST, 4 * C, 4)
    assert (test.answers.sum(axis=1) == 2 * C).all()  # n = L / 2 at L = 4C
    sizes = np.concatenate([t.train_batch(0, s, 64).answers.sum(axis=1) for s in range(4)])
    assert sizes.min() >= 1 and sizes.max() <= C // 2 and len(set(sizes.tolist())) > C // 4


def test_flipflop_sparse_and_dense_variants_set_the_ignore_rate():
    sparse = task("flipflop", p_ignore=0.98)
    dense = task("flipflop", p_ignore=0.8, eval_p_ignore=0.1)
    ops_sparse = sparse.train_batch(0, 0, 64).tokens[:, 2::2]
    assert abs((ops_sparse == 1).mean() - 0.98) < 0.02
    train, test = dense.train_batch(0, 0, 64).tokens[:, 2::2], dense.sequences(TEST, C, 64).tokens[:, 2::2]
    assert abs((train == 1).mean() - 0.8) < 0.05 and abs((test == 1).mean() - 0.1) < 0.05


# ----------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("name", list(TASKS))
def test_generation_is_deterministic_by_seed_and_splits_differ(name):
    t = task(name)
    a, b = t.sequences(TEST, 2 * C, 8), task(name).sequences(TEST, 2 * C, 8)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(t.train_batch(1, 5, 8).tokens, task(name).train_batch(1, 5, 8).tokens)
    assert not np.array_equal(t.train_batch(1, 5, 8).tokens, t.train_batch(1, 6, 8).tokens)  # steps
    assert not np.array_equal(t.train_batch(1, 5, 8).tokens, t.train_batch(2, 5, 8).tokens)  # run seeds
    assert not np.array_equal(a.tokens, task(name, seed=1).sequences(TEST, 2 * C, 8).tokens)  # task seed
    # train, validation and test are separate streams: no training row is a test/validation row
    train = {r.tobytes() for s in range(20) for r in t.train_batch(0, s, 16).tokens}
    for stream in (TEST, VALID):
        held_out = {r.tobytes() for r in t.sequences(stream, C, 64).tokens}
        assert not train & held_out, f"{name}: a training sequence equals a held-out one"
    assert not {r.tobytes() for r in t.sequences(TEST, C, 64).tokens} & {r.tobytes() for r in t.sequences(VALID, C, 64).tokens}


def test_task_batches_are_a_function_of_step_and_split_across_ranks():
    t = task("flipflop")
    x, y = TaskBatches(t, 8, seed=0).get(4)
    x0, y0 = TaskBatches(t, 8, seed=0, rank=0, world_size=2).get(4)
    x1, _ = TaskBatches(t, 8, seed=0, rank=1, world_size=2).get(4)
    assert torch.equal(x[0::2], x0) and torch.equal(x[1::2], x1) and torch.equal(y[0::2], y0)
    batch = t.train_batch(0, 4, 8)
    assert torch.equal(y != IGNORE, torch.from_numpy(batch.answers))  # only answers are targets


# ----------------------------------------------------------------------------- answer-only scoring


def tiny_model(vocab: int, method: str = "rope", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, **overrides)
    return build_model(cfg, method)


def test_training_loss_counts_only_answer_targets(monkeypatch):
    t = task("flipflop")
    x, y = TaskBatches(t, 4, seed=0).get(0)
    model = tiny_model(t.vocab_size)
    hidden = model.hidden_states(x).detach()  # (B, T, D)
    answers = y != IGNORE
    loss = lm_loss(hidden, model.lm_head, y)
    changed = hidden.clone()
    changed[~answers] += 5 * torch.randn_like(changed[~answers])  # every non-answer logit moves
    assert torch.equal(lm_loss(changed, model.lm_head, y), loss)
    b, t_ = answers.nonzero()[0].tolist()
    changed[b, t_] += 5.0  # one answer's logits move
    assert not torch.equal(lm_loss(changed, model.lm_head, y), loss)
    # the CPU path that makes the logits a chunk of rows at a time takes the same mean over answers
    import posbench.model.transformer as model_module

    reference = torch.nn.functional.cross_entropy(model.lm_head(hidden).flatten(0, 1), y.flatten())
    monkeypatch.setattr(model_module, "CPU_LOGITS_CHUNK_BYTES", 4 * t.vocab_size * 7)  # 7 rows per chunk
    torch.testing.assert_close(lm_loss(hidden, model.lm_head, y), reference)


@pytest.mark.parametrize("chunk_rows", [None, 7])
def test_a_micro_batch_without_answers_adds_zero_loss(monkeypatch, chunk_rows):
    """Sparse flip-flop (p_ignore 0.98) leaves most short micro-batches without a read: their loss
    was 0 / 0 = NaN and stopped the run at step 1 with a misleading message."""
    import posbench.model.transformer as model_module

    t = task("flipflop")
    if chunk_rows is not None:  # the CPU path that makes the logits a chunk of rows at a time
        monkeypatch.setattr(model_module, "CPU_LOGITS_CHUNK_BYTES", 4 * t.vocab_size * chunk_rows)
    x, y = TaskBatches(t, 2, seed=0).get(0)
    model = tiny_model(t.vocab_size)
    loss = model(x, targets=torch.full_like(y, IGNORE))
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert model(x, targets=y).item() > 0  # a micro-batch with answers is unchanged


def test_accuracy_and_eval_loss_count_only_answer_targets():
    t = task("copy")
    batch = t.sequences(TEST, 2 * C, 6)
    model = tiny_model(t.vocab_size)
    correct, loss = answer_scores(model, batch, 4, torch.device("cpu"))
    entry = task_entry(t, batch, correct, loss, length=2 * C, train_context=C)
    flipped_correct, noisy_loss = correct.copy(), loss.copy()
    flipped_correct[~batch.answers] = ~flipped_correct[~batch.answers]
    noisy_loss[~batch.answers] += 3.0
    again = task_entry(t, batch, flipped_correct, noisy_loss, length=2 * C, train_context=C)
    assert again == entry
    # the entry's numbers are those of the answers alone
    rows = [(correct[r][batch.answers[r]], loss[r][batch.answers[r]]) for r in range(6)]
    assert entry["accuracy"]["mean"] == pytest.approx(np.mean([c.mean() for c, _ in rows]))
    assert entry["loss"] == pytest.approx(np.mean(np.concatenate([e for _, e in rows])))
    assert entry["exact_match"]["mean"] == np.mean([c.all() for c, _ in rows])


def test_entries_bucket_answers_by_position_past_c():
    t = task("flipflop")
    batch = t.sequences(TEST, 4 * C, 8)
    correct = np.zeros_like(batch.answers)
    correct[:, C:] = True  # right exactly past C
    entry = task_entry(t, batch, correct, np.zeros(batch.answers.shape), length=4 * C, train_context=C)
    by = entry["by_position"]
    assert list(by) == [f"0-{C}", f"{C}-{2 * C}", f"{2 * C}-{4 * C}"]
    assert by[f"0-{C}"]["mean"] == 0.0 and by[f"{C}-{2 * C}"]["mean"] == by[f"{2 * C}-{4 * C}"]["mean"] == 1.0
    assert sum(b["answers"] for b in by.values()) == entry["answers"] == int(batch.answers.sum())
    assert entry["accuracy"]["low"] <= entry["accuracy"]["mean"] <= entry["accuracy"]["high"]
    assert entry["accuracy"]["kind"] == "bootstrap" and entry["accuracy"]["n"] == len(entry["sequence_accuracy"])


@pytest.mark.slow
def test_a_tiny_model_learns_flipflop_at_c():
    """About 10-20 s on one core: 150 steps of a d_model 32 model at C = 32."""
    t = task("flipflop")
    model = tiny_model(t.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = TaskBatches(t, 32, seed=0)
    for step in range(150):
        x, y = batches.get(step)
        loss = model(x, targets=y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    evaluation = EvalConfig(lengths=[C], num_sequences=100, batch_size=50)
    entry = evaluate_task(model, t, evaluation, C, torch.device("cpu"), None, log=lambda _: None)[0]
    assert t.chance() == 0.5 and entry["accuracy"]["low"] > 0.8, entry["accuracy"]


@pytest.mark.parametrize("method", list_methods())
def test_every_method_trains_on_a_task_and_is_evaluated_up_to_8c(method):
    """Each method takes a training step on a task's vocabulary and answers-only targets, and its
    evaluation runs at C, 2C and 8C (past any position it trained on)."""
    t = task("flipflop")
    model = tiny_model(t.vocab_size, method)
    x, y = TaskBatches(t, 4, seed=0).get(0)  # (4, C) each
    loss = model(x, targets=y)
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    evaluation = EvalConfig(lengths=[C, 2 * C, 8 * C], num_sequences=4, batch_size=4)
    entries = evaluate_task(model, t, evaluation, C, torch.device("cpu"), None, log=lambda _: None)
    assert [e["length"] for e in entries] == [C, 2 * C, 8 * C]
    for e in entries:
        assert e["answers"] > 0 and 0.0 <= e["accuracy"]["mean"] <= 1.0 and math.isfinite(e["loss"])


@pytest.mark.slow
def test_randomized_positions_and_the_window_baseline_train_on_a_task(tmp_path):
    """positions.randomize_max and model.attention_window reach a task run as a text run: the
    run is labelled rope+rand<N> and the model records its window."""
    cfg = compose_config("train", ["task=flipflop", "method=rope", *QUICK_TASK, "positions.randomize_max=128",
                                   "model.attention_window=16"])
    results = train(cfg, tmp_path / "run", log=lambda _: None)
    assert results["method"] == "rope+rand128" and results["model"]["attention_window"] == 16
    assert [e["length"] for e in results["task"]["entries"] if e["test_set"] == "standard"] == [32, 64, 128]


def test_task_evaluation_uses_the_extension_settings():
    """eval.rerope.* / eval.self_extend.* reach a task's evaluation as a text run's, and the
    entry records them (they were dropped: the extensions ran at their defaults)."""
    from posbench.model.extension import extended

    t = task("flipflop")
    model = tiny_model(t.vocab_size)
    evaluation = from_section(EvalConfig, "eval", {
        "lengths": [4 * C], "num_sequences": 4, "batch_size": 4, "extension": ["rerope", "self_extend"],
        "rerope": {"window": 3, "log_scaling": False}, "self_extend": {"window": 5, "group": 2}})
    entries = evaluate_task(model, t, evaluation, C, torch.device("cpu"), None, log=lambda _: None)
    by_extension = {e["extension"]: e for e in entries}
    assert by_extension["rerope"]["extension_options"] == {"window": 3, "leaky": None, "log_scaling": False}
    assert by_extension["self_extend"]["extension_options"] == {"window": 5, "group": 2}
    assert "extension_options" not in by_extension["none"]
    batch = t.sequences(TEST, 4 * C, 4)
    with extended(model, "rerope", C, 4 * C, None, evaluation.extension_options()):
        _, loss = answer_scores(model, batch, 4, torch.device("cpu"))
    assert by_extension["rerope"]["loss"] == float(loss[batch.answers].mean())


def test_a_length_without_any_answer_is_recorded_not_a_crash():
    """Sparse flip-flop on few test sequences can hold no read at all: the log line formatted the
    accuracy's None mean and the run died after training, its results unwritten."""
    t = task("flipflop", eval_p_ignore=0.999999)
    lines = []
    evaluation = EvalConfig(lengths=[C], num_sequences=2, batch_size=2)
    entry = evaluate_task(tiny_model(t.vocab_size), t, evaluation, C, torch.device("cpu"), None, log=lines.append)[0]
    assert entry["answers"] == 0 and entry["accuracy"]["mean"] is None and entry["loss"] is None
    assert "accuracy - (no answer)" in lines[0]


# ----------------------------------------------------------------------------- options and the CLI


@pytest.mark.parametrize("section, message", [
    ({"name": "flipflop", "p_ignore": 1.5}, "task.p_ignore=1.5 must be a probability"),
    ({"name": "flipflop", "bogus": 1}, "valid options: seed, p_ignore, eval_p_ignore"),
    ({"name": "nope"}, "unknown task 'nope'; choose one of: flipflop, assoc_recall, copy, life, lookup, same_line"),
    ({"name": "assoc_recall", "num_pairs": 9}, "task.num_pairs=9 needs a training context of at least 36"),
    ({"name": "copy", "num_symbols": 1}, "task.num_symbols=1 must be an integer >= 2"),
])
def test_bad_task_options_are_one_line(section, message):
    with pytest.raises(PosbenchError, match=message.replace("(", r"\(").replace("[", r"\[")) as err:
        make_task(section, C)
    assert "\n" not in str(err.value)
    assert list_tasks()[:3] == ["flipflop", "assoc_recall", "copy"]  # the sequence tasks, then the grid tasks


@pytest.mark.slow
def test_a_run_refuses_bad_task_settings_before_any_work():
    def refusal(*overrides: str) -> str:
        with pytest.raises(PosbenchError) as err:
            build_spec(compose_config("train", ["task=assoc_recall", *QUICK_TASK, *overrides]))
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "task.num_values=1 must be an integer >= 2" in refusal("task.num_values=1")
    assert "raise task.num_keys to 8" in refusal("task.num_keys=4")
    assert "drop eval.probes" in refusal("eval.probes=[copy]", "eval.copy.span=8")
    assert "set trainer.max_steps" in refusal("trainer.max_steps=null")
    # negative seeds passed build_spec and failed in numpy at the first batch, after the run started
    assert "task.seed must be an integer >= 0, got -1" in refusal("task.seed=-1")
    assert "a task run's seed must be >= 0" in refusal("seed=-3")
