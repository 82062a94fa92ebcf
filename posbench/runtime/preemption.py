"""Preemption: SIGTERM / SIGINT / SIGUSR1 (what SLURM sends before preemption) become a flag the
training loop checks at step boundaries, so it can save a checkpoint and exit non-zero."""

from __future__ import annotations

import signal
import threading
from typing import Any

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def threading_main() -> bool:
    return threading.current_thread() is threading.main_thread()


class StopRequest:
    """Turns preemption signals into a flag the loop checks at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading_main():
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum  # only a flag: logging here could re-enter a half-written log line

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def hand_over(self) -> None:
        """After our checkpoint, let the previous SIGUSR1 handler run: under Hydra's submitit
        launcher that is submitit's, which requeues the SLURM job (and the job resumes)."""
        previous = self._previous.get(signal.SIGUSR1)
        if self.signum == signal.SIGUSR1 and callable(previous):
            try:
                previous(self.signum, None)
            except SystemExit:  # submitit exits after requeueing; we exit our own way below
                pass


__all__ = ["PREEMPTION_SIGNALS", "StopRequest"]
