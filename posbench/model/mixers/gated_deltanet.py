"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025), the linear layer of Qwen3-Next, in plain torch.

Per head, a state S of (Dk, Dv) is a fast-weight memory from keys to values. Each step decays it
by a gate alpha_t in (0, 1) and writes the part of v_t that the memory does not yet predict
(the delta rule), at rate beta_t in (0, 1):

    S_t = alpha_t S_{t-1} + beta_t k_t (v_t - alpha_t S_{t-1}^T k_t)^T
    o_t = S_t^T q_t

with q, k L2-normalised per head (q also scaled by 1 / sqrt(Dk)) after a short causal convolution,
log alpha_t = -exp(A_log) softplus(w_a x_t + dt_bias), beta_t = sigmoid(w_b x_t), and the output
``out(RMSNorm(o) * silu(z))`` per head with the gate z from the input.

The chunked form solves the writes of a chunk of L tokens at once: with decay_ij = alpha_{j+1}..alpha_i,
the corrected values U of the chunk satisfy (I + tril_{-1}(diag(beta) K K^T * decay)) U =
diag(beta) (V - diag(alpha_1..alpha_i) K S_0), a unit lower-triangular system (the UT transform);
then the outputs are a masked attention over the chunk plus a read of the carried state. The
recurrent form runs the update above token by token. ``tests/unit/model/test_mixers.py`` checks
both against each other and against ``transformers``' ``Qwen3NextGatedDeltaNet`` and its torch
delta rules with the same weights. Initialisation follows that class (A uniform in [0.01, 16],
dt_bias = 1); value heads are ``expand_v`` times as wide as key heads (the paper's 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from posbench.model.mixers import Mixer, causal_conv, causal_depthwise_conv, register_mixer


@register_mixer
class GatedDeltaNet(Mixer):
    name = "gated_deltanet"

    def __init__(self, d_model: int, n_heads: int, norm_eps: float, *, expand_v: int = 2,
                 conv_kernel: int = 4, chunk_size: int = 64) -> None:
        super().__init__()
        self.n_heads, self.dk, self.dv = n_heads, d_model // n_heads, expand_v * (d_model // n_heads)
        self.chunk_size, self.norm_eps = chunk_size, norm_eps
        self.key_dim, self.value_dim = n_heads * self.dk, n_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim  # q | k | v go through the convolution
        self.qkv = nn.Linear(d_model, self.conv_dim, bias=False)
        self.gate = nn.Linear(d_model, self.value_dim, bias=False)  # z, the output gate
        self.beta_alpha = nn.Linear(d_model, 2 * n_heads, bias=False)  # b | a, per head
        self.conv = causal_depthwise_conv(self.conv_dim, conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(n_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(n_heads).uniform_(0.01, 16)))
        self.norm_weight = nn.Parameter(torch.ones(self.dv))
        self.out = nn.Linear(self.value_dim, d_model, bias=False)

    def initial_state(self, batch, device="cpu", dtype=torch.float32):
        conv = torch.zeros(batch, self.conv_dim, self.conv.kernel_size[0] - 1, device=device, dtype=dtype)
        memory = torch.zeros(batch, self.n_heads, self.dk, self.dv, device=device, dtype=torch.float32)
        return conv, memory

    def forward(self, x: Tensor, state=None):
        conv_state, memory = state if state is not None else self.initial_state(x.shape[0], x.device, x.dtype)
        qkv, conv_state = causal_conv(self.qkv(x), self.conv, conv_state)  # (B, T, conv_dim)
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (rearrange(t, "b t (h d) -> b h t d", h=self.n_heads) for t in (q, k))
        v = rearrange(v, "b t (h d) -> b h t d", h=self.n_heads)
        q = l2_normalize(q) * self.dk ** -0.5  # (B, H, T, Dk)
        k = l2_normalize(k)
        b, a = rearrange(self.beta_alpha(x).float(), "b t (two h) -> two b h t", two=2)
        beta = b.sigmoid()  # (B, H, T)
        log_alpha = -self.A_log.float().exp()[:, None] * F.softplus(a + self.dt_bias[:, None])  # (B, H, T)
        rule = chunk_gated_delta_rule if self.form == "chunked" else recurrent_gated_delta_rule
        o, memory = rule(q, k, v, log_alpha, beta, memory, self.chunk_size)  # (B, H, T, Dv)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight
        z = rearrange(self.gate(x).float(), "b t (h d) -> b h t d", h=self.n_heads)
        o = rearrange(o * F.silu(z), "b h t d -> b t (h d)")
        return self.out(o.to(x.dtype)), (conv_state, memory)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor, memory: Tensor,
                           chunk: int) -> tuple[Tensor, Tensor]:
    """The gated delta rule in chunks of ``chunk`` tokens.

    q, k (B, H, T, Dk), v (B, H, T, Dv), log_alpha and beta (B, H, T), memory (B, H, Dk, Dv)
    -> o (B, H, T, Dv), the final memory (B, H, Dk, Dv).
    """
    T = q.shape[2]
    pad = (-T) % chunk  # padded steps: k = v = 0, alpha = 1, beta = 0: they change nothing
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    log_alpha, beta = (F.pad(t, (0, pad)) for t in (log_alpha, beta))
    q, k, v = (rearrange(t, "b h (n l) d -> b h n l d", l=chunk) for t in (q, k, v))
    log_alpha, beta = (rearrange(t, "b h (n l) -> b h n l", l=chunk) for t in (log_alpha, beta))
    g = log_alpha.cumsum(dim=-1)  # (B, H, nC, L) log decay from the chunk's start to step l
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (B, H, nC, L, L)

    # The UT transform: U = (I + L)^-1 diag(beta) V, W = (I + L)^-1 diag(beta alpha_1..l) K, so
    # that the chunk's corrected values are U - W S_0 for the state S_0 it starts from.
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2)) * decay  # only its strict lower triangle counts
    system = torch.eye(chunk, device=q.device) + lower.tril(-1)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # (B, H, nC, L, L) within the chunk, diagonal included
    q_decayed = q * g.exp()[..., None]  # reads the carried state
    k_to_end = k * (g[..., -1:] - g).exp()[..., None]  # writes into the state at the chunk's end

    outs = []
    for n in range(q.shape[2]):
        values = u[:, :, n] - w[:, :, n] @ memory  # (B, H, L, Dv) corrected values
        outs.append(q_decayed[:, :, n] @ memory + attn[:, :, n] @ values)
        memory = memory * g[:, :, n, -1].exp()[..., None, None] + k_to_end[:, :, n].transpose(-1, -2) @ values
    o = rearrange(torch.stack(outs, dim=2), "b h n l d -> b h (n l) d")
    return o[:, :, :T], memory


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor, memory: Tensor,
                               chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token: same arguments and result as :func:`chunk_gated_delta_rule`."""
    outs = []
    for t in range(q.shape[2]):
        memory = memory * log_alpha[:, :, t].exp()[..., None, None]  # (B, H, Dk, Dv)
        predicted = torch.einsum("bhkv,bhk->bhv", memory, k[:, :, t])  # what the memory says for k_t
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)  # (B, H, Dv)
        memory = memory + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", memory, q[:, :, t]))
    return torch.stack(outs, dim=2), memory
