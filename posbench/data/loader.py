"""Batches from a flat token stream: shuffled training windows and fixed evaluation windows."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from posbench.core.errors import PosbenchError


class TrainBatches:
    """Deterministic sampler over non-overlapping training windows of ``context + 1`` tokens.

    Window ``i`` is ``tokens[i*context : i*context + context + 1]`` (inputs and shifted
    targets; consecutive windows share one boundary token). Samples are drawn epoch by epoch,
    each epoch a permutation of all windows seeded by ``(seed, epoch)``; global sample ``k``
    is position ``k % W`` of epoch ``k // W``'s permutation, so every window appears exactly
    once per epoch and a batch may straddle two epochs. Step ``s`` holds global samples
    ``s*batch_size ... s*batch_size + batch_size - 1``, and rank ``r`` of ``world_size`` takes
    rows ``r::world_size`` of it. A batch is thus a pure function of ``(seed, step)``: resuming
    needs no RNG state and N processes together see the same global batch as one process.

    ``insert`` (optional, e.g. :class:`posbench.data.retrieval.Inserter`) is called with the
    int64 rows ``(B, context + 1)`` and their global sample indices before they become
    tensors, and may write into the rows; without it the rows are the stream's tokens.

    ``streams`` (state passing, docs/mixers.md): no shuffling; the windows are cut into
    ``batch_size`` contiguous lanes of ``S = num_windows // batch_size`` windows, and row i of
    step s is window ``i * S + s % S``, so row i of step s + 1 continues row i of step s, except
    when a lane starts over (:meth:`starts_streams`).
    """

    def __init__(self, tokens: np.ndarray, context: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, device: str | torch.device | None = None,
                 pin_memory: bool = False, insert: Callable[[np.ndarray, np.ndarray], None] | None = None,
                 streams: bool = False):
        if context < 1 or batch_size < 1:
            raise PosbenchError(f"context={context} and batch_size={batch_size} must be positive")
        if world_size < 1 or not 0 <= rank < world_size:
            raise PosbenchError(f"rank {rank} is not in 0..{world_size - 1}; check the launcher's world size")
        if batch_size % world_size:
            raise PosbenchError(
                f"batch_size={batch_size} is not divisible by world_size={world_size}; "
                f"use a multiple of {world_size}"
            )
        self.num_windows = (len(tokens) - 1) // context if len(tokens) > 0 else 0
        if self.num_windows < 1:
            raise PosbenchError(
                f"training split has {len(tokens)} tokens, fewer than one window of {context + 1}; "
                "lower the training context or use more training data"
            )
        self.tokens, self.context, self.batch_size, self.seed = tokens, context, batch_size, seed
        self.rank, self.world_size, self.insert = rank, world_size, insert
        self.device = torch.device(device) if device is not None else None
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._offsets = np.arange(context + 1, dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}
        self.streams = streams
        if streams and self.num_windows // batch_size < 2:
            raise PosbenchError(f"trainer.state_passing=carry cuts the training split into {batch_size} streams, "
                                f"and its {self.num_windows} windows give fewer than 2 windows each; lower "
                                "trainer.batch_size or use more training data")

    @property
    def steps_per_epoch(self) -> int:
        """Whole steps per pass over all windows, ``max(1, num_windows // batch_size)``; epochs
        end mid-batch when the division is not exact (see :meth:`epoch`)."""
        return max(1, self.num_windows // self.batch_size)

    def epoch(self, step: int) -> float:
        """Exact epochs completed before global ``step`` (samples seen / windows)."""
        return step * self.batch_size / self.num_windows

    def permutation(self, epoch: int) -> np.ndarray:
        """Window order of ``epoch`` (cached for the two most recent epochs)."""
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_windows)
        return self._perms[epoch]

    def samples(self, step: int) -> np.ndarray:
        """Global sample indices of this rank's rows at global ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step * self.batch_size + np.arange(self.rank, self.batch_size, self.world_size, dtype=np.int64)

    def starts_streams(self, step: int) -> bool:
        """Whether the rows of global ``step`` start their streams afresh (always, without ``streams``)."""
        return not self.streams or step % self.steps_per_epoch == 0

    def windows(self, step: int) -> np.ndarray:
        """Window indices of this rank's rows at global ``step``."""
        if self.streams:  # lane i, its (step mod S)-th window
            rows = np.arange(self.rank, self.batch_size, self.world_size, dtype=np.int64)
            return rows * self.steps_per_epoch + step % self.steps_per_epoch
        samples = self.samples(step)
        epochs, positions = np.divmod(samples, self.num_windows)
        out = np.empty(len(samples), dtype=np.int64)
        for epoch in np.unique(epochs):  # at most two epochs per batch (unless tiny data)
            sel = epochs == epoch
            out[sel] = self.permutation(int(epoch))[positions[sel]]
        return out

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` int64 tensors ``[batch_size // world_size, context]`` for global ``step``;
        ``y`` is ``x`` shifted by one token."""
        starts = self.windows(step) * self.context
        rows = self.tokens[starts[:, None] + self._offsets].astype(np.int64)  # (B, context + 1), a copy
        if self.insert is not None:
            self.insert(rows, self.samples(step))
        rows = torch.from_numpy(rows)
        if self.device is not None and self.device.type != "cpu":
            if self.pin_memory:
                rows = rows.pin_memory()
            rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def eval_sequences(tokens: np.ndarray, length: int, num_sequences: int,
                   split: str = "validation") -> torch.Tensor:
    """The first ``num_sequences`` non-overlapping windows of ``length + 1`` tokens, as a
    ``LongTensor [N, length + 1]`` (deterministic). Returns fewer rows when fewer fit (the
    caller should log it); raises :class:`PosbenchError` when not even one fits."""
    window = length + 1
    available = len(tokens) // window
    if length < 1 or num_sequences < 1:
        raise PosbenchError(f"eval length={length} and num_sequences={num_sequences} must be positive")
    if available < 1:
        raise PosbenchError(
            f"{split} split has {len(tokens)} tokens, fewer than one eval window of {window}; "
            f"lower the eval length below {len(tokens)} or use more {split} data"
        )
    n = min(num_sequences, available)
    return torch.from_numpy(np.asarray(tokens[: n * window]).astype(np.int64).reshape(n, window))


VALIDATION_SUBSET_SEED = 0
"""Seed of the in-training validation subset: one fixed seed, so every method, seed and resume
of a given data setting validates on the very same windows."""


def spread_sequences(tokens: np.ndarray, length: int, num_sequences: int, seed: int = VALIDATION_SUBSET_SEED,
                     split: str = "validation") -> torch.Tensor:
    """``num_sequences`` of the non-overlapping windows of :func:`eval_sequences`, spread over
    the whole split: the windows are cut into ``num_sequences`` equal strata and one window is
    drawn from each (seeded, in text order), so the subset is neither the first windows (the
    start of a file is not a typical sample of it) nor dependent on anything but the tokens,
    ``length``, ``num_sequences`` and ``seed``. All windows when no more fit."""
    window = length + 1
    available = len(tokens) // window
    if num_sequences >= available or num_sequences < 1:
        return eval_sequences(tokens, length, num_sequences, split=split)  # all that fit (or its one-line refusal)
    edges = np.linspace(0, available, num_sequences + 1).astype(np.int64)  # strata [edges[i], edges[i+1])
    rng = np.random.default_rng(seed)
    picks = edges[:-1] + (rng.random(num_sequences) * (edges[1:] - edges[:-1])).astype(np.int64)
    rows = np.asarray(tokens)[picks[:, None] * window + np.arange(window)]  # (N, length + 1)
    return torch.from_numpy(rows.astype(np.int64))
