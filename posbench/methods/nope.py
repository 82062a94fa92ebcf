"""NoPE: no position embedding; the causal mask is the only source of order.

NoPE still infers position: under a causal mask, how much a query can attend to (and so, e.g.,
the variance of its attention average) depends on its index, and models learn to read absolute
position from that (Haviv et al.; Kazemnejad et al. show it can represent both absolute and
relative positions). That inferred signal is itself out of distribution past the training
context, so NoPE is not free of extrapolation cost (``NoPE.past_context`` gives the measured rise).

Haviv et al. 2022, "Transformer Language Models without Positional Encodings Still Learn
Positional Information"; Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length
Generalization in Transformers".
"""

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod


@register
class NoPE(PositionMethod):
    name = "nope"
    enters = "none (causal mask only)"
    source = "Haviv et al. 2022; Kazemnejad et al. 2023"
    past_context = (
        "no position embedding, but the model infers position from the causal mask (how many keys a query sees), and "
        "that inferred signal goes out of distribution past C: at cpu_quick its loss rises by 0.09 nats from band "
        "0-256 to 256-512 (cost +0.08, 3 seeds)"
    )
    backend_note = "fused causal"
    layouts = ("sequence", "grid")  # reads no positions: on the grid encoder it sees a bag of cells
    uses_positions = False

    def __init__(self, dims: ModelDims) -> None:
        super().__init__(dims)
