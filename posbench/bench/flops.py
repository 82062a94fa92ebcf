"""FLOPs per training token, the device's peak and MFU, as ``posbench bench`` reports them.

The convention is the PaLM paper's appendix B (also nanoGPT's ``estimate_mfu``)::

    training FLOPs per token = 6 * N + 12 * L * T * d

- ``N``: parameters of every ``nn.Linear`` in the model, i.e. the weights actually multiplied per
  token: q/k/v/out projections, SwiGLU gate/up/down and the LM head. The token embedding (a
  lookup, no multiply) and position-method tables are excluded. Forward costs 2 FLOPs per
  weight per token and backward twice that: 6 * N.
- ``12 * L * T * d``: attention scores ``Q K^T`` and the weighted sum ``A V``, each
  ``2 * T * d`` FLOPs per token per layer forward (``d = n_heads * head_dim``), times 3 for
  forward + backward, with ``T`` the training context. Causal masking is *not* halved (PaLM's
  convention), so the number is the dense-attention model cost.
- Position-method FLOPs (rotations, score terms, Shaw's ``q . r``) are not counted: every method
  gets the same model FLOPs, so its MFU differs from the twin's only through speed. The peer's
  ``N`` is counted the same way from its own ``nn.Linear`` modules (it comes out identical).
- ``MFU = FLOPs per token * median tokens/s / peak``, with ``peak_tflops`` the device's dense
  bf16 peak (``auto``: H200 / H100 SXM 989.4, H100 PCIe 756.5, A100 312, L4 121 TFLOP/s; other
  GPUs get ``null`` and no MFU). On CUDA, MFU is always relative to the bf16 peak, also when
  ``precision=fp32``. A CPU publishes no single peak, so ``auto`` measures one: the best
  TFLOP/s of 1024 x 1024 matmuls over half a second, in the run's precision (bf16 under bf16
  autocast, else fp32) with torch's thread count (:func:`posbench.runtime.hardware.cpu_matmul_peak_tflops`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from posbench.runtime.hardware import cpu_matmul_peak_tflops

# Dense (non-sparse) bf16 tensor-core peaks in TFLOP/s, matched against the CUDA device name in
# order (first match wins, so "H100 PCIe" is tried before "H100").
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH200\b", 989.4),
    (r"\bH100\b.*\bPCIe\b", 756.5),
    (r"\bH100\b", 989.4),
    (r"\bA100\b", 312.0),
    (r"\bL4\b", 121.0),
)

FLOP_FORMULA = (
    "training FLOPs/token = 6*N + 12*L*T*d (PaLM appendix B / nanoGPT): N = weights of all "
    "nn.Linear layers incl. the LM head (token embedding and position-method tables excluded), "
    "L = layers, T = training context, d = d_model; attention QK^T and AV not halved for "
    "causality; position-method FLOPs not counted"
)


def matmul_parameters(model: nn.Module) -> int:
    """Weights multiplied per token: every ``nn.Linear`` (a weight shared by two layers counts twice)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def train_flops_per_token(matmul_params: int, n_layers: int, context: int, d_model: int) -> float:
    """``6 * N + 12 * L * T * d`` (see the module docstring)."""
    return 6.0 * matmul_params + 12.0 * n_layers * context * d_model


def mfu(flops_per_token: float, tokens_per_second: float, peak_tflops: float | None) -> tuple[float, float | None]:
    """(achieved TFLOP/s, model FLOPs utilisation or None without a peak)."""
    tflops = flops_per_token * tokens_per_second / 1e12
    return tflops, tflops / peak_tflops if peak_tflops else None


def resolve_peak_tflops(setting: float | str | None, device: torch.device,
                        amp_dtype: torch.dtype | None = None) -> tuple[float | None, str]:
    """(peak dense TFLOP/s or None, where it came from). CUDA: the bf16 peak from the table.
    CPU: measured by a short matmul probe in the run's precision (``amp_dtype``, else fp32)."""
    if setting is None:
        return None, "peak_tflops=null"
    if setting != "auto":
        return float(setting), "peak_tflops (config)"
    if device.type == "cpu":
        dtype = amp_dtype or torch.float32
        peak = cpu_matmul_peak_tflops(dtype)
        name = str(dtype).replace("torch.", "")
        return peak, f"measured CPU peak: best {name} 1024x1024 matmul, {torch.get_num_threads()} threads"
    if device.type != "cuda":
        return None, f"no peak for {device.type}"
    name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return peak, f"bf16 dense peak of {name}"
    return None, f"{name} not in the peak table; set peak_tflops=<TFLOP/s>"
