"""HoPE (Chen et al. 2024, arXiv 2410.21216): RoPE keeping only the frequency pairs that complete a
full rotation within the training context; the others position-independent (unrotated)."""

import math

import pytest
import torch
import torch.nn.functional as F
from model_checks import assert_causal_model, assert_matches_reference

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method
from posbench.model.extension import EXTENSIONS, Setting


def reference_rotation(x, positions, base, train_context):
    """The paper's HoPE on x (B, H, T, D), rotate-half pairing (channel i with i + D/2), written
    out pair by pair: theta_i = base^(-2i/D) if theta_i * C >= 2 pi (a full turn within the
    training context), else 0 (the pair passes through)."""
    B, H, T, D = x.shape
    out = x.clone().double()
    for i in range(D // 2):
        theta = base ** (-2 * i / D)
        if theta * train_context < 2 * math.pi:
            continue
        for t in range(T):
            a = float(positions[t]) * theta
            x1, x2 = x[..., t, i].double(), x[..., t, i + D // 2].double()
            out[..., t, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[..., t, i + D // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


@pytest.mark.parametrize("head_dim,train_context,kept", [(64, 256, 13), (32, 256, 7), (32, 1024, 9), (16, 256, 4)])
def test_kept_pairs_are_those_turning_a_full_rotation(head_dim, train_context, kept):
    m = build_method("hope", ModelDims(head_dim * 2, 2, 1), train_context=train_context)
    assert m.kept_pairs == kept
    wavelengths = 2 * math.pi / m.inv_freq[:kept].double()
    assert wavelengths.max() <= train_context  # the kept pairs turn at least once within C
    next_one = 2 * math.pi * 10000.0 ** (2 * kept / head_dim)
    assert next_one > train_context  # the first dropped one does not
    assert (m.inv_freq[kept:] == 0).all()


@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rotation_matches_the_papers_rule_pair_by_pair(base):
    torch.manual_seed(0)
    m = build_method("hope", ModelDims(64, 4, 1), base=base)  # head_dim 16
    q, k = torch.randn(2, 2, 4, 300, 16, dtype=torch.float64).unbind(0)
    positions = torch.arange(300) * 3 + 5
    qr, kr = m.rotate_qk(q, k, positions)
    assert_matches_reference(qr, reference_rotation(q, positions, base, 256), method="hope",
                             reference="paper: RoPE pairs with theta_i C >= 2 pi, others unrotated (loop)",
                             atol=1e-4, rtol=1e-5)
    assert_matches_reference(kr, reference_rotation(k, positions, base, 256), method="hope",
                             reference="paper: RoPE pairs with theta_i C >= 2 pi, others unrotated (loop)",
                             atol=1e-4, rtol=1e-5)


def test_hope_is_p_rope_with_the_context_given_fraction():
    """Same mechanism as p_rope, another cut: at d_head 64, C 256 it is p_rope with p = 13/32."""
    dims = ModelDims(128, 2, 1)
    hope = build_method("hope", dims)
    p_rope = build_method("p_rope", dims, p=13 / 32)
    assert torch.equal(hope.inv_freq, p_rope.inv_freq)
    assert not torch.equal(hope.inv_freq, build_method("p_rope", dims).inv_freq)  # p_rope's default p = 0.75


def test_extensions_keep_the_unrotated_pairs_pinned():
    m = build_method("hope", ModelDims(64, 4, 1))
    for name in ("linear", "ntk", "yarn"):
        wrapped = EXTENSIONS[name].install(m, Setting(256, 1024, 4.0))
        inner = wrapped.inner
        assert (inner.inv_freq[m.kept_pairs:] == 0).all(), name
        assert (inner.inv_freq[: m.kept_pairs] > 0).all(), name


def test_causal_at_four_times_the_context():
    torch.manual_seed(0)
    model = posbench.create_model("hope", flavour="tiny", vocab_size=64).eval()
    assert_causal_model(model, 4 * 256, 900)
    assert not list(model.position.parameters())  # nothing learnable: no gradient to check
    idx = torch.randint(0, 64, (1, 65))
    F.cross_entropy(model(idx[:, :64]).flatten(0, 1), idx[:, 1:65].flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_bad_train_context_rejected(bad):
    with pytest.raises(PosbenchError, match="train_context"):
        posbench.create_model("hope", flavour="tiny", vocab_size=64, method_options={"train_context": bad})


def test_a_run_cuts_at_its_own_training_context():
    """hope's train_context was a fixed 256 that nothing tied to trainer.context: a task run
    (C = 64) silently kept a pair that never turns within its context. A run now fills it."""
    from helpers import compose_config

    from posbench.runs.spec import build_spec

    spec = build_spec(compose_config("train", ["task=flipflop", "method=hope"]))
    assert spec.trainer.context == 64 and spec.method_options["train_context"] == 64
    text = build_spec(compose_config("train", ["method=hope", "trainer.context=128"]))
    assert text.method_options["train_context"] == 128
    given = build_spec(compose_config("train", ["method=hope", "method.train_context=512"]))
    assert given.method_options["train_context"] == 512  # an explicit value is kept
    assert build_method("hope", ModelDims(64, 4, 1)).train_context == 256  # outside a run
    from posbench.runs.spec import MethodSpec

    assert MethodSpec.from_saved({"name": "hope"}).options["train_context"] == 256  # a run saved without it
