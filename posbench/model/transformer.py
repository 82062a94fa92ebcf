"""A Llama-style causal transformer whose position information comes from a pluggable method.

The same body is the bidirectional grid encoder (``model.layout=grid``, docs/grid.md): every token
attends to every token, a token's position is its cell (row, col), and the head predicts a label
per cell.

    tokens -> embedding (+ method.input_embedding)
           -> n_layers x [x + Attn(RMSNorm(x)),  x + SwiGLU(RMSNorm(x))]
           -> RMSNorm -> LM head -> logits

An image task (docs/images.md) embeds patches (``model.patch_dim``: ``Linear(patch_dim, d_model)``,
with ViT's bias) and reads one answer per image from the mean of the final hidden states
(``model.head=pooled``); the patch embedding exists only when the option is on.

Attention applies ``method.rotate_qk`` to q/k, ``method.score_term`` to the logits (it may read q,
k and the layer input x), ``method.normalizer`` in place of the softmax where the method has one,
and ``method.value_term`` to the output; one method instance is shared by all layers (methods that
want per-layer parameters index them by layer). ``attention_window`` masks keys W or more
positions back, for any method; a method may narrow it per layer (``method.attention_window``).
No biases anywhere, as in Llama. With ``method=rope`` the model is numerically the same function
as ``transformers.LlamaForCausalLM`` of the same shape (tested).

``model.mixer`` replaces attention in every layer, or in a repeating pattern of layers, with a
recurrent mixer (``posbench/model/mixers/``, docs/mixers.md): ``x + Mixer(RMSNorm(x))``, which
takes no position method. A forward given ``state`` (a dict, layer -> that layer's state) starts
each recurrent layer from it and leaves the final states in it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from posbench.core.errors import PosbenchError
from posbench.methods import LAYOUTS, ModelDims, PositionMethod, build_method, grid_positions, grid_side
from posbench.model.attention import BACKENDS, attend, causal_block_mask, prebuilt_block_mask, resolve_backend
from posbench.model.mixers import ATTENTION, MIXERS, build_mixer, list_mixers, mixer_options

HEADS = ("tokens", "pooled")
"""``model.head``: logits at every token, or one answer per sequence from the mean of the tokens."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and initialisation of the transformer. Defaults are the ``small`` flavour."""

    flavour: str = "small"
    """Name of the preset this config came from (``tiny``, ``small``, ...); informational."""
    vocab_size: int = 8192
    """Vocabulary size; the trainer sets it from the prepared data's tokenizer."""
    d_model: int = 384
    """Residual stream width."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 6
    """Attention heads; head dimension is d_model / n_heads."""
    mlp_hidden: int | None = None
    """SwiGLU hidden size; None = Llama's rule, 2/3 * 4 * d_model rounded up to mlp_multiple_of."""
    mlp_multiple_of: int = 64
    """Rounding for the default mlp_hidden (keeps matmuls tensor-core friendly)."""
    tie_embeddings: bool = False
    """Share the token embedding and LM head weights."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights (GPT-2/nanoGPT); residual output
    projections use init_std / sqrt(2 * n_layers)."""
    attention: str = "auto"
    """Attention backend: auto | eager | sdpa | flex (auto: flex on CUDA for score-term or
    windowed attention, sdpa otherwise, and always one the method can run in)."""
    attention_window: int | None = None
    """Sliding-window baseline (Chi et al. 2023): each query sees only its last W keys, itself
    included; None = full causal attention. Combines with any method."""
    layout: str = "sequence"
    """``sequence``: the causal language model. ``grid``: the bidirectional grid encoder (every
    token sees every token; a token's position is its cell (row, col) of a square grid, read
    by the grid methods). Set by the run spec from the task (a grid task: docs/grid.md)."""
    patch_dim: int | None = None
    """None: inputs are token ids (the embedding table). F: inputs are (B, T, F) float features
    (an image's patches), embedded by ``Linear(F, d_model)``. Set by the run spec from the task."""
    head: str = "tokens"
    """``tokens``: logits at every token (the LM head). ``pooled``: one answer per sequence, the
    head applied to the mean of the final hidden states (B, 1, vocab). Set by the run spec from the task."""
    mixer: list[str] | str = "attention"
    """The token mixer of every layer: ``attention``, or a recurrent mixer (``mamba2``,
    ``gated_deltanet``; docs/mixers.md); or a list, repeated over the layers (a hybrid:
    ``[gated_deltanet, gated_deltanet, gated_deltanet, attention]``)."""
    mixer_options: dict[str, dict[str, Any]] | None = None
    """Options of the recurrent mixers, by mixer name (``{mamba2: {d_state: 32}}``); every option not
    given takes the mixer's default, and the config keeps them all. None: no recurrent layer."""

    def __post_init__(self) -> None:
        if not isinstance(self.mixer, str):  # a pattern: a tuple, so the frozen config holds no list
            pattern = tuple(self.mixer)
            object.__setattr__(self, "mixer", pattern[0] if len(pattern) == 1 else pattern)
        self.validate()
        recurrent = sorted(set(self.layer_mixers) - {ATTENTION})
        given = dict(self.mixer_options or {})
        object.__setattr__(self, "mixer_options", {
            name: {**mixer_options(name), **given.get(name, {})} for name in recurrent} or None)

    @property
    def layer_mixers(self) -> list[str]:
        """The mixer of every layer: ``model.mixer``, or its list repeated over the layers."""
        pattern = [self.mixer] if isinstance(self.mixer, str) else list(self.mixer)
        return [pattern[layer % len(pattern)] for layer in range(self.n_layers)]

    @property
    def has_attention(self) -> bool:
        return ATTENTION in self.layer_mixers

    @property
    def recurrent(self) -> bool:
        """Some layer is a recurrent mixer."""
        return set(self.layer_mixers) != {ATTENTION}

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def dims(self) -> ModelDims:
        """The shape a position method is built for."""
        return ModelDims(d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers)

    @property
    def hidden_size(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        hidden = int(2 * 4 * self.d_model / 3)
        return self.mlp_multiple_of * math.ceil(hidden / self.mlp_multiple_of)

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PosbenchError(f"model.{name} must be a positive integer, got {value!r}")
        if self.mlp_hidden is not None and (not isinstance(self.mlp_hidden, int) or self.mlp_hidden <= 0):
            raise PosbenchError(f"model.mlp_hidden must be a positive integer or null, got {self.mlp_hidden!r}")
        if self.d_model % self.n_heads:
            raise PosbenchError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "pick n_heads that divides d_model"
            )
        if not self.norm_eps > 0 or not self.init_std > 0:
            raise PosbenchError("model.norm_eps and model.init_std must be positive")
        if self.attention_window is not None and (
            not isinstance(self.attention_window, int) or isinstance(self.attention_window, bool)
            or self.attention_window < 1
        ):
            raise PosbenchError(
                f"model.attention_window must be a positive integer or null, got {self.attention_window!r}"
            )
        if self.layout not in LAYOUTS:
            raise PosbenchError(f"model.layout={self.layout!r} is not a layout; choose one of {', '.join(LAYOUTS)}")
        if self.layout == "grid" and self.attention_window is not None:
            raise PosbenchError("model.attention_window is a causal sliding window; the grid encoder takes none "
                                "(set model.attention_window=null)")
        if self.patch_dim is not None and (type(self.patch_dim) is not int or self.patch_dim <= 0 or self.tie_embeddings):
            raise PosbenchError(f"model.patch_dim={self.patch_dim!r} must be a positive integer or null, and a patch "
                                "model has no token embedding to tie (model.tie_embeddings=false)")
        if self.head not in HEADS:
            raise PosbenchError(f"model.head={self.head!r} is not a head; choose one of {', '.join(HEADS)}")
        if self.attention not in BACKENDS:
            raise PosbenchError(
                f"model.attention={self.attention!r} is not a backend; choose one of {', '.join(BACKENDS)}"
            )
        self.validate_mixers()

    def validate_mixers(self) -> None:
        pattern = [self.mixer] if isinstance(self.mixer, str) else list(self.mixer)
        unknown = [m for m in pattern if m not in list_mixers()]
        if not pattern or unknown:
            raise PosbenchError(f"model.mixer={self.mixer!r} is not a mixer or a list of mixers; choose from "
                                f"{', '.join(list_mixers())}")
        if not self.recurrent:
            if self.mixer_options:
                raise PosbenchError("model.mixer_options set, but model.mixer has no recurrent layer; "
                                    "drop model.mixer_options or set model.mixer")
            return
        if self.layout != "sequence":
            raise PosbenchError(f"model.mixer={self.mixer!r}: a recurrent mixer is causal, the {self.layout} "
                                "layout is not; use model.mixer=attention")
        if not self.has_attention and self.attention_window is not None:
            raise PosbenchError("model.attention_window masks attention, and this model has no attention layer; "
                                "set model.attention_window=null")
        for name, options in (self.mixer_options or {}).items():
            if name not in MIXERS or name not in pattern:
                raise PosbenchError(f"model.mixer_options.{name}: {name} is not a recurrent mixer of this model "
                                    f"(model.mixer={self.mixer!r})")
            known = mixer_options(name)
            extra = sorted(set(options or {}) - set(known))
            if extra:
                raise PosbenchError(f"unknown option(s) {', '.join(extra)} of mixer {name}; known: "
                                    f"{', '.join(known)}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise PosbenchError(f"unknown model option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        if values["layout"] == "sequence":  # the language model's records stay as they were
            del values["layout"]
        for name, default in (("patch_dim", None), ("head", "tokens")):  # so do the token models'
            if values[name] == default:
                del values[name]
        if not self.recurrent:  # and the attention models'
            del values["mixer"], values["mixer_options"]
        elif not isinstance(self.mixer, str):
            values["mixer"] = list(self.mixer)
        return values

    @property
    def causal(self) -> bool:
        return self.layout == "sequence"


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.n_heads
        self.backend = cfg.attention
        self.causal = cfg.causal
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, positions: Tensor, method: PositionMethod, block_mask=None,
                window: int | None = None, shared: Any = None) -> Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_heads)
        q, k = method.rotate_qk(q, k, positions, self.layer)  # (B, H, T, D) each
        extra = {} if shared is None else {"shared": shared}  # method.per_forward's result
        score = method.score_term(q, positions, self.layer, k=k, x=x, **extra) if method.has_score_term else None
        value = method.value_term(positions, self.layer)
        backend = resolve_backend(self.backend, method, x.device, window)
        y = attend(q, k, v, score, backend, block_mask, window, value, method.normalizer(self.layer),
                   method.key_bias(x, self.layer), causal=self.causal)  # (B, H, T, D)
        return self.out(rearrange(y, "b h t d -> b t (h d)"))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.hidden_size, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.hidden_size, bias=False)
        self.down = nn.Linear(cfg.hidden_size, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        kind = cfg.layer_mixers[layer]
        if kind == ATTENTION:
            self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
            self.attn = Attention(cfg, layer)
        else:
            self.mixer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
            self.mixer = build_mixer(kind, cfg.d_model, cfg.n_heads, cfg.norm_eps, cfg.mixer_options[kind])
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor, positions: Tensor, method: PositionMethod, block_mask=None,
                window: int | None = None, shared: Any = None, state: dict | None = None) -> Tensor:
        if hasattr(self, "mixer"):  # a recurrent layer: no position method, its state carried in `state`
            y, final = self.mixer(self.mixer_norm(x), None if state is None else state.get(self.layer))
            if state is not None:
                state[self.layer] = final
            x = x + y
        else:
            x = x + self.attn(self.attn_norm(x), positions, method, block_mask, window, shared)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab).

    Two switches that change how, never what, it computes (set by the trainer from
    ``trainer.loss_chunk``; ``scripts/speed.py`` times both sides): ``loss_chunk`` (None: the loss
    of :func:`lm_loss`; N: :func:`chunked_lm_loss`, N tokens at a time, equal to rounding) and
    ``prebuilt_masks`` (True: flex's BlockMasks come from a cache outside any compiled graph,
    :func:`posbench.model.attention.prebuilt_block_mask`; False: built inside the graph, every forward).
    """

    loss_chunk: int | None = None
    prebuilt_masks: bool = True

    def __init__(self, cfg: ModelConfig, method: PositionMethod) -> None:
        super().__init__()
        if cfg.layout not in method.layouts:
            raise PosbenchError(
                f"method={method.name} is not made for the {cfg.layout} layout; "
                f"choose a {cfg.layout} method ({', '.join(_methods_for(cfg.layout))})"
            )
        check_mixer_method(cfg, method.name)
        self.cfg = cfg
        self.position = method
        if cfg.patch_dim is None:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        else:
            self.patch_embed = nn.Linear(cfg.patch_dim, cfg.d_model)  # (B, T, F) -> (B, T, C)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def method_name(self) -> str:
        return self.position.name

    def reset_parameters(self) -> None:
        """GPT-2 style init; position methods keep the init they chose for their own tables."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        if self.cfg.patch_dim is None:
            nn.init.normal_(self.embed.weight, std=std)
        else:
            nn.init.zeros_(self.patch_embed.bias)  # its weight: normal(std), below
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and not name.startswith("position."):
                is_residual_out = name.endswith(("attn.out", "mixer.out", "mlp.down"))
                nn.init.normal_(module.weight, std=residual_std if is_residual_out else std)

    def embed_inputs(self, idx: Tensor) -> Tensor:
        """(B, T) token ids -> (B, T, C) by the embedding table; with ``patch_dim``: (B, T, F)
        features -> (B, T, C) by the patch embedding."""
        if self.cfg.patch_dim is None:
            return self.embed(idx)
        if idx.dim() != 3 or idx.shape[-1] != self.cfg.patch_dim or not idx.is_floating_point():
            raise PosbenchError(f"a patch model takes float features (B, T, {self.cfg.patch_dim}), "
                                f"got {idx.dtype} of shape {tuple(idx.shape)}")
        return self.patch_embed(idx)

    def answer_states(self, hidden: Tensor) -> Tensor:
        """(B, T, C) final hidden states -> the states the head reads: every token's (the same
        tensor), or with the pooled head their mean over the tokens (B, 1, C)."""
        return hidden.mean(dim=1, keepdim=True) if self.cfg.head == "pooled" else hidden

    def initial_state(self, batch: int, device: torch.device | str = "cpu") -> dict[int, tuple[Tensor, ...]]:
        """The zero state of every recurrent layer for ``batch`` streams (empty: no recurrent layer)."""
        dtype = self.lm_head.weight.dtype
        return {block.layer: block.mixer.initial_state(batch, device, dtype)
                for block in self.blocks if hasattr(block, "mixer")}

    def set_mixer_form(self, form: str) -> None:
        """Run every recurrent layer ``chunked`` (training) or ``recurrent`` (token by token); the
        same function either way."""
        for block in self.blocks:
            if hasattr(block, "mixer"):
                block.mixer.form = form

    def hidden_states(self, idx: Tensor, positions: Tensor | None = None, state: dict | None = None) -> Tensor:
        """(B, T) token ids (or (B, T, patch_dim) features) -> (B, T, d_model) final normalised
        hidden states.

        ``positions``: (T,) or (B, T) position ids (randomized positions give each sequence its
        own row); default ``arange(T)``. On the grid layout: (T, 2) or (B, T, 2) cells (row, col);
        default the cells of the square grid of T tokens in row-major order.
        ``state``: recurrent layers start from it and leave their final states in it (see the class).
        """
        B, T = idx.shape[:2]
        windows = layer_windows(self.cfg, self.position)
        block_masks = {}  # once per forward and distinct window, shared by the layers that use it
        build_mask = prebuilt_block_mask if self.prebuilt_masks else causal_block_mask
        for window in dict.fromkeys(windows):
            if self.cfg.causal and resolve_backend(self.cfg.attention, self.position, idx.device, window) == "flex":
                block_masks[window] = build_mask(T, str(idx.device), window)
        if self.cfg.causal:
            if positions is None:
                positions = torch.arange(T, device=idx.device)
            if positions.shape not in ((T,), (B, T)):
                raise PosbenchError(f"positions must have shape ({T},) or ({B}, {T}), got {tuple(positions.shape)}")
        else:
            if positions is None:
                side = grid_side(T)
                positions = grid_positions(side, side, idx.device)
            if positions.shape not in ((T, 2), (B, T, 2)):
                raise PosbenchError(f"grid positions must have shape ({T}, 2) or ({B}, {T}, 2), "
                                    f"got {tuple(positions.shape)}")
        x = self.embed_inputs(idx)  # (B, T, C)
        pos_emb = self.position.input_embedding(positions)  # (T, C) or (B, T, C)
        if pos_emb is not None:
            x = x + pos_emb.to(x.dtype)
        shared = self.position.per_forward(positions)  # a term all layers share, computed once
        for block, window in zip(self.blocks, windows):
            x = block(x, positions, self.position, block_masks.get(window), window, shared, state)
        return self.norm(x)

    def forward(self, idx: Tensor, positions: Tensor | None = None, targets: Tensor | None = None,
                state: dict | None = None) -> Tensor:
        """(B, T) token ids -> (B, T, vocab) logits; with ``targets`` (B, T) -> the mean
        next-token cross-entropy (fp32), computed by :func:`lm_loss` (as nanoGPT's forward).
        The pooled head gives (B, 1, vocab) logits and takes (B, 1) targets."""
        hidden = self.answer_states(self.hidden_states(idx, positions, state))  # (B, T, C), pooled: (B, 1, C)
        if targets is None:
            return self.lm_head(hidden)  # (B, T, vocab)
        if self.loss_chunk:
            return chunked_lm_loss(hidden, self.lm_head.weight, targets, self.loss_chunk)
        return lm_loss(hidden, self.lm_head, targets)

    def num_parameters(self, non_embedding: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        total = sum(p.numel() for p in params.values())
        if non_embedding:
            total -= self.embed.weight.numel() if self.cfg.patch_dim is None else 0
            if not self.cfg.tie_embeddings:
                total -= self.lm_head.weight.numel()
        return total


def check_mixer_method(cfg: ModelConfig, method: str) -> None:
    """A model without attention layers takes no position method: only ``nope``."""
    if not cfg.has_attention and method != "nope":
        raise PosbenchError(f"model.mixer={cfg.mixer!r} has no attention layer for method={method} to "
                            "enter; use method=nope (a recurrent model takes no position method)")


def _methods_for(layout: str) -> list[str]:
    from posbench.methods import list_methods

    return list_methods(layout)


def layer_windows(cfg: ModelConfig, method: PositionMethod) -> list[int | None]:
    """The attention window of every layer: ``model.attention_window`` and the method's own
    (``method.attention_window``) both mask, so a layer keeps the narrower; None = full causal."""
    windows = []
    for layer in range(cfg.n_layers):
        given = [w for w in (cfg.attention_window, method.attention_window(layer)) if w is not None]
        windows.append(min(given) if given else None)
    return windows


def attention_backends(cfg: ModelConfig, method: PositionMethod, device: torch.device) -> str:
    """The backend the layers run in (``sdpa``), or each distinct one in layer order when they
    differ (``sdpa+flex``: on CUDA a schedule's windowed layers run in flex, its others in sdpa)."""
    return "+".join(dict.fromkeys(resolve_backend(cfg.attention, method, device, w) for w in layer_windows(cfg, method)))


# glibc serves allocations above its largest mmap threshold (32 MiB) with a fresh mmap, and every
# page of it faults on first touch. Full (B*T, vocab) logits are far above it (batch 16 x 256 x
# 8192 fp32 = 128 MiB), so on the CPU a training step spent more time in page faults than in the
# LM head's arithmetic. Chunks of at most this many bytes are reused from the heap instead.
CPU_LOGITS_CHUNK_BYTES = 16 * 2**20


def logits_chunk_rows(vocab: int, device: torch.device) -> int | None:
    """Rows of (rows, vocab) fp32 logits per chunk on ``device``; None = all at once (CUDA's
    caching allocator reuses memory, and one kernel beats many)."""
    if device.type == "cuda":
        return None
    return max(1, CPU_LOGITS_CHUNK_BYTES // (4 * vocab))


def lm_loss(hidden: Tensor, head: nn.Linear, targets: Tensor) -> Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets``: (B, T, C), (B, T) -> scalar.

    The softmax runs in fp32. On the CPU the logits are made, and freed by backward, a chunk of
    positions at a time (see :data:`CPU_LOGITS_CHUNK_BYTES`); the loss is the same up to the
    order of the summation.
    """
    hidden, targets = hidden.flatten(0, 1), targets.flatten()  # (N, C), (N,)
    rows = logits_chunk_rows(head.out_features, hidden.device) or hidden.shape[0]
    if rows >= hidden.shape[0]:
        loss = F.cross_entropy(head(hidden).float(), targets)
        # No scored target (a task micro-batch without an answer): 0, not cross_entropy's 0 / 0.
        return torch.where((targets != -100).any(), loss, 0.0)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], rows):
        logits = head(hidden[start:start + rows]).float()  # (rows, vocab)
        total = total + F.cross_entropy(logits, targets[start:start + rows], reduction="sum")
    # The mean over scored targets, as F.cross_entropy's: a task's non-answer targets are -100.
    return total / max(int((targets != -100).sum()), 1)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight^T`` against ``targets``, ``chunk`` rows at a time:
    the (N, vocab) logits are never held whole, in the forward nor in the backward, which
    recomputes each chunk's logits and turns them into the gradients of that chunk. Logits and
    softmax in fp32; matmuls in the inputs' dtype. Targets of -100 are not scored."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        # hidden (N, C), weight (V, C), targets (N,)
        scored = targets != -100
        count = scored.sum().clamp(min=1).float()
        lse = hidden.new_empty(hidden.shape[0], dtype=torch.float32)  # (N,) kept for the backward
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.t()).float()  # (n, V)
            lse[rows] = logits.logsumexp(dim=-1)
            picked = logits.gather(1, targets[rows].clamp(min=0)[:, None])[:, 0]  # (n,)
            total = total + torch.where(scored[rows], lse[rows] - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, targets, lse, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, targets, lse, count = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = grad.float() / count
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = (hidden[rows] @ weight.t()).float()  # (n, V)
            dlogits = (logits - lse[rows, None]).exp()  # softmax
            target = targets[rows]
            dlogits.scatter_add_(1, target.clamp(min=0)[:, None], torch.full_like(dlogits[:, :1], -1.0))
            dlogits = (dlogits * torch.where(target != -100, scale, 0.0)[:, None]).to(hidden.dtype)
            grad_hidden[rows] = dlogits @ weight
            grad_weight += (dlogits.t() @ hidden[rows]).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def chunked_lm_loss(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
    """:func:`lm_loss` (mean cross-entropy, fp32) through :class:`ChunkedCrossEntropy`:
    (B, T, C), (vocab, C), (B, T) -> scalar. Under autocast the matmuls run in its dtype, as the
    LM head's would; equal to :func:`lm_loss` to rounding (summation order)."""
    hidden, targets = hidden.flatten(0, 1), targets.flatten()  # (N, C), (N,)
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk)


def build_model(cfg: ModelConfig, method: str, method_options: dict[str, Any] | None = None) -> Transformer:
    """Build a model of shape ``cfg`` with position method ``method`` and its options."""
    dims = cfg.dims
    # Same seed, same body: every method consumes exactly one draw of the global RNG here and
    # builds its own parameters from a generator seeded by it, so the token embedding, blocks
    # and LM head that follow are bitwise identical across methods.
    method_seed = int(torch.randint(0, 2**62, (), device="cpu"))  # cpu: also under a meta-device probe
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(method_seed)
        try:
            position = build_method(method, dims, **(method_options or {}))
        except ValueError as err:  # a method's own shape requirement, e.g. rope's even head dim
            raise PosbenchError(f"method={method} cannot run on this model: {err}") from None
    return Transformer(cfg, position)
