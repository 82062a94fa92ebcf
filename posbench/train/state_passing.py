"""State passing (Buitrago & Gu 2025): what each training window of a recurrent model starts from.

A recurrent model trained only from the zero state meets, past the training context C, states it
never started from, and fails there for a reason that is not its own. ``trainer.state_passing``:

    off     every window starts from the zero state (the default; attention models always)
    carry   row i starts from the final state of row i of the step before, which the loader makes
            the previous window of the same stream (``TrainBatches(streams=True)``); zero where a
            stream starts over. The state is detached: gradients stay within a window.
    noise   every recurrent state starts as Gaussian noise of std ``trainer.state_noise`` (the
            convolution's state at zero), drawn from a generator seeded by (seed, step, micro-batch),
            so a resumed run draws the same noise.

The carried state is part of a checkpoint (:meth:`StatePassing.state_dict`), so a resumed run
continues bitwise.
"""

from __future__ import annotations

from typing import Any

import torch

from posbench.core.errors import PosbenchError

State = dict[int, tuple[torch.Tensor, ...]]  # recurrent layer -> its state (conv, recurrent)


class StatePassing:
    def __init__(self, mode: str, model: Any, batches: Any, micro: int, seed: int, noise: float,
                 device: torch.device, world_size: int = 1) -> None:
        if mode == "carry" and world_size > 1:
            raise PosbenchError("trainer.state_passing=carry runs in one process (each process would carry its "
                                "own rows' states); use one process or trainer.state_passing=noise")
        self.mode, self.model, self.batches, self.micro = mode, model, batches, micro
        self.seed, self.noise, self.device = seed, noise, device
        self.carried: dict[int, State] = {}  # micro-batch -> the state its rows ended the last step with

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def start(self, step: int, micro_batch: int) -> State | None:
        """The state micro-batch ``micro_batch`` of global ``step`` (1-based) starts from; the
        forward leaves its final state in it. None: the zero state (``off``)."""
        if self.mode == "off":
            return None
        fresh = self.model.initial_state(self.micro, self.device)
        if self.mode == "noise":
            g = torch.Generator().manual_seed(hash((self.seed, step, micro_batch)) % 2**63)
            return {layer: (conv, self.noise * torch.randn(rec.shape, generator=g).to(rec))
                    for layer, (conv, rec) in fresh.items()}
        if self.batches.starts_streams(step - 1) or micro_batch not in self.carried:
            return fresh
        return dict(self.carried[micro_batch])

    def keep(self, micro_batch: int, state: State | None) -> None:
        """After the forward: keep the final state (``carry``), cut from the graph."""
        if self.mode == "carry" and state is not None:
            self.carried[micro_batch] = {layer: tuple(t.detach() for t in parts) for layer, parts in state.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "carried": {i: {layer: tuple(t.cpu() for t in parts) for layer, parts in s.items()}
                                               for i, s in self.carried.items()}}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        carried = (saved or {}).get("carried") or {}
        self.carried = {int(i): {int(layer): tuple(t.to(self.device) for t in parts) for layer, parts in s.items()}
                        for i, s in carried.items()}

    def record(self) -> dict[str, Any] | None:
        """results.json's ``train.state_passing`` (None when off: records stay as they were)."""
        if self.mode == "off":
            return None
        return {"mode": self.mode, **({"noise": self.noise} if self.mode == "noise" else {})}
