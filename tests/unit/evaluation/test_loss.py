"""Per-position evaluation: exactness against a naive reference, bands, packing, validation."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posbench
from posbench.core.errors import PosbenchError
from posbench.evaluation.curves import band_means, effective_length
from posbench.evaluation.loss import (
    evaluate_model,
    per_position_loss,
    sliding_windows,
    windowed_loss,
)
from posbench.evaluation.settings import EvalConfig

VOCAB = 97


def tiny(method: str = "rope") -> nn.Module:
    torch.manual_seed(0)
    return posbench.create_model(method, flavour="tiny", vocab_size=VOCAB).eval()


def naive_reference(model: nn.Module, sequences: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(sequences[:, :-1]).float()  # (N, L, V)
        loss = F.cross_entropy(logits.transpose(1, 2), sequences[:, 1:], reduction="none")  # (N, L)
    return loss.double().mean(dim=0)


@pytest.mark.parametrize("method", ["rope", "alibi", "learned"])
def test_matches_naive_reference_chunked_and_unchunked(method: str) -> None:
    model = tiny(method)
    sequences = torch.randint(0, VOCAB, (7, 41), generator=torch.Generator().manual_seed(1))
    expected = naive_reference(model, sequences)
    whole = per_position_loss(model, sequences, batch_size=7, device="cpu")
    # batch 3 does not divide 7; chunk 6 does not divide 40
    chunked = per_position_loss(model, sequences, batch_size=3, device="cpu", vocab_chunk=6)
    assert whole.shape == (40,) and whole.dtype == torch.float64
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


class ConstantLogits(nn.Module):
    """hidden states are zero, so the logits are exactly the head's bias at every position."""

    def __init__(self, vocab: int = 50, d: int = 4) -> None:
        super().__init__()
        self.lm_head = nn.Linear(d, vocab, bias=True)
        nn.init.zeros_(self.lm_head.weight)
        with torch.no_grad():
            self.lm_head.bias.copy_(torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3)
        self.d = d

    def hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape, self.d)


def test_accumulates_in_float64() -> None:
    model = ConstantLogits()
    row = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(2))
    one = per_position_loss(model, row, batch_size=1, device="cpu")  # float32 losses, exactly
    many = per_position_loss(model, row.repeat(3001, 1), batch_size=7, device="cpu")
    # float32 accumulation of 3001 equal terms would be off by ~1e-5; float64 by ~1e-13
    assert many.dtype == torch.float64
    assert (many - one).abs().max().item() < 1e-10


def test_autocast_bf16_close_to_fp32() -> None:
    model = tiny("rope")
    sequences = torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(3))
    fp32 = per_position_loss(model, sequences, batch_size=2, device="cpu")
    bf16 = per_position_loss(model, sequences, batch_size=2, device="cpu", autocast_dtype=torch.bfloat16)
    assert bf16.dtype == torch.float64
    torch.testing.assert_close(bf16, fp32, rtol=0.02, atol=0.05)


def test_band_means_on_a_known_curve() -> None:
    curve = np.arange(2048, dtype=np.float64)  # loss = position -> band mean = midpoint - 0.5
    bands = band_means(curve, 256)
    assert bands == {"0-256": 127.5, "256-512": 383.5, "512-1024": 767.5, "1024-2048": 1535.5}
    assert band_means(torch.arange(2048.0), 256) == bands


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (512, ["0-256", "256-512"]),
        (1024, ["0-256", "256-512", "512-1024"]),
        (2048, ["0-256", "256-512", "512-1024", "1024-2048"]),
        (1500, ["0-256", "256-512", "512-1024"]),  # 1024-2048 not fully inside
        (300, ["0-256"]),
        (100, []),
    ],
)
def test_band_set(length: int, expected: list[str]) -> None:
    assert list(band_means(np.zeros(length))) == expected


def test_bands_follow_the_train_context() -> None:
    assert list(band_means(np.zeros(512), train_context=128)) == ["0-128", "128-256", "256-512"]


def test_evaluate_model_entries_and_first_windows() -> None:
    model = tiny("alibi")
    tokens = np.random.default_rng(0).integers(0, VOCAB, 5000).astype(np.uint16)
    entries = evaluate_model(model, tokens, EvalConfig(lengths=[64, 32, 64], num_sequences=4, batch_size=3),
                             train_context=16, device="cpu", log=lambda _: None)
    assert [e["length"] for e in entries] == [32, 64]  # sorted, deduplicated
    for entry in entries:
        assert {"split", "length", "num_sequences", "loss_by_position", "bands", "tokens_per_second"} <= set(entry)
        assert entry["split"] == "validation" and entry["num_sequences"] == 4
        assert len(entry["loss_by_position"]) == entry["length"]
        assert entry["tokens_per_second"] > 0
    assert list(entries[1]["bands"]) == ["0-16", "16-32", "32-64"]
    # the selection is the first 4 non-overlapping windows of L + 1 tokens
    windows = torch.from_numpy(tokens[: 4 * 65].astype(np.int64).reshape(4, 65))
    expected = per_position_loss(model, windows, batch_size=4, device="cpu")
    np.testing.assert_allclose(entries[1]["loss_by_position"], expected.numpy(), rtol=1e-6, atol=1e-6)
    again = evaluate_model(model, tokens, EvalConfig(lengths=[32, 64], num_sequences=4, batch_size=3),
                           train_context=16, device="cpu", log=lambda _: None)
    assert [e["loss_by_position"] for e in again] == [e["loss_by_position"] for e in entries]


def test_fewer_windows_than_requested_are_logged() -> None:
    lines: list[str] = []
    tokens = np.arange(200) % VOCAB
    (entry,) = evaluate_model(tiny(), tokens, EvalConfig(lengths=[64], num_sequences=10, batch_size=4),
                              train_context=32, device="cpu", log=lines.append)
    assert entry["num_sequences"] == 3  # 200 // 65
    assert any("only 3 of 10 requested windows" in line for line in lines)


def test_too_short_stream_and_bad_arguments() -> None:
    model, tokens = tiny(), np.arange(50) % VOCAB
    with pytest.raises(PosbenchError):
        evaluate_model(model, tokens, EvalConfig(lengths=[64], num_sequences=4, batch_size=2), 32, "cpu",
                       log=lambda _: None)
    long_tokens = np.arange(1000) % VOCAB
    for lengths, n, batch in (([0], 4, 2), ([-5], 4, 2), ([], 4, 2), ([16], 0, 2), ([16], 4, 0)):
        with pytest.raises(PosbenchError):
            evaluate_model(model, long_tokens, EvalConfig(lengths=lengths, num_sequences=n, batch_size=batch), 8,
                           "cpu", log=lambda _: None)



# --------------------------------------------------------------------------- like-for-like cost


def slow_windowed(model: nn.Module, sequences: torch.Tensor, context: int, stride: int) -> np.ndarray:
    """Per sequence and target t >= C, one model call on the window that scores t: the window
    ends at the first of C+S, C+2S, ..., L above t and holds the C inputs before that end."""
    length = sequences.shape[1] - 1
    ends = list(range(context + stride, length, stride)) + [length]
    out = np.zeros((sequences.shape[0], length - context))
    with torch.no_grad():
        for i, row in enumerate(sequences):
            for t in range(context, length):
                end = next(e for e in ends if e > t)
                window = row[end - context : end].unsqueeze(0)
                logits = model(window)[0, t - (end - context)].double()
                seen = t - (end - context) + 1
                assert context - stride + 1 <= seen <= context
                out[i, t - context] = float(F.cross_entropy(logits, row[t + 1]))
    return out


@pytest.mark.parametrize(("method", "length", "stride"), [("rope", 40, 5), ("alibi", 40, 8), ("learned", 37, 16)])
def test_windowed_loss_matches_one_forward_per_target(method: str, length: int, stride: int) -> None:
    model = tiny(method)
    sequences = torch.randint(0, VOCAB, (3, length + 1), generator=torch.Generator().manual_seed(4))
    expected = slow_windowed(model, sequences, context=16, stride=stride)
    got = windowed_loss(model, sequences, context=16, stride=stride, batch_size=2, device="cpu")
    assert got.shape == (3, length - 16) and got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_sliding_windows_score_every_target_once() -> None:
    for length, context, stride in ((512, 256, 64), (1000, 256, 64), (300, 256, 300), (33, 32, 1)):
        inputs, scored, fresh = sliding_windows(length, context, stride)
        assert sorted(scored[fresh].tolist()) == list(range(context, length))
        assert (inputs[:, -1] == scored[:, -1]).all()  # each window scores its own last positions
        seen = scored - inputs[:, :1] + 1  # inputs up to and including the scored one
        assert int(seen[fresh].min()) >= context - min(stride, context) + 1 and int(seen.max()) == context


def moving_average_loop(values: np.ndarray, window: int) -> np.ndarray:
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - window // 2), min(len(values), i - window // 2 + window)
        out.append(np.mean(values[lo:hi]))
    return np.array(out)


def test_evaluate_model_statistics_against_explicit_computation() -> None:
    model = tiny("rope")
    tokens = np.random.default_rng(5).integers(0, VOCAB, 3000).astype(np.uint16)
    context, stride, eps, window = 16, 6, 0.05, 8
    evaluation = EvalConfig(lengths=[32, 64], num_sequences=5, batch_size=2, window_stride=stride,
                            effective_length_eps=eps)
    entries = evaluate_model(model, tokens, evaluation, train_context=context, device="cpu", log=lambda _: None,
                             effective_length_window=window)
    for entry in entries:
        length = entry["length"]
        sequences = torch.from_numpy(tokens[: 5 * (length + 1)].astype(np.int64).reshape(5, length + 1))
        with torch.no_grad():
            logits = model(sequences[:, :-1]).double()
        full = np.array([[float(F.cross_entropy(logits[i, t], sequences[i, t + 1])) for t in range(length)]
                         for i in range(5)])
        windowed = np.concatenate([full[:, :context], slow_windowed(model, sequences, context, stride)], axis=1)
        edges = [(0, 16), (16, 32)] + ([(32, 64)] if length == 64 else [])
        names = [f"{a}-{b}" for a, b in edges]
        close = dict(rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(entry["loss_by_position"], full.mean(0), **close)
        np.testing.assert_allclose(entry["windowed"]["loss_by_position"], windowed.mean(0), **close)
        np.testing.assert_allclose(entry["cost"]["loss_by_position"], (full - windowed).mean(0), **close)
        assert entry["windowed"]["stride"] == stride and list(entry["bands"]) == names
        for (a, b), name in zip(edges, names):
            np.testing.assert_allclose(entry["bands"][name], full[:, a:b].mean(), **close)
            np.testing.assert_allclose(entry["windowed"]["bands"][name], windowed[:, a:b].mean(), **close)
            np.testing.assert_allclose(entry["cost"]["bands"][name], (full - windowed)[:, a:b].mean(), **close)
            np.testing.assert_allclose(entry["sequence_bands"][name], full[:, a:b].mean(1), **close)
            np.testing.assert_allclose(entry["windowed"]["sequence_bands"][name], windowed[:, a:b].mean(1), **close)
            np.testing.assert_allclose(entry["cost"]["sequence_bands"][name], (full - windowed)[:, a:b].mean(1),
                                       **close)
            ratio = np.exp(full[:, a:b].mean()) / np.exp(full[:, :context].mean())
            np.testing.assert_allclose(entry["perplexity_ratio"][name], ratio, **close)
        assert entry["cost"]["bands"]["0-16"] == 0.0
        cumulative = [np.exp(full[:, : l + 1].mean()) for l in range(length)]
        np.testing.assert_allclose(entry["cumulative_perplexity"], cumulative, **close)
        np.testing.assert_allclose(entry["windowed"]["cumulative_perplexity"],
                                   [np.exp(windowed[:, : l + 1].mean()) for l in range(length)], **close)
        # effective length: first t >= C where the smoothed curve exceeds the reference by > eps
        smooth = moving_average_loop(full.mean(0), window)
        level = full[:, :context].mean()
        expected_in = next((t for t in range(context, length) if smooth[t] > level + eps), length)
        smooth_windowed = moving_average_loop(windowed.mean(0), window)
        expected_win = next((t for t in range(context, length) if smooth[t] > smooth_windowed[t] + eps), length)
        assert entry["effective_length"] == {"eps": eps, "window": window, "in_context": expected_in,
                                             "windowed": expected_win}
        assert entry["sequences_sha256"] == hashlib.sha256(sequences.numpy().tobytes()).hexdigest()


def test_effective_length_on_known_curves() -> None:
    flat = np.full(100, 2.0)
    assert effective_length(flat, 2.0, 20, eps=0.05, window=1) == 100  # never leaves: the length
    step = np.where(np.arange(100) >= 60, 2.2, 2.0)
    assert effective_length(step, 2.0, 20, eps=0.05, window=1) == 60
    assert effective_length(step, step, 20, eps=0.05, window=1) == 100  # same as the reference
    assert effective_length(step - 1.0, 2.0, 20, eps=0.05, window=1) == 100  # better is not a failure


def test_window_stride_above_the_context_is_capped_and_logged() -> None:
    lines: list[str] = []
    tokens = np.random.default_rng(6).integers(0, VOCAB, 500).astype(np.uint16)
    (entry,) = evaluate_model(tiny(), tokens, EvalConfig(lengths=[48], num_sequences=2, batch_size=2, window_stride=64),
                              train_context=16, device="cpu", log=lines.append)
    assert entry["windowed"]["stride"] == 16
    assert any("window_stride=64 is above the training context 16" in line for line in lines)


@pytest.mark.slow
def test_a_run_evaluates_on_training_text_with_the_configured_stride(tmp_path) -> None:
    from helpers import QUICK_TRAIN, compose_config

    from posbench.runs.results import read_results
    from posbench.train.trainer import train

    cfg = compose_config("train", [*QUICK_TRAIN, "method=alibi", "eval.split=train", "eval.window_stride=8",
                                   "eval.effective_length_eps=0.1"])
    train(cfg, tmp_path, log=lambda _: None)
    (entry,) = read_results(tmp_path)["eval"]
    assert entry["split"] == "train" and entry["length"] == 64 and entry["windowed"]["stride"] == 8
    assert entry["effective_length"]["eps"] == 0.1 and set(entry["cost"]["bands"]) == {"0-32", "32-64"}
    assert len(entry["sequence_bands"]["32-64"]) == entry["num_sequences"] == 4


@pytest.mark.parametrize("override", ["eval.window_stride=0", "eval.effective_length_eps=-1"])
def test_bad_eval_options_are_refused(override: str) -> None:
    from helpers import QUICK_TRAIN, compose_config

    from posbench.runs.spec import build_spec

    with pytest.raises(PosbenchError, match=override.split("=")[0]):
        build_spec(compose_config("train", [*QUICK_TRAIN, override]))
