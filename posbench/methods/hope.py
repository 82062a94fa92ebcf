"""HoPE: high-frequency rotary position encoding (Chen et al. 2024, "HoPE: A Novel Positional
Encoding Without Long-Term Decay for Enhanced Context Awareness and Extrapolation", arXiv
2410.21216, ACL 2025).

RoPE (the rotation of :mod:`posbench.methods.rope`, reused) keeping only the frequency pairs that
complete at least one full rotation within the training context, ``theta_i * train_context >=
2 pi`` (wavelength ``2 pi / theta_i <= C``). The paper finds that some low-frequency components
("activated" ones) shape RoPE's U-shaped attention and limit extrapolation, and that the top
low-frequency components settle into near-constant, position-free patterns; HoPE replaces the
low-frequency components with position-independent ones: frequency 0 here, so those pairs pass
through unrotated (``inv_freq`` holds the zeros, and context extensions keep them).

Relation to ``p_rope``: the same mechanism (zero the lowest frequencies), a different rule for the
cut. p_rope keeps a fixed fraction ``p`` of the pairs, whatever the context; HoPE keeps the pairs
whose wavelength fits in the training context, so its cut moves with ``train_context`` and the
head dimension. At C = 256 and base 10000 it keeps 13 of 32 pairs for d_head = 64 (p = 0.41) and 7
of 16 for d_head = 32 (the mini model; p = 0.44); p_rope's default p = 0.75 keeps more.

Past the training context every kept pair has already turned through all its angles, so no
rotation is out of distribution; the unrotated pairs carry content only.
"""

import math

import torch

from posbench.methods import register
from posbench.methods.base import ModelDims
from posbench.methods.rope import RoPE

DEFAULT_CONTEXT = 256  # trainer.context's default, for a hope built outside a run


@register
class HoPE(RoPE):
    llama_equivalent = False
    name = "hope"
    enters = "q-k"
    source = "Chen et al. 2024 (HoPE)"
    past_context = (
        "RoPE on the pairs that turn a full rotation within C (13 of 32 at d_head 64); no rotation is new past C, the "
        "rest carry no position (docs/methods.md#hope)"
    )

    context_option = "train_context"  # a run fills it with trainer.context
    options_before = {"train_context": 256}  # its default before it followed trainer.context

    def __init__(self, dims: ModelDims, *, base: float = 10000.0, interleaved: bool = False,
                 train_context: int | None = None) -> None:
        super().__init__(dims, base=base, interleaved=interleaved)
        if train_context is None:  # outside a run (create_model): posbench's default context
            train_context = DEFAULT_CONTEXT
        if isinstance(train_context, bool) or not isinstance(train_context, int) or train_context < 1:
            raise ValueError(f"hope needs a positive integer train_context, got {train_context!r}")
        self.train_context = train_context
        full_turn = self.inv_freq.double() * train_context >= 2 * math.pi  # (R/2,) pairs that complete a rotation
        self.inv_freq = torch.where(full_turn, self.inv_freq, torch.zeros_like(self.inv_freq))

    @property
    def kept_pairs(self) -> int:
        """How many frequency pairs stay rotated."""
        return int((self.inv_freq > 0).sum())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, train_context={self.train_context}, kept_pairs={self.kept_pairs}"
