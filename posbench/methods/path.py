"""PaTH: position encoding via accumulated Householder transformations (Yang et al. 2025, "PaTH
Attention: Position Encoding via Accumulating Householder Transformations", NeurIPS).

Every token t carries a data-dependent Householder-like transform ``H_t = I - beta_t w_t w_t^T``
per head, and the logit of query i and key j is the bilinear form through every transform
between them:

    A_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(D)        (A_ii = q_i . k_i / sqrt(D))

As in the reference layer (fla-org/flash-linear-attention, ``fla/layers/path_attn.py``, with its
defaults): ``w_t`` is a low-rank projection of the attention input x (d_model -> 32 -> H * D, no
bias), then a causal depthwise short convolution (kernel 3, no bias, SiLU), then L2-normalised
per head; ``beta_t = 2 sigmoid(W_beta x_t + b)`` per head, in (0, 2), so H_t may have a negative
eigenvalue. Per layer. No other position signal (the reference layer has no RoPE; its optional
forget gate, PaTH-FoX, is off by default) and no qk norm (off by default). Init as the reference
model's ``_init_weights``: Linear and Conv1d weights ~ N(0, ``init_std`` = 0.02), biases 0 (so
beta starts near 1).

Computation (fp32, chunked as the reference's naive form, chunks of ``CHUNK`` tokens): inside a
chunk, the UT transform (a unit lower-triangular solve) turns the chunk's transforms into a few
matrix products, which give the intra-chunk logits, the queries carried back to the chunk start,
the keys carried to the chunk end and the chunk's whole transform M_c = H_end ... H_start (D, D);
across chunks, queries are carried back through M_c by one (D, D) product per chunk. Cost per
layer and head: O(T^2 D + T CHUNK D + T D^2) arithmetic in T / CHUNK sequential steps, and a
dense (B, H, T, T) logit matrix: eager and sdpa only (FlexAttention's score_mod sees one (i, j)
at a time, and the product of transforms between them is not a gather from per-token tables).

The hook: the backend adds the score term to q.k / sqrt(D); the term is A_ij - q_i.k_j / sqrt(D).
Past the training context nothing is out of distribution by construction (no position ids).
"""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, needs

CHUNK = 64  # tokens per chunk of the computation (the reference naive form's BT); not a model option
W_RANK = 32  # the reference's low-rank w projection (multi-head attention)
CONV_SIZE = 3  # the reference's short convolution on w


def householder_logits(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, chunk: int = CHUNK) -> Tensor:
    """(B, H, T, D) q, k, unit w and (B, H, T) beta -> (B, H, T, T) q_i^T H_i ... H_{j+1} k_j.

    Entries above the diagonal (future keys) are meaningless: the causal mask removes them.
    """
    B, H, T, D = q.shape
    C = min(chunk, T)
    pad = (-T) % C  # padded tokens come last and have beta = 0 (H = I): they change nothing before them
    if pad:
        q, k, w = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, w))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // C
    q, k, w = (rearrange(t, "b h (n c) d -> b h n c d", c=C) for t in (q, k, w))
    beta = rearrange(beta, "b h (n c) -> b h n c", c=C)

    # Inside a chunk (the UT / compact WY form of the reference's naive code): with L the strictly
    # lower (C, C) matrix beta_t w_t . w_s (s < t) and U = (I + L)^-1, the product of the chunk's
    # transforms up to t acts through U, so every intra-chunk quantity is a few (C, C) / (C, D) products.
    wb = w * beta[..., None]  # (B, H, n, C, D): beta_t w_t
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)  # s < t
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    lower = (wb @ w.transpose(-1, -2)) * strict  # (B, H, n, C, C)
    ut = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
    qw = (q @ w.transpose(-1, -2)).tril()  # q_i . w_t for t <= i
    tk = ut @ ((wb @ k.transpose(-1, -2)) * strict)  # (C, C): beta_s w_s . k_j for s > j, through U
    intra = q @ k.transpose(-1, -2) - qw @ tk  # (B, H, n, C, C): A_ij for i >= j in the chunk
    twb = ut @ wb  # (B, H, n, C, D)
    q_start = q - qw @ twb  # rows q_i^T H_i ... H_start
    k_end = k - tk.transpose(-1, -2) @ w  # H_end ... H_{j+1} k_j
    m = torch.eye(D, dtype=q.dtype, device=q.device) - w.transpose(-1, -2) @ twb  # (D, D): rows through M_c

    blocks = q.new_zeros(B, H, n, n, C, C)  # (query chunk, key chunk) blocks
    idx = torch.arange(n, device=q.device)
    blocks[:, :, idx, idx] = intra
    carried = q_start  # chunk a's queries carried back to the end of chunk a - g
    for g in range(1, n):
        carried = carried[:, :, 1:]  # query chunks a = g .. n-1
        blocks[:, :, idx[g:], idx[: n - g]] = carried @ k_end[:, :, : n - g].transpose(-1, -2)
        if g < n - 1:
            carried = carried @ m[:, :, : n - g]  # through M_{a-g}
    out = rearrange(blocks, "b h n m c e -> b h (n c) (m e)")
    return out[..., :T, :T]


@register
class PaTH(PositionMethod):
    name = "path"
    enters = "score (content dependent: q_i^T H_i ... H_{j+1} k_j, H_t = I - beta_t w_t w_t^T from the layer input)"
    source = "Yang et al. 2025"
    past_context = (
        "no position ids: order enters only through the product of per-token transforms; ~1.8x rope's CPU training "
        "step (docs/methods.md#path)"
    )
    backend_note = "dense; flex refuses it"
    has_score_term = True
    uses_positions = False

    def __init__(self, dims: ModelDims, *, init_std: float = 0.02) -> None:
        super().__init__(dims)
        if not init_std > 0:
            raise ValueError(f"path needs init_std > 0, got {init_std}")
        self.init_std = init_std
        inner = dims.n_heads * dims.head_dim
        self.w_proj = nn.ModuleList(
            nn.Sequential(nn.Linear(dims.d_model, W_RANK, bias=False), nn.Linear(W_RANK, inner, bias=False))
            for _ in range(dims.n_layers)
        )
        self.w_conv = nn.ModuleList(
            nn.Conv1d(inner, inner, CONV_SIZE, groups=inner, bias=False, padding=CONV_SIZE - 1)
            for _ in range(dims.n_layers)
        )
        self.beta_proj = nn.ModuleList(nn.Linear(dims.d_model, dims.n_heads) for _ in range(dims.n_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                nn.init.normal_(module.weight, std=self.init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def backend_limits(self) -> dict[str, str]:
        return {"flex": "path's logits pass through a product of per-token transforms, a dense (T, T) computation"}

    def transforms(self, x: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """(B, T, d_model) attention input -> unit w (B, H, T, D) and beta (B, H, T), fp32 at least."""
        T = x.shape[1]
        dtype = torch.promote_types(self.beta_proj[layer].weight.dtype, torch.float32)
        x = x.to(self.beta_proj[layer].weight.dtype)
        w = self.w_proj[layer](x)  # (B, T, H * D)
        w = F.silu(self.w_conv[layer](w.transpose(1, 2))[..., :T]).transpose(1, 2)  # causal: first T outputs
        w = F.normalize(rearrange(w.to(dtype), "b t (h d) -> b h t d", h=self.dims.n_heads), dim=-1)
        beta = 2 * self.beta_proj[layer](x).to(dtype).sigmoid()  # (B, T, H), in (0, 2)
        return w, rearrange(beta, "b t h -> b h t")

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None) -> ScoreFn:
        k, x = needs(k, "the keys k", self.name), needs(x, "the layer input x", self.name)
        w, beta = self.transforms(x, layer)
        dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 at least, fp64 for fp64 checks
        with torch.autocast(q.device.type, enabled=False):
            q32, k32, w, beta = q.to(dtype), k.to(dtype), w.to(dtype), beta.to(dtype)
            plain = q32 @ k32.transpose(-1, -2)  # (B, H, T, T): what the backend adds the term to
            term = (householder_logits(q32, k32, w, beta) - plain) * q.shape[-1] ** -0.5

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return term[b, h, q_idx, kv_idx]

        return bias

    def extra_repr(self) -> str:
        return f"init_std={self.init_std}"
