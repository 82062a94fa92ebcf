"""Randomized positional encodings (Ruoss et al. 2023, "Randomized Positional Encodings Boost
Length Generalization of Transformers"), generic for every method that reads position ids.

With ``positions.randomize_max: M``, each training sequence of length T gets as its position ids a
sorted random subset of [0, M) (drawn per sequence), so a model trained at context C has seen
position ids up to M; at evaluation the ids are ``arange(L)`` as usual. The draw is a pure
function of (seed, step, rank, micro-batch, batch, T, M): a resumed run repeats it exactly.
Methods that never read position ids (nope, cope, fox) reject the option rather than ignore it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.methods import PositionMethod, method_class

# Odd 64-bit constants (splitmix64's) spread (seed, step, rank, micro) over the seed space.
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)


def draw_positions(seed: int, step: int, batch: int, length: int, randomize_max: int,
                   rank: int = 0, micro: int = 0) -> Tensor:
    """(batch, length) int64 position ids: per row, a sorted random subset of [0, randomize_max)."""
    if length > randomize_max:
        raise PosbenchError(f"positions.randomize_max={randomize_max} is below the sequence length {length}")
    mixed = sum(value * mix for value, mix in zip((seed, step, rank, micro), _MIX, strict=True))
    generator = torch.Generator().manual_seed(mixed % 2**63)
    keys = torch.rand(batch, randomize_max, generator=generator)  # a random permutation per row
    return keys.argsort(dim=-1)[:, :length].sort(dim=-1).values


def method_label(method: str, randomize_max: int | None) -> str:
    """The name a run shows in tables: ``rope``, or ``rope+rand2048`` with randomized positions."""
    return method if randomize_max is None else f"{method}+rand{randomize_max}"


def randomize_max_from_config(cfg: Any, method: str | PositionMethod, context: int,
                              max_positions: int | None) -> int | None:
    """Validated ``positions.randomize_max`` of a run config (None when the option is off).
    ``method``: its name, or the built method (whether it reads positions can depend on its
    options, e.g. a per-layer schedule of nope layers only)."""
    section = cfg.get("positions") if cfg is not None else None
    value = None if section is None else section.get("randomize_max")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < context:
        raise PosbenchError(
            f"positions.randomize_max must be an integer >= trainer.context={context}, got {value!r}; "
            f"e.g. positions.randomize_max={8 * context}"
        )
    cls = method_class(method) if isinstance(method, str) else method
    reads_positions = cls.uses_positions
    if "sequence" not in cls.layouts:
        raise PosbenchError(f"positions.randomize_max draws sequence positions; method={cls.name} is a grid method, "
                            "remove positions.randomize_max")
    if not isinstance(method, str):
        method = method.name
    if not reads_positions:
        raise PosbenchError(f"method={method} reads no position ids, so positions.randomize_max cannot change it; remove it")
    if max_positions is not None and value > max_positions:
        raise PosbenchError(
            f"positions.randomize_max={value} exceeds method={method}'s max_positions={max_positions}; "
            f"raise method.max_positions to at least {value}"
        )
    return value


class TrainingPositions:
    """The training loop's hook: ``positions(step, micro, batch)`` -> ids for one micro-batch, or
    None (the model's arange); ``label`` is the run's name in tables (see :func:`method_label`)."""

    def __init__(self, cfg: Any, method: str, context: int, max_positions: int | None, seed: int,
                 rank: int, device: torch.device) -> None:
        self.randomize_max = randomize_max_from_config(cfg, method, context, max_positions)
        self.label = method_label(method, self.randomize_max)
        self.context, self.seed, self.rank, self.device = context, seed, rank, device

    def __call__(self, step: int, micro: int, batch: int) -> Tensor | None:
        if self.randomize_max is None:
            return None
        positions = draw_positions(self.seed, step, batch, self.context, self.randomize_max,
                                   rank=self.rank, micro=micro)
        return positions.to(self.device, non_blocking=True)
