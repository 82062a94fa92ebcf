"""The image model options (docs/images.md): the patch embedding (``model.patch_dim``) and the
pooled head (``model.head=pooled``), and that a model without them is the model it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posbench.core.errors import PosbenchError
from posbench.model.transformer import ModelConfig, build_model

IMAGE = dict(vocab_size=10, d_model=64, n_layers=2, n_heads=4, layout="grid", patch_dim=16, head="pooled")


def image_model(method: str = "axial_rope", seed: int = 0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(**IMAGE), method).eval()


@pytest.mark.parametrize("method", ["axial_rope", "nope", "learned_2d", "relative_2d"])
@pytest.mark.parametrize("tokens", [49, 196])
def test_patches_in_one_pooled_answer_out(method, tokens):
    model = image_model(method)
    x = torch.rand(3, tokens, 16)  # (B, T, patch_dim): pixels / 255
    logits = model(x)
    assert logits.shape == (3, 1, 10)
    hidden = model.hidden_states(x)  # (B, T, C)
    assert hidden.shape == (3, tokens, 64)
    torch.testing.assert_close(logits[:, 0], model.lm_head(hidden.mean(dim=1)))  # the head reads the mean
    targets = torch.tensor([[3], [0], [9]])  # (B, 1): one class per image
    loss = model(x, targets=targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits[:, 0].float(), targets[:, 0]))
    loss.backward()
    assert model.patch_embed.weight.grad is not None and model.patch_embed.weight.grad.abs().sum() > 0


def test_the_patch_embedding_is_a_linear_map_with_a_zero_bias():
    model = image_model()
    assert not hasattr(model, "embed") and isinstance(model.patch_embed, torch.nn.Linear)
    assert model.patch_embed.weight.shape == (64, 16) and (model.patch_embed.bias == 0).all()
    assert 0.015 < float(model.patch_embed.weight.detach().std()) < 0.025  # normal(init_std=0.02), as every Linear
    x = torch.rand(2, 49, 16)
    torch.testing.assert_close(model.embed_inputs(x), x @ model.patch_embed.weight.T)


def test_without_positions_the_pooled_answer_reads_a_bag_of_patches():
    """nope + mean pooling: shuffling the patches changes nothing; axial_rope reads where they are."""
    x = torch.rand(2, 49, 16)
    shuffled = x[:, torch.randperm(49, generator=torch.Generator().manual_seed(0))]
    nope, axial = image_model("nope"), image_model("axial_rope")
    torch.testing.assert_close(nope(shuffled), nope(x))
    assert not torch.allclose(axial(shuffled), axial(x))


def test_token_models_have_no_image_parts_and_record_as_before():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4), "rope")
    assert not hasattr(model, "patch_embed") and isinstance(model.embed, torch.nn.Embedding)
    h = model.hidden_states(torch.arange(12)[None])
    assert model.answer_states(h) is h  # the same tensor: the head reads every token
    assert model(torch.arange(12)[None]).shape == (1, 12, 50)
    assert "patch_dim" not in ModelConfig().to_dict() and "head" not in ModelConfig(layout="grid").to_dict()
    assert ModelConfig(**IMAGE).to_dict()["head"] == "pooled"
    assert ModelConfig.from_dict(ModelConfig(**IMAGE).to_dict()) == ModelConfig(**IMAGE)


@pytest.mark.parametrize("kwargs, match", [
    ({"patch_dim": 0}, "model.patch_dim=0 must be a positive integer or null"),
    ({"patch_dim": 16, "tie_embeddings": True}, r"no token embedding to tie \(model.tie_embeddings=false\)"),
    ({"head": "cls"}, "model.head='cls' is not a head; choose one of tokens, pooled"),
])
def test_bad_image_options_are_one_line(kwargs, match):
    with pytest.raises(PosbenchError, match=match):
        ModelConfig(vocab_size=10, d_model=64, n_layers=2, n_heads=4, layout="grid", **kwargs)


def test_a_patch_model_refuses_token_ids():
    with pytest.raises(PosbenchError, match=r"a patch model takes float features \(B, T, 16\), got torch.int64"):
        image_model()(torch.zeros(2, 49, dtype=torch.long))
