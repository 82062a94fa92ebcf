"""Recipes (posbench/methods/recipes.py) against the transformers classes of the released models.

Each recipe's attention is checked layer by layer: a tiny transformers model of the release (eager
attention, fp32, its own masks and rotary embeddings, random QK-norm weights and sinks) is run
with forward hooks on every attention module; posbench's attention of the same layer, with the
same projection weights and the same parts copied in, gets the hooked input and must give the
hooked output to fp32 rounding, at lengths inside and past the window or chunk. A per-layer check,
not a whole model: none of these releases has posbench's Llama block (Gemma's four norms and
scaled embedding, Cohere's parallel block, MoE layers). Each recipe also has a mutation (a part
switched off or moved) that the same comparison must catch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import transformers as tf
from torch import nn

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods.recipes import LayerType
from posbench.model.transformer import layer_windows

RECIPES = ("gemma3", "gemma4", "gpt_oss", "llama4", "smollm3", "cohere2", "olmo3")
WINDOW, CHUNK, FLOOR = 5, 6, 3
LENGTHS = (4, 20)  # inside the window (and chunk), and well past both
COMMON = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass
class Case:
    config: Callable[..., Any]
    model: Callable[..., nn.Module]
    hf: dict[str, Any]
    options: dict[str, Any]
    layers: int
    norm: str = "none"  # how the release's q/k norm weight maps to posbench's: gemma (1 + w), plain (w)
    mutations: dict[str, Callable[[Any], None]] = field(default_factory=dict)


CASES = {
    "gemma3": Case(tf.Gemma3TextConfig, tf.Gemma3TextModel, dict(sliding_window=WINDOW, query_pre_attn_scalar=16),
                   {"window": WINDOW}, 6, "gemma",
                   {"window + 1": lambda m: m.layer_window.__setitem__(0, WINDOW + 1),
                    "global base 10k": lambda m: m.groups[1].rope.inv_freq.copy_(m.groups[0].rope.inv_freq),
                    "no k norm": lambda m: m.groups[0].k_norm.data.fill_(1.0)}),
    "gemma4": Case(tf.Gemma4TextConfig, tf.Gemma4TextModel,
                   dict(sliding_window=WINDOW, global_head_dim=16, attention_k_eq_v=False, num_kv_shared_layers=0,
                        hidden_size_per_layer_input=0, enable_moe_block=False),
                   {"window": WINDOW}, 6, "plain",
                   {"global fully rotated": lambda m: m.groups[1].rope.inv_freq.copy_(
                       1e6 ** (-torch.arange(0, 16, 2) / 16)),
                    "logits scaled by 1/sqrt(D)": lambda m: setattr(m.groups[0], "logit_scale", 0.25)}),
    "gpt_oss": Case(tf.GptOssConfig, tf.GptOssModel,
                    dict(sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
                    {"window": WINDOW}, 2, "none",
                    {"no sinks": lambda m: m.groups[1].sinks.data.zero_(),
                     "window - 1": lambda m: m.layer_window.__setitem__(0, WINDOW - 1)}),
    "llama4": Case(tf.Llama4TextConfig, tf.Llama4TextModel,
                   dict(attention_chunk_size=CHUNK, floor_scale=FLOOR, attn_scale=0.1, intermediate_size_mlp=64,
                        num_local_experts=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
                   {"chunk": CHUNK, "floor_scale": float(FLOOR)}, 4, "none",
                   {"chunk + 1": lambda m: setattr(m.groups[0], "chunk", CHUNK + 1),
                    "no temperature": lambda m: setattr(m.groups[1], "floor_scale", None),
                    "no qk norm": lambda m: setattr(m.groups[0], "qk_norm", "none")}),
    "smollm3": Case(tf.SmolLM3Config, tf.SmolLM3Model, dict(), {}, 4, "none",
                    {"rope on every layer": lambda m: m.layer_group.__setitem__(3, 0)}),
    "cohere2": Case(tf.Cohere2Config, tf.Cohere2Model,
                    dict(sliding_window=WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
                    {"window": WINDOW}, 4, "none",
                    {"Llama's pairing": lambda m: setattr(m.groups[0].rope, "interleaved", False),
                     "window + 1": lambda m: m.layer_window.__setitem__(1, WINDOW + 1)}),
    "olmo3": Case(tf.Olmo3Config, tf.Olmo3Model, dict(sliding_window=WINDOW, rms_norm_eps=1e-6),
                  {"window": WINDOW}, 4, "plain",
                  {"norm per head": lambda m: [setattr(g, "qk_norm", "head") or setattr(
                      g, "q_norm", nn.Parameter(g.q_norm.data[:, :16].clone())) or setattr(
                      g, "k_norm", nn.Parameter(g.k_norm.data[:, :16].clone())) for g in m.groups],
                   "global windowed": lambda m: m.layer_window.__setitem__(3, WINDOW)}),
}


def reference(name: str, seed: int = 0):
    """A tiny transformers model of the release, eager fp32, with random QK-norm weights and sinks
    (their inits are ones or zeros, which would hide a wrong mapping), projections large enough for
    peaked attention (the 0.02 init gives near-uniform attention, which hides a wrong mask or
    temperature) and no biases."""
    case = CASES[name]
    kwargs = {**COMMON, **case.hf, "num_hidden_layers": case.layers}
    if name == "cohere2":
        kwargs.pop("head_dim")  # Cohere2 derives it
    torch.manual_seed(seed)
    config = case.config(**kwargs)
    config._attn_implementation = "eager"
    model = case.model(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            for part in ("q_norm", "k_norm"):
                if hasattr(attn, part):
                    getattr(attn, part).weight.normal_(0.5, 0.3)
            if hasattr(attn, "sinks"):
                attn.sinks.normal_(0.0, 1.0)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.weight.normal_(0.0, 0.3)  # logits of order 1: peaked attention, not near-uniform
                if proj.bias is not None:
                    proj.bias.zero_()  # posbench has no biases
            if name == "gemma4":
                attn.v_norm = nn.Identity()  # a departure: posbench's values are not normalised
    return model


def hooked(model: nn.Module, length: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every attention module in one forward of random tokens."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module, args, kwargs, output):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen.append((x.detach(), output[0].detach()))

    handles = [layer.self_attn.register_forward_hook(keep, with_kwargs=True) for layer in model.layers]
    ids = torch.randint(3, 50, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return seen


def posbench_copy(name: str, reference_model: nn.Module, attention: str = "eager"):
    """posbench's model of the recipe with the reference's attention weights and parts copied in."""
    case = CASES[name]
    torch.manual_seed(1)
    ours = posbench.create_model(name, flavour="tiny", method_options=case.options, vocab_size=50, d_model=32,
                                 n_heads=2, n_layers=case.layers, attention=attention)
    method = ours.position
    with torch.no_grad():
        for index, (block, layer) in enumerate(zip(ours.blocks, reference_model.layers)):
            attn = layer.self_attn
            block.attn.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            block.attn.out.weight.copy_(attn.o_proj.weight)
            sub, rank = method.sub(index)
            for part in ("q_norm", "k_norm"):
                if hasattr(attn, part) and isinstance(getattr(sub, part, None), nn.Parameter):
                    weight = getattr(attn, part).weight
                    getattr(sub, part)[rank] = 1 + weight if case.norm == "gemma" else weight
            if hasattr(attn, "sinks"):
                sub.sinks[rank] = attn.sinks
    return ours


def max_error(name: str, length: int, mutate: Callable[[Any], None] | None = None, attention: str = "eager") -> float:
    ref = reference(name)
    seen = hooked(ref, length)
    ours = posbench_copy(name, ref, attention)
    if mutate is not None:
        with torch.no_grad():
            mutate(ours.position)
    windows = layer_windows(ours.cfg, ours.position)
    positions = torch.arange(length)
    worst = 0.0
    with torch.no_grad():
        for block, window, (x, out) in zip(ours.blocks, windows, seen):
            y = block.attn(x, positions, ours.position, None, window)
            worst = max(worst, float((y - out).abs().max() / out.abs().max()))
    return worst


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_attention_matches_the_release_layer_by_layer(name, length):
    assert max_error(name, length) < 2e-6


@pytest.mark.parametrize("name, mutation", [(n, m) for n in RECIPES for m in CASES[n].mutations])
def test_a_mutated_recipe_fails_its_reference(name, mutation):
    assert max_error(name, LENGTHS[-1], CASES[name].mutations[mutation]) > 1e-3


def test_the_cases_cover_every_recipe_and_the_layer_types_match_the_release():
    from posbench.methods import list_methods, method_class
    from posbench.methods.recipes import Recipe

    assert sorted(n for n in list_methods() if issubclass(method_class(n), Recipe)) == sorted(RECIPES)
    for name in RECIPES:
        ref = reference(name)
        ours = posbench_copy(name, ref)
        windows = layer_windows(ours.cfg, ours.position)
        types = getattr(ref.config, "layer_types", None)
        if types is not None:  # windowed (or chunked) where the release says so
            local = [t != "full_attention" for t in types]
            ours_local = [w is not None or ours.position.sub(i)[0].chunk is not None for i, w in enumerate(windows)]
            assert ours_local == local, name


def test_llama4_temperature_is_one_inside_c_and_grows_past_it():
    """The default floor_scale is C = 256: 1 up to position 254, then 1 + 0.1 log(1 + floor((n+1)/256))."""
    layer = LayerType(posbench.methods.ModelDims(32, 2, 1), floor_scale=256.0)
    q = torch.ones(1, 2, 1024, 16)
    scaled, _ = layer.rotate_qk(q, q, torch.arange(1024))
    factor = scaled[0, 0, :, 0]
    assert torch.equal(factor[:255], torch.ones(255))
    n = torch.tensor([255, 511, 1023])
    assert torch.allclose(factor[n], 1 + 0.1 * torch.log1p(torch.floor((n + 1) / 256.0)))


def test_recipe_layer_type_refuses_bad_options_in_one_line():
    dims = posbench.methods.ModelDims(32, 2, 1)
    for options, message in (({"qk_norm": "layer"}, "qk_norm"), ({"chunk": 0}, "chunk"), ({"floor_scale": 0}, "floor_scale")):
        with pytest.raises(ValueError, match=message):
            LayerType(dims, **options)
    with pytest.raises(PosbenchError, match="gpt_oss"):
        posbench.create_model("gpt_oss", flavour="tiny", attention="sdpa", vocab_size=50)(torch.zeros(1, 4, dtype=torch.long))


def test_recipe_glob_sweeps_every_recipe_and_each_job_composes_its_method():
    """``posbench train -m 'recipe=glob(*)'``: Hydra's glob over the recipe group (as the sweeper
    expands it) gives every recipe, and each job composes to that method with its defaults."""
    from helpers import compose_config
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.posbench_launcher.layout_sweeper import job_layouts
    from posbench.config import config_dir
    from posbench.methods import method_options

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        [override] = parser.parse_overrides(["recipe=glob(*)"])
        jobs = list(override.sweep_string_iterator())
    assert sorted(jobs) == sorted(RECIPES)
    for name in jobs:
        cfg = compose_config("train", [f"recipe={name}", "experiment=cpu_quick"])
        assert dict(cfg.method) == {"name": name, **method_options(name)}
        assert job_layouts(cfg) == ("sequence", ("sequence",))
    assert compose_config("train", ["recipe=olmo3", "method.window=64"]).method.window == 64
    assert compose_config("train", []).method.name == "rope"  # no recipe: the default run is unchanged


# ----------------------------------------------------------------------------- extension scope
# Gemma 3 and OLMo 3 scale RoPE on their global (full-attention) layers only: transformers'
# rope_parameters per layer type. eval.extension_scope=global must compute what that does.

SCOPE_C, SCOPE_LENGTH = 8, 32  # yarn at factor L / C = 4


def yarn_on_global(name: str) -> dict[str, Any]:
    """transformers' per-layer-type rope_parameters of ``name`` with YaRN on the full-attention layers."""
    base = {"gemma3": (10000.0, 1000000.0), "olmo3": (500000.0, 500000.0)}[name]
    return {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": base[0]},
        "full_attention": {"rope_type": "yarn", "rope_theta": base[1], "factor": SCOPE_LENGTH / SCOPE_C,
                           "original_max_position_embeddings": SCOPE_C}}}


def scoped_error(name: str, scope: str, extension: str = "yarn") -> float:
    """Largest relative difference, over the layers, between posbench's recipe under ``extension``
    on the ``scope`` layers and transformers' model with YaRN on its full-attention layers."""
    from posbench.model.extension import extended

    case = CASES[name]
    saved = case.hf
    case.hf = {**saved, **yarn_on_global(name)}
    try:
        ref = reference(name)
    finally:
        case.hf = saved
    seen = hooked(ref, SCOPE_LENGTH)
    ours = posbench_copy(name, ref)
    windows, positions, worst = layer_windows(ours.cfg, ours.position), torch.arange(SCOPE_LENGTH), 0.0
    with torch.no_grad(), extended(ours, extension, SCOPE_C, SCOPE_LENGTH, options={"scope": scope}):
        for block, window, (x, out) in zip(ours.blocks, windows, seen):
            y = block.attn(x, positions, ours.position, None, window)
            worst = max(worst, float((y - out).abs().max() / out.abs().max()))
    return worst


@pytest.mark.parametrize("name", ["gemma3", "olmo3"])
def test_extension_on_the_global_layers_matches_the_release_s_per_layer_rope_parameters(name):
    assert scoped_error(name, "global") < 2e-6
    assert scoped_error(name, "local") > 1e-3  # the mutation: YaRN on the other layers


def test_extension_scope_refuses_in_one_line_and_results_record_it():
    from posbench.model.extension import extended, record_extension, resolve_extensions

    rope = posbench.create_model("rope", flavour="tiny", vocab_size=50)
    with pytest.raises(PosbenchError, match="extension_scope=global needs a per-layer method"):
        with extended(rope, "yarn", 8, 32, options={"scope": "global"}):
            pass
    gemma = posbench.create_model("gemma3", flavour="tiny", vocab_size=50, n_layers=6)
    with pytest.raises(PosbenchError, match="rerope applies to no global layer of method=gemma3"):
        with extended(gemma, "rerope", 8, 32, options={"scope": "global"}):
            pass
    cohere = posbench.create_model("cohere2", flavour="tiny", vocab_size=50, n_layers=4)
    with pytest.raises(PosbenchError, match="yarn applies to no global layer of method=cohere2"):
        resolve_extensions(["yarn"], cohere.position, scope="global")  # its global layers are NoPE
    assert resolve_extensions(["yarn", "log_scaling"], cohere.position, scope="local") == ["none", "yarn", "log_scaling"]
    with pytest.raises(PosbenchError, match="extension yarn does not apply to method=gemma3"):
        resolve_extensions(["yarn"], gemma.position)  # scope all: a schedule is not one rotary method
    with pytest.raises(PosbenchError, match="extension_scope='middle' is not a scope"):
        resolve_extensions(["yarn"], gemma.position, scope="middle")
    entry: dict[str, Any] = {}
    record_extension(entry, "yarn", 4.0, 8, 32, {"scope": "global"})
    assert entry["extension_scope"] == "global"
    plain: dict[str, Any] = {}
    record_extension(plain, "yarn", 4.0, 8, 32, {})
    assert "extension_scope" not in plain


def test_scope_rope_of_swan_extends_its_rope_layers_only():
    """swan's RoPE layers under yarn with scope rope = the same model with its RoPE group's
    frequencies and attention factor changed by hand; the NoPE layers untouched."""
    from posbench.model.extension import EXTENSIONS, Setting, extended

    torch.manual_seed(0)
    model = posbench.create_model("swan", flavour="tiny", vocab_size=50, n_layers=4, attention="eager",
                                  method_options={"window": 8})
    idx = torch.randint(0, 50, (1, 40))
    rope_group = model.position.groups[model.position.group_names.index("rope")]
    by_hand = EXTENSIONS["yarn"].install(rope_group, Setting(16, 40, 40 / 16))
    with torch.no_grad():
        with extended(model, "yarn", 16, 40, options={"scope": "rope"}):
            scoped = model(idx)
        original = model.position.groups[1]
        model.position.groups[1] = by_hand
        try:
            expected = model(idx)
        finally:
            model.position.groups[1] = original
        plain = model(idx)
    assert torch.equal(scoped, expected) and not torch.allclose(scoped, plain)


def test_posbench_eval_takes_the_scope():
    """configs/eval.yaml lists every eval key posbench eval accepts; the scope was missing there."""
    from helpers import compose_config

    cfg = compose_config("eval", ["run=some/run", "eval.extension_scope=global"])
    assert cfg.eval.extension_scope == "global"
    assert compose_config("eval", ["run=some/run"]).eval.extension_scope is None  # null: the run's own
