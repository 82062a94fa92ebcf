"""The position-method interface.

Following seed 003's framing (docs/departures.md), a position method touches the transformer in up to
three places, and implements any subset of them:

1. ``input_embedding``: a ``(..., T, d_model)`` tensor added to the token embeddings (learned,
   sinusoidal).
2. ``rotate_qk``: a transform of queries and keys given their positions and layer (rope, xpos,
   p_rope, abs_attention).
3. ``score_term``: an additive term on the attention logits before softmax (alibi, t5, kerple,
   fire, sandwich, relative, cope, fox). It may read the queries, the keys (``k``: cope gates on
   q.k) and the layer input (``x``: fox's forget gate), which the model always passes.

and, for the one method whose paper also changes the values (Shaw et al.'s ``a^V``):

4. ``value_term``: a table of vectors added to the attention output, weighted by the attention
   probabilities grouped by a per-(query, key) bucket.

The score term is ONE function ``fn(b, h, q_idx, kv_idx) -> Tensor`` written with broadcasting
tensor ops. Every attention backend consumes that same function: the eager and SDPA paths call it
on broadcast index grids to materialise a dense ``(B|1, H, Tq, Tk)`` bias, FlexAttention calls it
as a ``score_mod`` on scalar indices. One definition means the backends cannot drift apart. A
method that cannot run in some backend (a term that needs the dense (T, T) attention matrix)
says so in ``backend_limits``: asking for that backend is a one-line error, and ``auto`` skips it.

Positions are explicit: ``(T,)`` (``arange(T)`` by default, shared by the batch) or ``(B, T)``
(one row per sequence, e.g. randomized positions). Score terms read them through
:func:`position_at` / :func:`distance`, which accept both. Every method except ``learned`` and
``abs_attention`` runs at any length without retraining.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from posbench.core.errors import PosbenchError

# fn(b, h, q_idx, kv_idx) -> additive logit term, broadcasting over its integer-tensor arguments.
ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# fn(logits) -> attention weights, both (..., T, T) fp32; query i and key i share index i, keys a
# query must not see are -inf (the causal mask, the window, a -inf score term).
Normalizer = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ModelDims:
    """The model shape a position method is built for."""

    d_model: int
    n_heads: int
    n_layers: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class ValueTerm:
    """``out_i += sum_j p_ij * table[bucket(b, h, i, j)]``: a value-side position term.

    ``bucket`` has the score function's signature and returns integer indices into ``table``
    (``(n_buckets, D)``). Only backends that hold the attention probabilities can add it.
    """

    bucket: ScoreFn
    table: Tensor
    mass: Callable[[Tensor], Tensor] | None = None
    """Optional: probabilities (B, H, T, T) -> their sum per bucket (B, H, T, n_buckets), the
    same sums ``bucket`` defines, computed without a scatter (relative's ``fast`` path)."""


class DenseScore:
    """A score term handed over as its dense grid ``(B|1, H|1, T, T)`` for one length: eager
    and SDPA take the grid as it is (:func:`dense_score`), FlexAttention reads it element by
    element. The ``fast`` paths of fire, sandwich and t5 build their term this way, as batched
    tensor ops, instead of a function evaluated once per (query, key) pair."""

    def __init__(self, grid: Tensor) -> None:
        self.grid = grid

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        grid = self.grid
        return grid[b if grid.shape[0] > 1 else 0, h if grid.shape[1] > 1 else 0, q_idx, kv_idx]


def index_grid(positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Broadcast (batch, query, key) index grids over ``positions`` (T,) or (B, T):
    (B|1, 1, 1, 1), (1, 1, T, 1), (1, 1, 1, T); ``b`` spans the batch only for per-row positions."""
    T = positions.shape[-1]
    idx = torch.arange(T, device=positions.device)
    batch = positions.shape[0] if positions.dim() == 2 else 1
    b = torch.arange(batch, device=positions.device).view(-1, 1, 1, 1)
    return b, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1)


def position_at(positions: Tensor, b: Tensor, idx: Tensor) -> Tensor:
    """Position id of sequence index ``idx`` (in batch row ``b``); positions are (T,) or (B, T)."""
    return positions[idx] if positions.dim() == 1 else positions[b, idx]


def distance(positions: Tensor, b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal distance ``pos(q) - pos(kv)`` between query and key (>= 0 for visible keys)."""
    return position_at(positions, b, q_idx) - position_at(positions, b, kv_idx)


# ----------------------------------------------------------------------------- the grid layout
# On a grid (the bidirectional grid encoder, docs/grid.md) a token's position is its cell
# (row, col): positions are (T, 2) (shared by the batch) or (B, T, 2), int64, row-major order.

LAYOUTS = ("sequence", "grid")


def grid_positions(height: int, width: int, device: torch.device | str | None = None) -> Tensor:
    """The cells of a ``height x width`` grid in row-major order -> (height * width, 2) (row, col)."""
    rows = torch.arange(height, device=device).repeat_interleave(width)  # (T,)
    cols = torch.arange(width, device=device).repeat(height)  # (T,)
    return torch.stack((rows, cols), dim=-1)  # (T, 2)


def grid_side(length: int) -> int:
    """The side of the square grid of ``length`` cells (one clear error when there is none)."""
    side = math.isqrt(length)
    if side * side != length:
        raise PosbenchError(f"a grid of {length} cells is not square; grid lengths are side**2 (e.g. 64, 256, 1024)")
    return side


def cell_at(positions: Tensor, b: Tensor, idx: Tensor) -> Tensor:
    """(row, col) of sequence index ``idx`` (in batch row ``b``) -> (..., 2); positions (T, 2) or (B, T, 2)."""
    return positions[idx] if positions.dim() == 2 else positions[b, idx]


def cell_index_grid(positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`index_grid` for grid positions (T, 2) or (B, T, 2)."""
    T = positions.shape[-2]
    idx = torch.arange(T, device=positions.device)
    batch = positions.shape[0] if positions.dim() == 3 else 1
    b = torch.arange(batch, device=positions.device).view(-1, 1, 1, 1)
    return b, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1)


def grid_offset(positions: Tensor, b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> tuple[Tensor, Tensor]:
    """``(dy, dx)`` = cell(q) - cell(kv), row and column offsets from key to query (either sign)."""
    offset = cell_at(positions, b, q_idx) - cell_at(positions, b, kv_idx)  # (..., 2)
    return offset[..., 0], offset[..., 1]


class PositionMethod(nn.Module):
    """Base class: no position information at all (every hook is the identity).

    Subclasses set ``name`` (the ``method=`` config value), override the hooks they use, and
    declare ``has_score_term`` so backends can pick a fast path (no score term -> fused causal
    attention) without running the model. ``uses_positions`` is False for methods that never read
    position ids (nope, cope, fox): options that change the ids (randomized positions) are then
    rejected rather than silently ignored.
    """

    name: ClassVar[str] = ""
    layouts: ClassVar[tuple[str, ...]] = ("sequence",)
    """Where the method runs: ``sequence`` (the causal language model; positions (T,) or (B, T)),
    ``grid`` (the bidirectional grid encoder; positions (T, 2) or (B, T, 2), (row, col) per token,
    see :func:`grid_positions`), or both (nope). A model refuses a method not made for its layout."""
    enters: ClassVar[str] = ""
    """Where the method enters the model (input, q-k, score, normaliser, per layer), short."""
    source: ClassVar[str] = ""
    """The paper (authors and year) or code the method follows."""
    past_context: ClassVar[str] = ""
    """What happens past the training context C (past the training grid for a grid method). These
    three are the one place the facts are written: ``scripts/methods_overview.py`` renders them
    into docs/methods-overview.md (``docs/<page>.md`` becomes a link there)."""
    backend_note: ClassVar[str] = ""
    """A note beside the backends ``model.attention=auto`` picks on the CPU and on CUDA, which the
    overview computes (:func:`posbench.model.attention.resolve_backend`)."""
    has_score_term: ClassVar[bool] = False
    uses_positions: ClassVar[bool] = True
    relative_scores: ClassVar[bool] = False
    """Attention logits depend on positions only through i - j (shifting every position by the
    same amount changes nothing); tests check it for every method that declares it."""
    llama_equivalent: ClassVar[bool] = False
    """With its default options, a model using this method computes what transformers'
    ``LlamaForCausalLM`` of the same shape computes: ``posbench bench`` times that peer beside it."""
    context_option: ClassVar[str | None] = None
    """An option that follows the run's training context: null (its default) becomes
    ``trainer.context`` when a run is specified (:func:`posbench.runs.spec.build_spec`), and the run
    records the value it used (hope's ``train_context``)."""
    options_before: ClassVar[dict[str, Any]] = {}
    """Options added (or whose default changed) after runs were recorded: the value that reproduces
    what a run recorded without the option computed. A saved run is rebuilt with these, not with
    today's defaults (:meth:`posbench.runs.spec.MethodSpec.from_saved`)."""

    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.dims = dims

    @property
    def max_positions(self) -> int | None:
        """Largest supported position + 1, or None when any length works."""
        return None

    def length_fix(self, length: int) -> str:
        """The option change that lets this method run ``length`` tokens past :attr:`max_positions`
        (one clause of the error that refuses them)."""
        return f"raise method.max_positions to at least {length}"

    def backend_limits(self) -> dict[str, str]:
        """Attention backends this method (with its options) cannot run in -> one-line reason."""
        return {}

    def input_embedding(self, positions: Tensor) -> Tensor | None:
        """(..., T) positions -> (..., T, d_model) tensor added to the token embeddings, or None."""
        return None

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        """Transform q, k of shape (B, H, T, D) given their (T,) or (B, T) positions.

        Returns q, k of shape (B, H, T, D'): D' = D, or more channels for both alike (pope's polar
        form has 2D); the backends scale q.k by 1/sqrt(D') and the values keep D."""
        return q, k

    def score_term(
        self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None, x: Tensor | None = None
    ) -> ScoreFn | None:
        """Additive attention-logit term for ``layer``; ``q``, ``k`` are (B, H, T, D) after
        ``rotate_qk``, ``x`` is the attention input (B, T, d_model) after its RMSNorm.

        Returned function maps broadcastable integer tensors (batch, head, query index, key
        index) to the term added to the *scaled* logits ``q.k / sqrt(D)``. Indices are positions
        in the sequence; map them through ``positions`` (:func:`distance`) for position ids.
        The model always passes ``k`` and ``x``; methods that need them say so when they are None.
        """
        return None

    def value_term(self, positions: Tensor, layer: int) -> ValueTerm | None:
        """A value-side term for ``layer`` (see :class:`ValueTerm`), or None."""
        return None

    def per_forward(self, positions: Tensor) -> Any:
        """What every layer's score term shares within one forward (a term computed once for all
        layers), or None. The model calls it once per forward and passes a non-None result to
        each layer's :meth:`score_term` as ``shared=``; a score term called without it computes
        the same thing itself. Default: None."""
        return None

    def before_step(self) -> None:
        """Called by the training step before each optimizer step's forwards, outside any compiled
        graph, on every method module of the model (kerple projects its parameters here, so a
        compiled forward mutates nothing). Default: nothing."""

    @property
    def switched_at_step(self) -> int | None:
        """The training step after which the method stopped computing what it computed before
        (drope: the step after which its position encoding is dropped), once it has; None for
        every method that never switches. Recorded in results.json."""
        return None

    def key_bias(self, x: Tensor, layer: int) -> Tensor | None:
        """A term ``(B, H, T)`` fp32 added to the logit of every query for key j, or None; ``x``
        is the attention input (B, T, d_model) after its RMSNorm. It needs no score function: the
        backends fold it into extra key channels, so it runs in fused SDPA (fox's ``fast`` path)."""
        return None

    def attention_window(self, layer: int) -> int | None:
        """A sliding window the method imposes on ``layer`` (keys W or more positions back are
        masked), or None. ``model.attention_window`` still applies: a layer keeps the narrower."""
        return None

    def normalizer(self, layer: int) -> Normalizer | None:
        """What replaces the softmax over the masked logits of ``layer`` (see :data:`Normalizer`),
        or None for the softmax. Only the eager backend runs one: a method that returns one
        declares sdpa and flex in :meth:`backend_limits`."""
        return None

    def position_parameters(self) -> dict[str, nn.Parameter]:
        """The method's learned position parameters by name (logged as they train, see
        :class:`ParameterDrift`). Default: every trainable parameter registered on the method."""
        return {name: p for name, p in self.named_parameters() if p.requires_grad}

    def extra_repr(self) -> str:
        return f"name={self.name}"


class OverBase(PositionMethod):
    """A method built over a base method ``self.inner`` (dape, ssmax: ``method.base``): every hook
    it does not override is the base's (its table limit, input embedding, value term, per-layer
    windows, normaliser, backend limits and q-k rotation), so a base's windows (swan) or
    normaliser (stickbreaking) are kept."""

    inner: PositionMethod

    @property
    def max_positions(self) -> int | None:
        return self.inner.max_positions

    def length_fix(self, length: int) -> str:
        return self.inner.length_fix(length)

    def input_embedding(self, positions: Tensor) -> Tensor | None:
        return self.inner.input_embedding(positions)

    def value_term(self, positions: Tensor, layer: int) -> ValueTerm | None:
        return self.inner.value_term(positions, layer)

    def key_bias(self, x: Tensor, layer: int) -> Tensor | None:
        # A wrapper that transforms the logits (dape's MLP, ssmax's scale) builds its base with the
        # base's defaults, which have no key bias; one that only adds or masks keeps it exact.
        return self.inner.key_bias(x, layer)

    def attention_window(self, layer: int) -> int | None:
        return self.inner.attention_window(layer)

    def normalizer(self, layer: int) -> Normalizer | None:
        return self.inner.normalizer(layer)

    def backend_limits(self) -> dict[str, str]:
        return self.inner.backend_limits()

    @property
    def switched_at_step(self) -> int | None:
        return self.inner.switched_at_step

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        return self.inner.rotate_qk(q, k, positions, layer)


# ----------------------------------------------------------------------------- capabilities
# What a method can do beyond the hooks, declared by subclassing; evaluation-time extensions,
# figures and tests find methods by these, never by name.


class Rotary:
    """Capability: ``rotate_qk`` rotates channel pairs of q and k by angles ``pos * inv_freq``.

    Implementers hold ``inv_freq`` (R/2 frequencies, RoPE's layout ``base^(-2i/R)``; zeros for
    pairs left unrotated), ``base`` and ``rotary_dim`` (R rotated channels per head), and
    rotate with whatever ``inv_freq`` they hold, so :meth:`with_frequencies` changes the angles
    of every rotation. PI / NTK / YaRN / Llama 3 (:mod:`posbench.model.extension`) apply to them.
    """

    inv_freq: Tensor
    base: float
    rotary_dim: int

    def with_frequencies(self, inv_freq: Tensor) -> PositionMethod:
        """A copy of this method rotating by ``inv_freq`` (R/2,); parameters are shared, this
        module is never changed. Methods whose own frequencies pin some pairs (zeros) keep them."""
        inv_freq = inv_freq.to(self.inv_freq.device)
        inv_freq = torch.where(self.inv_freq == 0, torch.zeros_like(inv_freq), inv_freq)
        clone = copy.copy(self)
        clone._buffers = dict(self._buffers)  # type: ignore[attr-defined]  # its own buffer dict
        clone._buffers["inv_freq"] = inv_freq  # type: ignore[attr-defined]
        return clone  # type: ignore[return-value]


class InputTable:
    """Capability: ``input_embedding`` is a table of positions that can be read at fractional
    positions (position interpolation reads it at ``n / s``)."""

    table_note: ClassVar[str | None] = None
    """A caveat figures of the table state (e.g. rows that training never reaches)."""

    def input_embedding_at(self, positions: Tensor, trained_positions: int | None) -> Tensor:
        """(T,) fractional float64 positions -> (T, d_model); ``trained_positions``: rows past it
        never got a gradient. Formula-based tables evaluate the formula at any position."""
        return self.input_embedding(positions)  # type: ignore[attr-defined]


def interpolate_rows(weight: Tensor, positions: Tensor) -> Tensor:
    """Rows of ``weight`` (P, d) read at fractional ``positions`` (T,), linearly interpolated."""
    low = positions.floor().long().clamp(max=weight.shape[0] - 1)  # (T,)
    high = (low + 1).clamp(max=weight.shape[0] - 1)
    frac = (positions - low.double()).to(weight.dtype)[:, None]  # (T, 1)
    return weight[low] * (1 - frac) + weight[high] * frac  # (T, d)


class ParameterDrift:
    """How far a method's learned position parameters have moved from their initialisation.

    Snapshot the parameters when the model is built (the seed's initialisation, also when the run
    later resumes from a checkpoint); :meth:`metrics` then gives, per parameter, its norm
    ``position/<name>/norm`` and its relative movement ``position/<name>/move`` =
    ||p_t - p_0|| / ||p_0|| (the absolute ||p_t - p_0|| where p_0 = 0, e.g. cope's zero tables).
    """

    def __init__(self, method: PositionMethod) -> None:
        self.method = method
        self.initial = {name: p.detach().float().cpu().clone() for name, p in method.position_parameters().items()}

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, param in self.method.position_parameters().items():
            now, start = param.detach().float().cpu(), self.initial[name]
            moved, start_norm = float((now - start).norm()), float(start.norm())
            out[f"position/{name}/norm"] = float(now.norm())
            out[f"position/{name}/move"] = moved / start_norm if start_norm > 0 else moved
        return out


def needs(tensor: Tensor | None, what: str, method: str) -> Tensor:
    """``tensor``, or a clear error when a content-dependent method was called without it."""
    if tensor is None:
        raise ValueError(f"{method}'s score term depends on {what}; pass it to score_term")
    return tensor


def check_table_range(positions: Tensor, max_positions: int, method: str) -> None:
    """One clear error when a learned per-position table is asked for a row it does not have.

    The exact max is read only from CPU tensors: on a GPU it would cost a host sync per forward
    (out-of-range ids still fail in the lookup there), so the length stands in for it.
    """
    if torch.compiler.is_compiling() or not positions.numel():
        return
    last = int(positions.max()) if positions.device.type == "cpu" else positions.shape[-1] - 1
    if last >= max_positions:
        raise PosbenchError(
            f"{method} positions go up to {max_positions - 1} but position {last} "
            f"was requested; train with a larger method.max_positions"
        )


def dense_score(fn: ScoreFn, batch: int, heads: int, length: int, device: torch.device) -> Tensor:
    """Materialise ``fn`` on the full index grid -> (B or 1, H, T, T) (B only if fn uses it)."""
    if isinstance(fn, DenseScore):  # already dense
        return fn.grid.expand(fn.grid.shape[0], heads, length, length)
    idx = torch.arange(length, device=device)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    out = fn(b, h, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1))
    return out.expand(out.shape[0], heads, length, length)
