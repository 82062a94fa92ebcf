"""The console's view of the step loop: a tqdm bar on a terminal, timed one-line reports off one."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from tqdm.auto import tqdm


class make_progress:
    """Progress of the step loop: a tqdm bar on a terminal (loss, tokens/s, ETA); off a
    terminal (a log file, a batch job) one line every ``every_seconds`` with the step, loss,
    tokens/s, steps/s and ETA, and one at the last step. Silent when not ``enabled``."""

    def __init__(self, total: int, initial: int, enabled: bool, every_seconds: float = 0.0,
                 log: Callable[[str], None] | None = None) -> None:
        terminal = sys.stderr.isatty() and os.environ.get("CI") is None
        self.enabled = enabled and terminal
        self.bar = None
        if self.enabled:
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        # Off a terminal: timed lines (every_seconds > 0), else the caller's own step lines.
        self.timed = enabled and not terminal and every_seconds > 0 and log is not None
        self.total, self.initial, self.every, self.log = total, initial, every_seconds, log
        self.started = self.last_line = time.monotonic()
        self.loss, self.tokens_per_second = float("nan"), float("nan")
        self.loss_step: int | None = None  # the step the last logged loss comes from (None: none yet)

    def update_to(self, step: int, loss: float, tokens_per_second: float) -> None:
        self.loss, self.tokens_per_second, self.loss_step = loss, tokens_per_second, step
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_second:,.0f}")

    def tick(self, step: int) -> None:
        """Called after every step: off a terminal, a line once ``every_seconds`` have passed
        since the last one (and at the last step), with the last logged loss (and its step) and tokens/s."""
        if not self.timed:
            return
        now = time.monotonic()
        if now - self.last_line < self.every and step < self.total:
            return
        self.last_line = now
        self.log(progress_line(step, self.total, self.loss, self.tokens_per_second,
                               (step - self.initial) / max(now - self.started, 1e-9), self.loss_step))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def progress_line(step: int, total: int, loss: float, tokens_per_second: float, steps_per_second: float,
                  loss_step: int | None = None) -> str:
    """``step 125/1000 (12%) loss 4.1234 at step 120 52,000 tok/s 3.10 steps/s ETA 04:44``: the loss and
    tokens/s of the last logged step (``loss_step``; every ``trainer.log_every``), ``-`` before the
    first one (after a start or a resume)."""
    eta = tqdm.format_interval((total - step) / steps_per_second) if steps_per_second > 0 else "?"
    if loss_step is None:
        measured = "loss - - tok/s"
    else:
        measured = f"loss {loss:.4f} at step {loss_step} {tokens_per_second:,.0f} tok/s"
    return (f"step {step}/{total} ({100 * step / max(total, 1):.0f}%) {measured} "
            f"{steps_per_second:.2f} steps/s ETA {eta}")
