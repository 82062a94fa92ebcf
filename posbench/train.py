"""Training: one run of one position method, from config to checkpoint, results and figures.

    config -> data cache -> model -> AdamW (warmup + cosine) over deterministic batches
           -> metrics.jsonl / W&B / checkpoints -> evaluation -> results.json + figures

Batches are a pure function of (seed, step), so a checkpoint's step is its data position and a
resumed run reproduces the uninterrupted one exactly. The loop synchronises with the device only
at logging steps. SIGTERM / SIGINT / SIGUSR1 (what SLURM sends before preemption) make the loop
save a checkpoint at the next step boundary and exit non-zero; the next start resumes.

A run is a :class:`Trainer` whose stages read top to bottom in :meth:`Trainer.stages`: setup,
resume (checked before anything is written), claim, start, the step loop, final evaluation.
One process at a time holds a run directory (:class:`RunLock`).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from posbench.checkpoint import load_latest_checkpoint, load_model_weights, rng_state, save_checkpoint, set_rng_state, list_checkpoints
from posbench.config import check_top_level_keys
from posbench.distributed import DistInfo, any_rank, barrier, init_distributed, mean_across_ranks, shutdown
from posbench.errors import PosbenchError, one_line
from posbench.hardware import environment_line, run_environment
from posbench.io import write_json_atomic, write_text_atomic
from posbench.methods.base import ParameterDrift
from posbench.model import ModelConfig, Transformer, build_model
from posbench.positions import TrainingPositions, randomize_max_from_config
from posbench.runlog import HydraRecord
from posbench.settings import RESULT_SETTINGS, EvalConfig, TrainerConfig, from_section

logger = logging.getLogger("posbench")
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class TrainingInterrupted(Exception):
    """Raised after a checkpoint was saved because the run was asked to stop (signal / test aid)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class NonFiniteLoss(PosbenchError):
    """The loss became NaN/inf; the run stops with its last good checkpoint kept."""


# ----------------------------------------------------------------------------- configuration


@dataclass
class RunSpec:
    """Everything a run needs, validated before any work starts."""

    trainer: TrainerConfig
    eval: EvalConfig
    model: ModelConfig
    method: str
    method_options: dict[str, Any]
    data: Any  # posbench.data.DataConfig
    seed: int
    run_name: str


def method_from_config(section: Any) -> tuple[str, dict[str, Any]]:
    """``method`` config section -> (name, options)."""
    values = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
    name = values.pop("name", None)
    if not isinstance(name, str):
        raise PosbenchError("method.name is missing; pick a method with method=<name>")
    return name, values


def data_config(section: Any):
    from posbench.data import DataConfig

    return from_section(DataConfig, "data", OmegaConf.to_container(section, resolve=True))


def build_spec(cfg: DictConfig) -> RunSpec:
    """Validate the whole composed config; every user error surfaces here, before any work."""
    from posbench.extension import resolve_extensions
    from posbench.methods import build_method, method_class, ModelDims

    check_top_level_keys(cfg, "train")
    trainer = from_section(TrainerConfig, "trainer", OmegaConf.to_container(cfg.trainer, resolve=True))
    evaluation = from_section(EvalConfig, "eval", OmegaConf.to_container(cfg.eval, resolve=True))
    model_values = OmegaConf.to_container(cfg.model, resolve=True)
    model = from_section(ModelConfig, "model", model_values)
    method, options = method_from_config(cfg.method)
    method_class(method)
    # Build the method once on the meta device: shape problems (odd rope head dim, bad options)
    # are reported now rather than after the data is tokenized.
    try:
        with torch.device("meta"):
            probe = build_method(method, ModelDims(model.d_model, model.n_heads, model.n_layers), **options)
    except ValueError as err:
        raise PosbenchError(f"method={method} cannot run on this model: {err}") from None
    randomize_max_from_config(cfg, method, trainer.context, probe.max_positions)  # randomized positions
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PosbenchError(f"seed must be an integer, got {seed!r}")
    evaluation.check_lengths(trainer.context, need_headline=True)
    evaluation.check_probe(trainer.context)
    # Refused (or skipped with a line) now, not after training.
    evaluation.extension = resolve_extensions(evaluation.extension, method, log=logger.info)
    longest = max(max(evaluation.lengths), trainer.context)
    if probe.max_positions is not None and longest > probe.max_positions:
        raise PosbenchError(
            f"method={method} supports positions up to {probe.max_positions} but eval/training "
            f"needs {longest}; raise method.max_positions to at least {longest}"
        )
    return RunSpec(trainer, evaluation, model, method, options, data_config(cfg.data).check_path_is_read(), seed,
                   str(cfg.get("run_name", f"{method}-s{seed}")))


def resolve_device(name: str, dist_info: DistInfo | None = None) -> torch.device:
    """``auto`` -> cuda when available. With several GPUs, torchrun ranks use their local rank,
    and the jobs of a local sweep (joblib launcher) spread over the GPUs by job number."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda" and torch.cuda.device_count() > 1 and not (dist_info and dist_info.enabled):
            return torch.device("cuda", sweep_job_number() % torch.cuda.device_count())
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise PosbenchError(f"trainer.device={name} but CUDA is not available; use trainer.device=cpu")
        if dist_info is not None and dist_info.enabled:
            return torch.device("cuda", dist_info.local_rank)
    return torch.device(name)


def wandb_group(experiment: str) -> str:
    """Runs of one sweep share a W&B group (experiment + sweep folder); single runs group by
    experiment."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return f"{experiment}/{Path(hydra_cfg.sweep.dir).name}"
    except ValueError:
        pass
    return experiment


def sweep_job_number() -> int:
    """This job's number in a Hydra multirun (0 outside one)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return int(HydraConfig.get().job.num or 0)
    except (ValueError, ImportError, TypeError):
        return 0


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``trainer.precision`` on ``device`` (None: plain fp32).

    ``auto`` is bf16 on CUDA and on CPUs with native bf16 arithmetic (x86 AVX512-BF16 or AMX,
    Arm BF16), where bf16 autocast trains ~1.6x faster; fp32 on other CPUs, which would only
    emulate bf16. Master weights, the eval head and the loss stay fp32 either way.
    """
    from posbench.hardware import cpu_has_native_bf16

    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and (device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())):
        return torch.bfloat16
    return None


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup then cosine decay to ``min_ratio`` of the peak, as a multiplier of lr."""
    warmup = min(warmup_steps, max(1, total_steps // 10))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_optimizer(model: torch.nn.Module, t: TrainerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight matrices decay, norms and position-method tables do not.

    Position tables are excluded so that rows training never reaches (learned positions past the
    training context) stay exactly at their initialisation, as the method's definition says;
    decoupled decay would otherwise shrink them every step.
    """
    position = {id(p) for p in getattr(model, "position", torch.nn.Module()).parameters()}
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    decay = [p for p in params if p.dim() >= 2 and id(p) not in position]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in position]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=device.type == "cuda")


# ----------------------------------------------------------------------------- the loop


class StopRequest:
    """Turns preemption signals into a flag the loop checks at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
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


def same_on_all_ranks(path: Path, info: DistInfo) -> Path:
    """Rank 0's run directory for every rank: ranks started in different seconds would
    otherwise resolve Hydra's timestamped directory differently."""
    if not info.enabled:
        return path
    import torch.distributed as dist

    box = [str(path)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run_target(t: TrainerConfig, run_dir: Path) -> Path:
    """The directory the run writes to: ``trainer.resume=<run dir>`` names another one."""
    if str(t.resume).lower() in ("auto", "true", "false", "none", "null"):
        return run_dir
    return Path(str(t.resume)).expanduser()


def resolve_run_dir(t: TrainerConfig, run_dir: Path) -> bool:
    """Whether the run continues from a checkpoint in ``run_dir`` (its :func:`run_target`)."""
    resume = str(t.resume).lower()
    if resume in ("auto", "true"):
        return bool(list_checkpoints(run_dir))
    if resume in ("false", "none", "null"):
        if list_checkpoints(run_dir):
            raise PosbenchError(
                f"{run_dir} already has checkpoints; continue it with trainer.resume=auto "
                "or choose a fresh hydra.run.dir"
            )
        return False
    if not list_checkpoints(run_dir):
        raise PosbenchError(f"trainer.resume={t.resume}: no checkpoints in that directory; pass a run directory")
    return True


class RunLocked(PosbenchError):
    """Another process holds the run directory."""


class RunLock:
    """Exclusive lock on a run directory, so two trainings never write into one.

    filelock's lock is an flock(2) on ``.posbench.lock``: the kernel drops it when the holder
    exits in any way (kill -9 included), so a stale lock can never block. The holder's PID goes
    to a file of its own (the lock file is truncated by every process that tries to lock it).
    """

    LOCK_FILE, OWNER_FILE = ".posbench.lock", ".posbench.pid"

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.run_dir, self.enabled, self.lock = Path(run_dir), enabled, None

    def __enter__(self) -> "RunLock":
        if not self.enabled or self.lock is not None:  # already held: ``with`` on a taken lock
            return self
        from filelock import FileLock, Timeout

        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.run_dir / self.LOCK_FILE))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            try:
                holder = (self.run_dir / self.OWNER_FILE).read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise RunLocked(
                f"{self.run_dir} is in use by another posbench process (PID {holder}); wait for it to end "
                "or stop it, or choose another hydra.run.dir"
            ) from None
        self.lock = lock
        write_text_atomic(self.run_dir / self.OWNER_FILE, f"{os.getpid()}\n")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.lock is not None:
            (self.run_dir / self.OWNER_FILE).unlink(missing_ok=True)
            self.lock.release()
            self.lock = None


def remove_stray_temp_files(run_dir: Path, log: Callable[[str], None]) -> None:
    """Delete ``.tmp-*`` files a kill left mid-write (atomic writes, checkpoints included).
    Called under the run's lock, so none of them can belong to a live writer."""
    from posbench.checkpoint import checkpoint_dir

    stray = [p for folder in (run_dir, checkpoint_dir(run_dir)) if folder.is_dir()
             for p in folder.glob(".tmp-*") if p.is_file()]
    for path in stray:
        path.unlink(missing_ok=True)
    if stray:
        log(f"removed {len(stray)} unfinished temporary file(s) left by an interrupted write in {run_dir}")


def record_failure(run_dir: Path, cfg: DictConfig, err: BaseException, claimed: bool) -> None:
    """Record a failed job without destroying an earlier run's record.

    A run this process claimed, or a directory with no record yet, gets status "failed". A
    refused start next to an earlier run's record (a resume under another config, ...) leaves
    that record alone and writes refused.json, which the sweep summary counts as a failure.
    Best effort: on a full disk the one-line error matters more than the record.
    """
    from posbench.results import REFUSED_FILE, write_status

    if isinstance(err, RunLocked) or not run_dir.is_dir():
        return
    method = cfg.get("method", {}).get("name") if isinstance(cfg.get("method"), DictConfig) else None
    earlier_record = any((run_dir / name).exists() for name in ("status.json", "results.json")) or bool(
        list_checkpoints(run_dir))
    try:
        if claimed or not earlier_record:
            write_status(run_dir, "failed", method=method, seed=cfg.get("seed"), error=one_line(err))
        else:
            write_json_atomic(run_dir / REFUSED_FILE, {
                "error": one_line(err), "method": method, "seed": cfg.get("seed"),
                "updated": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    except OSError:
        pass


def as_posbench_error(err: BaseException) -> BaseException:
    """Out-of-memory and full-disk errors as one line naming the fix; others unchanged."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return PosbenchError(
            f"out of memory ({one_line(err)[:160]}); lower trainer.micro_batch_size (gradient accumulation "
            "keeps the batch), eval.batch_size, trainer.context or the model size"
        )
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return PosbenchError(
            f"no space left on the device writing {err.filename or 'the run'}; free some space, or point "
            "hydra.run.dir / POSBENCH_CACHE at a disk with room, then rerun the same command to resume"
        )
    if isinstance(err, RuntimeError) and "file write failed" in str(err):  # torch.save on a full disk
        return PosbenchError(
            f"writing a checkpoint failed ({one_line(err)[:160]}); check the free space of hydra.run.dir, "
            "then rerun the same command to resume"
        )
    return err


def check_memory_fits(spec: RunSpec, micro_batch: int, device: torch.device) -> None:
    """Refuse a model or batch that cannot fit the device, before anything is allocated.

    A lower bound, so only the impossible is refused: fp32 weights, gradients and the two AdamW
    moments (16 bytes per parameter), plus per micro-batch token the residual-stream and MLP
    activations kept for the backward pass and the fp32 logits, at training or evaluation size.
    """
    m, t, e = spec.model, spec.trainer, spec.eval
    d, ffn, vocab = m.d_model, m.hidden_size, m.vocab_size
    parameters = m.n_layers * (4 * d * d + 3 * d * ffn) + vocab * d * (1 if m.tie_embeddings else 2)
    training_tokens = micro_batch * t.context
    activations = 4 * (training_tokens * m.n_layers * (6 * d + 3 * ffn) + 2 * training_tokens * vocab)
    evaluation = 4 * e.batch_size * max(e.lengths) * (2 * d + ffn)  # no grad: one layer's worth at a time
    needed = 16 * parameters + max(activations, evaluation)
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[1]
    else:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > available:
        gib = 2 ** 30
        raise PosbenchError(
            f"this run needs at least {needed / gib:,.1f} GiB ({16 * parameters / gib:,.1f} GiB for "
            f"{parameters:,} parameters with AdamW, {activations / gib:,.1f} GiB of activations per micro-batch) "
            f"but the {device.type} has {available / gib:,.1f} GiB; lower model.n_layers / model.d_model, "
            "or trainer.micro_batch_size (gradient accumulation keeps trainer.batch_size)"
        )


def data_identity(prepared: Any) -> dict[str, str]:
    """What the tokens are: tokenizer file and token streams by checksum (not by path/mtime)."""
    from posbench.data.tokenizer import TOKENIZER_FILE, file_sha256

    splits = prepared.meta.get("splits", {})
    return {"tokenizer_sha256": file_sha256(prepared.dir / TOKENIZER_FILE),
            **{f"{split}_sha256": str(info.get("sha256")) for split, info in splits.items()}}


def validation_sets(prepared: Any, model: Transformer, t: TrainerConfig,
                    log: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """Fixed validation windows, by metrics.jsonl key: ``val_loss`` (``trainer.val_sequences``
    windows of the training context C) and ``val_loss_<C>_<2C>`` (the C-2C band of
    ``trainer.val_extrapolation_sequences`` windows of 2C: extrapolation during training).

    Each is a seeded subset spread over the whole validation text (``spread_sequences``): the
    same windows for every method and seed of a data setting, an estimate of the full set's
    mean (not the first windows, which read easier). The final evaluation uses its own windows."""
    from posbench.data.loader import spread_sequences

    valid, context = prepared.valid_tokens(), t.context
    sets = {"val_loss": spread_sequences(valid, context, t.val_sequences)}
    key = f"val_loss_{context}_{2 * context}"
    limit = model.position.max_positions
    if t.val_extrapolation_sequences and limit is not None and 2 * context > limit:
        log(f"note: no {key} during training: the method's positions stop at {limit} "
            f"(raise method.max_positions to {2 * context})")
    elif t.val_extrapolation_sequences:
        try:
            sets[key] = spread_sequences(valid, 2 * context, t.val_extrapolation_sequences)
        except PosbenchError as err:
            log(f"note: no {key} during training: {err}")
    return sets


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
            record_unstarted_failure(Path(run_dir), cfg, failure, hydra_record)
        raise failure from (None if failure is err else err)
    return run.run()


def record_unstarted_failure(run_dir: Path, cfg: DictConfig, err: BaseException,
                             hydra_record: HydraRecord | None) -> None:
    """:func:`record_failure` for a start that failed before taking the lock: nothing is
    written into a run directory another process holds."""
    if not run_dir.is_dir():
        return
    try:
        with RunLock(run_dir):
            record_failure(run_dir, cfg, err, claimed=False)
            if hydra_record is not None:
                hydra_record.write(cfg)
    except RunLocked:
        if hydra_record is not None:
            hydra_record.discard()
    except OSError:
        pass  # best effort, as record_failure: the one-line error matters more


class Trainer:
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
        self.spec = build_spec(cfg)
        self.t = self.spec.trainer
        self.device, self.dist_info = self._setup_device()
        self.is_main = self.dist_info.is_main
        self.run_dir = run_target(self.t, same_on_all_ranks(Path(run_dir), self.dist_info))
        self.claimed = False  # this process wrote config.yaml / status "running" (the record is ours)

    def run(self) -> dict[str, Any]:
        """:meth:`stages` under the run directory's lock; a failure is recorded in status.json
        (or refused.json while the record is still the earlier run's) as one line."""
        try:
            lock = RunLock(self.run_dir, enabled=self.is_main).__enter__()
        except RunLocked:
            if self.hydra_record is not None:
                self.hydra_record.discard()  # nothing of a refused start lands in the run
            raise
        with lock:
            try:
                if self.hydra_record is not None:  # the run is this process's: Hydra's record and log
                    self.hydra_record.write(self.cfg, is_main=self.is_main)
                return self.stages()
            except TrainingInterrupted:
                raise
            except BaseException as err:
                failure = as_posbench_error(err)
                if self.is_main and (self.claimed or not self.evaluate_only):  # eval refusals record nothing
                    record_failure(self.run_dir, self.cfg, failure, claimed=self.claimed)
                raise failure from (None if failure is err else err)

    def stages(self) -> dict[str, Any]:
        """The run, top to bottom."""
        self.setup()  # resume policy, stray temp files, data, memory check, model, optimizer
        finished = self.resume()  # continue from the newest good checkpoint; refuse a mismatch
        if finished is not None:
            return finished
        self.claim()  # only now config.yaml and status "running" replace the earlier record
        self.start()  # DDP / compile wrapping, validation sets, metrics logger
        self.fit()  # the step loop, with periodic validation and checkpoints
        return self.final_evaluation()  # final validation, evaluation, results.json, figures

    def setup(self) -> None:
        from posbench.data import prepare_data
        from posbench.data.loader import TrainBatches

        spec, t = self.spec, self.t
        self.resuming = resolve_run_dir(t, self.run_dir)
        if self.is_main:
            remove_stray_temp_files(self.run_dir, self.log)
        seed_everything(spec.seed)
        self.prepared = prepare_data(spec.data, log=self.log)
        spec.model.vocab_size = self.prepared.vocab_size
        self.micro, self.accum = micro_batching(t, self.dist_info.world_size)
        check_memory_fits(spec, self.micro, self.device)
        self.raw_model = build_model(spec.model, spec.method, spec.method_options).to(self.device)
        self.position_drift = ParameterDrift(self.raw_model.position)  # p_0: the seed's init, also on resume
        self.train_positions = TrainingPositions(self.cfg, spec.method, t.context, self.raw_model.position.max_positions,
                                                 spec.seed, self.dist_info.rank, self.device)  # randomized (or arange)
        self.optimizer = make_optimizer(self.raw_model, t, self.device)
        # One pinned host buffer per step, copied without blocking (no per-token Python work).
        self.batches = TrainBatches(self.prepared.train_tokens(), t.context, t.batch_size, spec.seed,
                                    rank=self.dist_info.rank, world_size=self.dist_info.world_size,
                                    device=self.device, pin_memory=self.device.type == "cuda")
        self.tokens_per_step = t.batch_size * t.context
        self.total_steps = total_steps(t, self.tokens_per_step, self.batches.steps_per_epoch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.total_steps, t.warmup_steps, t.min_lr_ratio)
        )
        # Where the run stands; resume() moves these to the checkpoint's values.
        self.start_step, self.elapsed_before, self.overhead_before = 0, 0.0, 0.0
        self.loss_value = float("nan")  # the last logged training loss
        self.resumed_from: Path | None = None
        self.last_good: Path | None = None  # newest checkpoint known to hold finite weights

    def _setup_device(self) -> tuple[torch.device, DistInfo]:
        t = self.t
        device = resolve_device(t.device)
        dist_info = init_distributed(device.type)
        device = resolve_device(t.device, dist_info)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            if t.precision != "fp32":  # fp32 means fp32: no TF32 matmuls then
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
        elif dist_info.is_main and self.cfg.model.get("flavour") not in ("tiny", "mini") and t.max_steps is None:
            self.log("warning: training on the CPU; the full setup takes very long there. "
                     "For a quick CPU run use experiment=cpu_quick")
        return device, dist_info

    # ------------------------------------------------------------------ resume

    def resume(self) -> dict[str, Any] | None:
        """Load the newest good checkpoint (when resuming), after checking it belongs to this
        config. Returns the stored results when the run is already complete, else None."""
        from posbench.results import REFUSED_FILE, read_results_or_quarantine

        if self.resuming:
            state = load_resume_state(self.run_dir, self.dist_info, self.log)
            if state is None:
                self.log(f"no usable checkpoint in {self.run_dir}; starting from scratch")
            else:
                check_resumable(state, self.spec, self.total_steps, self.run_dir, data_identity(self.prepared),
                                self.train_positions.randomize_max)
                load_model_weights(self.raw_model, state, self.run_dir)
                self.optimizer.load_state_dict(state["optimizer"])
                self.scheduler.load_state_dict(state["scheduler"])
                set_rng_state(state["rng"])
                self.start_step, self.elapsed_before = state["step"], state.get("elapsed_seconds", 0.0)
                self.overhead_before = state.get("overhead_seconds", 0.0)
                self.loss_value = state.get("last_loss", float("nan"))
                self.resumed_from = Path(state["path"])
                if self.start_step >= self.total_steps and already_complete(self.run_dir):
                    results = read_results_or_quarantine(self.run_dir, self.log) if self.is_main else {}
                    if results is not None:
                        self.log(f"{self.run_dir} is already complete; nothing to do (its results.json is unchanged)")
                        if self.is_main:  # this start succeeded: an earlier refusal is over
                            (self.run_dir / REFUSED_FILE).unlink(missing_ok=True)
                        shutdown(self.dist_info)
                        return results
                self.log(f"resuming {self.run_dir} from step {self.start_step} ({state['path']})")
        if self.evaluate_only and self.start_step < self.total_steps:
            raise PosbenchError(
                f"{self.run_dir} stopped at step {self.start_step} of {self.total_steps}; finish training it first: "
                f"posbench train <its overrides> trainer.resume={self.run_dir}"
            )
        return None

    def claim(self) -> None:
        """Write this run's config.yaml and status "running" (the checks have all passed)."""
        from posbench.results import REFUSED_FILE, write_status

        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "config.yaml", OmegaConf.to_yaml(self.cfg, resolve=True))
            write_status(self.run_dir, "running", method=self.spec.method, seed=self.spec.seed)
            (self.run_dir / REFUSED_FILE).unlink(missing_ok=True)  # an earlier refusal is over
            truncate_metrics(self.run_dir / "metrics.jsonl", self.start_step, self.log)
        self.claimed = True

    def start(self) -> None:
        """Wrap the model for DDP / torch.compile, pick the validation sets, open the logger."""
        from posbench.loggers import make_logger

        t, spec = self.t, self.spec
        self.model: torch.nn.Module = self.raw_model
        if self.dist_info.enabled:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.raw_model, device_ids=device_ids)
        use_compile = str(t.compile).lower() == "true" or (str(t.compile).lower() == "auto" and self.device.type == "cuda")
        if use_compile:
            self.model = torch.compile(self.model)
        self.amp_dtype = autocast_dtype(t.precision, self.device)
        self.environment = run_environment(t.precision, self.amp_dtype, self.device)  # results.json, W&B
        if self.is_main:
            self.log(environment_line(self.environment))
        self.val_sets = validation_sets(self.prepared, self.raw_model, t, self.log) if self.is_main else {}
        self.run_logger = make_logger(
            self.cfg.logger, run_dir=self.run_dir, run_name=spec.run_name,
            group=wandb_group(str(self.cfg.get("experiment_name", "default"))),
            tags=[spec.method, f"model-{spec.model.flavour}"],
            config={**OmegaConf.to_container(self.cfg, resolve=True), "environment": self.environment},
            rank=self.dist_info.rank, log=self.log,
        )

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext()

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
        self.log(
            f"training {spec.run_name}: method={spec.method} model={spec.model.flavour} "
            f"({self.raw_model.num_parameters(non_embedding=True) / 1e6:.2f} M non-embedding params) on {self.device}, "
            f"{self.total_steps} steps x {self.tokens_per_step} tokens ({self.batches.steps_per_epoch} steps/epoch), "
            f"world size {self.dist_info.world_size}"
        )
        self.progress = make_progress(self.total_steps, self.start_step, enabled=self.is_main and t.progress)
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
        """One optimizer step over the global batch of ``step`` (gradient accumulation over
        micro-batches, all-reduced once); returns the summed loss as a device tensor (no sync)."""
        x, y = self.batches.get(step - 1)  # (B, T) each, already on the device
        loss_sum = torch.zeros((), device=self.device)
        micro, accum = self.micro, self.accum
        for i in range(accum):
            xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
            sync = accum == 1 or i == accum - 1 or not self.dist_info.enabled
            with (nullcontext() if sync else self.model.no_sync()), self.autocast():
                loss = self.model(xs, self.train_positions(step, i, xs.shape[0]), targets=ys) / accum
            loss.backward()
            loss_sum += loss.detach()
        if self.t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_used = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
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
            append_metrics(self.run_dir / "metrics.jsonl", row)
            self.run_logger.log_metrics({f"train/{k}": v for k, v in row.items()}, step=step)
            self.progress.update_to(step, self.loss_value, tps)
            text_every = max(self.t.log_every, self.total_steps // 20)
            if not self.progress.enabled and (step % text_every == 0 or step == self.total_steps):
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
        from posbench.evaluate import per_position_loss

        context, tokens = self.t.context, step * self.tokens_per_step
        row: dict[str, Any] = {"step": step, "tokens": tokens}
        logged: dict[str, Any] = {"train/tokens": tokens}
        for name, sequences in self.val_sets.items():
            losses = per_position_loss(self.raw_model, sequences, self.micro, self.device, autocast_dtype=self.amp_dtype)
            # The fp32-head evaluator, so val_loss is comparable with results.json's 0-C band.
            value = float(losses.mean() if name == "val_loss" else losses[context:2 * context].mean())
            row[name] = value
            logged["val/" + name.removeprefix("val_")] = value
        drift = self.position_drift.metrics()  # position/<param>/norm and /move (issue 23)
        row.update(drift)
        logged.update(drift)
        if not validation_logged(self.run_dir, step):  # a run resumed at its final step validates it again
            append_metrics(self.run_dir / "metrics.jsonl", row)
        self.run_logger.log_metrics(logged, step=step)
        logger.info("step %d validation loss %.4f", step, row["val_loss"])
        return row["val_loss"]

    # ------------------------------------------------------------------ checkpoints and stopping

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
        return {
            "step": step, "tokens": step * self.tokens_per_step, "elapsed_seconds": elapsed,
            "overhead_seconds": self.overhead_before + self.overhead,
            "last_loss": self.loss_value,
            "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "rng": rng_state(),
            "config": OmegaConf.to_container(self.cfg, resolve=True), "method": spec.method,
            "method_options": spec.method_options, "model_config": spec.model.to_dict(),
            "data_dir": str(self.prepared.dir), "data_identity": data_identity(self.prepared),
        }

    def stop(self, step: int, stop: StopRequest) -> None:
        """After the stop checkpoint: record "interrupted", hand SIGUSR1 on, raise."""
        from posbench.results import write_status

        signum = stop.signum or signal.SIGTERM
        if stop.signum is not None:
            self.log(f"received {signal.Signals(signum).name}: checkpoint saved at step {step}")
        if self.is_main:
            write_status(self.run_dir, "interrupted", method=self.spec.method, seed=self.spec.seed,
                         error=f"stopped at step {step}", step=step)
            stop.hand_over()
        raise TrainingInterrupted(
            f"stopped at step {step}/{self.total_steps}; checkpoint saved in {self.run_dir / 'checkpoints'}; "
            f"continue with the same command plus trainer.resume={self.run_dir}",
            exit_code=128 + int(signum),
        )

    # ------------------------------------------------------------------ final evaluation

    def final_evaluation(self) -> dict[str, Any]:
        """Rank 0: final validation, evaluation at eval.lengths, results.json, figures, status."""
        from posbench.results import versions, write_results, write_status

        t, spec, run_dir = self.t, self.spec, self.run_dir
        results: dict[str, Any] = {}
        if self.is_main:
            raw_model, tokens_per_step = self.raw_model, self.tokens_per_step
            val_loss = self.validate(self.total_steps)
            results = evaluate_run(raw_model, self.prepared, spec, self.device, self.amp_dtype, self.log)
            train_tokens = self.total_steps * tokens_per_step
            results["train"] = {
                "tokens": train_tokens, "steps": self.total_steps, "final_loss": self.loss_value,
                "final_val_loss": val_loss,
                "epochs": train_tokens / max(1, self.batches.steps_per_epoch * tokens_per_step),
                # Over the whole run (all resumed segments): training tokens / training time, where
                # training time is wall time less periodic validation and checkpoint writing.
                "tokens_per_second": train_tokens / max(self.wall - self.overhead_total, 1e-9),
                "wall_seconds": self.wall, "overhead_seconds": self.overhead_total, "device": self.device.type,
                "world_size": self.dist_info.world_size, "resumed_from_step": self.start_step or None,
                # The in-training validation subsets (metrics.jsonl keys -> windows; see validation_sets).
                "validation_windows": {name: int(rows.shape[0]) for name, rows in self.val_sets.items()},
            }
            results["run_name"] = spec.run_name
            results["method"] = self.train_positions.label  # rope+rand2048 stays apart from rope in tables
            results["model"] = {**spec.model.to_dict(), "parameters": raw_model.num_parameters(),
                                "non_embedding_parameters": raw_model.num_parameters(non_embedding=True)}
            results["method_options"] = spec.method_options
            results["data"] = {"dir": str(self.prepared.dir), "meta": self.prepared.meta}
            results["versions"] = versions()
            results["environment"] = self.environment
            from filelock import FileLock

            from posbench.runs import RESULTS_LOCK

            with FileLock(str(run_dir / RESULTS_LOCK)):  # never between a posbench eval's read and write
                write_results(run_dir, results)
            figures = write_run_figures(run_dir, self.log)
            self.run_logger.log_eval(results["eval"], t.context)
            from posbench.probes import probe_summary

            self.run_logger.summary({"train/final_loss": self.loss_value,
                                     "train/tokens_per_second": results["train"]["tokens_per_second"],
                                     **probe_summary(results.get("probes", []))})
            self.run_logger.log_figures(figures)
            write_status(run_dir, "completed", method=spec.method, seed=spec.seed)
            band = f"{t.context}-{2 * t.context}"
            self.log(f"done: {run_dir / 'results.json'}; {band} loss {headline(results, band):.4f}")
        self.run_logger.finish(exit_code=0)
        # Other ranks wait here while rank 0 evaluates: tearing the process group down on some ranks
        # while another still runs left a rank hanging at exit (seen intermittently with gloo).
        barrier(self.dist_info)
        shutdown(self.dist_info)
        return results


def finish_run(run_dir: Path, config: DictConfig, log: Callable[[str], None], device: str = "auto",
               evaluation: Any = None) -> dict[str, Any]:
    """``posbench eval`` of a run whose newest checkpoint is at its final step but which has no
    (valid) results.json (stopped during its final evaluation, or its results were damaged):
    the run's own final evaluation, at ``evaluation`` (an eval section) when given. Refuses
    (PosbenchError) while the run still has steps to train."""
    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    cfg.trainer.resume, cfg.trainer.progress, cfg.trainer.device = str(run_dir), False, device
    if evaluation is not None:
        cfg.eval = OmegaConf.create(OmegaConf.to_container(evaluation, resolve=True))
    return train(cfg, run_dir, log, evaluate_only=True)


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def micro_batching(t: TrainerConfig, world_size: int) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) of each process."""
    per_process = t.batch_size // world_size
    if per_process * world_size != t.batch_size:
        raise PosbenchError(f"trainer.batch_size={t.batch_size} is not divisible by the {world_size} processes")
    micro = t.micro_batch_size or per_process
    if per_process % micro:
        raise PosbenchError(f"trainer.micro_batch_size={micro} must divide the per-process batch {per_process}")
    return micro, per_process // micro


def total_steps(t: TrainerConfig, tokens_per_step: int, steps_per_epoch: int) -> int:
    """trainer.max_steps, else max_tokens, else epochs, as a number of optimizer steps."""
    if t.max_steps is not None:
        return t.max_steps
    if t.max_tokens is not None:
        return max(1, math.ceil(t.max_tokens / tokens_per_step))
    return max(1, round(t.epochs * steps_per_epoch))


# ----------------------------------------------------------------------------- helpers


def evaluate_run(model: Transformer, prepared: Any, spec: RunSpec, device: torch.device,
                 amp_dtype: torch.dtype | None, log: Callable[[str], None]) -> dict[str, Any]:
    from posbench.evaluate import evaluate_model
    from posbench.results import SCHEMA_VERSION

    e = spec.eval
    tokens = prepared.tokens(e.split)
    entries = evaluate_model(model, tokens, e.lengths, e.num_sequences, e.batch_size, spec.trainer.context,
                             device, split=e.split, log=log, autocast_dtype=amp_dtype,
                             window_stride=e.window_stride, effective_length_eps=e.effective_length_eps,
                             extensions=e.extension, extension_factor=e.extension_factor)
    results = {"schema_version": SCHEMA_VERSION, "method": spec.method, "seed": spec.seed,
               "train_context": spec.trainer.context, "eval": entries,
               "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    from posbench.probes import run_probes

    probes = run_probes(model, prepared, e, spec.trainer.context, device, amp_dtype, log)  # eval.probes
    if probes:
        results["probes"] = probes
    return results


def load_resume_state(run_dir: Path, info: DistInfo, log: Callable[[str], None]) -> dict[str, Any] | None:
    """Rank 0 picks the checkpoint (skipping damaged ones); every rank loads that same file.

    Loaded to the CPU: RNG states must be CPU tensors, and load_state_dict moves the rest.
    """
    from posbench.checkpoint import read_checkpoint

    state = load_latest_checkpoint(run_dir, log=log, map_location="cpu") if info.is_main else None
    if not info.enabled:
        return state
    import torch.distributed as dist

    box = [state["path"] if state else None]
    dist.broadcast_object_list(box, src=0)
    if info.is_main or box[0] is None:
        return state
    return read_checkpoint(Path(box[0])) | {"path": box[0]}


def check_resumable(state: dict[str, Any], spec: RunSpec, total_steps: int, run_dir: Path,
                    identity: dict[str, str], randomize_max: int | None = None) -> None:
    """Refuse to continue a checkpoint under settings that would change what it means: method,
    seed, the whole model, the method options, the data (by checksum) and the result-changing
    trainer settings. One line lists every difference."""
    saved = state.get("config", {})
    theirs: dict[str, Any] = {"method": state.get("method"), "seed": saved.get("seed")}
    ours: dict[str, Any] = {"method": spec.method, "seed": spec.seed}
    for name in RESULT_SETTINGS:
        theirs[f"trainer.{name}"] = saved.get("trainer", {}).get(name)
        ours[f"trainer.{name}"] = getattr(spec.trainer, name)
    model = {k: v for k, v in spec.model.to_dict().items() if k not in ("attention", "flavour")}  # not results
    for name, value in model.items():
        theirs[f"model.{name}"], ours[f"model.{name}"] = state.get("model_config", {}).get(name), value
    saved_options = state.get("method_options", {})
    for name in sorted(set(saved_options) | set(spec.method_options)):
        theirs[f"method.{name}"] = saved_options.get(name, "<unset>")
        ours[f"method.{name}"] = spec.method_options.get(name, "<unset>")
    # Randomized positions change every training batch: "off" on both sides for runs without them.
    theirs["positions.randomize_max"] = (saved.get("positions") or {}).get("randomize_max") or "off"
    ours["positions.randomize_max"] = randomize_max or "off"
    for name, value in identity.items():  # checkpoints from before data_identity have none
        theirs[f"data.{name}"], ours[f"data.{name}"] = state.get("data_identity", {}).get(name), value
    differences = [f"{key}={value}, not {key}={ours[key]}" for key, value in theirs.items()
                   if value is not None and value != ours[key]]
    if differences:
        raise PosbenchError(
            f"{run_dir} holds a run with {'; '.join(differences)} (method={state.get('method')}); "
            "resume it with the same config or choose a fresh hydra.run.dir"
        )
    if state["step"] > total_steps:
        raise PosbenchError(
            f"the checkpoint in {run_dir} is at step {state['step']}, past this run's {total_steps} steps; "
            "raise trainer.max_steps or choose a fresh hydra.run.dir"
        )


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def validation_logged(run_dir: Path, step: int) -> bool:
    """Whether ``metrics.jsonl`` already holds the validation row of ``step``."""
    from posbench.results import read_metrics

    return any(r.get("step") == step and "val_loss" in r for r in read_metrics(run_dir))


def truncate_metrics(path: Path, step: int, log: Callable[[str], None]) -> None:
    """Drop metrics logged after ``step`` (a resumed run logs them again). A damaged file (a
    line that is not a JSON object, other than a last line cut by a kill) is quarantined and
    its good lines kept."""
    from posbench.results import quarantine

    if not path.exists():
        return
    lines = path.read_text(errors="replace").splitlines()
    keep, damaged = [], 0
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step", 0), (int, float)):
            cut_by_a_kill = number == len(lines) and row is None  # expected, not damage
            damaged += not cut_by_a_kill
            continue
        if row.get("step", 0) <= step:
            keep.append(line)
    if damaged:
        quarantine(path, f"has {damaged} damaged line(s)", log, copy=True)
    write_text_atomic(path, "".join(f"{line}\n" for line in keep))


def write_run_figures(run_dir: Path, log: Callable[[str], None]) -> list[Path]:
    from posbench.plot import plot_single_run

    try:
        written = plot_single_run(run_dir)
        return [Path(p) for p in (written or [])]
    except Exception as err:  # figures must never cost a finished run its results
        log(f"warning: could not draw the run's figures: {one_line(err)}")
        return []


def headline(results: dict[str, Any], band: str = "256-512") -> float:
    from posbench.results import headline_entries

    for entry in headline_entries(results.get("eval", [])):
        if band in entry.get("bands", {}):
            return float(entry["bands"][band])
    return float("nan")


def already_complete(run_dir: Path) -> bool:
    from posbench.results import read_status

    status = read_status(run_dir) or {}
    return status.get("status") == "completed" and (run_dir / "results.json").is_file()


class make_progress:
    """A tqdm bar (terminal only) showing loss, tokens/s and ETA; silent otherwise."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty() and os.environ.get("CI") is None
        self.bar = None
        if self.enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update_to(self, step: int, loss: float, tokens_per_second: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_second:,.0f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
