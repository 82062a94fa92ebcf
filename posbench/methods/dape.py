"""DAPE: data-adaptive positional encoding (Zheng et al. 2024, "DAPE: Data-Adaptive Positional
Encoding for Length Extrapolation", NeurIPS).

A base method's static bias B_ij (alibi, kerple, fire, ...) is adapted to the content by a small
MLP applied to every (query, key) pair, across heads: the attention logits of all H heads and
the bias of all H heads are concatenated into a 2H vector, and

    logit_ij = A_ij + B_ij + MLP([A_ij, B_ij]),   A = q k^T / sqrt(D),
    MLP = Linear(2H, mlp_width) -> LeakyReLU -> Linear(mlp_width, H, no bias)

with one MLP per layer, as in the reference code (chuanyang-Zheng/DAPE, ``DAPE.py``:
``AliBi_DAPE`` / ``ParallelKerpleLog_DAPE``): width 32 by default, LeakyReLU (slope 0.01), the
residual ``x + a + mlp(cat(x, a))``, PyTorch's default Linear init, applied to the scaled logits
before the causal mask (the MLP acts per (i, j), so future keys never reach a visible entry).
One departure: the reference's last Linear has a bias, a per-head constant on every logit of a
row, which the softmax cannot see (its gradient is exactly 0); posbench leaves it out.

The base is a method option, built through the registry (``method=dape method.base=kerple``)
with its own default options; every other hook (rotation, input embedding, value term, per-layer
windows, normaliser) is the
base's. A base without a score term contributes B = 0 (the MLP then sees the logits alone, like
the reference's ``rope_dapev1``). The MLP mixes heads, so the term needs the dense (B, H, T, T)
logits, kept in fp32: eager only (flex cannot mix heads; SDPA would round the term to q's dtype). Position ids reach it only through the base's bias, so
shifting positions changes nothing where the base is relative (alibi, kerple); the class does not
declare ``relative_scores`` because that depends on the base (fire is not relative).
"""

import torch
from torch import Tensor, nn

from posbench.methods import build_base, register
from posbench.methods.base import ModelDims, OverBase, ScoreFn, dense_score, needs


@register
class DAPE(OverBase):
    name = "dape"
    enters = "score (a per-layer MLP over [logits, base bias] across heads, on top of ``method.base``, default alibi)"
    source = "Zheng et al. 2024"
    past_context = (
        "the base's bias past C, adapted by the content; ~3.6x rope's CPU training step in sdpa (docs/methods.md#dape)"
    )
    backend_note = "dense fp32; SDPA would round it to bf16"
    has_score_term = True

    def __init__(self, dims: ModelDims, *, base: str = "alibi", mlp_width: int = 32) -> None:
        super().__init__(dims)
        if mlp_width < 1:
            raise ValueError(f"dape needs mlp_width >= 1, got {mlp_width}")
        self.base_name = base
        self.mlp_width = mlp_width
        self.inner = build_base(self.name, base, dims)
        self.uses_positions = self.inner.uses_positions  # type: ignore[misc]
        # The reference's last Linear has a bias: a constant per head on every logit of a row, which
        # the softmax ignores (it only ever gets rounding noise as a gradient), so it is left out.
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * dims.n_heads, mlp_width), nn.LeakyReLU(),
                          nn.Linear(mlp_width, dims.n_heads, bias=False))
            for _ in range(dims.n_layers)
        )

    def backend_limits(self) -> dict[str, str]:
        return {**self.inner.backend_limits(),
                "flex": "dape's MLP mixes the dense (T, T) logits of every head",
                "sdpa": "SDPA rounds dape's fp32 term to q's dtype (logits 2.6% off at T=520 under bf16); "
                        "eager keeps it fp32"}

    def adaptive_term(self, q: Tensor, k: Tensor, static: Tensor, layer: int) -> Tensor:
        """(B, H, T, D) q, k and the base's (B|1, H, T, T) bias -> B + MLP([A, B]), (B, H, T, T), fp32
        (a bias of hundreds, alibi's far keys, would lose whole units in bf16)."""
        mlp = self.mlps[layer]
        dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 at least, fp64 for fp64 checks
        with torch.autocast(q.device.type, enabled=False):
            logits = torch.einsum("bhid,bhjd->bhij", q.to(dtype), k.to(dtype)) * q.shape[-1] ** -0.5  # (B, H, T, T)
            static = static.to(dtype).expand_as(logits)
            features = torch.cat([logits, static], dim=1).permute(0, 2, 3, 1)  # (B, T, T, 2H)
            mixed = mlp(features.to(mlp[0].weight.dtype)).to(dtype).permute(0, 3, 1, 2)  # (B, H, T, T)
            return static + mixed

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None) -> ScoreFn:
        k = needs(k, "the keys k", self.name)
        B, H, T, _ = q.shape
        inner = self.inner.score_term(q, positions, layer, k=k, x=x) if self.inner.has_score_term else None
        static = dense_score(inner, B, H, T, q.device) if inner is not None else q.new_zeros(1, H, T, T)
        term = self.adaptive_term(q, k, static, layer)

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return term[b, h, q_idx, kv_idx]

        return bias

    def extra_repr(self) -> str:
        return f"base={self.base_name}, mlp_width={self.mlp_width}"
