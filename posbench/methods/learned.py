"""Learned absolute position embeddings added to the input (GPT-2, BERT).

Policy past the training context: the table has ``max_positions`` rows (default 4096, enough for
every evaluation length posbench uses). Rows past the training context receive no gradient during
training and stay at their random initialisation, which is exactly what "a learned embedding
evaluated past its training length" means. Asking for a position >= ``max_positions`` is an error
that names the option to raise.
"""

from torch import Tensor, nn

from posbench.core.errors import PosbenchError
from posbench.methods import register
from posbench.methods.base import InputTable, ModelDims, PositionMethod, check_table_range, interpolate_rows


@register
class Learned(InputTable, PositionMethod):
    name = "learned"
    enters = "input"
    source = "GPT-2 / BERT"
    past_context = (
        "rows >= the training context never get a gradient and stay at their random init; positions >= "
        "``method.max_positions`` (4096) are an error"
    )
    table_note = "rows past C get no gradient in training: they stay random"

    def __init__(self, dims: ModelDims, *, max_positions: int = 4096, init_std: float = 0.02) -> None:
        super().__init__(dims)
        if max_positions < 1:
            raise PosbenchError(f"method.max_positions must be >= 1, got {max_positions}")
        self.table = nn.Embedding(max_positions, dims.d_model)
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.table.weight, std=self.init_std)

    @property
    def max_positions(self) -> int:
        return self.table.num_embeddings

    def input_embedding(self, positions: Tensor) -> Tensor:
        check_table_range(positions, self.max_positions, self.name)
        return self.table(positions)  # (..., T, d_model)

    def input_embedding_at(self, positions: Tensor, trained_positions: int | None) -> Tensor:
        """Rows read at fractional (T,) positions, linearly interpolated. Positions in
        (C - 1, C) would blend in row C, which training never reached (it is still its random
        init): the last trained row is held instead."""
        if trained_positions is not None:
            positions = positions.clamp(max=trained_positions - 1)
        return interpolate_rows(self.table.weight, positions)  # (T, d_model)
