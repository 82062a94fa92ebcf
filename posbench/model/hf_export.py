"""A posbench model as its ``transformers`` class, with the very same weights.

    rope -> transformers.LlamaForCausalLM    (RoPE on every layer, rope_theta = method.base)
    nope -> transformers.SmolLM3ForCausalLM  (Llama's body; ``no_rope_layers`` all 0: no layer rotates)

posbench's body is Llama's: RMSNorm before attention and MLP, SwiGLU, no biases, an untied (or
tied) LM head, attention scaled by 1/sqrt(head_dim). The fused q/k/v projection is split into
Llama's q_proj, k_proj, v_proj; every other weight maps one to one. NoPE has no Llama config:
Llama applies rotary on every layer, and a rope config chosen so that it "makes no difference"
would be a different function that only happens to agree. SmolLM3 is Llama with a per-layer
switch that skips the rotation (its NoPE layers), so a SmolLM3 with every layer NoPE is exactly
posbench's nope. Other methods change attention in ways no transformers class computes; they
are refused (:func:`check_exportable`).

Tested: ``AutoModelForCausalLM.from_pretrained`` of an export gives posbench's logits to fp32
rounding (tests/unit/model/test_hf_export.py; tests/unit/model/test_transformer.py uses the same
mapping for its rope == Llama check).
"""

from __future__ import annotations

from typing import Any

import torch

from posbench.core.errors import PosbenchError
from posbench.model.transformer import Transformer

HF_CLASSES = {"rope": "LlamaForCausalLM", "nope": "SmolLM3ForCausalLM"}
"""The methods that export, and the transformers class each becomes."""


def check_exportable(model: Transformer) -> None:
    """One line naming why ``model`` has no exact transformers twin; nothing when it has one."""
    name, cfg = model.method_name, model.cfg
    if name not in HF_CLASSES:
        raise PosbenchError(
            f"method={name} has no transformers class that computes it; export takes "
            f"{' and '.join(HF_CLASSES)} runs (docs/commands.md, posbench export)")
    if cfg.layout != "sequence" or cfg.patch_dim is not None or cfg.head != "tokens":
        raise PosbenchError("export takes causal language models (model.layout=sequence, token inputs, "
                            "model.head=tokens); this run is a grid or image model")
    if cfg.attention_window is not None:
        raise PosbenchError(f"model.attention_window={cfg.attention_window} (a sliding window) has no "
                            f"{HF_CLASSES[name]} setting; export takes runs with full causal attention")
    if name == "rope" and model.position.partial_rotary_factor != 1:
        raise PosbenchError(f"method.partial_rotary_factor={model.position.partial_rotary_factor} is not "
                            "LlamaForCausalLM's rotary (every channel rotated); export takes rope runs with 1.0")


def hf_config(model: Transformer, max_positions: int, eos_token_id: int | None = None,
              attn_implementation: str = "sdpa") -> Any:
    """The transformers config of ``model``'s shape. ``max_positions`` becomes
    ``max_position_embeddings`` (informational for these rope types: no weight depends on it)."""
    from transformers import LlamaConfig, SmolLM3Config

    check_exportable(model)
    cfg = model.cfg
    shape = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.hidden_size,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False, hidden_act="silu",
        max_position_embeddings=int(max_positions), bos_token_id=None, eos_token_id=eos_token_id,
        pad_token_id=None, attn_implementation=attn_implementation,
    )
    if model.method_name == "rope":
        config = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": float(model.position.base)},
                             **shape)
        if config.rope_parameters.get("rope_theta") != float(model.position.base):
            raise PosbenchError("this transformers version did not take rope_theta; export needs transformers >= 5")
        return config
    config = SmolLM3Config(no_rope_layers=[0] * cfg.n_layers, use_sliding_window=False, **shape)
    if any(config.no_rope_layers):
        raise PosbenchError("this transformers version rotates a SmolLM3 NoPE layer; export needs transformers >= 5")
    return config


def head_permutation(model: Transformer) -> torch.Tensor | None:
    """The row order of q_proj/k_proj that turns an interleaved rope (channel 2i pairs with 2i+1)
    into Llama's rotate_half (channel i pairs with i + D/2), per head; None when no reordering is
    needed. The same permutation on q and k leaves every q.k, so every logit, unchanged."""
    if model.method_name != "rope" or not model.position.interleaved:
        return None
    D, H = model.cfg.head_dim, model.cfg.n_heads
    within = torch.cat((torch.arange(0, D, 2), torch.arange(1, D, 2)))  # (D,): evens, then odds
    return (torch.arange(H)[:, None] * D + within).flatten()  # (H * D,)


def to_transformers(model: Transformer, max_positions: int = 4096, eos_token_id: int | None = None,
                    attn_implementation: str = "sdpa") -> Any:
    """``model``'s transformers twin (LlamaForCausalLM or SmolLM3ForCausalLM) in eval mode, on the
    CPU in fp32, with ``model``'s weights copied in."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model, max_positions, eos_token_id, attn_implementation)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    order = head_permutation(model)
    d = model.cfg.d_model
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed.weight)
        if not model.cfg.tie_embeddings:
            hf.lm_head.weight.copy_(model.lm_head.weight)
        hf.model.norm.weight.copy_(model.norm.weight)
        for block, layer in zip(model.blocks, hf.model.layers, strict=True):
            # "b t (three h d)": rows [0, d) are q, [d, 2d) k, [2d, 3d) v, each laid out (h d).
            wq, wk, wv = block.attn.qkv.weight.split(d, dim=0)
            if order is not None:
                wq, wk = wq[order], wk[order]
            layer.self_attn.q_proj.weight.copy_(wq)
            layer.self_attn.k_proj.weight.copy_(wk)
            layer.self_attn.v_proj.weight.copy_(wv)
            layer.self_attn.o_proj.weight.copy_(block.attn.out.weight)
            layer.mlp.gate_proj.weight.copy_(block.mlp.gate.weight)
            layer.mlp.up_proj.weight.copy_(block.mlp.up.weight)
            layer.mlp.down_proj.weight.copy_(block.mlp.down.weight)
            layer.input_layernorm.weight.copy_(block.attn_norm.weight)
            layer.post_attention_layernorm.weight.copy_(block.mlp_norm.weight)
    if model.cfg.tie_embeddings and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise PosbenchError("transformers did not tie the LM head to the embedding; export needs transformers >= 5")
    n_hf = sum(p.numel() for p in hf.parameters())
    if n_hf != model.num_parameters():
        raise PosbenchError(f"the {type(hf).__name__} copy has {n_hf} parameters, the posbench model "
                            f"{model.num_parameters()}; this model has parameters export does not map")
    return hf
