"""Stick-breaking attention (Tan et al., ICLR 2025, arXiv 2410.17980; reference: the ``stickbreaking``
function of shawntan/stickbreaking-attention, ``stickbreaking_attention/sb_ref.py``).

No softmax and no position signal: query i breaks a stick, nearest key first. With logits
``z_ij = q_i . k_j / sqrt(D)`` (plus any additive term, below) and ``beta_ij = sigmoid(z_ij)``,

    A_ij = beta_ij * prod_{j < l < i} (1 - beta_il)          for keys j < i,

computed in log space as ``exp(log sigmoid(z_ij) + sum_{j < l < i} log sigmoid(-z_il))``, the sum
an exclusive reverse cumulative sum along the row (O(T^2), where sb_ref's matrix product with a
strictly lower triangular matrix is O(T^3)). As in sb_ref's default (``attend_current=False``) a
query never breaks the stick at itself; ``attend_current=True`` includes key i (the product then
runs over j < l <= i). The mass left over, ``1 - sum_j A_ij``, goes to the query's own value
(``remainder=value``: ``o_i = sum_j A_ij v_j + (1 - sum_j A_ij) v_i``, as the reference's tests
compute the output; the first query, with no key before it, returns its own value), or is
dropped (``remainder=none``: sb_ref's first return value alone). The paper's released model
instead multiplies the leftover mass by a learned per-head vector and normalises the output; that
is not done here (docs/methods.md).

Score terms and masks: ``z`` is the whole logit the softmax would have seen, the method's additive
term included, so an evaluation-time ``log_scaling`` scales it and a ``-inf`` term (the causal mask,
``model.attention_window``, the ``window`` extension, a schedule's window) makes a key invisible: it
takes no weight and breaks no stick (log sigmoid(-inf) = -inf, log sigmoid(+inf) = 0).

Backends: eager only. FlexAttention's ``score_mod`` sees one (query, key) pair at a time and always
normalises with the softmax, and SDPA is a fused softmax; the weight of key j depends on the logits
of every key between j and i. The paper's Triton kernel (a Flash-Attention-style pass that carries
the running log-sum of the row) is CUDA-only and not a dependency.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims, Normalizer, PositionMethod

REMAINDERS = ("value", "none")
NO_FUSED = ("stick-breaking weights are a cumulative product along each query's row, which only the eager "
            "path computes (no softmax to fuse)")


def stick_breaking(logits: Tensor, attend_current: bool = False, remainder: str = "value") -> Tensor:
    """(..., T, T) logits, invisible keys at -inf -> (..., T, T) stick-breaking weights (fp32 in, fp32 out)."""
    T = logits.shape[-1]
    if not attend_current:  # the query's own key neither takes weight nor breaks the stick
        logits = logits.masked_fill(torch.eye(T, dtype=torch.bool, device=logits.device), float("-inf"))
    log_beta = F.logsigmoid(logits)  # log beta_ij; -inf for invisible keys
    log_keep = F.logsigmoid(-logits)  # log (1 - beta_ij); 0 for invisible keys
    # sum_{l > j} log(1 - beta_il): the reverse cumulative sum, shifted by one key (exclusive).
    after = F.pad(log_keep.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
    weights = (log_beta + after).exp()  # (..., T, T)
    if remainder == "value":
        weights = weights + torch.diag_embed(1 - weights.sum(-1))  # the leftover mass on v_i
    return weights


@register
class StickBreaking(PositionMethod):
    name = "stickbreaking"
    enters = "normaliser (replaces the softmax)"
    source = "Tan et al. 2025"
    past_context = (
        "no position signal: weights sigmoid(z_ij) prod_(j<l<i) (1 - sigmoid(z_il)) favour near keys by construction"
    )
    backend_note = "why: docs/methods.md#stick-breaking-attention-stickbreaking"
    uses_positions = False

    def __init__(self, dims: ModelDims, *, attend_current: bool = False, remainder: str = "value") -> None:
        super().__init__(dims)
        if remainder not in REMAINDERS:
            raise ValueError(f"remainder={remainder!r} must be one of {', '.join(REMAINDERS)}")
        self.attend_current = attend_current
        self.remainder = remainder

    def backend_limits(self) -> dict[str, str]:
        return {"sdpa": NO_FUSED, "flex": NO_FUSED}

    def weights(self, logits: Tensor) -> Tensor:
        return stick_breaking(logits, self.attend_current, self.remainder)

    def normalizer(self, layer: int) -> Normalizer:
        return self.weights

    def extra_repr(self) -> str:
        return f"attend_current={self.attend_current}, remainder={self.remainder}"
