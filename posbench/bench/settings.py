"""The typed settings of ``posbench bench`` (``configs/bench.yaml``) and the checks that run
before any timing: every user error of the command is one line from here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.methods import list_methods, method_class
from posbench.model.transformer import ModelConfig
from posbench.runs.spec import MethodSpec


@dataclass
class BenchSettings:
    """What ``posbench bench`` measures and how. The defaults are ``configs/bench.yaml``'s
    (a test keeps the two equal); the model shape is the ``model`` group, a :class:`ModelConfig`."""

    methods: list[str] = field(default_factory=lambda: ["all"])
    """Position methods to time, in this order: ``all`` (every registered method, in registry
    order) or a list of names, e.g. ``[rope,alibi]``. Validated into the list of names."""
    batch_size: int = 64
    """Training sequences per step (the trainer's default)."""
    context: int = 256
    """Training sequence length in tokens (the trainer's default)."""
    warmup_steps: int = 5
    """Untimed training steps before timing (compilation, allocator warm-up, AdamW state);
    evaluation makes ``max(1, warmup_steps)`` untimed calls."""
    steps: int = 30
    """Timed training steps: median, p10/p90, min/max and mean over them."""
    eval_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    """Evaluation forward lengths (sorted, deduplicated); ``[]`` skips the evaluation timing.
    A single length (``eval_lengths=512``) is a list of one."""
    eval_batch_size: int = 8
    """Sequences per evaluation forward."""
    eval_steps: int = 10
    """Timed evaluation forwards per length (median over them)."""
    compile: str = "auto"
    """auto | true | false: compile the training model and the peer, as ``trainer.compile``
    (auto: on CUDA only), in the trainer's default ``trainer.compile_mode``."""
    precision: str = "auto"
    """auto | fp32 | bf16, as ``trainer.precision``: auto = bf16 autocast on CUDA and on CPUs with
    native bf16, else fp32. fp32 on CUDA is fp32 (no TF32 matmuls), as in training."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    peer: bool = True
    """Also time ``transformers.LlamaForCausalLM`` (SDPA) of the same shape against its twin."""
    vocab_size: int = 8192
    """Vocabulary of the model and of the random tokens (overrides ``model.vocab_size``)."""
    peak_tflops: float | str | None = "auto"
    """Peak dense TFLOP/s for MFU: ``auto`` (the bf16 peak of a known GPU, a measured matmul peak
    on the CPU), None (``null``: no MFU) or a positive number."""
    out: str | None = None
    """Folder for ``bench.json`` and ``bench.md``; None = the Hydra run directory."""
    debug: bool = False
    """Full tracebacks; stop at the first failing method."""

    def validate(self) -> None:
        """Ranges and choices (the types were checked by :func:`from_section`)."""
        self.methods = resolve_methods(self.methods)
        for name in ("batch_size", "context", "steps", "eval_batch_size", "eval_steps", "vocab_size"):
            _check_int(name, getattr(self, name))
        _check_int("warmup_steps", self.warmup_steps, minimum=0)
        self.eval_lengths = sorted({_check_int("eval_lengths entries", n, example="eval_lengths=[512,1024]")
                                    for n in self.eval_lengths})
        self.compile = self.compile.lower()
        if self.compile not in ("auto", "true", "false"):
            raise PosbenchError(f"compile must be auto, true or false, got {self.compile!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise PosbenchError(f"precision must be auto, fp32 or bf16, got {self.precision!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise PosbenchError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


def _check_int(name: str, value: Any, minimum: int = 1, example: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise PosbenchError(f"{name} must be {kind}, got {value!r}; e.g. {example or f'{name}={max(minimum, 1) * 8}'}")
    return value


def _peak(value: Any) -> float | str | None:
    """``auto`` / ``null`` / a positive number of TFLOP/s -> ``"auto"``, None or a float."""
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
        return None
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PosbenchError(f"peak_tflops must be auto, null or a positive number (TFLOP/s), got {value!r}")
    return float(value)


def resolve_methods(value: Any) -> list[str]:
    """``all`` / a name / a list of names -> registered method names (order kept, deduplicated)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise PosbenchError(f"methods must be all or a non-empty list like [rope,alibi], got {value!r}")
    if len(names) == 1 and isinstance(names[0], str) and names[0].strip().lower() == "all":
        return list_methods()
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise PosbenchError(f"methods must list method names, got {name!r}; e.g. methods=[rope,alibi]")
        method_class(name)  # unknown -> PosbenchError naming the valid ones
        if name not in out:
            out.append(name)
    return out


def settings_from_config(cfg: DictConfig | dict[str, Any]) -> tuple[BenchSettings, ModelConfig]:
    """The composed bench config -> (settings, model shape), every user error a one-line
    :class:`PosbenchError`, each method checked against the shape before any timing."""
    values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    values.pop("hydra", None)
    model_values = dict(values.pop("model", None) or {})
    peak = _peak(values.pop("peak_tflops", "auto"))  # a word or a number: no one type to check
    settings = from_section(BenchSettings, "", _expand_shorthands(values))
    settings.peak_tflops = peak
    model_values["vocab_size"] = settings.vocab_size
    model_cfg = from_section(ModelConfig, "model", model_values)
    for name in settings.methods:
        _check_method(name, model_cfg, settings)
    return settings, model_cfg


def _expand_shorthands(values: dict[str, Any]) -> dict[str, Any]:
    """What the command line writes short: ``methods=null`` (all), ``eval_lengths=512`` (one
    length), ``eval_lengths=null`` (none), ``out=2024`` (a folder name Hydra reads as a number)."""
    if "methods" in values and values["methods"] is None:
        values["methods"] = "all"
    lengths = values.get("eval_lengths")
    if "eval_lengths" in values and lengths is None:
        values["eval_lengths"] = []
    elif isinstance(lengths, int) and not isinstance(lengths, bool):
        values["eval_lengths"] = [lengths]
    if values.get("out") is not None and not isinstance(values["out"], str):
        values["out"] = str(values["out"])
    return values


def method_config(name: str) -> dict[str, Any]:
    """The method's options from ``configs/method/<name>.yaml`` (constructor defaults if none)."""
    return MethodSpec.defaults(name).options


def _check_method(name: str, model_cfg: ModelConfig, settings: BenchSettings) -> None:
    """Build the method on the meta device: shape problems surface before any timing."""
    try:
        probe = MethodSpec.defaults(name).probe(model_cfg.dims)
    except PosbenchError as err:
        raise PosbenchError(f"{err}; pick another model= or methods=") from None
    if probe.max_positions is not None and settings.context > probe.max_positions:
        raise PosbenchError(
            f"method {name} supports positions up to {probe.max_positions} but context={settings.context}; "
            f"lower context or leave {name} out of methods"
        )
