"""DroPE: train with a position encoding, then drop it (Gelberg et al. 2026, "Extending the Context
of Pretrained LLMs by Dropping Their Positional Embeddings", ICLR; SakanaAI/DroPE).

The paper pretrains with RoPE, removes every position encoding, and goes on training briefly at
the original context ("recalibration"): the model keeps what RoPE taught it early in training and
runs past C as a NoPE model. Here one run does both: ``method=drope method.base=rope
method.drop_step=N`` trains its first N optimizer steps with the base method and every step after
N without any position encoding, at the same context, data order and optimizer state; the base's
parameters (if any) are kept but no longer used. Evaluation (in training and afterwards) uses
whatever the model holds at that point: past N, the dropped model.

The switch is a pure function of the optimizer steps taken, which the method counts in a buffer
(``steps_done``, advanced by :meth:`before_step`, which the training step calls once per optimizer
step), so it is saved in every checkpoint: a run stopped before N and resumed after it, or resumed
past it, computes bitwise what the uninterrupted run computes, and ``posbench eval run=<dir>`` rebuilds
the dropped model. The run's results.json records the switch (``train.position_dropped_after_step``).

Dropping means every hook of the base becomes the identity (no input embedding, no rotation, no
score, value or key term). A base whose attention is not the softmax over position-free logits once
dropped is refused in one line: one that reads no positions (nope, cope, fox: nothing to drop),
one whose normaliser replaces the softmax (stickbreaking) or whose layers impose windows (swan,
layers with windows), a wrapper (ssmax, dape) and grid methods.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.methods import build_base, register
from posbench.methods.base import ModelDims, OverBase, PositionMethod, ScoreFn, ValueTerm


def droppable(base: PositionMethod, n_layers: int) -> str | None:
    """Why ``base`` cannot be dropped (one clause), or None when it can."""
    name = base.name
    if "sequence" not in base.layouts:
        return f"{name} is a grid method"
    if isinstance(base, OverBase):
        return f"{name} wraps another method (give drope that method itself)"
    if not base.uses_positions:
        return f"{name} reads no position ids, so there is nothing to drop"
    if any(base.normalizer(layer) is not None for layer in range(n_layers)):
        return f"{name}'s normaliser replaces the softmax, so dropping it would change the attention itself"
    if any(base.attention_window(layer) is not None for layer in range(n_layers)):
        return f"{name}'s layers impose attention windows (masks, not a position encoding)"
    return None


@register
class DroPE(OverBase):
    name = "drope"
    enters = "``method.base`` (default rope) for the first ``method.drop_step`` steps, then nothing"
    source = "Gelberg et al. 2026"
    past_context = (
        "after the drop a NoPE model: no position encoding to go out of distribution, only the causal mask's "
        "implicit position (docs/methods.md#drope)"
    )
    backend_note = "the base's until the drop, then fused causal"

    def __init__(self, dims: ModelDims, *, base: str = "rope", drop_step: int = 300) -> None:
        super().__init__(dims)
        if drop_step < 1:
            raise PosbenchError(f"method.drop_step must be a step >= 1 (the steps trained with method.base), got {drop_step}")
        self.base_name = base
        self.drop_step = drop_step
        self.inner = build_base(self.name, base, dims)
        why = droppable(self.inner, dims.n_layers)
        if why is not None:
            raise PosbenchError(f"method=drope cannot drop method.base={base}: {why}; choose a base that encodes "
                                "positions, e.g. method.base=rope")
        # Optimizer steps taken: a buffer, so checkpoints carry it. The python int mirrors it and
        # the forward reads only the bool ``_dropped``: no tensor read (the step never waits on the
        # device), and a compiled forward guards on a value that changes once (one recompile at
        # the drop), not on the step count.
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.int64))
        self._steps, self._dropped = 0, False
        self.has_score_term = self.inner.has_score_term  # type: ignore[misc]  # none once dropped
        self.uses_positions = self.inner.uses_positions  # type: ignore[misc]
        self.register_load_state_dict_post_hook(lambda module, keys: module.sync_steps())

    def sync_steps(self) -> None:
        """Take the step count from ``steps_done`` (after a checkpoint is loaded)."""
        self._steps = int(self.steps_done)
        self._dropped = self._steps > self.drop_step
        self.has_score_term = self.inner.has_score_term and not self.dropped  # type: ignore[misc]

    @property
    def dropped(self) -> bool:
        """Whether the position encoding is gone: more than ``drop_step`` steps taken."""
        return self._dropped

    @property
    def switched_at_step(self) -> int | None:
        return self.drop_step if self.dropped else None

    def before_step(self) -> None:
        self._steps += 1
        self.steps_done.fill_(self._steps)
        self._dropped = self._steps > self.drop_step
        self.has_score_term = self.inner.has_score_term and not self.dropped  # type: ignore[misc]

    # Every hook: the base's until the drop, then the identity.
    @property
    def max_positions(self) -> int | None:
        return None if self.dropped else self.inner.max_positions

    def backend_limits(self) -> dict[str, str]:
        return {} if self.dropped else self.inner.backend_limits()

    def input_embedding(self, positions: Tensor) -> Tensor | None:
        return None if self.dropped else self.inner.input_embedding(positions)

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        return (q, k) if self.dropped else self.inner.rotate_qk(q, k, positions, layer)

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None, **shared: Any) -> ScoreFn | None:
        if self.dropped:
            return None
        return self.inner.score_term(q, positions, layer, k=k, x=x, **shared)

    def per_forward(self, positions: Tensor) -> Any:
        return None if self.dropped else self.inner.per_forward(positions)

    def value_term(self, positions: Tensor, layer: int) -> ValueTerm | None:
        return None if self.dropped else self.inner.value_term(positions, layer)

    def key_bias(self, x: Tensor, layer: int) -> Tensor | None:
        return None if self.dropped else self.inner.key_bias(x, layer)

    def extra_repr(self) -> str:
        return f"name={self.name}, base={self.base_name}, drop_step={self.drop_step}, dropped={self.dropped}"
