"""Whole-model checks the method test files share (tests/test_methods_path.py, _dape.py, _ssmax.py):
causality at a length past the training context and a gradient for every method parameter, for a
method with given options (the generic suites run each method with its defaults only)."""

from __future__ import annotations

import torch
from torch import nn

import posbench

VOCAB = 64


def small_model(name: str, options: dict | None = None, **overrides) -> nn.Module:
    """A tiny model (d_model 64, 4 heads, 2 layers) of method ``name`` with ``options``, seed 0."""
    torch.manual_seed(0)
    return posbench.create_model(name, flavour="tiny", vocab_size=VOCAB, method_options=options, **overrides)


def ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def future_change_effect(model: nn.Module, T: int, t: int) -> tuple[float, float]:
    """Logits of two sequences equal before ``t`` and different from ``t`` on: (largest change
    before t, largest change from t on)."""
    a = ids(2, T, seed=1)
    b = a.clone()
    b[:, t:] = ids(2, T - t, seed=2)
    b[:, t] = (a[:, t] + 1) % VOCAB
    with torch.no_grad():
        diff = (model(a) - model(b)).abs()
    return float(diff[:, :t].max()), float(diff[:, t:].max())


def untrained_parameters(model: nn.Module, T: int) -> list[str]:
    """Names of the method's parameters that get no (or an all-zero) gradient from one LM loss."""
    idx = ids(2, T)
    logits = model(idx)
    nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
    return [n for n, p in model.position.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
