"""What ``posbench viz`` measures: pure tensor functions, each tested against a formula.

- attention: entropy and mean attended distance of attention rows;
- score terms: a method's score term against distance (mean over queries), from its own
  ``score_term`` on the backends' index grid;
- position signals: cosine similarity of position embeddings, RoFormer's long-term decay of q.k,
  and the evaluation-time extensions that decay can be drawn under.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from posbench.methods import ModelDims, PositionMethod
from posbench.methods.base import ScoreFn
from posbench.model.extension import EXTENSIONS, Setting, extension_factor


def attention_entropy(weights: Tensor) -> Tensor:
    """(..., Tq, Tk) attention rows -> (..., Tq) entropy in nats (0 log 0 = 0)."""
    return -(weights * weights.clamp_min(torch.finfo(weights.dtype).tiny).log()).sum(-1)


def _causal_distance(tq: int, tk: int, device: torch.device) -> Tensor:
    """(Tq, Tk) distance i - j between query i and key j, with the query window at the end."""
    offset = tk - tq
    return torch.arange(tq, device=device)[:, None] + offset - torch.arange(tk, device=device)[None, :]


def mean_attended_distance(weights: Tensor) -> Tensor:
    """(..., Tq, Tk) causal attention rows -> (..., Tq) expected distance sum_j p_ij (i - j)."""
    distance = _causal_distance(weights.shape[-2], weights.shape[-1], weights.device).clamp_min(0)
    return (weights * distance.to(weights.dtype)).sum(-1)


def mean_by_distance(term: Tensor) -> Tensor:
    """(..., T, T) term over (query i, key j) -> (..., T): mean over i of term[i, i - d], d = 0..T-1.

    Only the causal half (j <= i) counts; distance d is averaged over the T - d queries that have it.
    """
    T = term.shape[-1]
    distance = _causal_distance(T, T, term.device)
    causal = distance >= 0
    d = distance[causal]  # (n,) flattened causal distances
    values = term.expand(*term.shape[:-2], T, T)[..., causal].float()  # (..., n)
    sums = torch.zeros(*values.shape[:-1], T, device=term.device).index_add_(-1, d, values)
    return sums / torch.bincount(d, minlength=T).to(sums.dtype)


def cosine_similarity_matrix(table: Tensor) -> Tensor:
    """(T, d) embeddings -> (T, T) cosine similarity of every pair of positions."""
    unit = torch.nn.functional.normalize(table.float(), dim=-1)
    return unit @ unit.T


def qk_decay(method: PositionMethod, length: int, head_dim: int, layer: int = 0) -> Tensor:
    """(length,) ``E[q.k] / D`` at distance d for q, k with iid entries of mean 1 (variance
    irrelevant: the mean part is what survives the expectation), through the method's q-k
    transform of ``layer``: query at position d, key at position 0. For RoPE it is
    (2/D) sum_i cos(d theta_i)."""
    positions = torch.arange(length)
    ones = torch.ones(1, 1, length, head_dim)
    q, k = method.rotate_qk(ones, ones, positions, layer)  # (1, 1, T, D)
    return (q[0, 0] @ k[0, 0, 0]).float() / head_dim


def score_curves(fn: ScoreFn, heads: Sequence[int], length: int, device: torch.device | str = "cpu",
                 batch: int = 0) -> Tensor:
    """(len(heads), length) mean over queries of the score term at distance d, for sequence ``batch``.

    The term is evaluated on a (1, H, T, T) index grid exactly as the attention backends do; one
    head at a time keeps the memory at one (T, T) matrix.
    """
    return torch.stack([mean_by_distance(term_grid(fn, batch, head, length, device)) for head in heads])


def term_grid(fn: ScoreFn, batch: int, head: int, length: int, device: torch.device | str) -> Tensor:
    """(T, T) score term of one sequence and head, from (1, 1, 1, 1) / (1, 1, T, 1) / (1, 1, 1, T)
    index tensors: the same broadcasting grid the attention backends use."""
    idx = torch.arange(length, device=device)
    b = torch.full((1, 1, 1, 1), batch, device=device)
    h = torch.full((1, 1, 1, 1), head, device=device)
    term = fn(b, h, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1)).float()
    return term.expand(1, 1, length, length)[0, 0]


def is_content_dependent(method: PositionMethod, dims: ModelDims, length: int = 16) -> bool:
    """True when the method's score term changes with the queries, or cannot be evaluated from
    queries alone (a term gating on the layer input): then it needs a run's real attention."""
    positions = torch.arange(length)
    generator = torch.Generator().manual_seed(0)
    q_random = torch.randn(1, dims.n_heads, length, dims.head_dim, generator=generator)
    heads = list(range(dims.n_heads))
    try:
        with torch.no_grad():
            for layer in range(dims.n_layers):  # a per-layer schedule may gate on content in one layer only
                zero_fn = method.score_term(torch.zeros_like(q_random), positions, layer)
                if zero_fn is None:  # no score term in this layer
                    continue
                zero = score_curves(zero_fn, heads, length)
                rand = score_curves(method.score_term(q_random, positions, layer), heads, length)
                if not torch.allclose(zero, rand):
                    return True
    except (TypeError, ValueError, RuntimeError, IndexError):  # needs k or x (cope, fox)
        return True
    return False


def has_qk_transform(method: PositionMethod) -> bool:
    return type(method).rotate_qk is not PositionMethod.rotate_qk


# --------------------------------------------------------------------------- extension rules of the decay figure


def decay_rules(method: PositionMethod) -> list[str]:
    """The ``decay.rules`` that can be drawn for ``method``: every evaluation-time extension
    that applies to it (:data:`posbench.model.extension.EXTENSIONS`, by capability)."""
    return [name for name, ext in EXTENSIONS.items() if ext.applies(method)]


def decay_rule_method(method: PositionMethod, rule: str, context: int, end: int) -> PositionMethod:
    """``method`` under extension ``rule`` evaluated at length ``end`` (its default factor, L / C),
    or the method itself where the rule is the identity."""
    factor = extension_factor(rule, end, context, None)
    return EXTENSIONS[rule].install(method, Setting(context, end, factor)) or method


__all__ = [
    "attention_entropy",
    "cosine_similarity_matrix",
    "decay_rule_method",
    "decay_rules",
    "has_qk_transform",
    "is_content_dependent",
    "mean_attended_distance",
    "mean_by_distance",
    "qk_decay",
    "score_curves",
    "term_grid",
]
