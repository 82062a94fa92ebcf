"""NoPE: no position information; the causal mask is the only source of order.

Haviv et al. 2022, "Transformer Language Models without Positional Encodings Still Learn
Positional Information"; Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length
Generalization in Transformers".
"""

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod


@register
class NoPE(PositionMethod):
    name = "nope"

    def __init__(self, dims: ModelDims) -> None:
        super().__init__(dims)
