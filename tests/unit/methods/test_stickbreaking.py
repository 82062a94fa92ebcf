"""Stick-breaking attention against the paper's formula, written out here as a loop over (i, j),
and against the matrix form of the reference's ``sb_ref.stickbreaking`` (shawntan/stickbreaking-
attention), re-derived here: a mask, log-sigmoids and a product with a strictly lower triangular
matrix."""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import assert_causal_model, assert_matches_reference
from torch import nn

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method
from posbench.model.attention import attend, resolve_backend
from posbench.model.extension import extended
from posbench.viz.attention import recording_attention

VOCAB = 96
C = 256  # the training context the length checks are stated against (4 x C = 1024)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x > -math.inf else 0.0


def paper_weights(z: torch.Tensor, attend_current: bool, window: int | None = None) -> torch.Tensor:
    """A_ij = sigmoid(z_ij) prod_{j<l<i} (1 - sigmoid(z_il)) (l <= i with attend_current) over the
    keys the query sees (j <= i, i - j < window), one (i, j) at a time in float64; z: (T, T)."""
    T = z.shape[0]
    A = torch.zeros(T, T, dtype=torch.float64)
    for i in range(T):
        seen = [j for j in range(i + 1) if (window is None or i - j < window) and (attend_current or j < i)]
        for j in seen:
            w = sigmoid(float(z[i, j]))
            for l in seen:
                if l > j:
                    w *= 1 - sigmoid(float(z[i, l]))
            A[i, j] = w
    return A


def paper_output(q, k, v, attend_current=False, remainder="value", window=None, score=None):
    """o_i = sum_j A_ij v_j (+ (1 - sum_j A_ij) v_i), float64, from (B, H, T, D) tensors."""
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            z = q[b, h].double() @ k[b, h].double().T / math.sqrt(D)
            if score is not None:
                z = z + score[b, h]
            A = paper_weights(z, attend_current, window)
            out[b, h] = A @ v[b, h].double()
            if remainder == "value":
                out[b, h] += (1 - A.sum(-1))[:, None] * v[b, h].double()
    return out


def sb_ref_form(q, k, v, attend_current=False):
    """The reference's matrix form: invisible keys get log z = -1e5 and log(1 - beta) = 0, the
    product over later keys is a matmul with tril(-1); the leftover mass goes to v_i."""
    T, D = q.shape[-2], q.shape[-1]
    logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    mask = torch.ones(T, T).triu(1 if attend_current else 0).bool()  # True = invisible
    log_z = nn.functional.logsigmoid(logits).masked_fill(mask, -1e5)
    log_beta = nn.functional.logsigmoid(-logits).masked_fill(mask, 0)
    att = (log_z + torch.einsum("bhij,jk->bhik", log_beta, torch.ones(T, T).tril(-1).double())).exp()
    return att @ v.double() + (1 - att.sum(-1))[..., None] * v.double()


def qkv(B=2, H=3, T=12, D=8, seed=0, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(B, H, T, D, generator=g) for _ in range(3))


def sb(**options):
    return build_method("stickbreaking", ModelDims(32, 4, 2), **options)


@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("remainder", ["value", "none"])
def test_matches_paper_formula_loop(attend_current, remainder):
    q, k, v = qkv()
    m = sb(attend_current=attend_current, remainder=remainder)
    out = attend(q, k, v, None, "eager", normalize=m.normalizer(0))
    ref = paper_output(q, k, v, attend_current, remainder)
    assert_matches_reference(out.double(), ref, method="stickbreaking",
                             reference="paper: sigmoid(z_ij) prod_{j<l<i} (1 - sigmoid(z_il)), explicit loop",
                             atol=1e-5, rtol=1e-5)
    # The weights alone, in float64: the formula exactly (no fp32 attention around it).
    z = torch.randn(10, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 3
    masked = z.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    weights = m.weights(masked)
    A = paper_weights(z, attend_current)
    if remainder == "value":
        A = A + torch.diag(1 - A.sum(-1))
    assert_matches_reference(weights, A, method="stickbreaking", reference="paper formula weights (float64)",
                             atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("attend_current", [False, True])
def test_matches_sb_ref_matrix_form(attend_current):
    q, k, v = qkv(T=20, seed=1)
    out = attend(q, k, v, None, "eager", normalize=sb(attend_current=attend_current).normalizer(0))
    assert_matches_reference(out.double(), sb_ref_form(q, k, v, attend_current), method="stickbreaking",
                             reference="sb_ref.stickbreaking matrix form, o + rem * v", atol=1e-5, rtol=1e-5)


def test_matches_sb_ref_at_4c():
    """At 4 x C = 1024 keys the log-space reverse cumulative sum stays exact to fp32 rounding."""
    q, k, v = qkv(B=1, H=1, T=4 * C, D=16, seed=5, scale=1.0)
    out = attend(q, k, v, None, "eager", normalize=sb().normalizer(0))
    assert_matches_reference(out.double(), sb_ref_form(q, k, v), method="stickbreaking",
                             reference="sb_ref.stickbreaking matrix form at 4C = 1024", atol=1e-5, rtol=1e-5)


def test_windows_and_score_terms_enter_the_logits():
    """A window hides keys (no weight, no break); a score term is part of z; a -inf term is a mask."""
    q, k, v = qkv(B=1, H=2, T=14, seed=2)
    m = sb()
    out = attend(q, k, v, None, "eager", window=5, normalize=m.normalizer(0))
    assert_matches_reference(out.double(), paper_output(q, k, v, window=5), method="stickbreaking",
                             reference="paper formula, sliding window 5", atol=1e-5, rtol=1e-5)
    slopes = torch.tensor([0.5, 0.125])

    def bias(b, h, i, j):
        return -slopes[h] * (i - j).float()

    T = 14
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    dense = (-slopes.view(1, -1, 1, 1) * (i - j).double()).expand(1, 2, T, T)
    out = attend(q, k, v, bias, "eager", normalize=m.normalizer(0))
    assert_matches_reference(out.double(), paper_output(q, k, v, score=dense), method="stickbreaking",
                             reference="paper formula, z = q.k / sqrt(D) - m_h (i - j)", atol=1e-5, rtol=1e-5)

    def far_is_inf(b, h, i, j):
        return torch.where(i - j >= 5, float("-inf"), 0.0)

    masked = attend(q, k, v, far_is_inf, "eager", normalize=m.normalizer(0))
    windowed = attend(q, k, v, None, "eager", window=5, normalize=m.normalizer(0))
    torch.testing.assert_close(masked, windowed, atol=0, rtol=0)


def test_rows_sum_to_one_and_first_query_returns_its_value():
    q, k, v = qkv(B=1, H=2, T=9)
    z = (q @ k.transpose(-1, -2)).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    w = sb().weights(z)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 9), atol=1e-6, rtol=0)
    assert (w >= 0).all() and (w.triu(1) == 0).all()
    none = sb(remainder="none").weights(z)
    assert (none.sum(-1) <= 1 + 1e-6).all() and (none[..., 0, :] == 0).all()
    out = attend(q, k, v, None, "eager", normalize=sb().normalizer(0))
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])


def tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("vocab_size", VOCAB)
    return posbench.create_model("stickbreaking", flavour="tiny", **overrides)


def test_model_is_causal_and_finite_at_4c():
    model = tiny().eval()
    assert_causal_model(model, length=4 * C, changed_at=700, vocab=VOCAB)


def test_every_parameter_gets_a_gradient_on_the_cpu():
    model = tiny()
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    model(idx, targets=idx.roll(-1, 1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    # -inf logits (a window) give finite gradients too: no NaN from log sigmoid(-inf).
    windowed = tiny(attention_window=8)
    windowed(idx, targets=idx.roll(-1, 1)).backward()
    assert all(torch.isfinite(p.grad).all() for p in windowed.parameters())


def test_eager_only_with_one_line_for_sdpa_and_flex():
    m = sb()
    for device in (torch.device("cpu"), torch.device("cuda")):  # resolution only: no CUDA needed
        assert resolve_backend("auto", m, device) == "eager"
        assert resolve_backend("auto", m, device, window=64) == "eager"
    for backend in ("sdpa", "flex"):
        with pytest.raises(PosbenchError, match=f"model.attention={backend} cannot run method=stickbreaking: .*eager"):
            resolve_backend(backend, m, torch.device("cpu"))
    q, k, v = qkv(T=6)
    with pytest.raises(PosbenchError, match="sdpa always normalises with the softmax"):
        attend(q, k, v, None, "sdpa", normalize=m.normalizer(0))


def test_bad_remainder_is_one_line():
    with pytest.raises(PosbenchError, match="method=stickbreaking cannot run on this model: remainder='rest'"):
        posbench.create_model("stickbreaking", flavour="tiny", method_options={"remainder": "rest"})


def test_evaluation_extensions_keep_the_normaliser():
    """The window extension (a -inf score term) equals the model's own window; log scaling
    scales z and still breaks sticks (the method is never swapped for a softmax)."""
    model = tiny().eval()
    windowed = tiny(attention_window=16).eval()
    windowed.load_state_dict(model.state_dict())
    idx = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with extended(model, "window", 16, 48):
            assert model.position.normalizer(0) is not None
            by_extension = model(idx)
        torch.testing.assert_close(by_extension, windowed(idx), atol=1e-6, rtol=1e-6)
        with extended(model, "log_scaling", 16, 48):
            scaled = model(idx)
        assert not torch.allclose(scaled, model(idx), atol=1e-4)


def test_viz_records_the_stick_breaking_weights():
    """posbench viz computes attention in its hook: it must use the method's normaliser, or the
    figures (and the hooked forward) would show a softmax model."""
    model = tiny().eval()
    idx = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(idx)
        with recording_attention(model.cfg.n_layers, map_layers=[0]) as record:
            hooked = model(idx)
    torch.testing.assert_close(hooked, plain, atol=1e-5, rtol=1e-5)
    maps = torch.from_numpy(record.layers[0].maps)  # (H, T, T)
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:2]), atol=1e-5, rtol=0)
