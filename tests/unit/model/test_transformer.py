"""The transformer: equivalence with Hugging Face Llama, per-method model properties, config
validation and the Python API."""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import assert_matches_reference
from torch import nn
from transformers import LlamaForCausalLM

import posbench
from posbench.config import load_group_option
from posbench.core.errors import PosbenchError
from posbench.model.hf_export import to_transformers
from posbench.model.transformer import ModelConfig, Transformer

ALL_METHODS = posbench.list_methods()
VOCAB = 256


def tiny(method: str, seed: int = 0, method_options=None, **overrides) -> Transformer:
    torch.manual_seed(seed)
    overrides.setdefault("vocab_size", VOCAB)
    return posbench.create_model(method, flavour="tiny", method_options=method_options, **overrides)


def perturb_(model: nn.Module, seed: int = 1) -> None:
    """Give every parameter (norm gains and position tables too) non-default random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                spread = p.std() if p.numel() > 1 else p.abs()  # scalars (fire's c) have no std
                p.add_(0.5 * spread * torch.randn(p.shape, generator=g))


def tokens(B: int, T: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# rope model == transformers.LlamaForCausalLM
# ----------------------------------------------------------------------------------------------


def llama_copy(model: Transformer, rope_theta: float) -> LlamaForCausalLM:
    """The model's LlamaForCausalLM twin, by the export's weight mapping (posbench.model.hf_export)."""
    hf = to_transformers(model, attn_implementation="eager")
    assert isinstance(hf, LlamaForCausalLM)
    # transformers 5.x keeps theta in rope_parameters; make sure it took our value.
    assert hf.config.rope_parameters["rope_type"] == "default"
    assert hf.config.rope_parameters["rope_theta"] == rope_theta
    # Same rotary frequencies: theta_i = base^(-2i/d_head).
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, model.position.inv_freq, rtol=1e-6, atol=0)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert n_hf == model.num_parameters(), "every posbench parameter has exactly one HF counterpart"
    return hf


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("T", [64, 512])
def test_rope_model_equals_hf_llama(T, backend):
    model = tiny("rope", attention=backend).eval()
    perturb_(model)
    hf = llama_copy(model, rope_theta=10000.0)
    idx = tokens(2, T)
    with torch.no_grad():
        ours = model(idx)
        theirs = hf(input_ids=idx).logits
    assert ours.shape == theirs.shape == (2, T, VOCAB)
    assert theirs.abs().max() > 0.1  # a non-trivial function, not all ~0
    assert_matches_reference(ours, theirs, method="rope", reference=f"whole model = transformers LlamaForCausalLM logits ({backend}, T={T})",
                             atol=1e-5, rtol=1e-4)


def test_rope_model_equals_hf_llama_with_other_base_and_shape():
    model = tiny("rope", method_options={"base": 500000.0}, n_layers=3, d_model=96, n_heads=3).eval()
    perturb_(model, seed=5)
    hf = llama_copy(model, rope_theta=500000.0)
    idx = tokens(1, 300)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(input_ids=idx).logits, atol=1e-5, rtol=1e-4)


def test_hf_comparison_is_sensitive_to_rope():
    """Negative control: a wrong theta on the HF side must break the match at long context."""
    model = tiny("rope").eval()
    perturb_(model)
    hf = llama_copy(model, rope_theta=10000.0)
    with torch.no_grad():
        hf.model.rotary_emb.inv_freq.mul_(1.01)
    idx = tokens(1, 512)
    with torch.no_grad():
        assert not torch.allclose(model(idx), hf(input_ids=idx).logits, atol=1e-4, rtol=1e-3)


# ----------------------------------------------------------------------------------------------
# Every method
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ALL_METHODS)
def test_causality(name, backend):
    """Changing tokens at positions >= t never changes logits at positions < t."""
    if backend in tiny(name).position.backend_limits():
        backend = "eager"  # relative's default value term, stick-breaking: eager-only (their other paths: test_attention)
    model = tiny(name, attention=backend).eval()
    perturb_(model)
    T, t = 48, 20
    a = tokens(2, T, seed=1)
    b = a.clone()
    b[:, t:] = tokens(2, T - t, seed=2)
    b[:, t] = (a[:, t] + 1) % VOCAB  # definitely different at t
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :t], lb[:, :t], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(la[:, t:], lb[:, t:], atol=1e-4)


@pytest.mark.parametrize("name", ALL_METHODS)
def test_runs_beyond_training_length(name):
    """Tiny model runs at 256, 512, 1024 with finite logits of shape (B, T, vocab)."""
    model = posbench.create_model(name, flavour="tiny").eval()
    vocab = model.cfg.vocab_size
    assert vocab == load_group_option("model", "tiny")["vocab_size"]
    with torch.no_grad():
        for T in (256, 512, 1024):
            logits = model(tokens(1, T, vocab=vocab))
            assert logits.shape == (1, T, vocab)
            assert logits.dtype == torch.float32
            assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ALL_METHODS)
def test_forward_backward_smoke(name):
    """Loss is finite, every parameter that can get a gradient gets a finite one."""
    model = tiny(name)
    idx = tokens(2, 40)
    logits = model(idx)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(math.log(VOCAB), rel=0.1)  # near-uniform at init
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(p.grad).all(), pname
        if not pname.startswith("position."):
            assert p.grad.abs().sum() > 0, f"{pname} got a zero gradient"
    for pname, p in model.position.named_parameters():
        assert p.grad.abs().sum() > 0, f"position method parameter {pname} is not trained"


def test_learned_rows_past_context_get_no_gradient():
    model = tiny("learned", method_options={"max_positions": 64})
    model(tokens(2, 40)).sum().backward()
    grad = model.position.table.weight.grad
    assert grad[:40].abs().sum(-1).gt(0).all()
    assert grad[40:].abs().sum() == 0


@pytest.mark.parametrize("name", ALL_METHODS)
def test_batch_independence_and_dtype(name):
    model = tiny(name).eval()
    idx = tokens(3, 32)
    with torch.no_grad():
        full = model(idx)
        single = model(idx[1:2])
    torch.testing.assert_close(full[1:2], single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "relative"])
def test_relative_models_invariant_to_position_offset(name):
    """With explicit positions p + 1000 a relative (or no-position) model gives the same logits."""
    model = tiny(name).eval()
    perturb_(model)
    idx = tokens(2, 64)
    with torch.no_grad():
        base = model(idx)
        shifted = model(idx, positions=torch.arange(64) + 1000)
    tol = 5e-4 if name == "rope" else 1e-5  # rope: fp32 angles at ~1000
    torch.testing.assert_close(shifted, base, atol=tol, rtol=1e-4)


@pytest.mark.parametrize("name", ["learned", "sinusoidal"])
def test_absolute_models_depend_on_position_offset(name):
    model = tiny(name).eval()
    idx = tokens(2, 64)
    with torch.no_grad():
        assert not torch.allclose(model(idx), model(idx, positions=torch.arange(64) + 1000), atol=1e-4)


@pytest.mark.parametrize("name", ["learned", "sinusoidal"])
def test_input_methods_add_to_input_only(name):
    """First block sees embed(idx) + method.input_embedding(positions), and nothing else differs
    from a no-position model with the same weights."""
    model = tiny(name).eval()
    seen = {}

    def capture(module, args):
        seen["x"] = args[0].detach()  # returns None: inputs unchanged

    model.blocks[0].register_forward_pre_hook(capture)
    idx = tokens(2, 20)
    with torch.no_grad():
        out = model(idx)
        expected_x = model.embed(idx) + model.position.input_embedding(torch.arange(20))
    torch.testing.assert_close(seen["x"], expected_x)
    # Same weights, method nope, and the position embedding injected by hand: identical logits.
    nope = tiny("nope").eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("position.")}
    nope.load_state_dict(state)
    pe = model.position.input_embedding(torch.arange(20)).detach()
    nope.position.input_embedding = lambda positions: pe  # type: ignore[method-assign]
    with torch.no_grad():
        assert_matches_reference(out, nope(idx), method=name, reference="nope body + the table added to the token embedding by hand",
                                 atol=1e-6, rtol=1e-6)


def test_learned_zero_table_equals_nope():
    model = tiny("learned").eval()
    with torch.no_grad():
        model.position.table.weight.zero_()
    nope = tiny("nope").eval()
    nope.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("position.")})
    idx = tokens(2, 30)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), nope(idx), atol=0, rtol=0)


@pytest.mark.parametrize("max_positions", [1, 32])
def test_learned_raises_past_max_positions(max_positions):
    model = tiny("learned", method_options={"max_positions": max_positions}).eval()
    assert model.position.max_positions == max_positions
    with torch.no_grad():
        assert model(tokens(1, max_positions)).shape == (1, max_positions, VOCAB)
        with pytest.raises(PosbenchError, match=r"method\.max_positions"):
            model(tokens(1, max_positions + 1))
        with pytest.raises(PosbenchError, match=r"method\.max_positions"):
            model(tokens(1, 1), positions=torch.tensor([max_positions]))


def test_learned_invalid_max_positions():
    with pytest.raises(PosbenchError, match="max_positions"):
        tiny("learned", method_options={"max_positions": 0})


def test_position_method_keeps_its_own_init():
    """Transformer.reset_parameters must not re-initialise the method's tables."""
    model = tiny("learned", method_options={"init_std": 0.5, "max_positions": 2048})
    assert model.position.table.weight.std().item() == pytest.approx(0.5, rel=0.05)
    model = tiny("t5", method_options={"init_std": 0.3}, n_heads=8)
    assert model.position.bias.weight.std().item() == pytest.approx(0.3, rel=0.25)
    model = tiny("relative", method_options={"init_std": 0.4})
    assert model.position.tables[0].std().item() == pytest.approx(0.4, rel=0.2)


def test_one_method_instance_shared_by_all_layers():
    model = tiny("relative", n_layers=3)
    assert len(model.position.tables) == 3
    assert [b.attn.layer for b in model.blocks] == [0, 1, 2]
    assert sum(1 for m in model.modules() if isinstance(m, posbench.methods.PositionMethod)) == 1
    assert model.method_name == "relative"


# ----------------------------------------------------------------------------------------------
# Config validation and the Python API
# ----------------------------------------------------------------------------------------------


def test_d_model_not_divisible_by_heads():
    with pytest.raises(PosbenchError, match="n_heads"):
        ModelConfig(d_model=65, n_heads=4)


@pytest.mark.parametrize("field", ["vocab_size", "d_model", "n_layers", "n_heads", "mlp_multiple_of"])
@pytest.mark.parametrize("value", [0, -4, "64", 64.0, True, None])
def test_bad_integer_sizes(field, value):
    with pytest.raises(PosbenchError, match=f"model.{field}"):
        ModelConfig(**{field: value})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mlp_hidden": 0}, "mlp_hidden"),
        ({"mlp_hidden": "128"}, "mlp_hidden"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"init_std": -0.02}, "init_std"),
        ({"attention": "flash"}, "attention"),
    ],
)
def test_bad_other_fields(kwargs, match):
    with pytest.raises(PosbenchError, match=match):
        ModelConfig(**kwargs)


def test_config_from_dict_rejects_unknown_and_roundtrips():
    with pytest.raises(PosbenchError, match="d_modle"):
        ModelConfig.from_dict({"d_modle": 64})
    cfg = ModelConfig.from_dict(load_group_option("model", "tiny"))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("flavour", ["tiny", "mini", "small", "medium"])
def test_flavours_load(flavour):
    values = load_group_option("model", flavour)
    cfg = ModelConfig.from_dict(values)
    assert cfg.flavour == flavour
    assert cfg.d_model % cfg.n_heads == 0 and cfg.head_dim % 2 == 0  # every method (rope) fits


def test_hidden_size_rule():
    cfg = ModelConfig(d_model=64, n_heads=4, mlp_multiple_of=64)
    assert cfg.hidden_size == 192  # int(8 * 64 / 3) = 170 -> 192
    assert ModelConfig(d_model=384, n_heads=6).hidden_size == 1024
    assert ModelConfig(d_model=64, n_heads=4, mlp_hidden=100).hidden_size == 100
    model = tiny("nope", mlp_hidden=40)
    assert model.blocks[0].mlp.gate.weight.shape == (40, 64)


def test_rope_odd_head_dim_is_a_user_error():
    with pytest.raises(PosbenchError, match="rope"):
        posbench.create_model("rope", flavour="tiny", d_model=12, n_heads=4)  # head dim 3


def test_unknown_method_lists_methods():
    with pytest.raises(PosbenchError) as err:
        posbench.create_model("rotary", flavour="tiny")
    for name in ALL_METHODS:
        assert name in str(err.value)


def test_unknown_method_option():
    with pytest.raises(PosbenchError, match="bogus") as err:
        posbench.create_model("rope", flavour="tiny", method_options={"bogus": 1})
    assert "base" in str(err.value) and "interleaved" in str(err.value)


def test_unknown_flavour_and_model_option():
    with pytest.raises(PosbenchError, match="tiny"):
        posbench.create_model("nope", flavour="huge")
    with pytest.raises(PosbenchError, match="n_layer"):
        posbench.create_model("nope", flavour="tiny", n_layer=3)


@pytest.mark.parametrize("name", ALL_METHODS)
def test_create_model_api(name):
    model = posbench.create_model(name, flavour="tiny", vocab_size=100, n_layers=1)
    assert isinstance(model, nn.Module) and isinstance(model, Transformer)
    assert model.method_name == name and model.cfg.n_layers == 1 and len(model.blocks) == 1
    with torch.no_grad():
        assert model(tokens(3, 17, vocab=100)).shape == (3, 17, 100)


def test_method_options_are_applied():
    model = posbench.create_model("rope", flavour="tiny", method_options={"base": 1234.0, "interleaved": True})
    assert model.position.base == 1234.0 and model.position.interleaved is True
    model = posbench.create_model("t5", flavour="tiny", method_options={"num_buckets": 8, "max_distance": 32})
    assert model.position.bias.weight.shape == (8, 4)


def expected_params(cfg: ModelConfig, tied: bool) -> tuple[int, int]:
    d, V, h = cfg.d_model, cfg.vocab_size, cfg.hidden_size
    per_layer = 3 * d * d + d * d + 3 * d * h + 2 * d
    body = cfg.n_layers * per_layer + d
    emb = V * d if tied else 2 * V * d
    return body + emb, body


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", ALL_METHODS)
def test_num_parameters(name, tied):
    model = tiny(name, tie_embeddings=tied)
    total, non_emb = expected_params(model.cfg, tied)
    pos = sum(p.numel() for p in model.position.parameters())
    assert model.num_parameters() == total + pos
    assert model.num_parameters(non_embedding=True) == non_emb + pos
    assert model.num_parameters() == len(torch.nn.utils.parameters_to_vector(model.parameters()))


def test_tied_embeddings_share_the_tensor():
    model = tiny("rope", tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    with torch.no_grad():
        model.embed.weight[3, 0] = 123.0
    assert model.lm_head.weight[3, 0] == 123.0
    model(tokens(1, 8)).sum().backward()
    assert model.embed.weight.grad is model.lm_head.weight.grad
    untied = tiny("rope")
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()


def test_init_std_residual_projections_smaller():
    model = tiny("nope", n_layers=8, d_model=128, init_std=0.02)
    residual = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks:
        assert block.attn.out.weight.std().item() == pytest.approx(residual, rel=0.1)
        assert block.mlp.down.weight.std().item() == pytest.approx(residual, rel=0.1)
        assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert block.mlp.gate.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert block.mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.1)
        for m in (block.attn.qkv, block.attn.out, block.mlp.gate, block.mlp.up, block.mlp.down):
            assert m.weight.mean().abs().item() < 0.005
        assert torch.equal(block.attn_norm.weight, torch.ones(128))
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))


def test_seeded_construction_is_deterministic():
    a, b = tiny("relative", seed=7), tiny("relative", seed=7)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_training_loss_in_cpu_chunks_equals_the_full_cross_entropy(monkeypatch):
    """forward(targets=...) chunks the LM head on the CPU (so the heap, not a fresh mmap per step,
    holds the logits); the loss and every gradient equal the full-logits cross-entropy."""
    import torch.nn.functional as F

    import posbench.model.transformer as model_module

    torch.manual_seed(0)
    model = posbench.create_model("rope", flavour="tiny", vocab_size=96)
    idx, targets = torch.randint(0, 96, (3, 20)), torch.randint(0, 96, (3, 20))
    # 7 rows per chunk: 60 positions -> 9 chunks, the last one partial.
    monkeypatch.setattr(model_module, "CPU_LOGITS_CHUNK_BYTES", 7 * 4 * 96)
    assert model_module.logits_chunk_rows(96, torch.device("cpu")) == 7
    assert model_module.logits_chunk_rows(96, torch.device("cuda")) is None
    chunked = model(idx, targets=targets)
    chunked.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    full = F.cross_entropy(model(idx).float().flatten(0, 1), targets.flatten())
    full.backward()
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


# ----------------------------------------------------------------- all methods: grads, init, positions


@pytest.mark.parametrize("name", ALL_METHODS)
def test_every_learnable_parameter_gets_a_gradient_on_the_default_cpu_backend(name):
    torch.manual_seed(0)
    model = posbench.create_model(name, flavour="tiny", vocab_size=64)
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: {pname} gets no gradient"


@pytest.mark.parametrize("name", ALL_METHODS)
def test_same_seed_same_body_for_every_method(name):
    """Same seed, same body: token embedding, blocks and LM head are bitwise identical across methods."""

    def body(method):
        torch.manual_seed(123)
        model = posbench.create_model(method, flavour="tiny", vocab_size=64)
        return {k: v for k, v in model.state_dict().items() if not k.startswith("position.")}

    reference, ours = body("nope"), body(name)
    assert reference.keys() == ours.keys()
    for key, value in reference.items():
        assert torch.equal(ours[key], value), f"{name}: {key} differs from nope's at the same seed"


def test_method_parameters_still_depend_on_the_seed():
    def table(seed):
        torch.manual_seed(seed)
        return posbench.create_model("t5", flavour="tiny", vocab_size=64).position.bias.weight

    assert torch.equal(table(1), table(1)) and not torch.equal(table(1), table(2))


