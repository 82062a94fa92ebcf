"""The peer: ``transformers.LlamaForCausalLM`` of posbench's shape, timed as posbench is.

Same vocab, width, layers, heads, SwiGLU width, no biases, RMSNorm eps and tying; SDPA
attention; the same batch, context, precision, optimizer, schedule, clip and compile setting.
``posbench bench`` times it right after its twin (the registered method declaring
``llama_equivalent``; or last when the twin is not benchmarked) and reports ``peer_ratio`` =
twin training tokens/s / peer tokens/s (medians). A peer that cannot be built or run is skipped
with the reason recorded.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posbench.bench.flops import matmul_parameters, train_flops_per_token
from posbench.bench.measure import Env, time_training
from posbench.bench.timing import is_oom
from posbench.core.errors import one_line
from posbench.methods import list_methods, method_class

logger = logging.getLogger("posbench")


def peer_twin() -> str | None:
    """The registered method whose model is the peer's twin (``llama_equivalent``), if any."""
    return next((name for name in list_methods() if method_class(name).llama_equivalent), None)


def build_peer(env: Env) -> nn.Module:
    """``transformers.LlamaForCausalLM`` with posbench's shape (the :func:`peer_twin`'s twin)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m, s = env.model_cfg, env.settings
    config = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.hidden_size,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_heads,
        max_position_embeddings=max([s.context, *s.eval_lengths]),
        rms_norm_eps=m.norm_eps,
        initializer_range=m.init_std,
        tie_word_embeddings=m.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(env.device)


def bench_peer(env: Env) -> dict[str, Any]:
    """Time the peer's training step; never raises (a failure is recorded as ``skipped``)."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - transformers is a dependency
        return {"skipped": f"transformers is not importable: {one_line(err)}"}
    info: dict[str, Any] = {"model": "transformers.LlamaForCausalLM", "transformers": transformers.__version__}
    logger.info("bench peer: transformers LlamaForCausalLM (sdpa)%s", ", compiled" if env.use_compile else "")
    try:
        peer = build_peer(env)
        info["attention"] = getattr(peer.config, "_attn_implementation", "sdpa")
        n_matmul = matmul_parameters(peer)
        info["parameters"] = sum(p.numel() for p in {id(p): p for p in peer.parameters()}.values())
        info["matmul_parameters"] = n_matmul
        flops = train_flops_per_token(n_matmul, env.model_cfg.n_layers, env.settings.context, env.model_cfg.d_model)
        runner = env.compiled(peer)

        def loss_of(x: Tensor, y: Tensor) -> Tensor:  # what the trainer did before lm_loss: full logits
            return F.cross_entropy(runner(input_ids=x).logits.float().flatten(0, 1), y.flatten())

        info["train"] = time_training(env, peer, loss_of, flops)
        logger.info("  training: %.2f ms/step, %s tok/s", info["train"]["step_ms_median"],
                    f"{info['train']['tokens_per_second_median']:,.0f}")
    except Exception as err:
        if env.settings.debug:
            raise
        logger.warning("peer skipped: %s\n%s", one_line(err), traceback.format_exc())
        info = {"skipped": "oom" if is_oom(err) else one_line(err), **{k: info[k] for k in ("model", "transformers")}}
    return info
