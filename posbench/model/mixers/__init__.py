"""Recurrent mixers: a layer that replaces attention with a recurrence over a fixed-size state.

A mixer maps the normalised layer input (B, T, C) to its output (B, T, C), reading and returning
its state, so a window can continue where the previous one stopped (state passing, docs/mixers.md):

    y, state = mixer(x, state)        # state None: the zero state

Each mixer has two forms of the same function: ``chunked`` (the training form: matmuls within
chunks of ``chunk_size`` tokens, a scan over chunks) and ``recurrent`` (a scan over tokens, the
form of generation); ``mixer.form`` picks one. A mixer takes no position method: order enters
only through the recurrence.

Every module of this package is imported, and so registered, automatically: a new mixer is one
module here (a :class:`Mixer` subclass decorated with :func:`register_mixer`) and its tests.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ATTENTION = "attention"
"""``model.mixer``'s name of the attention layer, the default."""
FORMS = ("chunked", "recurrent")

MIXERS: dict[str, type[Mixer]] = {}


def register_mixer(cls: type[Mixer]) -> type[Mixer]:
    """Class decorator: make ``cls`` available as ``model.mixer=<cls.name>``."""
    if cls.name in MIXERS or cls.name == ATTENTION:
        raise ValueError(f"mixer {cls.name!r} is registered twice")
    MIXERS[cls.name] = cls
    return cls


class Mixer(nn.Module):
    """A recurrent token mixer. Subclasses take ``(d_model, n_heads, norm_eps)`` and their
    options as keyword-only arguments with defaults (the options' one place)."""

    name: ClassVar[str]
    residual_out = "out"
    """The output projection: initialised with the residual std, as attention's ``out``."""

    form: str = "chunked"

    def forward(self, x: Tensor, state: tuple[Tensor, ...] | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
        raise NotImplementedError

    def initial_state(self, batch: int, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
        """The zero state of ``batch`` streams."""
        raise NotImplementedError


def mixer_options(name: str) -> dict[str, Any]:
    """The options of mixer ``name`` and their defaults (its constructor's keyword-only arguments)."""
    params = inspect.signature(MIXERS[name].__init__).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def list_mixers() -> list[str]:
    """``model.mixer``'s names: attention, then every recurrent mixer alphabetically."""
    return [ATTENTION, *sorted(MIXERS)]


def build_mixer(name: str, d_model: int, n_heads: int, norm_eps: float, options: dict[str, Any]) -> Mixer:
    return MIXERS[name](d_model, n_heads, norm_eps, **options)


# --- pieces both mixers share ------------------------------------------------------------------


def causal_conv(x: Tensor, conv: nn.Conv1d, conv_state: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution, then SiLU, continuing from the last K - 1 inputs.

    x (B, T, D), conv_state (B, D, K - 1) -> (B, T, D), the new conv state (B, D, K - 1).
    """
    padded = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, D, K - 1 + T)
    y = F.silu(conv(padded))  # no padding in conv: (B, D, T)
    return y.transpose(1, 2), padded[:, :, padded.shape[-1] - conv_state.shape[-1]:]


def causal_depthwise_conv(channels: int, kernel: int, bias: bool) -> nn.Conv1d:
    return nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias)


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
