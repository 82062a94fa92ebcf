"""p-RoPE (Barbero et al. 2025, "Round and Round We Go! What Makes Rotary Positional Encodings
Useful?", ICLR).

RoPE (the rotation of :mod:`posbench.methods.rope`, reused) with the lowest frequencies removed:
the ``p`` fraction of highest-frequency channel pairs is rotated as in RoPE, the remaining
(1 - p) lowest-frequency pairs get frequency 0 and pass through unrotated (``inv_freq`` holds the
zeros). p = 1 is RoPE and p = 0 is NoPE; the paper's best Gemma setting is p = 0.75. The rotated
pairs are ``round(p * D/2)``.

Past the training context: the lowest frequencies, whose angles would leave the range seen in
training first, carry no position at all, so they act as position-free "semantic" channels; the
kept high frequencies wrap around many times within the training context already.
"""

from posbench.methods import register
from posbench.methods.base import ModelDims
from posbench.methods.rope import RoPE


@register
class PRoPE(RoPE):
    llama_equivalent = False
    name = "p_rope"
    enters = "q-k"
    source = "Barbero et al. 2025"
    past_context = (
        "RoPE on the highest-frequency p (0.75) of channel pairs; the lowest frequencies, whose angles leave the "
        "trained range first, carry no position"
    )

    def __init__(self, dims: ModelDims, *, base: float = 10000.0, interleaved: bool = False, p: float = 0.75) -> None:
        super().__init__(dims, base=base, interleaved=interleaved)
        if not 0 <= p <= 1:
            raise ValueError(f"p_rope needs 0 <= p <= 1, got {p}")
        self.p = p
        kept = round(p * self.inv_freq.numel())
        self.inv_freq[kept:] = 0.0  # inv_freq decreases with the index: the tail is the lowest

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, p={self.p}"
