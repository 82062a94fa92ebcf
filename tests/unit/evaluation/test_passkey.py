"""The passkey evaluation (posbench/evaluation/probes/passkey.py): windows, scoring against oracles, results entries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from posbench.core.errors import PosbenchError
from posbench.data import DataConfig, prepare_data
from posbench.data.retrieval import PasskeyText
from posbench.evaluation.probes import ProbeRun
from posbench.evaluation.probes.merge import merge_probe_entries
from posbench.evaluation.probes.passkey import (
    CHANCE,
    PasskeySettings,
    build_windows,
    draw_haystacks,
    passkey_eval,
    passkey_summary,
)


@pytest.fixture(scope="module", params=["synthetic", pytest.param("sample", marks=pytest.mark.slow)])
def prepared(request):
    """The TinyStories sample with its own BPE (the tokenizer of experiment=cpu_quick: preparing it
    takes seconds, so the slow lane's) and the generated text of data=synthetic with its own BPE
    (the fast lane's: the quick training runs prepare it anyway)."""
    return prepare_data(DataConfig(source=request.param).validate(), log=lambda _: None)


def find(row: list[int], pattern: list[int], last: bool = False) -> int:
    """Start of ``pattern`` in ``row`` (the first or the last occurrence; -1 when absent)."""
    starts = [i for i in range(len(row) - len(pattern) + 1) if row[i : i + len(pattern)] == pattern]
    return (starts[-1] if last else starts[0]) if starts else -1


class Oracle(nn.Module):
    """Reads the key from the needle sentence and predicts it after the question: a perfect
    retriever. Without a needle it predicts token 0 everywhere (never a digit)."""

    def __init__(self, text: PasskeyText, vocab: int):
        super().__init__()
        self.text, self.vocab = text, vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids.shape, self.vocab)  # (B, T, V)
        logits[..., 0] = 1.0
        prefix, suffix = self.text.needle_prefix.tolist(), self.text.needle_suffix.tolist()
        question = self.text.question_prefix.tolist()
        for b, row in enumerate(ids.tolist()):
            start = find(row, prefix)
            asked = find(row, question, last=True)
            if start < 0 or asked < 0:
                continue
            key_start = start + len(prefix)
            key = row[key_start : key_start + find(row[key_start:], suffix)]
            answer_start = asked + len(question)  # the answer's first token is predicted from here - 1
            for i, token in enumerate(key):
                if answer_start - 1 + i < len(row):
                    logits[b, answer_start - 1 + i, token] = 30.0
        return logits


class DigitPrior(nn.Module):
    """Cannot read the key: the same distribution over the digit tokens at every position."""

    def __init__(self, text: PasskeyText, vocab: int):
        super().__init__()
        self.bias = torch.full((vocab,), -30.0)
        self.bias[text.digit_ids] = 0.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(*ids.shape, -1).clone()


def run(model, prepared, **kwargs):
    options = {"lengths": [128, 320], "depths": [0.0, 0.5, 1.0], "num_windows": 6, "log": lambda _: None, **kwargs}
    settings = {k: options.pop(k) for k in list(options) if k in PasskeySettings.__dataclass_fields__}
    (entry,) = passkey_eval(model, prepared.valid_tokens(), prepared.encode, PasskeySettings(**settings),
                            ProbeRun(256, **options))
    return entry


@pytest.mark.slow
def test_an_oracle_that_copies_the_key_scores_one_and_the_control_zero(prepared) -> None:
    entry = run(Oracle(PasskeyText(prepared.encode), prepared.vocab_size), prepared)
    assert len(entry["cells"]) == 6
    for c in entry["cells"]:
        assert c["accuracy"] == 1.0 and c["control_accuracy"] == 0.0
        assert c["logprob"] > -1e-6 and c["gain"] > 20  # the control cannot find the key: about -30 per token
    assert entry["chance"] == CHANCE == 1e-5 and entry["chance_logprob"] == pytest.approx(math.log(1e-5))


def test_a_model_that_cannot_read_the_key_is_at_chance(prepared) -> None:
    entry = run(DigitPrior(PasskeyText(prepared.encode), prepared.vocab_size), prepared, num_windows=16)
    for c in entry["cells"]:
        assert c["accuracy"] == 0.0 and c["control_accuracy"] == 0.0
        assert c["gain"] == 0.0 and c["logprob"] == c["control_logprob"]
    # a uniform prior over the (at least 10) digit tokens gives any key of 5 or more tokens at most chance
    assert all(c["logprob"] <= math.log(CHANCE) + 1e-9 for c in entry["cells"])
    assert passkey_summary([entry])["passkey/gain_L128"] == 0.0


def test_window_and_control_differ_only_in_the_key_sentence(prepared) -> None:
    text = PasskeyText(prepared.encode)
    haystacks = draw_haystacks(prepared.valid_tokens(), 4, 512, seed=0)
    keys = ["12345", "00000", "98765", "55555"]
    built = build_windows(haystacks, keys, text, 300, [0.0, 0.5, 1.0])
    for i, key in enumerate(keys):
        key_ids = text.key_ids(key)
        needle, _ = text.needle(key_ids)
        question, _ = text.question(key_ids, answered=False)
        control = built.control[i]
        assert built.answer[i] == len(key_ids)
        assert prepared.decode(control[-len(question) - len(key_ids):]) == f" What is the pass key? The pass key is {key}"
        assert np.array_equal(control[: 300 - len(question) - len(key_ids)], haystacks[i, : 300 - len(question) - len(key_ids)])
        for depth, rows in built.windows.items():
            differs = np.flatnonzero(rows[i] != control)
            p = round(depth * (300 - len(question) - len(key_ids) - len(needle)))
            assert np.array_equal(rows[i, p : p + len(needle)], needle)
            assert differs.min() >= p and differs.max() < p + len(needle)
            assert built.distances[depth][i] == (300 - len(key_ids)) - (p + len(text.needle_prefix))
        # depth 0: the window's first token; depth 1: right before the question
        assert np.array_equal(built.windows[0.0][i, : len(needle)], needle)
        end = 300 - len(question) - len(key_ids)
        assert np.array_equal(built.windows[1.0][i, end - len(needle) : end], needle)


def test_windows_never_depend_on_the_model(prepared) -> None:
    text = PasskeyText(prepared.encode)
    a = run(Oracle(text, prepared.vocab_size), prepared)
    b = run(DigitPrior(text, prepared.vocab_size), prepared)
    assert a["windows_sha256"] == b["windows_sha256"]
    assert run(DigitPrior(text, prepared.vocab_size), prepared, seed=1)["windows_sha256"] != a["windows_sha256"]


def test_the_evaluation_reads_held_out_text_only(prepared) -> None:
    with pytest.raises(PosbenchError, match="held-out text only"):
        run(DigitPrior(PasskeyText(prepared.encode), prepared.vocab_size), prepared, split="train")
    with pytest.raises(PosbenchError, match="lower eval.passkey.num_windows"):
        run(DigitPrior(PasskeyText(prepared.encode), prepared.vocab_size), prepared, num_windows=10_000)


@pytest.mark.parametrize("passkey, message", [
    ({"lengths": [32]}, "lengths must be integers >= 64"),
    ({"depths": [1.5]}, r"depths must be numbers in \[0, 1\]"),
    ({"split": "train"}, "validation or test"),
    ({"num_windows": 1}, "at least 2"),
    ({"window": 3}, "unknown option.*eval.passkey.window"),
])
def test_bad_passkey_settings_are_refused(passkey, message) -> None:
    from posbench.evaluation.probes import configure_probes
    from posbench.evaluation.settings import eval_settings

    with pytest.raises(PosbenchError, match=message):
        configure_probes(eval_settings({"probes": ["passkey"], "passkey": passkey}), 256)


def test_entries_merge_like_probe_entries() -> None:
    base = {"probe": "passkey", "split": "validation", "extension": "none", "seed": 0, "num_windows": 32,
            "windows_sha256": "a" * 64, "cells": [], "lengths": [256], "precision": "fp32"}
    same = {**base, "cells": [{"accuracy": 1.0}]}
    assert merge_probe_entries([base], [same]) == [same]
    fewer = {**base, "num_windows": 8, "windows_sha256": "b" * 64}
    merged = merge_probe_entries([base], [fewer])
    assert merged[0] == base and merged[1]["variant"] == "num_windows=8"
    ext = {**base, "extension": "yarn"}
    assert merge_probe_entries([base], [ext]) == [base, ext]


PASSKEY = ["eval.passkey.lengths=[64,96]", "eval.passkey.depths=[0.0,1.0]", "eval.passkey.num_windows=3"]


@pytest.mark.slow
def test_training_and_posbench_eval_write_passkey_entries_and_the_heatmap(tmp_path) -> None:
    from helpers import QUICK_TRAIN, compose_config

    from posbench.commands.eval import evaluate_saved_run
    from posbench.runs.results import read_results
    from posbench.train.trainer import train

    run_dir = tmp_path / "run"
    train(compose_config("train", [*QUICK_TRAIN, "eval.probes=[passkey]", *PASSKEY, "eval.figures=true"]), run_dir,
          log=lambda _: None)
    results = read_results(run_dir)
    (entry,) = results["passkey"]
    assert "probes" not in results  # the copy probe's list is left alone
    assert entry["lengths"] == [64, 96] and {(c["length"], c["depth"]) for c in entry["cells"]} == {
        (64, 0.0), (64, 1.0), (96, 0.0), (96, 1.0)}
    assert all(c["past_context"] for c in entry["cells"])  # C = 32
    assert (run_dir / "figures" / "passkey.png").is_file()
    # posbench eval: the same measurement under an extension is added beside it; probes_only skips the loss curves
    before = read_results(run_dir)["eval"]
    evaluate_saved_run(compose_config("eval", [f"run={run_dir}", "probes_only=true", "eval.probes=[passkey]",
                                               "eval.extension=[window]"]), log=lambda _: None)
    again = read_results(run_dir)
    assert [e["extension"] for e in again["passkey"]] == ["none", "window"] and again["eval"] == before
    assert again["passkey"][0]["windows_sha256"] == entry["windows_sha256"] and again["passkey"][0]["checkpoint_step"] == 6
    assert (run_dir / "figures" / "passkey_window.png").is_file()


@pytest.mark.slow
def test_training_with_retrieval_inserts_and_records_it(tmp_path) -> None:
    from helpers import QUICK_TRAIN, compose_config

    from posbench.runs.results import read_results
    from posbench.train.trainer import train

    run_dir = tmp_path / "run"
    options = ["data.retrieval.rate=1.0", "data.retrieval.kinds=[repeat_random]", "data.retrieval.span=4",
               "data.retrieval.max_distance=16"]
    train(compose_config("train", [*QUICK_TRAIN, *options]), run_dir, log=lambda _: None)
    assert read_results(run_dir)["data"]["retrieval"] == {"rate": 1.0, "kinds": ["repeat_random"], "min_distance": 1,
                                                         "max_distance": 16, "span": 4}
    with pytest.raises(PosbenchError, match="does not fit a training window of 33 tokens"):
        train(compose_config("train", [*QUICK_TRAIN, "data.retrieval.rate=1.0", "data.retrieval.kinds=[passkey]"]),
              tmp_path / "refused", log=lambda _: None)


class LearnedTable(DigitPrior):
    """A model whose positions stop at ``max_positions`` (a ``learned`` table)."""

    def __init__(self, text: PasskeyText, vocab: int, max_positions: int):
        super().__init__(text, vocab)
        self.position = nn.Module()
        self.position.max_positions = max_positions


def test_a_learned_model_with_every_length_left_out_is_one_line(prepared) -> None:
    """Every passkey length past the model's learned positions: it logged them left out, then
    crashed with ``ValueError: max() arg is an empty sequence``."""
    model = LearnedTable(PasskeyText(prepared.encode), prepared.vocab_size, max_positions=128)
    with pytest.raises(PosbenchError, match=r"every eval.passkey.lengths \[256\] lies past the model's 128 learned "
                                            r"positions.*e.g. eval.passkey.lengths=\[129\]") as refused:
        run(model, prepared, lengths=[256])
    assert "\n" not in str(refused.value)
    entry = run(model, prepared, lengths=[129, 256])  # one left: measured, the other left out
    assert entry["lengths"] == [129]


@pytest.mark.slow
def test_training_refuses_a_passkey_that_a_learned_model_cannot_reach_before_any_step(tmp_path) -> None:
    """``posbench train`` crashed the same way after every training step had run."""
    from helpers import QUICK_TRAIN, compose_config

    from posbench.train.trainer import train

    run_dir = tmp_path / "run"
    cfg = compose_config("train", [*QUICK_TRAIN, "method=learned", "method.max_positions=64", "eval.probes=[passkey]",
                                   "eval.passkey.lengths=[128]", "eval.passkey.num_windows=2"])
    with pytest.raises(PosbenchError, match=r"every eval.passkey.lengths \[128\] lies past the model's 64 learned"):
        train(cfg, run_dir, log=lambda _: None)
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
