"""Per-position evaluation: exactness against a naive reference, bands, packing, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posbench
from posbench.errors import PosbenchError
from posbench.evaluate import band_means, evaluate_model, per_position_loss

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
    entries = evaluate_model(model, tokens, [64, 32, 64], num_sequences=4, batch_size=3,
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
    again = evaluate_model(model, tokens, [32, 64], num_sequences=4, batch_size=3,
                           train_context=16, device="cpu", log=lambda _: None)
    assert [e["loss_by_position"] for e in again] == [e["loss_by_position"] for e in entries]


def test_fewer_windows_than_requested_are_logged() -> None:
    lines: list[str] = []
    tokens = np.arange(200) % VOCAB
    (entry,) = evaluate_model(tiny(), tokens, [64], num_sequences=10, batch_size=4,
                              train_context=32, device="cpu", log=lines.append)
    assert entry["num_sequences"] == 3  # 200 // 65
    assert any("only 3 of 10" in line for line in lines)


def test_too_short_stream_and_bad_arguments() -> None:
    model, tokens = tiny(), np.arange(50) % VOCAB
    with pytest.raises(PosbenchError):
        evaluate_model(model, tokens, [64], 4, 2, 32, "cpu", log=lambda _: None)
    long_tokens = np.arange(1000) % VOCAB
    for lengths, n, batch in (([0], 4, 2), ([-5], 4, 2), ([], 4, 2), ([16], 0, 2), ([16], 4, 0)):
        with pytest.raises(PosbenchError):
            evaluate_model(model, long_tokens, lengths, n, batch, 8, "cpu", log=lambda _: None)

