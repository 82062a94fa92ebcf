"""Checks the method and model test files share: fixed inputs (``qk``, ``ids``), methods and small
models of a given method (``make_method``, ``small_model``), the full attention logits of a method
(``full_scores``), checks against an independent reference (``assert_matches_reference``, which
also logs the measured difference for scripts/reference_table.py), causality at a length past the
training context and a gradient for every method parameter (``check_causal_and_trained``,
``assert_causal_model``), and ALiBi's bias written out as a reference base."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import posbench
from posbench.methods import dense_score

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


def assert_matches_reference(actual: torch.Tensor, expected: torch.Tensor, *, method: str, reference: str,
                             atol: float | None = None, rtol: float | None = None) -> None:
    """``torch.testing.assert_close`` for a method checked against an independent reference,
    which also records the largest absolute difference when ``POSBENCH_REFERENCE_LOG`` names a
    file: ``scripts/reference_table.py`` runs these tests and tabulates the measured maxima."""
    log = os.environ.get("POSBENCH_REFERENCE_LOG")
    if log:
        diff = (actual.detach().double() - expected.detach().double()).abs()
        record = {"method": method, "reference": reference, "dtype": str(actual.dtype).replace("torch.", ""),
                  "max_abs_diff": float(diff.max()) if diff.numel() else 0.0, "elements": diff.numel(),
                  "atol": atol, "rtol": rtol, "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def methods_with(predicate) -> list[str]:
    """Registered methods whose class satisfies ``predicate`` (its declared traits), in registry
    order: test lists follow the registry, so a new method needs no edit here."""
    from posbench.methods import list_methods, method_class

    return [name for name in list_methods() if predicate(method_class(name))]


def qk(B=2, H=4, T=24, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    return q, k


def layer_input(q, d_model=32, seed=5):
    """A stand-in attention input x (B, T, d_model) for content-dependent methods (fox)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(q.shape[0], q.shape[2], d_model, generator=g, dtype=q.dtype)


def full_scores(method, q, k, positions, layer=0):
    """q.k / sqrt(D) after rotate_qk, plus the dense score term: (B, H, T, T)."""
    qr, kr = method.rotate_qk(q, k, positions, layer)
    B, H, T, D = q.shape
    s = torch.einsum("bhid,bhjd->bhij", qr.double(), kr.double()) * D**-0.5
    x = layer_input(q, method.dims.d_model)
    fn = method.score_term(qr, positions, layer, k=kr, x=x) if method.has_score_term else None
    if fn is not None:
        s = s + dense_score(fn, B, H, T, q.device).double()
    return s


def causal(T):
    idx = torch.arange(T)
    return idx[:, None] >= idx[None, :]


def make_method(name, d_model=32, n_heads=4, n_layers=2, randomise=True, **options):
    """Method ``name`` in float64, its parameters drawn positive (valid for every method) unless
    ``randomise`` is false."""
    torch.manual_seed(0)
    from posbench.methods import ModelDims, build_method

    m = build_method(name, ModelDims(d_model, n_heads, n_layers), **options)
    if randomise:
        with torch.no_grad():
            for p in m.parameters():
                p.uniform_(0.2, 1.2)  # positive: valid for kerple's r1, r2 and fire's c
    return m.double()


def dense_term(m, q, pos, layer=0, k=None):
    """The score term of ``m`` materialised: (B, H, T, T) float64."""
    B, H, T, _ = q.shape
    fn = m.score_term(q, pos, layer, k=k, x=layer_input(q, m.dims.d_model))
    return dense_score(fn, B, H, T, q.device).double()


def assert_causal_model(model, length: int, changed_at: int, vocab: int = 64) -> torch.Tensor:
    """Changing input token ``changed_at`` of a (1, length) sequence changes no earlier logit and
    does change a later one; the logits (1, length, vocab) are finite. Returns them."""
    idx = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, changed_at] = (idx[0, changed_at] + 1) % vocab
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[0, :changed_at], b[0, :changed_at], atol=0, rtol=0)
    assert not torch.allclose(a[0, changed_at:], b[0, changed_at:])
    return a
