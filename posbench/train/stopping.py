"""The trainer's checkpoints and stops: when a checkpoint is due, what it holds, and how a run
stops on a signal or ``trainer.stop_after_steps`` (checkpoint, status ``interrupted``, exit
128 + signal) with the command that continues it.

:class:`Checkpoints` is a part of :class:`posbench.train.trainer.Trainer` (its attributes are the
trainer's), kept apart so that the trainer's module reads as its stages.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from posbench.runs.checkpoint import rng_state, save_checkpoint
from posbench.runs.runlog import continue_hint
from posbench.runtime.distributed import any_rank
from posbench.runtime.preemption import StopRequest


class TrainingInterrupted(Exception):
    """Raised after a checkpoint was saved because the run was asked to stop (signal / test aid)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Checkpoints:
    """Checkpoint and stop steps of the :class:`posbench.train.trainer.Trainer`."""

    def stop_requested(self, step: int, stop: StopRequest) -> bool:
        """A signal arrived or ``trainer.stop_after_steps`` is reached; DDP ranks agree on it
        at log steps only (one collective per window)."""
        t = self.t
        stop_now = stop.signum is not None or (t.stop_after_steps is not None and step >= t.stop_after_steps)
        if not self.dist_info.enabled:
            return stop_now
        return any_rank(stop_now, self.dist_info) if step % t.log_every == 0 else False

    def checkpoint_due(self, step: int) -> bool:
        t = self.t
        return bool((t.checkpoint_every_steps and step % t.checkpoint_every_steps == 0) or (
            t.checkpoint_every_minutes and time.perf_counter() - self.last_ckpt_time >= 60 * t.checkpoint_every_minutes
        ))

    def save_checkpoint(self, step: int, elapsed: float | None = None) -> None:
        # Never keep non-finite weights as a checkpoint (the loss is checked at log steps only;
        # this sync is free next to the save).
        self.ensure_finite(float(self.loss_sum), step)
        with self.overhead_timer():
            if elapsed is None:
                elapsed = self.elapsed_before + time.perf_counter() - self.start_time
            self.last_good = save_checkpoint(self.run_dir, self.checkpoint_state(step, elapsed), self.t.keep_checkpoints)
        self.last_ckpt_time = time.perf_counter()

    def checkpoint_state(self, step: int, elapsed: float) -> dict[str, Any]:
        spec = self.spec
        carried = {"state_passing": self.state_passing.state_dict()} if self.state_passing.active else {}
        return {
            "step": step, "tokens": step * self.tokens_per_step, "elapsed_seconds": elapsed,
            "overhead_seconds": self.overhead_before + self.overhead,
            "last_loss": self.loss_value,
            "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "rng": rng_state(),
            "config": OmegaConf.to_container(self.cfg, resolve=True), "method": spec.method,
            "method_options": spec.method_options, "model_config": spec.model.to_dict(),
            "data_dir": self.workload.data_dir, "data_identity": self.workload.identity(), **carried,
        }

    def stop(self, step: int, stop: StopRequest) -> None:
        """After the stop checkpoint: record "interrupted", hand SIGUSR1 on, raise."""
        signum = stop.signum or signal.SIGTERM
        if stop.signum is not None:
            self.log(f"received {signal.Signals(signum).name}: checkpoint saved at step {step}")
        if self.is_main:
            self.rundir.write_status("interrupted", method=self.spec.method, seed=self.spec.seed,
                                     error=f"stopped at step {step}", step=step)
            stop.hand_over()
        raise TrainingInterrupted(
            f"stopped at step {step}/{self.total_steps}; checkpoint saved in {self.rundir.checkpoint_dir}; "
            f"{self.continue_hint()}",
            exit_code=128 + int(signum),
        )

    def continue_hint(self) -> str:
        """How to continue: a sweep job in its sweep (hydra.sweep.dir), a run in its directory."""
        resume_named = not same_dir(self.run_dir, self.output_dir)  # the command has trainer.resume=<dir>
        if self.hydra_record is not None:
            return self.hydra_record.continue_hint(self.run_dir, resume_named)
        return continue_hint(self.run_dir, resume_named)


def same_dir(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


