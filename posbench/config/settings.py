"""Typed, validated settings for the trainer and the evaluator.

Hydra composes plain YAML; these dataclasses are where every field is documented, typed and
checked, so a bad value (``trainer.lr=-1``, ``trainer.context=abc``) is refused before any work
with a message naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from posbench.core.errors import PosbenchError

T = TypeVar("T")


def from_section(cls: type[T], section: str, values: dict[str, Any] | None) -> T:
    """Build dataclass ``cls`` from a config section, with one-line errors for bad keys/types."""
    values = dict(values or {})
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise PosbenchError(
            f"unknown option(s) {', '.join(f'{section}.{k}' for k in unknown)}; "
            f"known: {', '.join(known)}"
        )
    for name, value in values.items():
        values[name] = coerce_value(section, name, known[name].type, value)
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if validate:
        validate()
    return obj


def coerce_value(section: str, name: str, annotation: Any, value: Any) -> Any:
    """Check ``value`` against the annotation of option ``section.name`` (a type or its string
    form, e.g. ``"int | None"``); ints are accepted for floats. One-line error when it does not fit."""
    spec = (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))).replace(" ", "")
    optional = "None" in spec.split("|")
    if value is None:
        if optional:
            return None
        raise PosbenchError(f"{section}.{name} cannot be null")
    base = [t for t in spec.split("|") if t != "None"][0]

    def bad(kind: str) -> PosbenchError:
        return PosbenchError(f"{section}.{name} must be {kind}, got {value!r}")

    if base == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
    elif base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
    elif base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        value = float(value)
    elif base == "str":
        if isinstance(value, bool):  # YAML reads `compile: true` / `resume: false` as booleans
            value = str(value).lower()
        if not isinstance(value, str):
            raise bad("a string")
    elif base.startswith("list"):
        if base == "list[str]" and isinstance(value, str):  # eval.extension=all, a single name
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad("a list, e.g. [512,1024]")
        value = list(value)
    return value


def _positive(section: str, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise PosbenchError(f"{section}.{name} must be positive, got {value}")


# Trainer settings that change what a run computes (the step count may grow on resume): a resume
# must keep them, and runs that differ in them are never pooled as seeds.
RESULT_SETTINGS = ("context", "batch_size", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
                   "beta1", "beta2", "grad_clip", "precision")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs


@dataclass
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
    Which are bitwise equal to default: docs/benchmarks.md."""
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
    """Validation sequences (of context length) for the periodic validation loss."""
    val_extrapolation_sequences: int = 8
    """Validation windows of 2 x context whose context-2xcontext band is also scored at every
    validation (metrics.jsonl ``val_loss_<C>_<2C>``, W&B ``val/loss_<C>_<2C>``): extrapolation
    during training. 0 disables it."""
    checkpoint_every_steps: int = 1000
    """Save a checkpoint every N steps (0 = only by time, signal and at the end)."""
    checkpoint_every_minutes: float = 30.0
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
    progress_every_seconds: float = 30.0
    """Off a terminal (a log file, a batch job): a progress line with loss, tokens/s, steps/s
    and ETA every this many seconds (0 = a line every 5 % of the steps instead)."""

    def validate(self) -> None:
        s = "trainer"
        _positive(s, context=self.context, batch_size=self.batch_size, lr=self.lr,
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
        if self.compile_mode not in COMPILE_MODES:
            raise PosbenchError(f"trainer.compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")


@dataclass
class EvalConfig:
    """How a trained model is evaluated past its training context."""

    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    """Evaluation sequence lengths; each gets a per-position loss curve. 512 holds the
    headline 256-512 band; 1024 and 2048 the bands of longer extrapolation."""
    split: str = "validation"
    """validation (held-out, default), test (the text of local files named *test*, never trained
    on) or train (the seed article's measurement, on training text)."""
    num_sequences: int = 256
    """Non-overlapping sequences per length, taken deterministically from the start of the split."""
    batch_size: int = 16
    """Sequences per forward pass during evaluation (the windowed pass puts the same number of
    tokens in each forward)."""
    window_stride: int = 64
    """Stride S of the like-for-like (windowed) pass: targets past the training context C are
    scored again by windows of C tokens, each scoring its last S positions, so every target sees
    C - S + 1 .. C tokens. Smaller S = closer to exactly C tokens of context, but (L - C) / S
    windows per sequence to run. Capped at C."""
    effective_length_eps: float = 0.05
    """Tolerance in nats of the effective length: the first position past the context where the
    smoothed loss exceeds its 0-C level (or the windowed curve) by more than this."""
    extension: list[str] = field(default_factory=lambda: ["none"])
    """Context extensions evaluated at every length, each its own results.json entry: none (the
    plain model), linear, ntk, dynamic_ntk, yarn, llama3, log_scaling, window, rerope,
    self_extend, or all (every one that applies to the method). See posbench/model/extension.py."""
    extension_factor: float | None = None
    """Scaling factor of the extensions; None = L / C at each evaluated length L (dynamic_ntk:
    transformers' factor, default 1)."""
    probes: list[str] = field(default_factory=list)
    """Zero-shot probes run after the loss curves, each under every extension: copy (a span
    repeated at distance d, scored against a control; docs/probes.md), passkey (docs/retrieval.md).
    Empty = none. The names and each probe's settings section are checked by the probe registry
    (posbench/evaluation/probes/__init__.py)."""
    copy: Any = field(default_factory=dict)
    """Settings of the copy probe (eval.copy.*, CopySettings in posbench/evaluation/probes/copy.py)."""
    passkey: Any = field(default_factory=dict)
    """Settings of the passkey evaluation (eval.passkey.*, PasskeySettings in posbench/evaluation/probes/passkey.py)."""
    rerope: Any = field(default_factory=dict)
    """Settings of the rerope extension (eval.rerope.*, see ReRoPEConfig); a ReRoPEConfig once validated."""
    self_extend: Any = field(default_factory=dict)
    """Settings of the self_extend extension (eval.self_extend.*, see SelfExtendConfig)."""

    def validate(self) -> None:
        if not self.lengths or any(
            isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in self.lengths
        ):
            raise PosbenchError(f"eval.lengths must be a list of positive integers, got {self.lengths}")
        if self.split not in ("validation", "test", "train"):
            raise PosbenchError(f"eval.split must be validation, test or train, got {self.split!r}")
        _positive("eval", num_sequences=self.num_sequences, batch_size=self.batch_size,
                  window_stride=self.window_stride, effective_length_eps=self.effective_length_eps)
        if self.extension_factor is not None and not self.extension_factor >= 1:
            raise PosbenchError(f"eval.extension_factor must be >= 1 (or null for L / C), got {self.extension_factor}")
        # Extension names are checked by posbench.model.extension.check_names (it owns them).
        if not isinstance(self.rerope, ReRoPEConfig):
            self.rerope = from_section(ReRoPEConfig, "eval.rerope", _section("eval.rerope", self.rerope))
        if not isinstance(self.self_extend, SelfExtendConfig):
            self.self_extend = from_section(SelfExtendConfig, "eval.self_extend",
                                            _section("eval.self_extend", self.self_extend))

    def extension_options(self) -> dict[str, Any]:
        """The settings of the extensions that take some, by extension name (validated)."""
        return {"rerope": self.rerope, "self_extend": self.self_extend}

    def check_lengths(self, train_context: int, need_headline: bool) -> None:
        """Refuse lengths below the training context (they have no band at all), and, with
        ``need_headline`` (training), a set of lengths without the headline C-2C band."""
        if min(self.lengths) < train_context:
            raise PosbenchError(
                f"eval.lengths {self.lengths} has a length below trainer.context={train_context}; "
                f"evaluate at or beyond the training context, e.g. eval.lengths=[{2 * train_context}]"
            )
        if need_headline and max(self.lengths) < 2 * train_context:
            raise PosbenchError(
                f"eval.lengths {self.lengths} has no length >= 2 x trainer.context = {2 * train_context}, so the "
                f"headline {train_context}-{2 * train_context} band cannot be measured; add it, e.g. "
                f"eval.lengths=[{','.join(map(str, sorted(set(self.lengths) | {2 * train_context})))}]"
            )


def _section(name: str, values: Any) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise PosbenchError(f"{name} must be a mapping of settings, got {values!r}")
    return values


@dataclass
class ReRoPEConfig:
    """ReRoPE at evaluation (eval.rerope.*; posbench/model/extension.py, docs/context-extension.md)."""

    window: int | None = None
    """w: relative positions below w stay exact, the others become w. None = C / 8 (the
    reference's 512 at a 4096 context)."""
    leaky: float | None = None
    """Leaky ReRoPE's k > 1: past w the relative position is w + (d - w) / k (the reference's
    leaky patch uses 16). None = ReRoPE (k -> infinity)."""
    log_scaling: bool = True
    """Multiply the queries by max(1, log(n + 1) / log C), as the reference patch does; false =
    the clamped positions alone."""

    def validate(self) -> None:
        _positive("eval.rerope", window=self.window)
        if self.leaky is not None and not self.leaky > 1:
            raise PosbenchError(f"eval.rerope.leaky must be > 1 (or null for ReRoPE), got {self.leaky}")


@dataclass
class SelfExtendConfig:
    """Self-Extend at evaluation (eval.self_extend.*; posbench/model/extension.py, docs/context-extension.md)."""

    window: int | None = None
    """Neighbour window W: relative positions below W stay exact. None = C / 4 (LongLM's
    default 1024 at a 4096 context)."""
    group: int = 8
    """Group size G: past W, positions are floor(n / G) (LongLM's default 8)."""

    def validate(self) -> None:
        _positive("eval.self_extend", window=self.window, group=self.group)
