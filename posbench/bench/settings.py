"""The typed settings of ``posbench bench``: their defaults and documentation, written once here
(Hydra's ConfigStore holds them as ``bench_settings``, which ``configs/bench.yaml`` composes;
docs/configuration.md's bench table is generated from this class). A layer-1 module: the checks
that need the methods and the model shape are :mod:`posbench.bench.checks`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from posbench.core.errors import PosbenchError


@dataclass
class BenchSettings:
    """What ``posbench bench`` measures and how; the model shape is the ``model`` group, a
    :class:`posbench.model.transformer.ModelConfig` (``configs/bench.yaml``: ``model: small``)."""

    methods: list[str] | str = "all"
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
    """Peak dense TFLOP/s for MFU: ``auto`` (the bf16 dense peak of a known GPU: H200 and H100
    SXM 989.4, A100 312, L4 121, else no MFU; on the CPU a measured matmul peak), None (no MFU)
    or a positive number."""
    out: str | None = None
    """Folder for ``bench.json`` and ``bench.md``; None = the Hydra run directory."""
    debug: bool = False
    """Full tracebacks; stop at the first failing method."""

    def validate(self) -> None:
        """Ranges and choices (the types were checked by ``from_section``; the method names by
        :func:`posbench.bench.checks.resolve_methods`)."""
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


def parse_peak(value: Any) -> float | str | None:
    """``auto`` / ``null`` / a positive number of TFLOP/s -> ``"auto"``, None or a float."""
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
        return None
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PosbenchError(f"peak_tflops must be auto, null or a positive number (TFLOP/s), got {value!r}")
    return float(value)


__all__ = ["BenchSettings", "parse_peak"]
