"""The export's mapping (posbench.model.hf_export): rope -> LlamaForCausalLM, nope ->
SmolLM3ForCausalLM with every layer NoPE; saved and loaded back by AutoModelForCausalLM, the
logits are posbench's to fp32 rounding, past the training context too. Mutations must fail."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import posbench
from posbench.core.errors import PosbenchError
from posbench.model.hf_export import head_permutation, to_transformers

VOCAB = 128


def model_of(method: str, options: dict | None = None, **overrides):
    """A tiny model whose every weight (norm gains included) is random, so no mapping error hides
    behind an init of ones or zeros."""
    torch.manual_seed(0)
    model = posbench.create_model(method, flavour="tiny", vocab_size=VOCAB, method_options=options, **overrides).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.15) + (1.0 if p.dim() == 1 else 0.0))
    return model


def exported_logits(model, tmp_path, idx: torch.Tensor) -> tuple[torch.Tensor, str]:
    to_transformers(model, max_positions=64).save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        return loaded(input_ids=idx).logits, type(loaded).__name__


CASES = [
    ("rope", None, {}, "LlamaForCausalLM"),
    ("rope", {"base": 500.0, "interleaved": True}, {"tie_embeddings": True}, "LlamaForCausalLM"),
    ("nope", None, {}, "SmolLM3ForCausalLM"),
    ("nope", None, {"tie_embeddings": True, "n_layers": 3}, "SmolLM3ForCausalLM"),
]


@pytest.mark.parametrize(("method", "options", "shape", "cls"), CASES)
def test_export_loads_back_with_the_same_logits(method, options, shape, cls, tmp_path):
    model = model_of(method, options, **shape)
    idx = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(1))  # past max_positions=64
    with torch.no_grad():
        ours = model(idx)
    theirs, loaded_cls = exported_logits(model, tmp_path, idx)
    assert loaded_cls == cls
    assert ours.abs().max() > 1.0  # a non-trivial function
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)  # fp32 rounding, past max_positions too


def test_nope_export_has_no_rotation_on_any_layer():
    hf = to_transformers(model_of("nope"))
    assert hf.config.no_rope_layers == [0, 0]
    assert not any(layer.self_attn.use_rope for layer in hf.model.layers)


def test_mutations_fail_the_reference(tmp_path):
    """Mutated exports must not match: interleaved rope without the channel permutation, and nope
    exported as a Llama (with rotary)."""
    idx = torch.randint(0, VOCAB, (1, 96), generator=torch.Generator().manual_seed(2))
    model = model_of("rope", {"interleaved": True})
    with torch.no_grad():
        ours = model(idx)
    hf = to_transformers(model)
    order = head_permutation(model)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    with torch.no_grad():
        for layer in hf.model.layers:  # undo the permutation: the interleaved weights as they are
            layer.self_attn.q_proj.weight.copy_(layer.self_attn.q_proj.weight[inverse])
            layer.self_attn.k_proj.weight.copy_(layer.self_attn.k_proj.weight[inverse])
        assert (hf(input_ids=idx).logits - ours).abs().max() > 1e-2

    nope = model_of("nope")
    rope_twin = model_of("rope")  # same seed, same weights: nope's weights in a Llama with rotary
    with torch.no_grad():
        assert torch.equal(nope.embed.weight, rope_twin.embed.weight)
        wrong = to_transformers(rope_twin)(input_ids=idx).logits
        assert (wrong - nope(idx)).abs().max() > 1e-2


@pytest.mark.parametrize(("method", "options", "shape", "says"), [
    ("alibi", None, {}, "method=alibi has no transformers class"),
    ("rope", {"partial_rotary_factor": 0.5}, {}, "partial_rotary_factor=0.5"),
    ("rope", None, {"attention_window": 16}, "model.attention_window=16"),
])
def test_methods_without_a_transformers_twin_are_refused(method, options, shape, says):
    with pytest.raises(PosbenchError, match=says):
        to_transformers(model_of(method, options, **shape))
