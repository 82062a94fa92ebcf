"""The trainer's settings (``trainer.*``): typed, documented, validated.

Built from the ``trainer`` config section by :func:`posbench.config.settings.from_section`; the
defaults here are the only ones (``configs/trainer/default.yaml`` composes them), and
docs/configuration.md's trainer table is generated from the fields and their docstrings
(``scripts/config_reference.py``). Layer 1 like ``posbench.config``: the run spec (``posbench.runs``)
builds it, so it imports only ``core`` and ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass

from posbench.config.settings import require_positive
from posbench.core.errors import PosbenchError

# Trainer settings that change what a run computes (the step count may grow on resume): a resume
# must keep them, and runs that differ in them are never pooled as seeds.
RESULT_SETTINGS = ("context", "batch_size", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
                   "beta1", "beta2", "grad_clip", "precision")


STATE_PASSING = ("off", "carry", "noise")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs


@dataclass(frozen=True)
class TrainerConfig:
    """How a model is trained. Defaults reproduce the seed article's setup."""

    context: int = 256
    """Training context length (tokens per sequence)."""
    batch_size: int = 64
    """Global batch in sequences per optimizer step, summed over all processes."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward per process; None = batch_size / world size (no
    gradient accumulation). Must divide batch_size / world size."""
    epochs: float = 1.0
    """Passes over the training tokens; ignored when max_steps or max_tokens is set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs)."""
    max_tokens: int | None = None
    """Stop after this many training tokens (overrides epochs; max_steps wins if both set)."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 200
    """Linear warmup steps (capped at a tenth of the run for very short runs)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables."""
    precision: str = "auto"
    """auto | fp32 | bf16. auto = bf16 autocast (fp32 master weights, fp32 loss) on CUDA and on
    CPUs with native bf16 (AVX512-BF16 / AMX / Arm BF16), fp32 on other CPUs."""
    compile: str = "auto"
    """auto | true | false: torch.compile the model. auto = on for CUDA, off on CPU."""
    compile_mode: str = "default"
    """How a compiled model is compiled: default (``torch.compile(model)``) | reduce-overhead
    (CUDA graphs, CUDA only) | max-autotune-no-cudagraphs | max-autotune (CUDA graphs, CUDA only).
    A CUDA-graph mode off CUDA is refused unless trainer.compile=false; a mode left unused (no
    compile) is logged.
    Which are bitwise equal to default: docs/benchmarks.md#faster-paths-and-scriptsspeedpy."""
    compile_cache: str | None = None
    """A folder for torch.compile's caches (Inductor's compiled graphs and kernels, Triton's
    kernels) kept across processes: a sweep's jobs of one shape compile once. None = torch's own
    (a per-user temporary folder, lost with the machine). ``~`` is expanded."""
    loss_chunk: int | None = None
    """Tokens per chunk of a fused LM head + cross-entropy that never holds the whole (tokens,
    vocab) logits (its backward recomputes them chunk by chunk); None = the plain head and
    ``F.cross_entropy``. Equal to rounding, not bitwise (docs/benchmarks.md)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N. auto = cuda when available."""
    log_every: int = 10
    """Write a metrics.jsonl line (and check the loss is finite) every N steps."""
    val_every: int = 250
    """Validation loss at the training context every N steps (0 = only at the end)."""
    val_sequences: int = 64
    """Validation sequences (of context length) for the periodic validation loss: a seeded subset
    spread over the whole validation text (one window drawn from each of N equal stretches; the
    same windows for every method and seed), not its first N."""
    val_extrapolation_sequences: int = 8
    """Validation windows of 2 x context whose context-2xcontext band is also scored at every
    validation (metrics.jsonl ``val_loss_<C>_<2C>``, W&B ``val/loss_<C>_<2C>``): extrapolation
    during training; a spread subset as for val_sequences (``results.json`` ``train.validation_windows``
    records the counts). 0 disables it. A subset estimates the final evaluation's band only to
    within its sampling error (one standard error for 8 windows of 512 on the sample: about 0.16
    nats, from the 0.44 per-window spread)."""
    checkpoint_every_steps: int = 1000
    """Save a checkpoint every N steps (0 = only by time, signal and at the end)."""
    checkpoint_every_minutes: float = 30
    """Also save when this many minutes passed since the last checkpoint (0 = off)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep (oldest deleted first)."""
    resume: str = "auto"
    """auto: continue from the latest checkpoint in the run directory if there is one;
    false: never (refuses to overwrite a run directory that has checkpoints);
    <run dir>: continue that run, in that directory."""
    stop_after_steps: int | None = None
    """Testing aid: behave as if preempted (checkpoint, exit non-zero) after this global step."""
    progress: bool = True
    """Show a progress bar (on a terminal) with loss, tokens/s and ETA."""
    progress_every_seconds: float = 30
    """Off a terminal (a log file, a batch job): a line ``step N/M (P%) loss L at step K T tok/s
    S steps/s ETA hh:mm:ss`` every this many seconds and at the last step, with the loss and
    tokens/s of the last logged step K (``-`` before the first one); 0 = a line every 5 % of the
    steps instead."""

    state_passing: str = "off"
    """What each training window of a recurrent model (``model.mixer``, docs/mixers.md) starts
    from: off (the zero state) | carry (the final state of the previous window of the same stream:
    the batch becomes ``batch_size`` contiguous streams of the training text, row i of a step
    continuing row i of the step before; Buitrago & Gu 2025) | noise (Gaussian noise of std
    ``state_noise`` in every recurrent state, shuffled windows as usual)."""
    state_noise: float = 1.0
    """Standard deviation of the noise of ``state_passing=noise``."""

    def validate(self) -> None:
        s = "trainer"
        require_positive(s, context=self.context, batch_size=self.batch_size, lr=self.lr,
                         micro_batch_size=self.micro_batch_size, max_steps=self.max_steps,
                         max_tokens=self.max_tokens, log_every=self.log_every,
                         val_sequences=self.val_sequences, keep_checkpoints=self.keep_checkpoints,
                         loss_chunk=self.loss_chunk)
        if not self.epochs > 0:
            raise PosbenchError(f"trainer.epochs must be positive, got {self.epochs}")
        for name in ("warmup_steps", "val_every", "val_extrapolation_sequences", "checkpoint_every_steps", "grad_clip",
                     "weight_decay", "checkpoint_every_minutes", "progress_every_seconds"):
            if getattr(self, name) < 0:
                raise PosbenchError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise PosbenchError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise PosbenchError("trainer.beta1 and trainer.beta2 must be in [0, 1)")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise PosbenchError(f"trainer.precision must be auto, fp32 or bf16, got {self.precision!r}")
        if str(self.compile).lower() not in ("auto", "true", "false"):
            raise PosbenchError(f"trainer.compile must be auto, true or false, got {self.compile!r}")
        if self.state_passing not in STATE_PASSING:
            raise PosbenchError(f"trainer.state_passing must be one of {', '.join(STATE_PASSING)}, "
                                f"got {self.state_passing!r}")
        if not self.state_noise >= 0:
            raise PosbenchError(f"trainer.state_noise must be >= 0, got {self.state_noise}")
        if self.compile_mode not in COMPILE_MODES:
            raise PosbenchError(f"trainer.compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
