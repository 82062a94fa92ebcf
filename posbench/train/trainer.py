"""Training: one run of one position method, from config to checkpoint, results and figures.

    config -> data cache -> model -> AdamW (warmup + cosine) over deterministic batches
           -> metrics.jsonl / W&B / checkpoints -> evaluation -> results.json + figures

Batches are a pure function of (seed, step), so a checkpoint's step is its data position and a
resumed run reproduces the uninterrupted one exactly. The loop synchronises with the device only
at logging steps. SIGTERM / SIGINT / SIGUSR1 (what SLURM sends before preemption) make the loop
save a checkpoint at the next step boundary and exit non-zero; the next start resumes.

A run is a :class:`Trainer` whose stages read top to bottom in :meth:`Trainer.stages`: setup,
resume (checked before anything is written), claim, start, the step loop, final evaluation; its
checkpoints and stops (:mod:`posbench.train.stopping`) and its final evaluation
(:mod:`posbench.train.final`) are parts of it kept in their own modules. What it uses lives beside it: the validated config (:mod:`posbench.runs.spec`), what it trains on and
is scored on (:mod:`posbench.train.workload`: text or a synthetic task), device and precision
(:mod:`posbench.runtime.device`), the optimizer and THE training step (:mod:`posbench.train.optim`, which
``posbench bench`` times too), resume checks (:mod:`posbench.runs.resume`) and the run directory with
its lock and records (:mod:`posbench.runs.rundir`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.nn.parallel import DistributedDataParallel

from posbench.core.errors import PosbenchError
from posbench.evaluation.probes import configure_probes
from posbench.methods import ParameterDrift
from posbench.model.positions import TrainingPositions
from posbench.model.transformer import build_model
from posbench.runs.checkpoint import load_model_weights, set_rng_state
from posbench.runs.resume import check_resumable, load_resume_state, resolve_run_dir, run_target
from posbench.runs.rundir import RunDir, RunLocked
from posbench.runs.runlog import HydraRecord
from posbench.runs.spec import MethodSpec, build_spec, check_memory_fits
from posbench.runtime.device import as_posbench_error, autocast_dtype, resolve_device, seed_everything, setup_device
from posbench.runtime.distributed import (
    DistInfo,
    init_distributed,
    mean_across_ranks,
    same_on_all_ranks,
    shutdown,
)
from posbench.runtime.hardware import environment_line, run_environment
from posbench.runtime.preemption import StopRequest
from posbench.train import loggers
from posbench.train.final import FinalEvaluation
from posbench.train.optim import TrainStep, compile_model, compiles, micro_batching, total_steps
from posbench.train.progress import make_progress
from posbench.train.state_passing import StatePassing
from posbench.train.stopping import Checkpoints, TrainingInterrupted, same_dir
from posbench.train.wandb_session import wandb_group
from posbench.train.workload import Workload, make_workload

logger = logging.getLogger("posbench")


class NonFiniteLoss(PosbenchError):
    """The loss became NaN/inf; the run stops with its last good checkpoint kept."""


def train(cfg: DictConfig, run_dir: Path, log: Callable[[str], None] | None = None,
          evaluate_only: bool = False, hydra_record: HydraRecord | None = None) -> dict[str, Any]:
    """Train, evaluate and write a complete run directory; returns the results dict.

    Whatever goes wrong (a bad config value included) is recorded in the run's status.json, so
    a sweep's summary can name the failed jobs and why; a refused resume never touches the
    earlier run's record (it leaves refused.json beside it instead). ``evaluate_only``: only
    finish a run whose checkpoint is at its final step (``posbench eval``), never train.
    ``hydra_record`` (the CLI's): Hydra's ``.hydra/`` and log file, written once the run's lock
    is held; a single run whose config is refused before anything started leaves no folder.
    """
    log = log or logger.info
    try:
        run = Trainer(cfg, Path(run_dir), log, evaluate_only=evaluate_only, hydra_record=hydra_record)
    except BaseException as err:
        failure = as_posbench_error(err)
        if os.environ.get("RANK", "0") == "0" and not (hydra_record and hydra_record.remove_unstarted()):
            RunDir(run_dir).record_unstarted_failure(cfg, failure, hydra_record)
        raise failure from (None if failure is err else err)
    return run.run()


class Trainer(Checkpoints, FinalEvaluation):
    """One training run. Holds what the stages share, so each stage is a short method, called
    top to bottom by :meth:`stages`: setup -> resume -> claim -> start -> fit (per step:
    :meth:`train_step`, :meth:`log_step`, :meth:`validate`, :meth:`save_checkpoint`,
    :meth:`stop`) -> :meth:`final_evaluation`.
    """

    # ------------------------------------------------------------------ setup

    def __init__(self, cfg: DictConfig, run_dir: Path, log: Callable[[str], None], evaluate_only: bool = False,
                 hydra_record: HydraRecord | None = None) -> None:
        """Config and device only: nothing is read from or written to the run directory yet."""
        self.cfg, self.log, self.evaluate_only, self.hydra_record = cfg, log, evaluate_only, hydra_record
        self.spec = build_spec(cfg, saved=evaluate_only)
        with open_dict(cfg):
            cfg.kind = self.spec.kind  # recorded with the config (config.yaml, checkpoints): the run's kind
        self.t = self.spec.trainer
        configure_probes(self.spec.eval, self.t.context)  # eval.probes and their settings, before any work
        self.device, self.dist_info = self._setup_device()
        self.is_main = self.dist_info.is_main
        self.output_dir = same_on_all_ranks(Path(run_dir), self.dist_info)  # the job's own (Hydra's) directory
        self.run_dir = run_target(self.t, self.output_dir)
        self.rundir = RunDir(self.run_dir)  # its lock, records, metrics and results
        self.claimed = False  # this process wrote config.yaml / status "running" (the record is ours)

    def run(self) -> dict[str, Any]:
        """:meth:`stages` under the run directory's lock; a failure is recorded in status.json
        (or refused.json while the record is still the earlier run's) as one line."""
        try:
            otherwise = (f"then rerun posbench eval run={self.run_dir}" if self.evaluate_only
                         else "or choose another hydra.run.dir")
            lock = self.rundir.lock(enabled=self.is_main, otherwise=otherwise).__enter__()
        except RunLocked:
            if self.hydra_record is not None:
                self.hydra_record.discard()  # nothing of a refused start lands in the run
            raise
        with lock:
            try:
                return self.stages()
            except TrainingInterrupted:
                raise
            except BaseException as err:
                failure = as_posbench_error(err)
                ours = False  # whether the directory's record is now this start's
                if self.is_main and (self.claimed or not self.evaluate_only):  # eval refusals record nothing
                    ours = self.record_failure(failure)
                self.settle_hydra_record(accepted=self.claimed or ours)
                raise failure from (None if failure is err else err)

    def record_failure(self, failure: BaseException) -> bool:
        """Record a failure where it belongs; True when the job's directory now records it.

        A start refused before it claimed a run that ``trainer.resume=<run dir>`` named (not the
        job's own directory) writes nothing into that run, which is another job's record: the
        job's own directory records the failure (a sweep's summary counts it), or, for a single
        run, the empty folders Hydra made for it are removed again."""
        if self.claimed or same_dir(self.run_dir, self.output_dir):
            return self.rundir.record_failure(self.cfg, failure, claimed=self.claimed)
        if self.hydra_record is not None and self.hydra_record.remove_unstarted():
            return False
        return RunDir(self.output_dir).record_failure(self.cfg, failure, claimed=False)

    def settle_hydra_record(self, accepted: bool) -> None:
        """Hydra's ``.hydra/`` and log file: written once the run is accepted (or its failure is
        the directory's only record), else dropped, so a refused start leaves an earlier run's
        record and log as they were."""
        if self.hydra_record is None:
            return
        if accepted:
            self.hydra_record.write(self.cfg, is_main=self.is_main)
        else:
            self.hydra_record.discard()

    def stages(self) -> dict[str, Any]:
        """The run, top to bottom."""
        self.setup()  # resume policy, stray temp files, data, memory check, model, optimizer
        finished = self.resume()  # continue from the newest good checkpoint; refuse a mismatch
        self.settle_hydra_record(accepted=True)  # the run is this process's: Hydra's record and log
        if finished is not None:
            return finished
        self.claim()  # only now config.yaml and status "running" replace the earlier record
        self.start()  # DDP / compile wrapping, validation sets, metrics logger
        self.fit()  # the step loop, with periodic validation and checkpoints
        return self.final_evaluation()  # final validation, evaluation, results.json, figures

    def setup(self) -> None:
        spec, t = self.spec, self.t
        self.resuming = resolve_run_dir(t, self.run_dir)
        if self.is_main:
            self.rundir.remove_stray_temp_files(self.log)
        seed_everything(spec.seed)
        self.micro, self.accum = micro_batching(t, self.dist_info.world_size)
        # Before the tokenizer and data are prepared (minutes for a new cache): a model or batch
        # that cannot fit is refused at once, counting a one-token vocabulary (the real one is not known yet).
        check_memory_fits(replace(spec, model=replace(spec.model, vocab_size=1)), self.micro, self.device)
        self.workload: Workload = make_workload(spec, self.log)  # text (a token cache) or a task's generator
        self.spec = spec = replace(spec, model=replace(spec.model, vocab_size=self.workload.vocab_size))
        check_memory_fits(spec, self.micro, self.device)  # again, with the vocabulary's embedding and logits
        self.raw_model = build_model(spec.model, spec.method, spec.method_options).to(self.device)
        self.raw_model.loss_chunk = t.loss_chunk  # how the loss is computed, not what (trainer.loss_chunk)
        # Probes that would measure nothing on this model's positions (a learned table): before training.
        configure_probes(spec.eval, t.context, max_positions=self.raw_model.position.max_positions)
        self.position_drift = ParameterDrift(self.raw_model.position)  # p_0: the seed's init, also on resume
        self.train_positions = TrainingPositions(self.cfg, spec.method, t.context, self.raw_model.position.max_positions,
                                                 spec.seed, self.dist_info.rank, self.device)  # randomized (or arange)
        self.batches = self.workload.train_batches(t, spec.seed, self.dist_info.rank, self.dist_info.world_size,
                                                   self.device)
        self.state_passing = StatePassing(t.state_passing, self.raw_model, self.batches, self.micro, spec.seed,
                                          t.state_noise, self.device, self.dist_info.world_size)
        self.tokens_per_step = t.batch_size * t.context
        self.total_steps = total_steps(t, self.tokens_per_step, self.batches.steps_per_epoch)
        self.amp_dtype = autocast_dtype(t.precision, self.device)
        self.step_fn = TrainStep(self.raw_model, t, self.device, self.total_steps, self.amp_dtype)
        self.optimizer, self.scheduler = self.step_fn.optimizer, self.step_fn.scheduler
        # Where the run stands; resume() moves these to the checkpoint's values.
        self.start_step, self.elapsed_before, self.overhead_before = 0, 0.0, 0.0
        self.loss_value = float("nan")  # the last logged training loss
        self.resumed_from: Path | None = None
        self.last_good: Path | None = None  # newest checkpoint known to hold finite weights

    def _setup_device(self) -> tuple[torch.device, DistInfo]:
        t = self.t
        device = resolve_device(t.device)
        dist_info = init_distributed(device.type)
        device = setup_device(t.device, t.precision, dist_info)
        quick = self.cfg.model.get("flavour") in ("tiny", "mini") or t.max_steps is not None
        if device.type != "cuda" and dist_info.is_main and not quick:
            self.log("warning: training on the CPU; the full setup takes very long there. "
                     "For a quick CPU run use experiment=cpu_quick")
        return device, dist_info

    # ------------------------------------------------------------------ resume

    def resume(self) -> dict[str, Any] | None:
        """Load the newest good checkpoint (when resuming), after checking it belongs to this
        config. Returns the stored results when the run is already complete, else None."""
        if self.resuming:
            # posbench eval renames no damaged checkpoint: it reports it and uses the one before
            state = load_resume_state(self.run_dir, self.dist_info, self.log, quarantine=not self.evaluate_only)
            if state is None:
                self.log(f"no usable checkpoint in {self.run_dir}; starting from scratch")
            else:
                check_resumable(state, self.spec, self.total_steps, self.run_dir, self.workload.identity(),
                                self.train_positions.randomize_max)
                load_model_weights(self.raw_model, state, self.run_dir)
                self.optimizer.load_state_dict(state["optimizer"])
                self.scheduler.load_state_dict(state["scheduler"])
                set_rng_state(state["rng"])
                self.state_passing.load_state_dict(state.get("state_passing"))  # the carried states
                self.start_step, self.elapsed_before = state["step"], state.get("elapsed_seconds", 0.0)
                self.overhead_before = state.get("overhead_seconds", 0.0)
                self.loss_value = state.get("last_loss", float("nan"))
                self.resumed_from = Path(state["path"])
                self.check_finished_training()  # posbench eval: refused before any other line
                if self.start_step >= self.total_steps and self.rundir.already_complete():
                    results = self.rundir.read_results(self.log) if self.is_main else {}
                    if results is not None:
                        self.log(f"{self.run_dir} is already complete; nothing to do (its results.json is unchanged)")
                        if self.is_main:  # this start succeeded: an earlier refusal is over
                            self.rundir.clear_refusal()
                        shutdown(self.dist_info)
                        return results
                if self.evaluate_only:
                    self.log(f"{self.run_dir} has no usable results.json; running its final evaluation "
                             f"from its checkpoint at step {self.start_step}")
                else:
                    self.log(f"resuming {self.run_dir} from step {self.start_step} ({state['path']})")
        self.check_finished_training()
        return None

    def check_finished_training(self) -> None:
        """``posbench eval`` (``evaluate_only``) finishes a run only once it has no steps left."""
        if self.evaluate_only and self.start_step < self.total_steps:
            raise PosbenchError(
                f"{self.run_dir} stopped at step {self.start_step} of {self.total_steps}; finish training it first: "
                f"posbench train <its overrides> trainer.resume={self.run_dir}"
            )

    def claim(self) -> None:
        """Write this run's config.yaml and status "running" (the checks have all passed)."""
        if self.is_main:
            self.rundir.claim(self.cfg, self.spec.method, self.spec.seed)
            self.rundir.truncate_metrics(self.start_step, self.log)
        self.claimed = True

    def start(self) -> None:
        """Wrap the model for DDP / torch.compile, pick the validation sets, open the logger."""
        t, spec = self.t, self.spec
        self.model: torch.nn.Module = self.raw_model
        if self.dist_info.enabled:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.raw_model, device_ids=device_ids)
        if compiles(t, self.device):
            self.model = compile_model(self.model, t.compile_mode, t.compile_cache)
        elif t.compile_mode != "default" and self.is_main:  # a CUDA-graph mode was refused by TrainStep
            self.log(f"note: trainer.compile_mode={t.compile_mode} is unused: trainer.compile={t.compile} compiles "
                     f"nothing on {self.device.type}")
        self.environment = run_environment(t.precision, self.amp_dtype, self.device)  # results.json, W&B
        if self.is_main:
            self.log(environment_line(self.environment))
        self.val_sets = self.workload.validation_sets(self.raw_model, t, self.log) if self.is_main else {}
        self.run_logger = loggers.make_logger(  # looked up at call time: tests wrap it
            self.cfg.logger, run_dir=self.run_dir, run_name=spec.run_name,
            group=wandb_group(str(self.cfg.get("experiment_name", "default"))),
            tags=[spec.method, f"model-{spec.model.flavour}"],
            config={**OmegaConf.to_container(self.cfg, resolve=True), "environment": self.environment},
            rank=self.dist_info.rank, log=self.log,
        )

    # ------------------------------------------------------------------ the step loop

    def fit(self) -> None:
        """Train from ``start_step`` to ``total_steps``; save the final checkpoint.

        On a stop request (signal, ``trainer.stop_after_steps``) a checkpoint is saved and
        :class:`TrainingInterrupted` raised. A run resumed at its final step (stopped during
        its final evaluation) goes straight on to :meth:`final_evaluation`.
        """
        t, spec = self.t, self.spec
        self.start_time = self.last_ckpt_time = self.window_start = time.perf_counter()
        self.window_tokens = 0  # tokens since the last logged step (for tokens/s)
        self.overhead = 0.0  # validation + checkpoint seconds of this segment, kept out of tokens/s
        if self.start_step >= self.total_steps:
            self.log(f"the checkpoint of {self.run_dir} is at the final step {self.total_steps}; "
                     "going straight to the final evaluation")
            self.wall, self.overhead_total = self.elapsed_before, self.overhead_before
            return
        epochs = "fresh data every step" if spec.task is not None else f"{self.batches.steps_per_epoch} steps/epoch"
        self.log(
            f"training {spec.run_name}: method={spec.method} model={spec.model.flavour} "
            f"({self.raw_model.num_parameters(non_embedding=True) / 1e6:.2f} M non-embedding params) on {self.device}, "
            f"{self.total_steps} steps x {self.tokens_per_step} tokens ({epochs}), "
            f"world size {self.dist_info.world_size}"
        )
        self.progress = make_progress(self.total_steps, self.start_step, enabled=self.is_main and t.progress,
                                      every_seconds=t.progress_every_seconds, log=self.log)
        try:
            with StopRequest() as stop:
                self.model.train()
                for step in range(self.start_step + 1, self.total_steps + 1):
                    self.loss_sum = self.train_step(step)
                    last = step == self.total_steps
                    if step == self.start_step + 1:  # one sync: tells a broken config / checkpoint from lr
                        self.ensure_finite(float(self.loss_sum), step)
                    if step % t.log_every == 0 or last:
                        self.log_step(step)
                    if self.is_main and t.val_every and step % t.val_every == 0 and not last:
                        with self.overhead_timer():
                            self.validate(step)
                        self.model.train()
                    self.progress.tick(step)  # off a terminal: a line every trainer.progress_every_seconds
                    stop_now = self.stop_requested(step, stop)
                    if self.is_main and (self.checkpoint_due(step) or stop_now) and not last:
                        self.save_checkpoint(step)
                    if stop_now and not last:
                        self.stop(step, stop)
                self.wall = self.elapsed_before + time.perf_counter() - self.start_time
                self.overhead_total = self.overhead_before + self.overhead
                if self.is_main:
                    self.save_checkpoint(self.total_steps, elapsed=self.wall)
        except BaseException:
            self.progress.close()
            self.run_logger.finish(exit_code=1)
            shutdown(self.dist_info)
            raise
        self.progress.close()

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step (:class:`posbench.train.optim.TrainStep`) over the global batch of
        ``step``: gradient accumulation over micro-batches, all-reduced once; returns the summed
        loss as a device tensor (no sync)."""
        x, y = self.batches.get(step - 1)  # (B, T) each, already on the device
        micro, accum = self.micro, self.accum

        def micro_loss(i: int) -> torch.Tensor:
            xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]  # (b, T) each
            state = self.state_passing.start(step, i)  # None unless trainer.state_passing is on
            carried = {} if state is None else {"state": state}
            loss = self.model(xs, self.train_positions(step, i, xs.shape[0]), targets=ys, **carried)
            self.state_passing.keep(i, state)
            return self.workload.micro_loss(loss, ys, y, accum)

        def no_sync(i: int) -> Any:  # DDP all-reduces on the last micro-batch only
            sync = accum == 1 or i == accum - 1 or not self.dist_info.enabled
            return nullcontext() if sync else self.model.no_sync()

        loss_sum = self.step_fn(micro_loss, accum, no_sync)
        self.lr_used = self.step_fn.lr_used
        self.window_tokens += self.tokens_per_step
        return loss_sum

    def log_step(self, step: int) -> None:
        """The one device sync per logging window: loss, lr and tokens/s to metrics.jsonl,
        the logger and the progress bar."""
        self.loss_value = float(mean_across_ranks(self.loss_sum, self.dist_info))
        now = time.perf_counter()
        tps = self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_start, self.window_tokens = now, 0
        self.ensure_finite(self.loss_value, step)
        if self.last_good is None:  # training went on finitely from the checkpoint it resumed
            self.last_good = self.resumed_from
        row = {"step": step, "tokens": step * self.tokens_per_step, "loss": self.loss_value,
               "lr": self.lr_used, "tokens_per_second": tps,
               "elapsed_seconds": self.elapsed_before + now - self.start_time}
        if self.is_main:
            self.rundir.append_metrics(row)
            self.run_logger.log_metrics({f"train/{k}": v for k, v in row.items()}, step=step)
            self.progress.update_to(step, self.loss_value, tps)
            text_every = max(self.t.log_every, self.total_steps // 20)
            timed = self.progress.enabled or self.progress.timed  # else a line every 5 % of the steps
            if not timed and (step % text_every == 0 or step == self.total_steps):
                self.log(f"step {step}/{self.total_steps} loss {self.loss_value:.4f} {tps:,.0f} tok/s")

    def ensure_finite(self, loss: float, step: int) -> None:
        """Stop on a NaN/inf loss with a message that names the likely cause truthfully."""
        if math.isfinite(loss):
            return
        spec = self.spec
        if step == 1:
            raise NonFiniteLoss(
                f"the loss is {loss} at step 1, from the untrained model: this configuration produces "
                f"non-finite values before any update (method={spec.method}, method options "
                f"{spec.method_options or 'none'}, model.d_model={spec.model.d_model}, "
                f"model.n_heads={spec.model.n_heads}); check the method options and model settings "
                "(trainer.lr is not the cause)"
            )
        if step == self.start_step + 1 and self.resumed_from is not None:
            raise NonFiniteLoss(
                f"the loss is {loss} at step {step}, the first step after resuming from {self.resumed_from.name}: "
                f"that checkpoint holds damaged weights; delete {self.resumed_from} to resume from the one "
                "before it, or start afresh in a new hydra.run.dir"
            )
        raise NonFiniteLoss(
            f"loss became {loss} at step {step}; "
            + (f"last good checkpoint kept: {self.last_good.name}; " if self.last_good else "")
            + "lower trainer.lr or raise trainer.warmup_steps"
        )

    @contextmanager
    def overhead_timer(self) -> Iterator[None]:
        """Time spent validating or checkpointing: counted as overhead, kept out of tokens/s."""
        began = time.perf_counter()
        yield
        spent = time.perf_counter() - began
        self.overhead += spent
        self.window_start += spent

    # ------------------------------------------------------------------ validation

    def validate(self, step: int) -> float:
        """Validation loss at the training context and on the C-2C band (metrics.jsonl + logger)."""
        context, tokens = self.t.context, step * self.tokens_per_step
        row: dict[str, Any] = {"step": step, "tokens": tokens}
        logged: dict[str, Any] = {"train/tokens": tokens}
        values = self.workload.validation_row(self.raw_model, self.val_sets, context, self.micro, self.device,
                                              self.amp_dtype)
        row.update(values)
        logged.update({"val/" + name.removeprefix("val_"): value for name, value in values.items()})
        drift = self.position_drift.metrics()  # position/<param>/norm and /move (docs/fidelity.md)
        row.update(drift)
        logged.update(drift)
        if not self.rundir.validation_logged(step):  # a run resumed at its final step validates it again
            self.rundir.append_metrics(row)
        self.run_logger.log_metrics(logged, step=step)
        logger.info("step %d validation loss %.4f", step, row["val_loss"])
        return row["val_loss"]


def finish_run(run_dir: Path, config: DictConfig, log: Callable[[str], None], device: str = "auto",
               evaluation: Any = None) -> dict[str, Any]:
    """``posbench eval`` of a run whose newest checkpoint is at its final step but which has no
    (valid) results.json (stopped during its final evaluation, or its results were damaged):
    the run's own final evaluation, at ``evaluation`` (an eval section) when given. Refuses
    (PosbenchError) while the run still has steps to train."""
    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    cfg.trainer.resume, cfg.trainer.progress, cfg.trainer.device = str(run_dir), False, device
    cfg.method = MethodSpec.from_saved(cfg.method).section()  # as it trained, not today's defaults
    if evaluation is not None:
        cfg.eval = OmegaConf.create(OmegaConf.to_container(evaluation, resolve=True))
    return train(cfg, run_dir, log, evaluate_only=True)
