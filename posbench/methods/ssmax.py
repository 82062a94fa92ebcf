"""SSMax: scalable softmax (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention").

The softmax over n inputs becomes ``softmax((s log n) z)``: the whole attention logit of query i
(its q.k / sqrt(D) and the base method's additive term alike) is multiplied by ``s_lh log n_i``,
with ``s_lh`` learned per layer and head (as in the paper) and initialised to ``s_init``.
In causal attention query i sees ``n_i = i + 1`` keys (sequence index i, 0-based: the count of
visible tokens, independent of position ids). With ``model.attention_window = W`` it still uses
i + 1, not min(i + 1, W): the method is built without the model's mask settings (ModelDims), and
with i + 1 the logit scale keeps the meaning it had in training; a windowed run scales a little
more than the paper's n = min(i + 1, W) would past W. The first query (n = 1) gets factor 0: it
sees one key, so its attention is the same for any factor.

It wraps a base method (``method=ssmax method.base=alibi``; default rope), built through the
registry with its own default options: the base's rotation, input embedding, value term, per-layer
windows and normaliser are
used as they are, then q is multiplied by the factor (which scales q.k in every backend, fused
SDPA and FlexAttention included) and the base's score term, if any, is multiplied by it too
(evaluated on the unscaled q, so a term that reads q is scaled once, not twice).

Differences from the evaluation-time ``log_scaling`` extension (posbench/model/extension.py), which
multiplies a trained model's logits by ``max(1, log(n + 1) / log C)``: SSMax is a trained
architecture (the model learns with the scale from step 0), its per-head slope s is learned, and
it scales at every n (it sharpens attention inside the training context too, and flattens the
first few queries), while log_scaling is the identity up to C and fixed past it.

Capabilities: the wrapper is not ``Rotary``/``InputTable`` even over a rotary base, so the rotary
and table extensions (PI, NTK, YaRN, Llama 3) do not apply to it; ``log_scaling`` and ``window``
apply to every method and wrap it as they wrap any method.
"""

import math

import torch
from torch import Tensor, nn

from posbench.methods import build_base, register
from posbench.methods.base import ModelDims, OverBase, ScoreFn


@register
class SSMax(OverBase):
    name = "ssmax"
    enters = "logits of query i x s_lh log(i + 1), s learned, over ``method.base`` (default rope)"
    source = "Nakanishi 2025"
    past_context = (
        "the logit scale keeps growing with the number of keys, sharpening attention past C (docs/methods.md#ssmax)"
    )
    backend_note = "the base's; rope's by default"

    def __init__(self, dims: ModelDims, *, base: str = "rope", s_init: float = 0.168) -> None:
        super().__init__(dims)
        if not math.isfinite(s_init):
            raise ValueError(f"ssmax needs a finite s_init, got {s_init}")
        self.base_name = base
        self.s_init = s_init
        self.inner = build_base(self.name, base, dims)
        self.s = nn.Parameter(torch.full((dims.n_layers, dims.n_heads), float(s_init)))  # (L, H)
        self.has_score_term = self.inner.has_score_term  # type: ignore[misc]
        self.uses_positions = self.inner.uses_positions  # type: ignore[misc]

    def factor(self, length: int, layer: int, device: torch.device) -> Tensor:
        """(H, T) logit multipliers s_lh log(i + 1), fp32 (fp64 for an fp64 method)."""
        dtype = torch.promote_types(self.s.dtype, torch.float32)
        log_n = torch.arange(1, length + 1, device=device, dtype=dtype).log()  # (T,)
        return self.s[layer].to(dtype)[:, None] * log_n  # (H, T)

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        q, k = self.inner.rotate_qk(q, k, positions, layer)  # (B, H, T, D) each
        return q * self.factor(q.shape[-2], layer, q.device)[..., None].to(q.dtype), k

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None) -> ScoreFn | None:
        if not self.inner.has_score_term:
            return None
        factor = self.factor(q.shape[-2], layer, q.device)  # (H, T)
        # q arrives scaled by rotate_qk; the base's term sees the base's q (n = 1 rows: factor 0,
        # their q is 0 and so is their scaled term).
        unscaled = q / torch.where(factor == 0, 1.0, factor)[..., None].to(q.dtype)
        inner = self.inner.score_term(unscaled, positions, layer, k=k, x=x)
        assert inner is not None

        def score(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return inner(b, h, q_idx, kv_idx) * factor[h, q_idx]

        return score

    def extra_repr(self) -> str:
        return f"base={self.base_name}, s_init={self.s_init}"
