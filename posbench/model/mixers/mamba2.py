"""Mamba-2 (Dao & Gu 2024, "Transformers are SSMs"): the SSD layer, in plain torch.

Per head h, with a scalar decay per step and a state S of (P, N) (head dim x state size):

    dt_t = softplus(w_dt x_t + dt_bias_h)                     step size, (B, T, H)
    S_t  = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T             A_h = -exp(A_log_h) < 0
    y_t  = S_t C_t + D_h x_t

where x, B, C come from one projection through a short causal convolution (x: (B, T, H, P);
B, C: (B, T, G, N), shared by the H / G heads of a group), and the output is
``out(RMSNorm_groups(y * silu(z)))`` with the gate z from the same projection.

The chunked form ("state space duality") computes, within a chunk of L tokens, the (L, L)
matrix of C_i . B_j times the decay from j to i (a masked attention), and carries the state
between chunks; the recurrent form runs the scan above token by token. Both give the same
function: ``tests/unit/model/test_mixers.py`` checks them against each other and against
``transformers``' ``Mamba2Mixer`` with the same weights. Layout and initialisation follow that
class (A = 1..H, D = 1, dt's bias the inverse softplus of a log-uniform draw in [dt_min, dt_max]).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from posbench.model.mixers import Mixer, causal_conv, causal_depthwise_conv, register_mixer


@register_mixer
class Mamba2(Mixer):
    name = "mamba2"

    def __init__(self, d_model: int, n_heads: int, norm_eps: float, *, d_state: int = 64, expand: int = 2,
                 n_groups: int = 1, conv_kernel: int = 4, chunk_size: int = 64,
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_floor: float = 1e-4) -> None:
        super().__init__()
        inner = expand * d_model
        if inner % n_heads or n_heads % n_groups:
            raise ValueError(f"expand * d_model = {inner} must divide into n_heads={n_heads} heads, "
                             f"and n_heads into n_groups={n_groups} groups")
        self.n_heads, self.head_dim, self.d_state, self.n_groups = n_heads, inner // n_heads, d_state, n_groups
        self.inner, self.chunk_size, self.norm_eps = inner, chunk_size, norm_eps
        self.conv_dim = inner + 2 * n_groups * d_state  # x | B | C go through the convolution
        self.in_proj = nn.Linear(d_model, inner + self.conv_dim + n_heads, bias=False)  # z | x B C | dt
        self.conv = causal_depthwise_conv(self.conv_dim, conv_kernel, bias=True)
        dt = torch.exp(torch.rand(n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm_weight = nn.Parameter(torch.ones(inner))
        self.out = nn.Linear(inner, d_model, bias=False)

    def initial_state(self, batch, device="cpu", dtype=torch.float32):
        conv = torch.zeros(batch, self.conv_dim, self.conv.kernel_size[0] - 1, device=device, dtype=dtype)
        ssm = torch.zeros(batch, self.n_heads, self.head_dim, self.d_state, device=device, dtype=torch.float32)
        return conv, ssm

    def forward(self, x: Tensor, state=None):
        B = x.shape[0]
        conv_state, ssm_state = state if state is not None else self.initial_state(B, x.device, x.dtype)
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.n_heads], dim=-1)
        xbc, conv_state = causal_conv(xbc, self.conv, conv_state)  # (B, T, conv_dim)
        xs, b, c = xbc.split([self.inner, self.n_groups * self.d_state, self.n_groups * self.d_state], dim=-1)
        xs = rearrange(xs, "b t (h p) -> b t h p", h=self.n_heads)
        b = rearrange(b, "b t (g n) -> b t g n", g=self.n_groups)
        c = rearrange(c, "b t (g n) -> b t g n", g=self.n_groups)
        dt = F.softplus(dt + self.dt_bias)  # (B, T, H)
        A = -torch.exp(self.A_log.float())  # (H,)
        scan = ssd_chunked if self.form == "chunked" else ssd_recurrent
        y, ssm_state = scan(xs.float(), dt.float(), A, b.float(), c.float(), ssm_state, self.chunk_size)
        y = y + self.D[:, None] * xs.float()  # (B, T, H, P)
        y = gated_group_rms_norm(rearrange(y, "b t h p -> b t (h p)"), z, self.norm_weight, self.n_groups,
                                 self.norm_eps)
        return self.out(y.to(x.dtype)), (conv_state, ssm_state)


def gated_group_rms_norm(y: Tensor, z: Tensor, weight: Tensor, groups: int, eps: float) -> Tensor:
    """RMSNorm of ``y * silu(z)`` over each of ``groups`` equal slices of the channels (fp32):
    (B, T, E), (B, T, E) -> (B, T, E)."""
    y = y.float() * F.silu(z.float())
    y = rearrange(y, "b t (g e) -> b t g e", g=groups)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * rearrange(y, "b t g e -> b t (g e)")


def heads_of_groups(t: Tensor, heads: int) -> Tensor:
    """(B, T, G, N) -> (B, T, H, N): each group's B or C serves H / G consecutive heads."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def segment_sums(a: Tensor) -> Tensor:
    """(..., L) log decays -> (..., L, L): entry [i, j] = a_{j+1} + ... + a_i for j <= i (the log
    decay from step j to step i; 0 on the diagonal), -inf above it. Summed per entry, not as a
    difference of two cumulative sums, which would cancel badly once the sums grow large."""
    L = a.shape[-1]
    after_j = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)  # [k, j]: k > j
    terms = a[..., :, None].expand(*a.shape, L).masked_fill(~after_j, 0.0)  # [..., k, j] = a_k if k > j
    sums = terms.cumsum(dim=-2)  # [..., i, j] = sum over j < k <= i
    causal = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, b: Tensor, c: Tensor, state: Tensor,
                chunk: int) -> tuple[Tensor, Tensor]:
    """The SSD scan in chunks of ``chunk`` tokens (no D term).

    x (B, T, H, P), dt (B, T, H), A (H,), b and c (B, T, G, N), state (B, H, P, N)
    -> y (B, T, H, P), the final state (B, H, P, N).
    """
    T, H = x.shape[1], x.shape[2]
    b, c = heads_of_groups(b, H), heads_of_groups(c, H)  # (B, T, H, N)
    pad = (-T) % chunk
    a = dt * A  # (B, T, H) log decay of each step
    xdt = x * dt[..., None]  # (B, T, H, P) the input of each step
    a, xdt, b, c = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (a, xdt, b, c))  # padded steps add 0
    a = rearrange(a, "b (n l) h -> b n h l", l=chunk)  # (B, nC, H, L)
    xdt, b, c = (rearrange(t, "b (n l) h d -> b n l h d", l=chunk) for t in (xdt, b, c))
    a_cum = a.cumsum(dim=-1)  # (B, nC, H, L) log decay from the chunk's start to step l

    # Within a chunk: a masked attention, scores C_i . B_j times the decay from j to i.
    decay = torch.exp(segment_sums(a))  # (B, nC, H, L, L)
    scores = torch.einsum("bnlhd,bnshd->bnhls", c, b) * decay
    y_in = torch.einsum("bnhls,bnshp->bnlhp", scores, xdt)  # (B, nC, L, H, P)

    # Between chunks: read the carried state, then carry it past the chunk.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (B, nC, H, L) decay from step l to the chunk's end
    y_carried = []
    for n in range(a.shape[1]):
        read = torch.einsum("blhd,bhpd->blhp", c[:, n], state)  # (B, L, H, P)
        y_carried.append(read * rearrange(torch.exp(a_cum[:, n]), "b h l -> b l h")[..., None])
        written = torch.einsum("blhd,bhl,blhp->bhpd", b[:, n], to_end[:, n], xdt[:, n])  # (B, H, P, N)
        state = state * torch.exp(a_cum[:, n, :, -1])[..., None, None] + written
    y = y_in + torch.stack(y_carried, dim=1)  # (B, nC, L, H, P)
    return rearrange(y, "b n l h p -> b (n l) h p")[:, :T], state


def ssd_recurrent(x: Tensor, dt: Tensor, A: Tensor, b: Tensor, c: Tensor, state: Tensor,
                  chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """The SSD scan token by token, as in generation: same arguments and result as :func:`ssd_chunked`."""
    H = x.shape[2]
    b, c = heads_of_groups(b, H), heads_of_groups(c, H)  # (B, T, H, N)
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # (B, H, 1, 1)
        write = (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]  # (B, H, P, N)
        state = state * decay + write
        ys.append(torch.einsum("bhpn,bhn->bhp", state, c[:, t]))  # (B, H, P)
    return torch.stack(ys, dim=1), state
