"""Checks the method test files share (tests/test_methods_path.py, _dape.py, _ssmax.py): causality
at a length past the training context and a gradient for every method parameter, for a method
with given options (the generic suites run each method with its defaults only), and ALiBi's bias
written out as a reference base."""

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


def check_causal_and_trained(name: str, options: dict | None, T: int, t: int) -> set[str]:
    """Method ``name`` with ``options`` in a small model: changing tokens from ``t`` on changes no
    logit before ``t`` (and does change later ones) at length ``T``, and every method parameter
    gets a gradient. Returns the names of its position parameters."""
    before, after = future_change_effect(small_model(name, options).eval(), T, t)
    assert before == 0.0 and after > 1e-4, (before, after)
    model = small_model(name, options)
    assert not untrained_parameters(model, T), untrained_parameters(model, T)
    return set(model.position.position_parameters())


def alibi_bias(T: int, H: int) -> torch.Tensor:
    """Press et al.: -m_h (i - j), m_h = 2^(-8 h / H), h = 1..H (H a power of two) -> (H, T, T) fp64."""
    slopes = torch.tensor([2.0 ** (-8 * h / H) for h in range(1, H + 1)], dtype=torch.float64)
    d = torch.arange(T).view(-1, 1) - torch.arange(T).view(1, -1)
    return -slopes.view(-1, 1, 1) * d.double()
